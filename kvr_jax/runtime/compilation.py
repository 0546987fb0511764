"""JAX's persistent compilation cache, as the command lines use it.

Every distinct prompt length, partition and kernel is its own compiled program (the chunks
are static). With the cache on, a second process that asks for a program with the same
shapes, on the same devices and JAX version, reads the executable from disk instead of
compiling it again. `enable` turns it on (the command lines do, unless `--nocompilation_cache`);
`CacheUse.since` reports how many of a piece of work's programs the cache answered and how
many were compiled and written to it (JAX's own monitoring events), which `launch.run`
prints beside compile times.

The library itself never turns the cache on: a notebook or a program decides for itself
(`jax.config.update("jax_compilation_cache_dir", ...)`, or call `enable`).
"""

from __future__ import annotations

import collections
import dataclasses
import os

import jax

from kvr_jax.core import resources

# JAX's monitoring events (jax._src.compiler, compilation_cache): a program the cache
# answered, and one compiled now and written to it (long enough to be worth keeping).
HIT_EVENT = "/jax/compilation_cache/cache_hits"
WRITE_EVENT = "/jax/compilation_cache/cache_misses"
# Programs that compile faster than this are not written (JAX's own default is 1 s; the tiny
# presets' programs take a fraction of that, and reading one back costs milliseconds).
MIN_COMPILE_SECONDS = 0.2

_counts: collections.Counter[str] = collections.Counter()
_listening = False


def _count(event: str, **_kwargs) -> None:
  if event in (HIT_EVENT, WRITE_EVENT):
    _counts[event] += 1


def default_directory() -> str | None:
  """The cache under this machine's kvr-jax cache directory (KVR_JAX_CACHE_DIR); None when
  that cannot be used."""
  base = resources.cache_dir()
  return None if base is None else os.path.join(base, "xla")


def enable(directory: str | os.PathLike | None = None) -> str | None:
  """Turns JAX's persistent compilation cache on in `directory` (default
  `default_directory()`); returns the directory. Refuses a directory given that cannot be
  written; without one and with an unusable kvr-jax cache directory, leaves the cache off
  (resources.cache_dir warned) and returns None."""
  global _listening
  if directory is None:
    directory = default_directory()
    if directory is None:
      return None
  directory = os.fspath(directory)
  resources.writable_directory(directory, f"compilation cache {directory}")
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  if not _listening:
    jax.monitoring.register_event_listener(_count)
    _listening = True
  return directory


def disable() -> None:
  """Turns the cache off, also where JAX_COMPILATION_CACHE_DIR turned it on: every program is
  compiled (what `--nocompilation_cache` promises)."""
  jax.config.update("jax_compilation_cache_dir", None)


def enabled() -> bool:
  return bool(jax.config.jax_compilation_cache_dir)


@dataclasses.dataclass(frozen=True)
class CacheUse:
  """Programs worth caching (compiled in at least MIN_COMPILE_SECONDS) over some work: read
  from the persistent cache (hits) or compiled and written to it (written)."""

  hits: int
  written: int

  @classmethod
  def now(cls) -> CacheUse:
    return cls(_counts[HIT_EVENT], _counts[WRITE_EVENT])

  def since(self, earlier: CacheUse) -> CacheUse:
    return CacheUse(self.hits - earlier.hits, self.written - earlier.written)

  def describe(self) -> str:
    """ "cache" (every such program read from disk), "compiled" (none), "k/n" (k of n read),
    or "-" (none asked: the cache is off, or every program was already in memory)."""
    total = self.hits + self.written
    if total == 0:
      return "-"
    if self.written == 0:
      return "cache"
    if self.hits == 0:
      return "compiled"
    return f"{self.hits}/{total}"
