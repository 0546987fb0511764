"""kvr_jax.prefill's plan of a hybrid's or latent model's prefill, run with room kept for
decoding: what the family tests compare with one device's forward (its cache has that room)."""

from kvr_jax.inference.prefill import plan_prefill, run_prefill


def prefilled(
  model, tokens, mesh, partition=None, attention=None, room=0, strategy="kvr", cache="last"
):
  """`kvr_jax.prefill(model, tokens, strategy, mesh, partition, attention, cache)` with its
  cache keeping `room` more positions (`run_prefill(decode_room=)`, what generate runs)."""
  plan = plan_prefill(model, tokens, strategy, mesh, partition, attention, cache)
  return run_prefill(model, plan, tokens, decode_room=room)
