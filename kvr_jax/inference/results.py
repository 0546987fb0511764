"""What `prefill` returns, for every model: a `PrefillResult`, the last prompt position's
logits and the cache (`past`) in the object its model's cache form makes (`form`;
inference.cache_form) and the layout `cache` names: "last" (joined on the last rank) or
"sharded" (left in the ranks' parts).

  form      cache="last"                     cache="sharded"
  kv        kv_form.KVWhole (K,V, rings)     kv_form.KVParts (each rank's part, last hop)
  hybrid    cache_form.OwnWhole (the model's  cache_form.OwnParts (the full layers' parts,
  latent      own cache, room for decoding)     the linear states; the latents' parts)

The result reads its past through its form alone (`stepper`, `gather_cache`, ...), so that
decode, timing and the jobs never ask which form made it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from kvr_jax.planning.choice import StrategyChoice
from kvr_jax.runtime.cache_layout import CacheLayout
from kvr_jax.runtime.mesh import AXIS, model_parallel, rank_row_mesh, spans_processes


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class PrefillResult:
  """What a prefill hands to decode.

  logits: [B, V] float32, each row's last prompt position, on the last rank's device (None in
  a process of a multi-process run that does not hold it: `is_local` is False).
  prompt_len: T, the rows' padded length. strategy: the strategy's name. partition: the
  chunk lengths a partitioned strategy ran, else None. attention: the kernel that ran ("auto"
  resolved). lengths: [B] int32, each row's true length: positions [lengths[b], prompt_len)
  of row b are padding (buckets, ragged batches); decode continues row b at position
  lengths[b]. cache: the layout, "last" or "sharded". past: the cache in its form's object
  for that layout (module docstring); None where another process holds it, or where the
  prefill left a model's own cache where the program put it (run_prefill(move_cache=False)).
  form: the model's `cache_form.CacheForm`, which made the past and reads it. mesh, config:
  the prefill's mesh and the model's config. cache_layout: which prompt positions each rank's
  part held.
  """

  logits: jax.Array | None
  prompt_len: int
  strategy: str
  partition: tuple[int, ...] | None
  attention: str
  lengths: np.ndarray
  cache: str
  past: Any
  form: Any = dataclasses.field(repr=False)
  mesh: Any = dataclasses.field(repr=False)
  config: Any = dataclasses.field(repr=False)
  cache_layout: CacheLayout | None = None
  # cache="sharded" across processes: the last rank's logits [B, V] replicated over `mesh`,
  # so that every process can run the decode steps that read its parts (generate).
  replicated_logits: jax.Array | None = None
  # strategy="auto": the strategy it picked and every candidate's MODELLED TTFT; else None.
  choice: StrategyChoice | None = None
  # The model's KV heads: on a 2-D mesh with more "model" shards than KV heads the caches hold
  # each head repeated (tensor_parallel.shard_ready_state), which `gather_cache` undoes.
  kv_heads: int | None = None
  # KV-Runahead on a hybrid with a split per layer kind: the full layers' chunks (`partition`
  # is then the linear layers'); None where one split ran every layer (every K,V model).
  full_partition: tuple[int, ...] | None = None
  # cache="last": whether the ranks' parts moved onto the last rank (the peers' parts, the
  # split as data's) or were there already (KV-Runahead's kept last hops and own chunk: no
  # move). False for cache="sharded", where nothing moves.
  moved: bool = False

  @property
  def is_local(self) -> bool:
    return self.logits is not None

  @property
  def device(self):
    return next(iter(self.logits.devices()))

  @property
  def decode_mesh(self):
    """The last rank's model group where the mesh has one (a joined cache split there), else
    None."""
    if model_parallel(self.mesh) == 1:
      return None
    return rank_row_mesh(self.mesh, self.mesh.shape[AXIS] - 1)

  @property
  def decodes_here(self) -> bool:
    """Whether this process decodes from this cache: it holds the last rank's logits (or,
    left in parts, some rank's part)."""
    return self.is_local or (self.cache == "sharded" and self.past is not None)

  @property
  def decodes_in_every_process(self) -> bool:
    """Whether every process runs each decode step (the cache left in parts over a mesh that
    spans processes), all of them taking the last rank's token."""
    parts = self.cache == "sharded" and self.past is not None
    return parts and spans_processes(self.mesh)

  @property
  def k_cache(self) -> jax.Array | None:
    """cache="last" of K,V: every layer's K [L, B, S, K, H] in prompt order on the last rank
    (zeros before a ring's window; each head once per "model" shard on a 2-D mesh with more
    shards than KV heads, as decode reads it)."""
    return self._whole_kv()[0]

  @property
  def v_cache(self) -> jax.Array | None:
    """V as `k_cache` gives K."""
    return self._whole_kv()[1]

  def _whole_kv(self):
    if self.cache != "last":  # AttributeError: a result in parts has no such field
      raise AttributeError(
        "k_cache / v_cache are cache='last''s; a cache='sharded' result's cache in prompt "
        "order is gather_cache()"
      )
    return self.decode_cache()

  def stepper(self, model, lengths_B, max_new_tokens: int, seed: int, consume: bool = False):
    """decode_from's stepper for this cache (its form's, kvr_jax.inference.steppers): (step,
    the first tail, the prompt's logits, the sampling key). consume: the decode may write
    into the prefill's own cache where it has the room (a model's own cache of generate's; a
    K,V cache grows into a fresh buffer either way)."""
    return self.form.stepper(model, self, lengths_B, max_new_tokens, seed, consume)

  def after_decode(self, tail, consume: bool, max_new_tokens: int) -> PrefillResult:
    """This result after a decode of `max_new_tokens` from it (`stepper(consume=)`; tail: the
    last step's cache): the decode's own cache where it consumed the prefill's, else itself."""
    return self.form.after_decode(self, tail, consume, max_new_tokens)

  def gather_cache(self):
    """The cache in one device's layout on the last rank's device, whichever layout: K,V
    [L, B, S, K, H] each in prompt order with the model's K heads (single's shape) on every
    mesh; a model's own cache (cache="last") as its one-device forward lays it out."""
    return self.form.gather_cache(self)

  def decode_cache(self):
    """The cache as decode reads it: `gather_cache`'s, but on a 2-D mesh with more "model"
    shards than KV heads each head stays repeated, one per shard (the decode step's split).
    A model's own cache refuses it (its decode reads the past itself)."""
    return self.form.decode_cache(self)

  def layer_cache(self, layer: int):
    """(K, V) of one layer, each [B, S, K, H] (a K,V cache's)."""
    return self.form.layer_cache(self, layer)

  def moved_to_last_rank(self) -> PrefillResult:
    """This prefill as cache="last", from the parts that run_prefill(move_cache=False) left
    (a form whose join runs apart: `CacheForm.joins_apart`)."""
    return self.form.moved_to_last_rank(self)
