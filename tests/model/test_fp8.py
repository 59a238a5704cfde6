"""`model.fp8` (megascale_jax/model/fp8.py): the layers' GEMMs as FP8 GEMMs with current scaling.
Against float64 NumPy on fresh random inputs: the product and both gradients carry FP8's error
(e4m3 values, e5m2 gradients: a few percent, never bf16's tenth of a percent, which would mean
the FP8 path did not run) at any magnitude (the scales follow each tensor's amax); a model's loss
and gradients stay those of bf16 to FP8's precision. tests/aot asserts that compiled for an H200
every layer GEMM becomes cuBLASLt's FP8 GEMM."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megascale_jax.config import ModelConfig, load_config
from megascale_jax.config_checks import ConfigError
from megascale_jax.model.fp8 import fp8_matmul
from megascale_jax.model.transformer import Transformer, loss_fn


def relative(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
def test_an_fp8_product_and_its_gradients_have_fp8s_error_at_any_magnitude(magnitude):
    kx, kw, kg = jax.random.split(jax.random.key(int(magnitude * 1000) % 97), 3)
    x = (magnitude * jax.random.normal(kx, (4, 32, 128))).astype(jnp.bfloat16)
    w = 0.05 * jax.random.normal(kw, (128, 96))
    g = (magnitude * jax.random.normal(kg, (4, 32, 96))).astype(jnp.bfloat16)
    y, vjp = jax.vjp(fp8_matmul, x, w)
    dx, dw = vjp(g)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    X, W, G = (np.asarray(a, np.float64) for a in (x, w, g))
    errors = [relative(y, X @ W), relative(dx, G @ W.T), relative(dw, X.reshape(-1, 128).T @ G.reshape(-1, 96))]
    assert all(5e-3 < e < 0.08 for e in errors), errors  # FP8's, not bf16's (~3e-3) nor broken


@pytest.mark.slow
def test_a_model_with_fp8_gemms_keeps_bf16s_loss_and_gradients_to_fp8_precision():
    cfg = ModelConfig(layers=2, d_model=64, heads=4, kv_heads=2, seq_len=32, vocab=256, dtype="bfloat16")
    bf16, fp8 = Transformer(cfg), Transformer(dataclasses.replace(cfg, fp8=True))
    params = bf16.init(jax.random.key(1), jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, params, is_leaf=lambda x: hasattr(x, "value"))
    batch = jax.random.randint(jax.random.key(2), (4, cfg.seq_len + 1), 0, cfg.vocab)
    (loss, grads), (loss8, grads8) = (jax.jit(jax.value_and_grad(lambda p, m=m: loss_fn(m, p, batch)))(params)
                                      for m in (bf16, fp8))
    assert abs(float(loss8) - float(loss)) < 1e-2 * float(loss) and float(loss8) != float(loss)
    flat, flat8 = (np.concatenate([np.ravel(g) for g in jax.tree.leaves(t)]) for t in (grads, grads8))
    cosine = flat @ flat8 / np.linalg.norm(flat) / np.linalg.norm(flat8)
    assert cosine > 0.99, cosine


def test_fp8_with_the_collective_matmul_is_one_line():
    with pytest.raises(ConfigError, match="the collective matmul has no FP8 GEMM yet"):
        load_config(None, ["model.fp8=true", "parallel.tp_overlap=collective_matmul", "parallel.sequence_parallel=true"])
