"""A throttled loopback link for measured low-bandwidth runs (the paper's slow-link case).

`throttled_loopback("2gbit")` puts a token-bucket filter (`tc qdisc ... tbf`) on `lo` for
the duration of a `with` block, so that processes of a local multi-process run talk over a
link of known bandwidth. It needs root and `tc`, refuses a loopback that already carries a
queueing discipline (it could not put an arbitrary one back), and always removes its own:
on normal exit, on an exception, on Ctrl-C and on SIGTERM. Never used by tests or CI.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess

# A link the launcher leaves alone (`--link_rates`).
UNTHROTTLED = "unthrottled"
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
  # The bucket must hold at least one timer tick of traffic (rate / HZ, HZ <= 1000 on Linux)
  # or the filter cannot reach its rate; 256 kB is enough below 2 Gbit/s.
  burst = max(256 * 1024, int(bits / 8 / 250))
  previous_term = signal.getsignal(signal.SIGTERM)

  def on_term(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through the `finally` below

  added = _tc(
    "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", str(burst),
    "latency", "200ms",
  )  # fmt: skip
  if added.returncode != 0:
    raise ValueError(f"tc could not throttle {device} to {rate}: {added.stderr.strip()}")
  signal.signal(signal.SIGTERM, on_term)
  try:
    yield bits
  finally:
    signal.signal(signal.SIGTERM, previous_term)
    removed = _tc("qdisc", "del", "dev", device, "root")
    if removed.returncode != 0:
      raise RuntimeError(
        f"could not restore {device} ({removed.stderr.strip()}); run: tc qdisc del dev "
        f"{device} root"
      )
