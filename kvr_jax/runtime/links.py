"""Throttled links for measured low-bandwidth runs (the paper's slow-link case), two kinds:

  full   `full_duplex_links("500mbit", p)`: each of the p processes runs in its own network
         namespace, joined to the others through a bridge by a veth pair shaped at the rate
         in both directions (`tc qdisc ... tbf` on each end): every process sends at up to
         the rate and receives at up to the rate at the same time, as hosts whose full-duplex
         NICs meet at a switch. `launch_local(network=...)` starts process i inside its
         namespace (`ip netns exec`), the coordinator at process 0's address.
  half   `throttled_loopback("500mbit")`: one token bucket on `lo`, which every packet of
         every process crosses: one link shared by every direction of every pair (a
         4-process ring step of 16 MB per rank at 500 Mbit/s: 0.988 s, against 0.256 s on
         "full"; `launch.benchmark --mode=links`). What the benchmarks measured before
         "full" existed.

On either kind gloo takes a pair's two directions in turn (16 MB each way: 0.505-0.513 s
against 0.256 s one way), which favours KV-Runahead's one-way hops over the peers' two-way
exchanges on two processes (docs/measurements.md, "Links").

Both need root, `tc` (and `ip` for "full"), refuse what they could not put back (a loopback
that already carries a queueing discipline, namespaces or a bridge of their names), and
always remove their own: on normal exit, on an exception, on Ctrl-C and on SIGTERM. Never
used by tests or CI (tests replace the commands by recorders).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess

# A link the launcher leaves alone (`--link_rates`).
UNTHROTTLED = "unthrottled"
DUPLEX = ("full", "half")  # `--link_duplex`: the module docstring
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_BITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate: str) -> float:
  """'2gbit' -> 2e9 bits/s; a clear error for anything else."""
  match = _RATE.match(rate) if isinstance(rate, str) else None
  if not match or float(match.group(1)) <= 0:
    raise ValueError(
      f"link rate {rate!r}: expected a positive number with kbit, mbit or gbit (e.g. 500mbit)"
    )
  return float(match.group(1)) * _BITS[match.group(2)]


def _tc(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["tc", *args], capture_output=True, text=True, check=False)


def _ip(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


def _burst(bits: float) -> int:
  # The bucket must hold at least one timer tick of traffic (rate / HZ, HZ <= 1000 on Linux)
  # or the filter cannot reach its rate; 256 kB is enough below 2 Gbit/s.
  return max(256 * 1024, int(bits / 8 / 250))


@contextlib.contextmanager
def _restored_on_sigterm():
  """SIGTERM raises SystemExit inside the block, so that its `finally` clauses run."""
  previous_term = signal.getsignal(signal.SIGTERM)

  def on_term(signum, frame):
    raise SystemExit(128 + signum)

  signal.signal(signal.SIGTERM, on_term)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous_term)


def check_can_throttle(device: str = "lo") -> None:
  """Refuses, with the reason, where the loopback cannot be throttled and restored."""
  if os.geteuid() != 0:
    raise ValueError("throttling the loopback link needs root (it runs `tc qdisc`)")
  if shutil.which("tc") is None:
    raise ValueError("throttling the loopback link needs `tc` (iproute2), which is not installed")
  shown = _tc("qdisc", "show", "dev", device)
  if shown.returncode != 0:
    raise ValueError(f"`tc qdisc show dev {device}` failed: {shown.stderr.strip()}")
  if not shown.stdout.startswith("qdisc noqueue"):
    raise ValueError(
      f"{device} already has a queueing discipline ({shown.stdout.strip()}); remove it first "
      f"(tc qdisc del dev {device} root), this tool only restores an unthrottled loopback"
    )


@contextlib.contextmanager
def throttled_loopback(rate: str, device: str = "lo"):
  """`with throttled_loopback("500mbit"):` the loopback runs at that rate (tc tbf)."""
  bits = rate_bits(rate)
  check_can_throttle(device)
  added = _tc(*_tbf("dev", device, rate=rate, bits=bits))
  if added.returncode != 0:
    raise ValueError(f"tc could not throttle {device} to {rate}: {added.stderr.strip()}")
  try:
    with _restored_on_sigterm():
      yield bits
  finally:
    removed = _tc("qdisc", "del", "dev", device, "root")
    if removed.returncode != 0:
      raise RuntimeError(
        f"could not restore {device} ({removed.stderr.strip()}); run: tc qdisc del dev "
        f"{device} root"
      )


def _tbf(*where: str, rate: str, bits: float) -> tuple[str, ...]:
  """tc's arguments adding a token-bucket filter at `where` ("dev", name)."""
  return (
    "qdisc", "add", *where, "root", "tbf", "rate", rate, "burst", str(_burst(bits)),
    "latency", "200ms",
  )  # fmt: skip


# The full-duplex network's names: namespaces, the veth pair's two ends (the one in process i's
# namespace, the one on the bridge), the bridge, and /etc/netns/<namespace>/hosts, which
# `ip netns exec` mounts over /etc/hosts so that this machine's hostname resolves to the
# process's own address there (gloo binds its sockets to the hostname's address).
_SUBNET = "10.77.0"
_BRIDGE = "kvrlinkbr"


def _namespace(i: int) -> str:
  return f"kvrlink{i}"


def _process_end(i: int) -> str:
  return f"kvrp{i}"


def _bridge_end(i: int) -> str:
  return f"kvrb{i}"


@dataclasses.dataclass(frozen=True)
class ProcessNetwork:
  """Where `distributed.launch_local` runs each process of a full-duplex link: inside
  namespace i, reachable at address(i); the coordinator at address(0)."""

  num_processes: int

  def command_prefix(self, i: int) -> list[str]:
    return ["ip", "netns", "exec", _namespace(i)]

  def address(self, i: int) -> str:
    return f"{_SUBNET}.{i + 1}"


def check_can_link(num_processes: int) -> None:
  """Refuses, with the reason, where the full-duplex network cannot be made and removed."""
  if os.geteuid() != 0:
    raise ValueError("a full-duplex throttled link needs root (it runs `ip netns` and `tc`)")
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      raise ValueError(f"a full-duplex throttled link needs `{tool}` (iproute2): not installed")
  if not 1 <= num_processes <= 250:
    raise ValueError(f"a full-duplex link joins 1 to 250 processes, not {num_processes}")
  listed = _ip("netns", "list")
  if listed.returncode != 0:
    raise ValueError(f"`ip netns list` failed: {listed.stderr.strip()}")
  taken = {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
  ours = [_namespace(i) for i in range(num_processes)]
  if taken & set(ours) or _ip("link", "show", _BRIDGE).returncode == 0:
    raise ValueError(
      f"network namespaces {sorted(taken & set(ours))} or the bridge {_BRIDGE} already exist "
      f"(a run that did not clean up?); remove them first (ip netns del NAME; ip link del "
      f"{_BRIDGE}); this tool only removes what it made"
    )


@contextlib.contextmanager
def full_duplex_links(rate: str, num_processes: int):
  """`with full_duplex_links("500mbit", 2) as network:` a ProcessNetwork whose processes send
  and receive at up to `rate` each, both directions at once (module docstring)."""
  bits = rate_bits(rate)
  check_can_link(num_processes)
  network = ProcessNetwork(num_processes)
  made: list[tuple[str, ...]] = []  # how to remove each thing made, in reverse order

  def run(tool, *args):
    done = tool(*args)
    if done.returncode != 0:
      name = "ip" if tool is _ip else "tc"
      raise ValueError(f"`{name} {' '.join(args)}` failed: {done.stderr.strip()}")

  try:
    with _restored_on_sigterm():
      run(_ip, "link", "add", _BRIDGE, "type", "bridge")
      made.append(("link", "del", _BRIDGE))
      for i in range(num_processes):
        ns, inside, outside = _namespace(i), _process_end(i), _bridge_end(i)
        run(_ip, "netns", "add", ns)
        made.append(("netns", "del", ns))  # takes its veth end, and so the pair, with it
        _write_hosts(ns, network.address(i))
        run(_ip, "link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns)
        run(_ip, "link", "set", outside, "mtu", "65535", "master", _BRIDGE, "up")
        run(_ip, "-n", ns, "link", "set", inside, "mtu", "65535", "up")
        run(_ip, "-n", ns, "link", "set", "lo", "up")
        run(_ip, "-n", ns, "addr", "add", f"{network.address(i)}/24", "dev", inside)
        run(_tc, "-n", ns, *_tbf("dev", inside, rate=rate, bits=bits))  # what it sends
        run(_tc, *_tbf("dev", outside, rate=rate, bits=bits))  # what it receives
      run(_ip, "link", "set", _BRIDGE, "up")
      yield network
  finally:
    failures = []
    for undo in reversed(made):
      if _ip(*undo).returncode != 0:
        failures.append("ip " + " ".join(undo))
      if undo[:2] == ("netns", "del"):
        _remove_hosts(undo[2])
    if failures:
      raise RuntimeError(f"could not remove the full-duplex link; run: {'; '.join(failures)}")


def _hosts_dir(ns: str) -> str:
  return os.path.join("/etc/netns", ns)


def _write_hosts(ns: str, address: str) -> None:
  os.makedirs(_hosts_dir(ns), exist_ok=True)
  with open(os.path.join(_hosts_dir(ns), "hosts"), "w") as f:
    f.write(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")


def _remove_hosts(ns: str) -> None:
  shutil.rmtree(_hosts_dir(ns), ignore_errors=True)


@contextlib.contextmanager
def throttled(rate: str, duplex: str, num_processes: int):
  """The link a multi-process benchmark runs over: None (the loopback as it is) for
  UNTHROTTLED, else the `duplex` kind at `rate` (module docstring); yields the
  ProcessNetwork to launch in (None: the loopback)."""
  if rate == UNTHROTTLED:
    yield None
  elif duplex == "full":
    with full_duplex_links(rate, num_processes) as network:
      yield network
  else:
    with throttled_loopback(rate):
      yield None


def check_links(link_rates, duplex: str, num_processes: int) -> None:
  """Every rate and the duplex kind checked, and the tools tried, before anything runs."""
  if duplex not in DUPLEX:
    raise ValueError(f"link duplex must be one of {DUPLEX}, got {duplex!r}")
  throttled_rates = [rate for rate in link_rates if rate != UNTHROTTLED]
  for rate in throttled_rates:
    rate_bits(rate)
  if throttled_rates:
    check_can_link(num_processes) if duplex == "full" else check_can_throttle()


def link_runs(link_rates, duplexes) -> list[tuple[str, str]]:
  """(rate, duplex) of each run: UNTHROTTLED once, every throttled rate under each kind."""
  runs = []
  for rate in link_rates:
    runs += [(rate, "-")] if rate == UNTHROTTLED else [(rate, d) for d in duplexes]
  return runs


def link_label(rate: str, duplex: str) -> str:
  """A run's link in the tables: "unthrottled", "500mbit/full", "500mbit/half"."""
  return rate if rate == UNTHROTTLED else f"{rate}/{duplex}"


def checked_runs(link_rates, duplexes, num_processes: int) -> list[tuple[str, str, str]]:
  """A benchmark's runs, (rate, duplex, label), every rate and kind checked and the tools
  tried first (`check_links`): what the benchmarks loop over, each run under `throttled`."""
  for duplex in duplexes:
    check_links(link_rates, duplex, num_processes)
  runs = link_runs(link_rates, duplexes)
  return [(rate, duplex, link_label(rate, duplex)) for rate, duplex in runs]
