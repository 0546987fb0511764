"""One registry of the caches this process keeps (compiled programs, planned partitions), so
that they can be dropped together: `clear_caches()` makes the next call of any shape compile
and plan again, as in a new process (what a cold-start benchmark measures).

A cache joins by being made with `kept_cache(maxsize)` instead of `functools.lru_cache`.
Measurements kept on purpose (the `local` calibration) are not registered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

_CACHES: list = []


def kept_cache(maxsize: int) -> Callable:
  """`functools.lru_cache(maxsize)`, registered for `clear_caches`."""

  def decorate(fn):
    cached = functools.lru_cache(maxsize=maxsize)(fn)
    _CACHES.append(cached)
    return cached

  return decorate


def clear_caches() -> int:
  """Empties every registered cache; returns how many there are."""
  for cached in _CACHES:
    cached.cache_clear()
  return len(_CACHES)
