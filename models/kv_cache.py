"""A K,V model's own cache as its decode step reads it (`CausalLM.decode_step`): each layer's
K,V grouped by the positions the layer keeps (`DecodeLayout`: every position, or a windowed
layer's ring of its window), one stack per group (`KVCache`). Device-agnostic: where the
cache lies is kvr_jax's business (kvr_jax.inference.decode.decode_caches builds it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
  """How the whole-cache decode keeps each layer's K,V: layers stacked in groups, a group by
  the positions it keeps. `rings[g]` None: every position (a full layer, or a window that
  never binds within the cache's capacity), written at its position; W: a windowed layer's
  last W positions only, a ring buffer written at position mod W (its queries see exactly
  those W keys, so nothing before the window is kept or read). Layer l is slot
  `slot_of_layer[l]` of group `group_of_layer[l]`."""

  rings: tuple[int | None, ...]
  group_of_layer: tuple[int, ...]
  slot_of_layer: tuple[int, ...]

  @classmethod
  def whole(cls, num_layers: int) -> DecodeLayout:
    """Every layer keeps every position, in one stack [L, B, S, K, H] (layer l at slot l)."""
    return cls((None,), (0,) * num_layers, tuple(range(num_layers)))

  @classmethod
  def of(cls, config, capacity: int) -> DecodeLayout:
    """`config`'s layers for a cache of `capacity` positions (prompt and new tokens): a
    window shorter than the capacity keeps a ring of its size."""
    ring_L = [w if w is not None and w < capacity else None for w in config.windows]
    rings = tuple(dict.fromkeys(ring_L))
    group_L = [rings.index(r) for r in ring_L]
    slot_L = [group_L[:l].count(g) for l, g in enumerate(group_L)]
    return cls(rings, tuple(group_L), tuple(slot_L))

  def group_of_window(self, window: int | None) -> int:
    """The group of a layer whose window is `window` (static inside a layer's body)."""
    return self.rings.index(window if window in self.rings else None)

  def layers_of(self, group: int) -> np.ndarray:
    """The layers of `group`, in slot order."""
    return np.flatnonzero(np.asarray(self.group_of_layer) == group)

  @property
  def every_position_group(self) -> int | None:
    """The group of the layers that keep every position (None where every layer keeps a
    ring)."""
    return self.rings.index(None) if None in self.rings else None

  @property
  def every_position_layers(self) -> np.ndarray:
    """The layers that keep every position, in slot order (none where all keep rings)."""
    group = self.every_position_group
    return np.zeros(0, int) if group is None else self.layers_of(group)

  def in_layer_order(self, per_group: list) -> jax.Array:
    """Arrays per group [L_g, ...] (same trailing shape) stacked back into layer order."""
    order = np.concatenate([self.layers_of(g) for g in range(len(self.rings))])
    return jnp.concatenate(per_group)[np.argsort(order)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """A K,V model's decode cache: per group of `layout`, (k, v) [L_g, B, S_g, K, H] (S_g the
  cache's capacity for the layers that keep every position, W for a ring of window W, whose
  slot j holds the latest position p = j mod W). A pytree: its groups are the leaves, the
  layout static (a cache of another layout is another program). Leaves may be
  PartitionSpecs: the same structure says how a cache lies over a mesh."""

  layout: DecodeLayout = dataclasses.field(metadata=dict(static=True))
  groups: tuple
