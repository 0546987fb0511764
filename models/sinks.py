"""Attention sinks (gpt-oss): a learned logit per head that joins every query's softmax
denominator as a key without a value, and the rule that lets attention split over key sets
still merge exactly: a call adds the sink only to the rows whose own key it is given.

Nothing here knows about devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sees_own_key(num_queries: int, query_offset, key_end) -> jax.Array:
  """[T] (or [B, T] where `query_offset` or `key_end` is per row, [B]) bool: query t, at
  position query_offset + t counted from the first key, finds its own key among the keys
  [0, key_end) of this call. A causal query sees its own key whenever it is given (a window
  always holds it)."""
  position = jnp.asarray(query_offset)[..., None] + jnp.arange(num_queries)
  return position < jnp.asarray(key_end)[..., None]


def add_sinks(out_BTNH, lse_BTN, sinks_N, rows_BT) -> tuple[jax.Array, jax.Array]:
  """Attention sinks (gpt-oss): head n's learned logit sinks_N[n] joins the softmax
  denominator of every query, as a key without a value: out * e^lse / (e^lse + e^sink), and
  lse becomes log(e^lse + e^sink). Only the rows `rows_BT` ([T] or [B, T] bool) take it: the
  rows whose own key is among this call's keys (`sees_own_key`). Every query's own key is
  attended in exactly one call of any strategy, so the sink enters each query's sum once
  however the keys are split, and the partials merge exactly (`merge_partials`).
  Returns (out float32, lse float32)."""
  lse = lse_BTN.astype(jnp.float32)
  with_sink = jnp.logaddexp(lse, sinks_N.astype(jnp.float32))
  rows_BT1 = jnp.asarray(rows_BT)[..., None]
  scale = jnp.where(rows_BT1, jnp.exp(lse - with_sink), 1.0)
  return out_BTNH.astype(jnp.float32) * scale[..., None], jnp.where(rows_BT1, with_sink, lse)
