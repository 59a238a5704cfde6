"""The dp reduce-scatter (parallel/reduce_scatter.py): its all-to-all form, used where XLA:CPU's
gloo reduce-scatter is unreliable, sums the same values into the same shards as a float64 NumPy
reduce-scatter; outside `jax.distributed` the step keeps XLA's own reduce-scatter."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from megascale_jax.parallel.reduce_scatter import all_to_all_then_sum, reduce_scatter


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_all_to_all_then_sum_is_a_reduce_scatter(dim):
    n = 4
    mesh = jax.make_mesh((n,), ("dp",), devices=jax.devices()[:n])
    x = np.random.default_rng(dim).standard_normal((n, 8, 12, 16)).astype(np.float32)  # member i's input: x[i]
    run = jax.jit(jax.shard_map(lambda y: all_to_all_then_sum(y[0], "dp", dim)[None], mesh=mesh,
                                in_specs=P("dp"), out_specs=P("dp")))
    got = np.asarray(run(jax.device_put(x, NamedSharding(mesh, P("dp")))))
    total = x.astype(np.float64).sum(0)
    expected = np.stack(np.split(total, n, axis=dim))  # member i keeps slice i of dimension `dim`
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_one_process_keeps_xla_reduce_scatter():
    mesh = jax.make_mesh((2,), ("dp",), devices=jax.devices()[:2])
    run = jax.jit(jax.shard_map(lambda y: reduce_scatter(y[0], "dp", 0)[None], mesh=mesh,
                                in_specs=P("dp"), out_specs=P("dp")))
    text = run.lower(jax.ShapeDtypeStruct((2, 8, 4), np.float32, sharding=NamedSharding(mesh, P("dp")))).compile().as_text()
    assert not jax.distributed.is_initialized()
    assert "reduce-scatter(" in text and "all-to-all(" not in text
