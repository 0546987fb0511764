"""The throttled loopback: rates parsed, refusals clear, and the link always restored.

`tc` is replaced by a recorder here: tests never throttle the machine's real loopback.
"""

import contextlib
import signal
import subprocess
import sys

import pytest

from kvr_jax.runtime import distributed, links
from launch.harness import link_probe


@pytest.fixture
def fake_tc(monkeypatch):
  calls = []

  def tc(*args):
    calls.append(args)
    out = "qdisc noqueue 0: root refcnt 2\n" if args[:2] == ("qdisc", "show") else ""
    return subprocess.CompletedProcess(("tc", *args), 0, out, "")

  monkeypatch.setattr(links, "_tc", tc)
  monkeypatch.setattr(links.os, "geteuid", lambda: 0)
  monkeypatch.setattr(links.shutil, "which", lambda name: "/usr/sbin/tc")
  return calls


def test_rates():
  assert links.rate_bits("2gbit") == 2e9
  assert links.rate_bits("500mbit") == 5e8
  for bad in ("fast", "0gbit", "2 gbit", "-1mbit", 5):
    with pytest.raises(ValueError, match="expected a positive number with kbit, mbit or gbit"):
      links.rate_bits(bad)


def test_throttles_then_restores(fake_tc):
  with links.throttled_loopback("500mbit") as bits:
    assert bits == 5e8
    added = fake_tc[-1]
    assert added[:6] == ("qdisc", "add", "dev", "lo", "root", "tbf")
    assert added[added.index("rate") + 1] == "500mbit"
  assert fake_tc[-1] == ("qdisc", "del", "dev", "lo", "root")


@pytest.mark.parametrize("error", [RuntimeError("run failed"), KeyboardInterrupt()])
def test_restored_on_failure_and_interrupt(fake_tc, error):
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(type(error)):
    with links.throttled_loopback("2gbit"):
      raise error
  assert fake_tc[-1] == ("qdisc", "del", "dev", "lo", "root")
  assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back


def test_sigterm_unwinds_and_restores(fake_tc):
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(SystemExit):
    with links.throttled_loopback("2gbit"):
      signal.raise_signal(signal.SIGTERM)
  assert fake_tc[-1] == ("qdisc", "del", "dev", "lo", "root")
  assert signal.getsignal(signal.SIGTERM) == before


def test_refusals(fake_tc, monkeypatch):
  monkeypatch.setattr(links.os, "geteuid", lambda: 1000)
  with pytest.raises(ValueError, match="needs root"):
    links.check_can_throttle()
  monkeypatch.setattr(links.os, "geteuid", lambda: 0)
  monkeypatch.setattr(
    links,
    "_tc",
    lambda *a: subprocess.CompletedProcess(a, 0, "qdisc tbf 8001: root refcnt 2 rate 1Gbit\n", ""),
  )
  with pytest.raises(ValueError, match="already has a queueing discipline"):
    with links.throttled_loopback("2gbit"):
      pass


# --- the full-duplex link: a network namespace per process ------------------------------------


@pytest.fixture
def fake_net(monkeypatch, tmp_path):
  """Records every `ip` and `tc` call (none runs); `ip` fails where `failing` says."""
  calls, failing = [], set()

  def tool(name):
    def run(*args):
      calls.append((name, *args))
      listed = args[:2] == ("netns", "list")
      shown = args[:2] == ("link", "show")  # the bridge: absent unless a test says so
      code = 1 if shown and "bridge" not in failing else 0
      code = 1 if any(" ".join(args).startswith(f) for f in failing) else code
      return subprocess.CompletedProcess((name, *args), code, "other\n" if listed else "", "no")

    return run

  monkeypatch.setattr(links, "_ip", tool("ip"))
  monkeypatch.setattr(links, "_tc", tool("tc"))
  monkeypatch.setattr(links.os, "geteuid", lambda: 0)
  monkeypatch.setattr(links.shutil, "which", lambda name: f"/usr/sbin/{name}")
  hosts = {}
  monkeypatch.setattr(links, "_write_hosts", lambda ns, address: hosts.__setitem__(ns, address))
  monkeypatch.setattr(links, "_remove_hosts", lambda ns: hosts.pop(ns))
  return calls, failing, hosts


def _made_and_removed(calls):
  made = [c for c in calls if c[:3] == ("ip", "netns", "add")]
  removed = [c for c in calls if c[:3] == ("ip", "netns", "del")]
  return [c[3] for c in made], [c[3] for c in removed]


def test_full_duplex_shapes_each_process_both_ways_then_removes_everything(fake_net):
  calls, _, hosts = fake_net
  with links.full_duplex_links("500mbit", 3) as network:
    # Process i runs inside its namespace, at its own address; the coordinator at process 0's.
    assert network.command_prefix(1) == ["ip", "netns", "exec", "kvrlink1"]
    assert [network.address(i) for i in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert hosts == {"kvrlink0": "10.77.0.1", "kvrlink1": "10.77.0.2", "kvrlink2": "10.77.0.3"}
    filters = [c for c in calls if c[0] == "tc"]
    # Two token buckets per process at the rate: its own end (what it sends) and the bridge's
    # end (what it receives), so both directions run at the rate at once.
    assert len(filters) == 6
    assert all(c[c.index("rate") + 1] == "500mbit" for c in filters)
    sends = {c[c.index("dev") + 1] for c in filters if c[1] == "-n"}
    receives = {c[c.index("dev") + 1] for c in filters if c[1] != "-n"}
    assert sends == {"kvrp0", "kvrp1", "kvrp2"} and receives == {"kvrb0", "kvrb1", "kvrb2"}
  made, removed = _made_and_removed(calls)
  assert sorted(removed) == sorted(made) == ["kvrlink0", "kvrlink1", "kvrlink2"]
  assert calls[-1] == ("ip", "link", "del", "kvrlinkbr") and hosts == {}


@pytest.mark.parametrize("error", [RuntimeError("run failed"), KeyboardInterrupt()])
def test_full_duplex_removed_on_failure_and_interrupt(fake_net, error):
  calls, _, hosts = fake_net
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(type(error)):
    with links.full_duplex_links("2gbit", 2):
      raise error
  made, removed = _made_and_removed(calls)
  assert sorted(removed) == sorted(made) and hosts == {}
  assert calls[-1] == ("ip", "link", "del", "kvrlinkbr")
  assert signal.getsignal(signal.SIGTERM) == before


def test_full_duplex_half_made_is_removed_and_says_what_failed(fake_net):
  calls, failing, hosts = fake_net
  failing.add("-n kvrlink1 addr add")  # the second process's address cannot be set
  with pytest.raises(ValueError, match="ip -n kvrlink1 addr add 10.77.0.2/24 dev kvrp1.*failed"):
    with links.full_duplex_links("500mbit", 2):
      pass
  made, removed = _made_and_removed(calls)
  assert sorted(removed) == sorted(made) == ["kvrlink0", "kvrlink1"] and hosts == {}


def test_full_duplex_refusals(fake_net, monkeypatch):
  calls, failing, _ = fake_net
  failing.add("bridge")  # `ip link show` finds the bridge: left over from another run
  with pytest.raises(ValueError, match="already exist.*ip link del kvrlinkbr"):
    links.check_can_link(2)
  assert not [c for c in calls if c[1:3] == ("netns", "add")]  # nothing made
  failing.clear()
  with pytest.raises(ValueError, match="joins 1 to 250 processes"):
    links.check_can_link(0)
  monkeypatch.setattr(links.os, "geteuid", lambda: 1000)
  with pytest.raises(ValueError, match="needs root"):
    links.check_can_link(2)
  with pytest.raises(ValueError, match="link duplex must be one of"):
    links.check_links(["500mbit"], "simplex", 2)


def test_link_runs_and_labels():
  runs = links.link_runs(["unthrottled", "500mbit"], ["full", "half"])
  assert runs == [("unthrottled", "-"), ("500mbit", "full"), ("500mbit", "half")]
  assert [links.link_label(*r) for r in runs] == ["unthrottled", "500mbit/full", "500mbit/half"]


def test_throttled_picks_the_kind(fake_tc, monkeypatch):
  with links.throttled("unthrottled", "full", 2) as network:
    assert network is None and fake_tc == []
  with links.throttled("500mbit", "half", 2) as network:
    assert network is None and fake_tc[-1][:6] == ("qdisc", "add", "dev", "lo", "root", "tbf")
  made = []

  @contextlib.contextmanager
  def full(rate, num_processes):
    made.append((rate, num_processes))
    yield "network"

  monkeypatch.setattr(links, "full_duplex_links", full)
  with links.throttled("500mbit", "full", 4) as network:
    assert network == "network" and made == [("500mbit", 4)]


def test_launch_local_starts_each_process_inside_its_network():
  """launch_local puts process i's command after the network's prefix i and points every
  process at process 0's address; here the prefix is a shell that prints the command it was
  given instead of running it."""

  class EchoNetwork:
    def command_prefix(self, i):
      return ["sh", "-c", f'echo "inside {i}: $*"', "sh"]

    def address(self, i):
      return f"10.77.0.{i + 1}"

  outcomes = distributed.launch_local("launch.multiprocess", ["--x=1"], 2, network=EchoNetwork())
  for outcome in outcomes:
    i = outcome.process_id
    line = outcome.stdout.strip()
    assert line.startswith(f"inside {i}: {sys.executable} -m launch.multiprocess"), line
    assert "--coordinator_address=10.77.0.1:" in line and f"--process_id={i}" in line


# --- the link probe (launch.benchmark --mode=links) -------------------------------------------


def test_link_probe_exchanges_and_table():
  perms = link_probe.exchange_perms(4)
  assert perms["one-way"] == [(0, 1)] and perms["two-way"] == [(0, 1), (1, 0)]
  assert perms["ring"] == [(0, 1), (1, 2), (2, 3), (3, 0)]
  rows = [{"link": "500mbit/full", "seconds": {"one-way": 0.25, "two-way": 0.5, "ring": 0.25}}]
  table = link_probe.links_table(rows, 16, 2)
  assert table.lines[0].split() == ["500mbit/full", "0.250", "0.500", "0.250", "2.00x", "1.00x"]
  assert table.records[0]["megabytes"] == 16 and table.records[0]["num_processes"] == 2


def test_link_probe_job_times_every_exchange_on_this_processs_devices():
  # One process's 8 emulated devices: the job runs whole and reports a positive time for
  # each exchange.
  result = link_probe.exchange_job(0.01, repeats=1)
  assert set(result["seconds"]) == set(link_probe.EXCHANGES)
  assert all(s > 0 for s in result["seconds"].values())
