"""The interface every prefill strategy implements, and the one trace counter they share.

A strategy is a frozen `Strategy`: how it lays the prompt out over the ranks of a 1-D mesh
(`layout`, `arrange`), how it compiles one SPMD program for (graphdef, mesh, chunks,
attention) (`compile`), and which rank ends with the logits and the whole KV cache
(`cache_rank`). Every program has the same signature:

  program(state, tokens_pBc) -> (logits_pBV, kv_pL2BSKH)

state replicated over the mesh, tokens_pBc each rank's tokens (from `arrange`), outputs
sharded by rank: only rank `cache_rank(chunks)`'s slice is the answer, and its shard lives on
that rank's device, where decode continues. `kvr_jax.inference.prefill` dispatches on the
registry in kvr_jax/strategies/__init__.py and knows nothing else about any strategy.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from kvr_jax.runtime.mesh import AXIS
from models.layers import ATTENTION_KINDS, DEFAULT_CAUSAL_KERNEL

# The kernels of strategies that skip masked work (single, kvr), their default first.
CAUSAL_KERNELS = (DEFAULT_CAUSAL_KERNEL,) + tuple(
  k for k in ATTENTION_KINDS if k != DEFAULT_CAUSAL_KERNEL
)

# Times each strategy's program was traced (= compiled): tests use it to show that a second
# call with the same shapes compiles nothing.
TRACE_COUNT: collections.Counter[str] = collections.Counter()


def count_trace(strategy: str) -> None:
  TRACE_COUNT[strategy] += 1


@dataclasses.dataclass(frozen=True)
class Strategy:
  """One prefill strategy.

  name: what `prefill(strategy=...)` and the command lines take.
  description: one line for help texts.
  partitioned: the user chooses the chunk lengths (`partition=`); otherwise `layout` alone
    decides them.
  attention_kinds: the attention kernels it runs (the first is its default).
  max_ranks: the largest mesh it runs on (single: 1), None for any.
  layout(context_len, num_ranks, chunks) -> chunks: each rank's token count as the program
    sees it (chunks is the validated partition for a partitioned strategy, else None).
  arrange(tokens_BC, chunks) -> [p, B, c_max] host tokens, each rank's slice padded.
  compile(graphdef, mesh, chunks, attention) -> the jitted program (cached by the strategy).
  cache_rank(chunks) -> the rank whose output shard holds the logits and the whole cache.
  """

  name: str
  description: str
  partitioned: bool
  attention_kinds: tuple[str, ...]
  layout: Callable[[int, int, tuple[int, ...] | None], tuple[int, ...]]
  arrange: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]
  compile: Callable[..., Callable]
  cache_rank: Callable[[tuple[int, ...]], int]
  max_ranks: int | None = None
  attention_note: str = ""  # why it runs only these kernels, for the error message

  @property
  def default_attention(self) -> str:
    return self.attention_kinds[0]

  def check_attention(self, attention: str | None) -> str:
    """`attention` or this strategy's default; refuses a kernel it does not run."""
    if attention is None:
      return self.default_attention
    if attention not in ATTENTION_KINDS:
      raise ValueError(f"unknown attention {attention!r}; expected one of {ATTENTION_KINDS}")
    if attention not in self.attention_kinds:
      raise ValueError(
        f"strategy {self.name!r} runs attention in {self.attention_kinds}, not {attention!r}"
        + (f": {self.attention_note}" if self.attention_note else "")
      )
    return attention


def last_rank(chunks: tuple[int, ...]) -> int:
  return len(chunks) - 1


def spmd(rank_program, mesh):
  """The common program shape: weights replicated, tokens and both outputs sharded by rank."""
  P = jax.P
  body = jax.shard_map(
    rank_program, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(AXIS), P(AXIS))
  )
  return jax.jit(body)


def logits_to_last_rank(logits_BV, owner: int, num_ranks: int):
  """The prompt's last position's logits, computed on rank `owner`, moved to rank p-1 where
  decode continues (B x V values, once); unchanged when the owner is already p-1."""
  if owner == num_ranks - 1:
    return logits_BV
  return jax.lax.ppermute(logits_BV, AXIS, perm=[(owner, num_ranks - 1)])
