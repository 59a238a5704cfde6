"""Model options that are speed levers (issue 36's lever table), each giving the same numbers as
without it: the loss in sequence slices (`model.loss_chunks`: the whole loss's value and
gradients, without ever holding the whole float32 logits), and the layer scan unrolled
(`model.scan_unroll`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megascale_jax.config import ModelConfig, load_config
from megascale_jax.config_checks import ConfigError
from megascale_jax.model.transformer import Transformer, loss_fn

SHAPE = dict(layers=2, d_model=64, heads=4, kv_heads=2, seq_len=32, vocab=512, window=None, dtype="float32")


def perturbed_params(model, seed):
    """Parameters moved off the initialisation (so biases and norms matter), seeded."""
    params = model.init(jax.random.key(seed), jnp.zeros((1, model.cfg.seq_len), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, params,
                          is_leaf=lambda x: hasattr(x, "value"))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return treedef.unflatten([x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["head", "tied"])
def test_the_loss_in_slices_has_the_whole_losss_value_and_gradients(tied):
    cfg = ModelConfig(**SHAPE, tied_embeddings=tied)
    whole, sliced = Transformer(cfg), Transformer(dataclasses.replace(cfg, loss_chunks=4))
    params = perturbed_params(whole, seed=7)
    batch = jax.random.randint(jax.random.key(11), (3, cfg.seq_len + 1), 0, cfg.vocab)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(whole, p, batch)))(params)
    loss4, grads4 = jax.jit(jax.value_and_grad(lambda p: loss_fn(sliced, p, batch)))(params)
    # an independent reference for the value: float64 numpy log-softmax of the model's own logits
    logits = np.asarray(whole.apply({"params": params}, batch[:, :-1]), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, np.asarray(batch[:, 1:])[..., None], -1).mean()
    np.testing.assert_allclose(float(loss4), expected, rtol=1e-6)
    np.testing.assert_allclose(float(loss4), float(loss), rtol=1e-6)
    assert ("head" in grads4) == (not tied)
    for (path, g4), g in zip(jax.tree_util.tree_flatten_with_path(grads4)[0], jax.tree.leaves(grads)):
        np.testing.assert_allclose(g4, g, rtol=1e-5, atol=1e-6 * float(np.abs(g).max()), err_msg=str(path))


@pytest.mark.slow
def test_the_sliced_loss_never_holds_the_whole_logits():
    """The compiled step's scratch memory: the whole loss holds the float32 logits of the batch
    (and their gradient); in 8 slices only one slice's are live at a time."""
    cfg = ModelConfig(**{**SHAPE, "vocab": 8192, "seq_len": 128, "layers": 1})
    batch = jax.random.randint(jax.random.key(0), (4, cfg.seq_len + 1), 0, cfg.vocab)
    logits_bytes = 4 * cfg.seq_len * cfg.vocab * 4  # 16.8 MB

    def scratch(chunks):
        model = Transformer(dataclasses.replace(cfg, loss_chunks=chunks))
        params = perturbed_params(model, seed=1)
        step = jax.jit(jax.value_and_grad(lambda p: loss_fn(model, p, batch)))
        return step.lower(params).compile().memory_analysis().temp_size_in_bytes

    whole, sliced = scratch(1), scratch(8)
    assert whole >= logits_bytes, (whole, logits_bytes)
    assert sliced <= whole - 0.75 * logits_bytes, (sliced, whole, logits_bytes)


def test_slices_that_do_not_divide_the_sequence_are_refused_before_compiling():
    with pytest.raises(ConfigError, match=r"model.loss_chunks=3 must be >= 1 and divide model.seq_len=128"):
        load_config(None, ["model.loss_chunks=3"])
    with pytest.raises(ConfigError, match=r"model.loss_chunks=0"):
        load_config(None, ["model.loss_chunks=0"])


@pytest.mark.slow
def test_an_unrolled_layer_scan_has_the_same_loss_and_gradients_and_no_loop():
    """`model.scan_unroll`: the stacked layers unrolled into straight-line code (no while loop in
    the lowered step), the same parameters, loss and gradients as the scan. More than the layers
    (configs/gpt_1b.yaml's 24 with model.layers=4) unrolls them all; 0 is refused."""
    cfg = ModelConfig(**{**SHAPE, "layers": 4})
    looped, unrolled = Transformer(cfg), Transformer(dataclasses.replace(cfg, scan_unroll=24))
    with pytest.raises(ConfigError, match=r"model.scan_unroll=0 must be >= 1"):
        load_config(None, ["model.scan_unroll=0"])
    params = perturbed_params(looped, seed=3)
    assert jax.tree.structure(params) == jax.tree.structure(perturbed_params(unrolled, seed=3))
    batch = jax.random.randint(jax.random.key(5), (2, cfg.seq_len + 1), 0, cfg.vocab)
    steps = [jax.jit(jax.value_and_grad(lambda p, m=m: loss_fn(m, p, batch))) for m in (looped, unrolled)]
    (loss, grads), (loss_u, grads_u) = (step(params) for step in steps)
    np.testing.assert_allclose(float(loss_u), float(loss), rtol=1e-6)
    for g_u, g in zip(jax.tree.leaves(grads_u), jax.tree.leaves(grads)):
        np.testing.assert_allclose(g_u, g, rtol=1e-5, atol=1e-6 * float(np.abs(g).max()))
    loops = [step.lower(params).as_text().count("stablehlo.while") for step in steps]  # before XLA's passes
    assert loops[0] >= 1 and loops[1] == 0, loops


@pytest.mark.slow
@pytest.mark.parametrize("block,activation,norm", [("parallel", "gelu_tanh", "layernorm"),
                                                   ("serial", "swiglu", "rmsnorm")])
def test_elementwise_remat_has_the_same_loss_and_gradients_and_keeps_less(block, activation, norm):
    """model.remat=elementwise: the norms and the MLP activation recomputed in the backward from
    their inputs. Same loss and gradients as remat=none (the same ops, run again); the residuals
    the backward keeps do not grow, and shrink by at least the MLP-wide copies SwiGLU's autodiff
    keeps (two) in every layer. (GeLU and the norms keep only their inputs either way:
    `transformer.xla_bias_gelu`, `transformer.normalize`.)"""
    cfg = ModelConfig(**SHAPE, block=block, activation=activation, norm=norm, bias=activation != "swiglu")
    plain, recomputed = Transformer(cfg), Transformer(dataclasses.replace(cfg, remat="elementwise"))
    params = perturbed_params(plain, seed=5)
    batch = jax.random.randint(jax.random.key(6), (3, cfg.seq_len + 1), 0, cfg.vocab)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(plain, p, batch)))(params)
    loss_r, grads_r = jax.jit(jax.value_and_grad(lambda p: loss_fn(recomputed, p, batch)))(params)
    np.testing.assert_allclose(float(loss_r), float(loss), rtol=1e-6)
    for (path, g_r), g in zip(jax.tree_util.tree_flatten_with_path(grads_r)[0], jax.tree.leaves(grads)):
        np.testing.assert_allclose(g_r, g, rtol=1e-5, atol=1e-6 * float(np.abs(g).max()), err_msg=str(path))

    def kept(model):  # bytes of what the vjp closes over (the parameters are the same in both)
        backward = jax.eval_shape(lambda p: jax.vjp(lambda p: loss_fn(model, p, batch), p)[1], params)
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(backward))

    tokens, mlp = 3 * cfg.seq_len, cfg.mlp_dim
    activation_copies = 0 if activation == "gelu_tanh" else 2
    assert kept(plain) - kept(recomputed) >= tokens * cfg.layers * 4 * activation_copies * mlp


def head_reference(x, head, g):
    """float64 NumPy gradients of sum(g * (x @ head)) with respect to x and head."""
    x64, head64, g64 = (np.asarray(a, np.float64) for a in (x, head, g))
    return np.einsum("bsv,dv->bsd", g64, head64), np.einsum("bsd,bsv->dv", x64, g64)


def test_the_heads_backward_gemms_take_the_logits_gradient_in_bf16_with_float32_results():
    """model.dtype=bfloat16: the LM head's backward runs both GEMMs on bf16 operands, as every
    other GEMM's backward does, with float32 accumulation; the gradients match float64 to bf16's
    rounding of the logits' gradient, and the head's gradient stays float32 (its parameter's)."""
    from megascale_jax.model.transformer import head_logits

    kx, kh, kg = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (2, 16, 64)).astype(jnp.bfloat16)
    head = jax.random.normal(kh, (64, 256), jnp.float32) * 0.1
    g = jax.random.normal(kg, (2, 16, 256), jnp.float32)
    logits, pullback = jax.vjp(lambda x, h: head_logits(x, h, "bfloat16"), x, head)
    dx, dhead = pullback(g)
    assert logits.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dhead.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits, np.float64), np.asarray(x, np.float64)
                               @ np.asarray(head.astype(jnp.bfloat16), np.float64), rtol=1e-5, atol=1e-5)
    ref_dx, ref_dhead = head_reference(x, head.astype(jnp.bfloat16).astype(jnp.float32), g)
    for got, want in ((dx, ref_dx), (dhead, ref_dhead)):
        rel = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
        assert 1e-4 < rel < 1e-2, rel  # bf16's rounding of g (and of dx), nothing larger
    # the compiled backward's dots: bf16 operands, float32 results
    text = jax.jit(pullback).lower(g).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 2 and all(line.count("bf16>") == 2 and line.rstrip().endswith("xf32>") for line in dots), dots


@pytest.mark.slow
def test_a_bf16_models_gradients_with_the_bf16_head_backward_match_the_float32_one(monkeypatch):
    """The whole model at bf16 (as on a GPU; XLA:CPU runs this untied head's GEMMs): the default
    head backward (bf16 operands) and model.head_grad_float32=true give the same loss, and
    gradients equal up to bf16's rounding."""
    from megascale_jax.model import transformer

    monkeypatch.setattr(transformer, "mixed_dots_backend", lambda: True)
    cfg = ModelConfig(**{**SHAPE, "dtype": "bfloat16"})
    fast, exact = Transformer(cfg), Transformer(dataclasses.replace(cfg, head_grad_float32=True))
    params = perturbed_params(fast, seed=5)
    batch = jax.random.randint(jax.random.key(9), (3, cfg.seq_len + 1), 0, cfg.vocab)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(fast, p, batch)))(params)
    loss32, grads32 = jax.jit(jax.value_and_grad(lambda p: loss_fn(exact, p, batch)))(params)
    assert float(loss) == float(loss32)  # the forward is the same computation
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads), jax.tree.leaves(grads32)):
        assert a.dtype == b.dtype == jnp.float32
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert rel < 2e-2, (jax.tree_util.keystr(path[0]), rel)


@pytest.mark.slow
def test_on_the_cpu_a_bf16_head_keeps_autodiffs_float32_backward():
    """XLA:CPU cannot run a tied head's bf16 backward GEMM; there the head is the plain einsum."""
    cfg = ModelConfig(**{**SHAPE, "dtype": "bfloat16"}, tied_embeddings=True)
    model = Transformer(cfg)
    params = perturbed_params(model, seed=2)
    batch = jax.random.randint(jax.random.key(4), (2, cfg.seq_len + 1), 0, cfg.vocab)
    text = jax.jit(jax.grad(lambda p: loss_fn(model, p, batch))).lower(params).as_text()
    vocab_dots = [line for line in text.splitlines() if "dot_general" in line and f"x{cfg.vocab}x" in line]
    # the forward (bf16 operands) and the backward's two GEMMs, on the float32 logits' gradient
    assert jax.default_backend() == "cpu" and len(vocab_dots) == 3
    assert sum(f"x{cfg.vocab}xf32>, tensor" in line for line in vocab_dots) == 2, vocab_dots
    grads = jax.jit(jax.grad(lambda p: loss_fn(model, p, batch)))(params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("approximate", [True, False], ids=["tanh", "exact"])
def test_the_mlps_gelu_keeps_only_its_input_and_has_gelus_gradient(approximate):
    """`transformer.xla_bias_gelu`, the MLP's activation: its backward keeps u and the bias only
    (autodiff of jax.nn.gelu kept five arrays of u's size), and its gradients are GeLU's: float64
    NumPy's derivative for float32 inputs; bf16 inputs within bf16's rounding of it."""
    import math

    from megascale_jax.model.transformer import xla_bias_gelu

    ku, kb, kg = jax.random.split(jax.random.key(8), 3)
    u = 2 * jax.random.normal(ku, (3, 16, 64), jnp.float32)
    b = 0.5 * jax.random.normal(kb, (64,), jnp.float32)
    g = jax.random.normal(kg, (3, 16, 64), jnp.float32)
    z = np.asarray(u, np.float64) + np.asarray(b, np.float64)
    if approximate:
        c = math.sqrt(2 / math.pi)
        t = np.tanh(c * (z + 0.044715 * z ** 3))
        value, slope = 0.5 * z * (1 + t), 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * 0.044715 * z * z)
    else:
        from scipy.special import erf

        cdf = 0.5 * (1 + erf(z / math.sqrt(2)))
        value, slope = z * cdf, cdf + z * np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
        y, pullback = jax.vjp(lambda u, b: xla_bias_gelu(u, b, approximate), u.astype(dtype), b.astype(dtype))
        du, db = pullback(g.astype(dtype))
        assert y.dtype == du.dtype == db.dtype == dtype and db.shape == b.shape
        dz = np.asarray(g, np.float64) * slope
        for got, want in ((y, value), (du, dz), (db, dz.sum(axis=(0, 1)))):
            got = np.asarray(got, np.float64)
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
        residuals = jax.tree.leaves(jax.vjp(lambda u, b: xla_bias_gelu(u, b, approximate),
                                            u.astype(dtype), b.astype(dtype))[1])
        assert sorted(r.shape for r in residuals) == sorted([b.shape, u.shape])


@pytest.mark.parametrize("centered", [True, False], ids=["layernorm", "rmsnorm"])
def test_the_norms_keep_only_their_input_and_row_statistics_and_have_the_norms_gradient(centered):
    """`transformer.normalize`: LayerNorm or RMSNorm whose backward keeps x (its own dtype) and
    each row's mean and 1/sigma, not autodiff's float32 copies of x; value and gradients are
    float64 NumPy's for float32 inputs, within bf16's rounding for bf16 inputs."""
    from megascale_jax.model.transformer import normalize

    kx, ks, kb, kg = jax.random.split(jax.random.key(12), 4)
    x = 3 + 2 * jax.random.normal(kx, (3, 16, 64), jnp.float32)  # off-centre rows: the mean matters
    scale = 1 + 0.3 * jax.random.normal(ks, (64,))
    bias = 0.2 * jax.random.normal(kb, (64,)) if centered else jnp.zeros((), jnp.float32)
    g = jax.random.normal(kg, (3, 16, 64))

    def reference(x64):
        mean = x64.mean(-1, keepdims=True) if centered else 0.0
        return (x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(-1, keepdims=True) + 1e-5) \
            * np.asarray(scale, np.float64) + np.asarray(bias, np.float64)

    x64, g64 = np.asarray(x, np.float64), np.asarray(g, np.float64)
    want = reference(x64)
    # the gradients by central differences of the float64 reference, along one random direction
    # for x, and exactly for scale and bias (the output is linear in them)
    xhat = (want - np.asarray(bias, np.float64)) / np.asarray(scale, np.float64)
    want_dscale, want_dbias = (g64 * xhat).sum((0, 1)), g64.sum((0, 1))
    direction = np.asarray(jax.random.normal(jax.random.key(13), x.shape), np.float64)
    h = 1e-6
    want_dx_along = ((g64 * reference(x64 + h * direction)).sum() - (g64 * reference(x64 - h * direction)).sum()) / (2 * h)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
        y, pullback = jax.vjp(lambda x, s, b: normalize(x, s, b, 1e-5, jnp.dtype(dtype), centered),
                              x.astype(dtype), scale, bias)
        dx, dscale, dbias = pullback(g.astype(dtype))
        assert y.dtype == dx.dtype == dtype and dscale.dtype == dbias.dtype == jnp.float32
        rel = lambda got, ref: np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref)
        assert rel(y, want) < tol and rel(dscale, want_dscale) < tol
        if centered:
            assert rel(dbias, want_dbias) < tol
        along = float((np.asarray(dx, np.float64) * direction).sum())
        assert abs(along - want_dx_along) < 10 * tol * np.linalg.norm(np.asarray(dx, np.float64)) * np.linalg.norm(direction) / np.sqrt(direction.size)
        residuals = jax.tree.leaves(jax.vjp(lambda x: normalize(x, scale, bias, 1e-5, jnp.dtype(dtype), centered),
                                            x.astype(dtype))[1])
        big = [r for r in residuals if r.size >= x.size]
        assert [(r.shape, r.dtype) for r in big] == [(x.shape, jnp.dtype(dtype))]  # x itself, nothing float32 of its size
