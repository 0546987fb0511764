"""Benchmark variants as records: what runs (a registered strategy, `auto`, or one of
KV-Runahead's program bodies), how its split is chosen, its kernel and its cache layout.

The command lines name them (`--variants=ring,kvr-search:sharded`); `get_variant` reads a
name once, before anything loads, and every job reads the record's fields, never the name.
"""

from __future__ import annotations

import dataclasses

from kvr_jax.inference.kv_cache import CACHE_LAYOUTS
from kvr_jax.planning import search
from kvr_jax.strategies import REGISTRY
from kvr_jax.strategies.base import AUTO
from kvr_jax.strategies.runahead import BODIES

# How a partitioned strategy's (or auto's) split is chosen: "even"; "search": the cost model
# with the job's modelled plan; "measured": KVR-S over measured TTFT, once (timed apart);
# "fitted": the cost model with FLOP/s fitted to the model's phases here (timed apart).
SPLITS = ("even", "search", "measured", "fitted")
SHARDED_SUFFIX = ":sharded"


@dataclasses.dataclass(frozen=True)
class Variant:
  """One benchmark variant (see the module docstring)."""

  name: str
  strategy: str  # a registered strategy, or "auto"
  split: str | None = None  # one of SPLITS (kvr and auto); None: the strategy lays it out
  body: str | None = None  # KV-Runahead's program body (runahead.BODIES); None: its default
  attention: str | None = None  # None: the strategy's own kernel
  cache: str | None = None  # None: prefill's default layout; "sharded": the parts stay
  one_process: bool = False  # runs only in a one-process launch (the single baselines)
  # The modelled search's one split for every layer kind (a hybrid's "search" otherwise
  # gives its full layers their own split where that models faster).
  one_split: bool = False

  def __post_init__(self):
    if self.strategy != AUTO and self.strategy not in REGISTRY:
      raise ValueError(f"variant {self.name!r}: unknown strategy {self.strategy!r}")
    if self.split is not None and self.split not in SPLITS:
      raise ValueError(f"variant {self.name!r}: split {self.split!r} is not one of {SPLITS}")
    chain = self.strategy != AUTO and REGISTRY[self.strategy].prefix_chain
    if self.body is not None and (not chain or self.body not in BODIES):
      raise ValueError(f"variant {self.name!r}: a program body {BODIES} is KV-Runahead's")
    if self.one_split and self.split not in ("search", "fitted"):
      raise ValueError(f"variant {self.name!r}: one split for every layer kind is searched")
    if self.cache is not None and self.cache not in CACHE_LAYOUTS:
      raise ValueError(f"variant {self.name!r}: cache {self.cache!r} is not one of {CACHE_LAYOUTS}")

  def sharded(self) -> Variant:
    """The same variant with its cache left where it was computed."""
    return dataclasses.replace(self, name=self.name + SHARDED_SUFFIX, cache="sharded")


VARIANTS: tuple[Variant, ...] = (
  # single is the best single process (its default kernel, flash); single-dense the paper's
  # single-device baseline (dense masked scores); single-blocked the older blocked kernel.
  Variant("single", "single", one_process=True),
  Variant("single-dense", "single", attention="dense", one_process=True),
  Variant("single-blocked", "single", attention="blocked", one_process=True),
  Variant("tsp", "tsp"),
  Variant("ring", "ring"),
  Variant("allgather", "allgather"),
  *(Variant(f"kvr-{split}", "kvr", split=split) for split in SPLITS),
  # On a hybrid: one split for both layer kinds, beside the search's split per kind.
  Variant("kvr-one-fitted", "kvr", split="fitted", one_split=True),
  # KV-Runahead's per-rank switch program on the same splits: what the one-body program
  # replaced, timed beside it; its one body (the default only above runahead.PER_RANK_UP_TO
  # ranks) on the same splits.
  *(
    Variant(f"kvr-{prefix}-{split}", "kvr", split=split, body=body)
    for prefix, body in (("per-rank", "per-rank"), ("one-body", "one"))
    for split in ("even", "search")
  ),
  # strategy="auto": the cost model's pick (with this machine's `local` calibration, or with
  # FLOP/s fitted to the model's phases here), timed beside what it picks from.
  Variant("auto", AUTO, split="search"),
  Variant("auto-fitted", AUTO, split="fitted"),
)
NAMES: tuple[str, ...] = tuple(v.name for v in VARIANTS)
_BY_NAME = {v.name: v for v in VARIANTS}


def get_variant(variant: str | Variant) -> Variant:
  """The record of a variant name (a record is returned as it is): one of NAMES, or one of
  them ending ':sharded'."""
  if isinstance(variant, Variant):
    return variant
  base, suffix, rest = str(variant).partition(":")
  if suffix and rest != "sharded":
    raise ValueError(f"variant {variant!r}: the only suffix is {SHARDED_SUFFIX!r}")
  if base not in _BY_NAME:
    raise ValueError(f"unknown variant {variant!r}; expected some of {NAMES}")
  return _BY_NAME[base].sharded() if suffix else _BY_NAME[base]


def own_past_variants(config, measured: bool = False) -> list[str]:
  """The variants `launch.benchmark --mode=hybrid` runs on `config`'s model: the peers and
  KV-Runahead with the whole cache on the last rank (the peers' move in their time) and with
  it left where computed (":sharded", each judged against the peers of its layout);
  KV-Runahead on the split the cost model finds with rates fitted to this model and the link
  measured in the run (kvr-fitted), on a hybrid with a split per layer kind also its one
  split for both (kvr-one-fitted), and even; measured: also a measured search's split."""
  variants = ["ring", "allgather", "ring:sharded", "allgather:sharded"]
  variants += ["kvr-even", "kvr-fitted", "kvr-fitted:sharded"]
  if search.splits_by_kind(config):
    variants.append("kvr-one-fitted:sharded")
  return variants + (["kvr-measured"] if measured else [])
