"""`parallel.residuals`: which vjp residuals depend on the activation, checked against the values.

The reference is numerical and independent of any jaxpr: a residual depends on the activation
iff its value changes when only the activation changes (two random activations, same weights).
The analysis must agree leaf for leaf: a leaf wrongly called weight-only would be rebuilt from a
zero activation in the pipeline's backward (wrong gradients); one wrongly called dependent is
stashed per microbatch (memory wasted).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megascale_jax.config import load_config
from megascale_jax.model import documents
from megascale_jax.model.transformer import Transformer, run_layers
from megascale_jax.parallel.residuals import activation_dependent_residuals

BASE = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.kv_heads=2", "model.seq_len=16",
        "mesh.dp=1", "mesh.tp=1", "mesh.cpu_devices=1"]


def numerically_dependent(fn, params, x_shape, dtype) -> list[bool]:
    x1, x2 = (jax.random.normal(jax.random.key(k), x_shape, dtype) for k in (2, 3))
    # the pullback's residuals as values, from one compiled program run twice (eagerly, op by op,
    # the same leaves cost ~1-2 s more a case)
    pullback = jax.jit(lambda p, x: jax.vjp(fn, p, x)[1])
    a, b = (jax.tree.leaves(pullback(params, x)) for x in (x1, x2))
    return [not np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(a, b)]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    [], ["model.block=serial", "model.norm=rmsnorm"], ["model.window=null"],
    ["model.attention=pallas", "model.fused_norm=true", "model.fused_mlp=true"],
    ["model.document_eos=3"], ["model.document_eos=3", "model.attention=pallas"],
], ids=["parallel", "serial-rmsnorm", "no-window", "pallas-fused", "documents", "pallas-documents"])
def test_model_chunk_residuals_match_their_values(extra):
    cfg = load_config(None, BASE + extra)
    boxed = jax.eval_shape(Transformer(cfg.model, cfg.parallel).init, jax.random.key(0),
                           jnp.zeros((1, cfg.model.seq_len), jnp.int32))
    shapes = nn.unbox(boxed)["params"]["layers"]
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(shapes))))
    layers = jax.tree.map(lambda a: jax.random.normal(next(keys), a.shape, a.dtype), shapes)
    x_shape = (2, cfg.model.seq_len, cfg.model.d_model)
    # packed documents: a context beside the weights (the pipeline's stash rebuilds what depends on
    # it alone from the backward's microbatch), fixed in the numerical reference
    eos = cfg.model.document_eos
    tokens = np.random.default_rng(4).integers(0, 6, x_shape[:2])
    docs = None if eos is None else documents.layout(jnp.asarray(tokens), eos)
    fn = lambda p, x, docs: run_layers(cfg.model, p, x, cfg.parallel, docs)
    depends, avals = activation_dependent_residuals(fn, layers, jax.ShapeDtypeStruct(x_shape, jnp.float32), docs)
    expected = numerically_dependent(lambda p, x: fn(p, x, docs), layers, x_shape, jnp.float32)
    assert list(depends) == expected
    assert 0 < sum(depends) < len(depends)  # both kinds exist: the check is not vacuous


def test_scan_cond_and_while_are_analysed_inside():
    """Inside a layer scan, a cond over the weights alone stays weight-only, as do the stacked
    weight slices the scan emits (the carry is what depends on x); a while loop over the weights
    alone is weight-only too. Checked against the residuals' values."""
    def fn(w, x):
        def layer(h, wl):
            scale = jax.lax.cond(wl[0, 0] > 0, lambda: wl * 2.0, lambda: wl + 1.0)  # weight-only
            h = jnp.tanh(h @ scale)
            return h, None
        h, _ = jax.lax.scan(layer, x, w)
        n = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.5), (0, w.sum()))[1]
        return h * n

    w = jax.random.normal(jax.random.key(0), (3, 4, 4))
    depends, _ = activation_dependent_residuals(fn, w, jax.ShapeDtypeStruct((2, 4), jnp.float32))
    assert list(depends) == numerically_dependent(fn, w, (2, 4), jnp.float32)
    assert 0 < sum(depends) < len(depends)
