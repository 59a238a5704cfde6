"""The per-worker device self-test (`cluster/self_test.py`): it passes on healthy devices and
fails when one device computes wrong values."""

import jax
import numpy as np

from megascale_jax.cluster import self_test


def test_healthy_devices_pass_with_a_positive_rate():
    result = self_test.device_self_test(size=64, reps=2)
    assert result["ok"] is True
    assert result["seconds"] > 0 and result["gflops"] > 0


def test_a_device_that_computes_wrong_values_fails(monkeypatch):
    put, broken = jax.device_put, jax.local_devices()[3]

    def corrupting_put(x, device=None, **kw):
        # The fourth device perturbs one element of its input, like a bad memory cell.
        if device == broken:
            x = np.array(x)
            x[5, 7] += 1.0
        return put(x, device, **kw)

    monkeypatch.setattr(jax, "device_put", corrupting_put)
    assert self_test.device_self_test(size=64, reps=1)["ok"] is False


def test_fastest_seconds_is_the_minimum_of_the_calls(monkeypatch):
    # A clock that reads 0, 3, 10, 11, 20, 22: the calls take 3, 1 and 2 seconds.
    clock = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])
    monkeypatch.setattr(self_test.time, "perf_counter", lambda: next(clock))
    assert self_test.fastest_seconds(lambda: None, 3) == 1.0
