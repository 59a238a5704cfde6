"""Watching runs: `timings` (per-phase rows, TensorBoard), `device_profile` (profiled steps),
`stragglers`, `hangs`, `report` (heat maps, trace, 3D view, summary). Reading a run's files needs
no jax: the driver uses `timings`, `stragglers` and `hangs` too."""
