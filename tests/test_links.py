"""The throttled loopback: rates parsed, refusals clear, and the link always restored.

`tc` is replaced by a recorder here: tests never throttle the machine's real loopback.
"""

import signal
import subprocess

import pytest

from kvr_jax.runtime import links


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
