"""A check the hybrid and latent tests share: the measured search on one program."""

import json

from kvr_jax.strategies import TRACE_COUNT, runahead
from kvr_jax.tools import measured


def assert_candidates_on_one_program(model, tokens, mesh, trace_name: str, tmp_path):
  """objective='measured' on `model`: its split sums to the prompt, it timed at least three
  candidates, on the split as data's program (the setup says so), and `trace_name`'s
  program was traced fewer times than there were candidates (not one each)."""
  traced = TRACE_COUNT[trace_name]
  path = str(tmp_path / "measured.json")
  chunks = measured.measured_search(
    model, tokens, mesh, multiple=8, repeats=1, cache_path=path, show_progress=False
  )
  with open(path) as f:
    stored = json.load(f)
  candidates = {p for key in stored["batches"] for p in key.split(";")}
  assert sum(chunks) == tokens.shape[1] and len(candidates) >= 3
  assert stored["setup"]["program"] == runahead.SPLIT_AS_DATA
  assert TRACE_COUNT[trace_name] - traced < len(candidates) - 1, "a program per candidate"
