"""A module fixture's table built entry by entry: the default tier runs a few of a file's
cases, and a fixture that compiled every model's reference up front paid for all of them."""


class LazyDict(dict):
  """A dict whose missing key is made by `make(key)` once, on first use."""

  def __init__(self, make):
    super().__init__()
    self._make = make

  def __missing__(self, key):
    value = self[key] = self._make(key)
    return value
