"""One report type for the tools' tables: what a launcher prints and writes.

A `Table` holds the lines that introduce it, its header, each row as printed (the tool that
measured the rows owns their format) and the same rows as values (for CSV or JSON). Every
tool returns one; the launcher prints it, writes it, and does nothing else with it.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class Table:
  """title: the lines before the header (what was measured, where, how); header: the column
  line; lines: each row as printed; records: the rows as values; notes: lines after it."""

  title: tuple[str, ...]
  header: str
  lines: tuple[str, ...]
  records: tuple[dict[str, Any], ...] = ()
  notes: tuple[str, ...] = ()

  def text(self) -> str:
    return "\n".join((*self.title, self.header, *self.lines, *self.notes))

  def print(self) -> None:
    print(self.text())

  def write_csv(self, path: str) -> None:
    """The records as CSV, the title lines as comments above them."""
    with open(path, "w", newline="") as f:
      for line in self.title:
        f.write(f"# {line}\n")
      if self.records:
        writer = csv.DictWriter(f, fieldnames=list(self.records[0]))
        writer.writeheader()
        writer.writerows(self.records)

  def write_json(self, path: str) -> None:
    with open(path, "w") as f:
      json.dump({"title": list(self.title), "rows": list(self.records)}, f, indent=1)


NO_PLOT = 'no plot written: matplotlib is not installed (pip install -e ".[harness]")'


def pyplot():
  """matplotlib.pyplot drawing into files (the Agg backend), or None where matplotlib is not
  installed: the harness then writes its tables alone and says so (NO_PLOT), nothing lost."""
  if importlib.util.find_spec("matplotlib") is None:
    print(NO_PLOT)
    return None
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt
