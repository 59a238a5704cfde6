"""A worker's check of its own devices: a matmul on every local device against numpy's float64
result, timed. Run by `diagnose` after a fault and by NaN triage after a transient non-finite
step, so it lives with the other worker-side code, not in a driver module."""

from __future__ import annotations

import time


def device_self_test(size: int = 256, reps: int = 5) -> dict:
    import jax
    import numpy as np

    a, b = np.random.default_rng(0).standard_normal((2, size, size), dtype=np.float32)
    expected = a.astype(np.float64) @ b
    ok, seconds = True, 0.0
    for device in jax.local_devices():
        x, y = jax.device_put(a, device), jax.device_put(b, device)
        out = (x @ y).block_until_ready()  # compile outside the timing
        ok &= bool(np.allclose(np.asarray(out), expected, rtol=1e-3, atol=1e-3))
        seconds += fastest_seconds(lambda: (x @ y).block_until_ready(), reps)
    return {"ok": ok, "seconds": seconds, "gflops": 2 * size ** 3 * len(jax.local_devices()) / seconds / 1e9}


def fastest_seconds(fn, reps: int) -> float:
    """The fastest of `reps` calls: a shared host's noise only ever adds time."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
