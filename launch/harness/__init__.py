"""The benchmark and report harness behind `launch.benchmark`, `launch.paper` and
`launch.multiprocess`: measured jobs and their tables, the modelled grids, the multi-process
jobs. Not part of the library: a notebook calls kvr_jax; plotting needs the `harness` extra."""
