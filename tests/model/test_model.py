"""megascale_jax.model.transformer / megascale_jax.model.attention against an independent float64 NumPy reference.

The reference below is written from the documented contract (model.py / attention.py
docstrings) and shares no code with the library: embedding lookup, parallel or serial pre-norm
blocks, LayerNorm (eps 1e-5, biased variance) / RMSNorm (eps 1e-6), half-split rotary
embedding (base 10000), grouped-query attention by explicitly repeating k/v heads, a
brute-force Python-loop sliding-window mask, GeLU (exact or tanh), final norm and untied LM
head. Every parameter is re-drawn at random (biases and norm scales included) so that no term
can silently vanish.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import re
import zlib

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megascale_jax.model import attention
from megascale_jax.config import MeshConfig, ModelConfig
from megascale_jax.model.transformer import Transformer, loss_fn

# layers 2, d_model 32, heads 4 (head_dim 8), mlp 128, vocab 50, seq 12.
BASE = ModelConfig(layers=2, d_model=32, heads=4, kv_heads=4, mlp_ratio=4.0, vocab=50, seq_len=12,
                   block="parallel", window=None, attention="xla", norm="layernorm",
                   activation="gelu_tanh", dtype="float32")
BATCH = 2

# fp32 model vs float64 reference: |model - ref| <= ATOL + RTOL * |ref| element-wise.
RTOL, ATOL = 1e-4, 1e-5


def _cfg(**kw) -> ModelConfig:
    return dataclasses.replace(BASE, **kw)


def _param_shapes(cfg: ModelConfig):
    """Unboxed ShapeDtypeStruct tree of the model's parameters (traced, never compiled)."""
    tokens = jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32)
    return nn.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens))["params"]


def _random_params(cfg: ModelConfig, seed: int, scale: float = 0.3):
    """Every parameter leaf drawn at random with its own generator (seed, leaf index).

    Norm scales are 1 + N(0, scale^2) (non-trivial but not collapsing the signal); everything
    else, biases included, is N(0, scale^2). float32 NumPy arrays (host RNG: no compiles).
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(_param_shapes(cfg))
    new = []
    for i, (path, leaf) in enumerate(leaves):
        assert leaf.dtype == jnp.float32, path
        noise = np.random.default_rng([seed, i]).normal(0.0, scale, leaf.shape)
        is_scale = jax.tree_util.keystr(path).endswith("['scale']")
        new.append(((1.0 + noise) if is_scale else noise).astype(np.float32))
    return jax.tree_util.tree_unflatten(treedef, new)


# XLA:CPU compile time dominates this file; backend optimisation level 0 makes it ~3x cheaper and
# does not change what is computed (only fp reassociation). The one-device-mesh test below uses
# the default pipeline, so the production compile path is exercised too.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.lru_cache(maxsize=None)
def _compiled_apply(cfg: ModelConfig, batch: int, seq: int):
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    lowered = jax.jit(Transformer(cfg).apply).lower({"params": _param_shapes(cfg)}, tokens)
    return lowered.compile(compiler_options=FAST_COMPILE)


def _apply(cfg: ModelConfig, params, tokens):
    return _compiled_apply(cfg, *tokens.shape)({"params": params}, tokens)


def _random_tokens(seed: int, shape, vocab: int):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


# ----------------------------------------------------------------------------- float64 reference


def ref_mask(seq: int, window):
    mask = np.zeros((seq, seq), dtype=bool)
    for i in range(seq):
        for j in range(seq):
            mask[i, j] = j <= i and (window is None or i - j < window)
    return mask


def ref_norm(x, p, kind):
    x = np.asarray(x, np.float64)
    scale = np.asarray(p["scale"], np.float64)
    if kind == "rmsnorm":
        assert "bias" not in p
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)  # biased
    return (x - mean) / np.sqrt(var + 1e-5) * scale + np.asarray(p["bias"], np.float64)


def ref_rotary(x):
    """x: (batch, seq, heads, hd); pairs (x[..., i], x[..., i + hd/2]) rotate by pos * 10000^(-i/half)."""
    seq, hd = x.shape[1], x.shape[-1]
    half = hd // 2
    out = np.empty_like(x)
    for pos in range(seq):
        for i in range(half):
            theta = pos * 10000.0 ** (-i / half)
            c, s = math.cos(theta), math.sin(theta)
            a, b = x[:, pos, :, i], x[:, pos, :, i + half]
            out[:, pos, :, i] = a * c - b * s
            out[:, pos, :, i + half] = b * c + a * s
    return out


def ref_attend(q, k, v, window):
    """q: (b, s, h, hd); k, v: (b, s, kv, hd). Repeats kv heads explicitly: head j uses kv j // (h/kv)."""
    b, s, h, hd = q.shape
    group = h // k.shape[2]
    kv_index = np.array([j // group for j in range(h)])
    k, v = k[:, :, kv_index], v[:, :, kv_index]
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    mask = ref_mask(s, window)
    scores = np.where(mask, scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs, v)


_erf = np.vectorize(math.erf)


def ref_gelu(x, activation):
    if activation == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def ref_attention_block(x, p, cfg):
    def proj(name):
        return np.einsum("bsd,dnh->bsnh", x, p["w" + name]) + p["b" + name]

    q, k, v = ref_rotary(proj("q")), ref_rotary(proj("k")), proj("v")
    o = ref_attend(q, k, v, cfg.window)
    return np.einsum("bsnh,nhd->bsd", o, p["wo"]) + p["bo"]


def ref_mlp(x, p, cfg):
    hidden = ref_gelu(x @ p["w1"] + p["b1"], cfg.activation)
    return hidden @ p["w2"] + p["b2"]


def ref_forward(params, tokens, cfg):
    """float64 logits (batch, seq, vocab)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    tokens = np.asarray(tokens)
    x = p["embed"][tokens]
    layers = p["layers"]
    for l in range(cfg.layers):
        lp = jax.tree.map(lambda a: a[l], layers)
        if cfg.block == "parallel":
            assert set(lp) == {"norm", "attn", "mlp"}
            h = ref_norm(x, lp["norm"], cfg.norm)
            x = x + ref_attention_block(h, lp["attn"], cfg) + ref_mlp(h, lp["mlp"], cfg)
        else:
            assert set(lp) == {"norm1", "norm2", "attn", "mlp"}
            x = x + ref_attention_block(ref_norm(x, lp["norm1"], cfg.norm), lp["attn"], cfg)
            x = x + ref_mlp(ref_norm(x, lp["norm2"], cfg.norm), lp["mlp"], cfg)
    x = ref_norm(x, p["final_norm"], cfg.norm)
    return x @ p["head"]


def ref_loss(params, batch, cfg):
    batch = np.asarray(batch)
    logits = ref_forward(params, batch[:, :-1], cfg)
    targets = batch[:, 1:]
    total, count = 0.0, 0
    for b in range(logits.shape[0]):
        for s in range(logits.shape[1]):
            row = logits[b, s]
            m = row.max()
            logz = m + math.log(np.exp(row - m).sum())
            total += logz - row[targets[b, s]]
            count += 1
    return total / count


def _assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- self-checks of the reference


def test_reference_rotary_matches_complex_rotation():
    """The loop rotary equals multiplying (a + ib) by e^{i pos theta_i} (a second derivation)."""
    x = np.random.default_rng(0).normal(size=(1, 5, 2, 6))
    out = ref_rotary(x)
    half = 3
    for pos in range(5):
        for i in range(half):
            z = (x[0, pos, :, i] + 1j * x[0, pos, :, i + half]) * np.exp(1j * pos * 10000.0 ** (-i / half))
            np.testing.assert_allclose(out[0, pos, :, i], z.real, atol=1e-12)
            np.testing.assert_allclose(out[0, pos, :, i + half], z.imag, atol=1e-12)


def test_reference_gelu_variants_differ():
    x = np.linspace(-3, 3, 13)
    assert np.max(np.abs(ref_gelu(x, "gelu") - ref_gelu(x, "gelu_tanh"))) > 1e-4
    np.testing.assert_allclose(ref_gelu(x, "gelu"), np.asarray(jax.nn.gelu(x, approximate=False)), atol=1e-6)


# ----------------------------------------------------------------------------- full forward vs reference

WINDOWS = [None, 1, 3, BASE.seq_len, BASE.seq_len + 5]
KV_HEADS = [BASE.heads, BASE.heads // 2, 1]
FACTORS = dict(window=WINDOWS, kv_heads=KV_HEADS, block=["parallel", "serial"],
               norm=["layernorm", "rmsnorm"], activation=["gelu", "gelu_tanh"])

# The full product is 120 models (~1-2 s of compile each on 2 CPU cores). By default we run a
# covering design instead: every (window, kv_heads) pair once, chosen so that every pair of values
# of any two factors appears and all 8 (block, norm, activation) combinations appear
# (test_grid_is_a_covering_design checks it). MEGASCALE_FULL_MODEL_GRID=1 runs the full product.
_ROWS = [
    (None, 4, "serial", "rmsnorm", "gelu"),
    (None, 2, "serial", "layernorm", "gelu_tanh"),
    (None, 1, "parallel", "layernorm", "gelu_tanh"),
    (1, 4, "parallel", "layernorm", "gelu"),
    (1, 2, "parallel", "rmsnorm", "gelu_tanh"),
    (1, 1, "serial", "layernorm", "gelu_tanh"),
    (3, 4, "serial", "rmsnorm", "gelu_tanh"),
    (3, 2, "parallel", "layernorm", "gelu_tanh"),
    (3, 1, "serial", "layernorm", "gelu"),
    (12, 4, "parallel", "rmsnorm", "gelu_tanh"),
    (12, 2, "serial", "rmsnorm", "gelu"),
    (12, 1, "serial", "layernorm", "gelu"),
    (17, 4, "serial", "layernorm", "gelu"),
    (17, 2, "serial", "rmsnorm", "gelu_tanh"),
    (17, 1, "parallel", "rmsnorm", "gelu"),
]
if os.environ.get("MEGASCALE_FULL_MODEL_GRID") == "1":
    _ROWS = list(itertools.product(*FACTORS.values()))
GRID = [dict(zip(FACTORS, row)) for row in _ROWS]


def _grid_id(kw):
    return "-".join(f"{k}={v}" for k, v in kw.items())


def test_grid_is_a_covering_design():
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(kw[a], kw[b]) for kw in GRID}
        assert len(seen) == len(FACTORS[a]) * len(FACTORS[b]), (a, b)
    assert len({(kw["block"], kw["norm"], kw["activation"]) for kw in GRID}) == 8
    assert WINDOWS[-2] == BASE.seq_len and WINDOWS[-1] > BASE.seq_len


@pytest.mark.parametrize("kw", GRID, ids=[_grid_id(kw) for kw in GRID])
def test_forward_matches_float64_reference(kw):
    cfg = _cfg(**kw)
    seed = zlib.crc32(_grid_id(kw).encode()) % (2 ** 31)  # deterministic per case
    params = _random_params(cfg, seed)
    tokens = _random_tokens(seed + 1, (BATCH, cfg.seq_len), cfg.vocab)
    logits = _apply(cfg, params, tokens)
    chex.assert_shape(logits, (BATCH, cfg.seq_len, cfg.vocab))
    chex.assert_type(logits, jnp.float32)
    expected = ref_forward(params, tokens, cfg)
    assert np.std(expected) > 0.3  # the random parameters give logits of order one, not ~0
    _assert_close(logits, expected)


def test_window_changes_the_output():
    """Guards the grid above against a model that ignores `window`: 4 vs None must differ."""
    params = _random_params(_cfg(kv_heads=2), 7)
    tokens = _random_tokens(8, (BATCH, BASE.seq_len), BASE.vocab)
    full = _apply(_cfg(kv_heads=2, window=None), params, tokens)
    local = _apply(_cfg(kv_heads=2, window=4), params, tokens)  # compiled once, shared below
    # Positions 0..3 see the same keys in both; later positions must differ.
    _assert_close(local[:, :4], np.asarray(full[:, :4], np.float64))
    assert np.min(np.max(np.abs(np.asarray(local - full))[:, 4:], axis=-1)) > 1e-3


def test_causality_future_tokens_do_not_change_past_logits():
    cfg = _cfg(window=4, kv_heads=2)
    params = _random_params(cfg, 11)
    tokens = _random_tokens(12, (BATCH, cfg.seq_len), cfg.vocab)
    changed = tokens.copy()
    changed[:, 7:] = (tokens[:, 7:] + 1) % cfg.vocab
    a, b = np.asarray(_apply(cfg, params, tokens)), np.asarray(_apply(cfg, params, changed))
    np.testing.assert_array_equal(a[:, :7], b[:, :7])
    assert np.all(np.max(np.abs(a[:, 7:] - b[:, 7:]), axis=-1) > 1e-4)


@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_loss_fn_matches_reference_cross_entropy(block):
    cfg = _cfg(block=block, window=5, kv_heads=2, norm="rmsnorm", activation="gelu")
    params = _random_params(cfg, 21)
    batch = _random_tokens(22, (3, cfg.seq_len + 1), cfg.vocab)
    lowered = jax.jit(lambda p, b: loss_fn(Transformer(cfg), p, b)).lower(params, batch)
    loss = lowered.compile(compiler_options=FAST_COMPILE)(params, batch)
    chex.assert_shape(loss, ())
    chex.assert_type(loss, jnp.float32)
    expected = ref_loss(params, batch, cfg)
    # Scalar mean cross entropy (~4-6 here): same fp32-vs-fp64 tolerance as the logits.
    _assert_close(loss, expected)


def test_forward_under_one_device_mesh_and_rules_matches_reference():
    """The logical constraints are no-ops numerically when a mesh and the rules are in scope."""
    from megascale_jax.parallel import sharding
    from megascale_jax.parallel.mesh import make_mesh

    cfg = _cfg(block="serial", window=3, kv_heads=1)
    params = _random_params(cfg, 31)
    tokens = _random_tokens(32, (BATCH, cfg.seq_len), cfg.vocab)
    mesh = make_mesh(MeshConfig(dp=1, pp=1, tp=1, cpu_devices=1), devices=jax.devices()[:1])
    with jax.set_mesh(mesh), sharding.axis_rules():
        logits = jax.jit(Transformer(cfg).apply)({"params": params}, tokens)
    _assert_close(logits, ref_forward(params, tokens, cfg))


def test_pipeline_pieces_compose_to_reference():
    """embed_tokens -> run_layers over consecutive layer chunks -> lm_logits (the pipeline's
    decomposition) equals the float64 reference of the whole model, and cross_entropy its loss."""
    from megascale_jax.model import transformer as M

    cfg = _cfg(layers=4, block="serial", window=3, kv_heads=2, norm="rmsnorm")
    params = _random_params(cfg, 41)
    batch = _random_tokens(42, (BATCH, cfg.seq_len + 1), cfg.vocab)

    def pieces(p, batch):
        x = M.embed_tokens(cfg, p["embed"], batch[:, :-1])
        start = 0
        for n in (1, 3):  # chunks of unequal length: "any leading length"
            x = M.run_layers(cfg, jax.tree.map(lambda a: a[start:start + n], p["layers"]), x)
            start += n
        logits = M.lm_logits(cfg, p["final_norm"], p["head"], x)
        return logits, M.cross_entropy(logits, batch[:, 1:])

    logits, loss = jax.jit(pieces).lower(params, batch).compile(compiler_options=FAST_COMPILE)(params, batch)
    _assert_close(logits, ref_forward(params, batch[:, :-1], cfg))
    _assert_close(loss, ref_loss(params, batch, cfg))


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_eps_and_variance_on_small_inputs(kind):
    """Inputs with variance ~1e-5 make the eps (1e-5 / 1e-6) matter at the percent level."""
    from megascale_jax.model.transformer import norm

    cfg = _cfg(norm=kind)
    rng = np.random.default_rng(91)
    x = (0.02 + 3e-3 * rng.normal(size=(2, 5, cfg.d_model))).astype(np.float32)
    p = {"scale": (1.0 + 0.3 * rng.normal(size=cfg.d_model)).astype(np.float32)}
    if kind == "layernorm":
        p["bias"] = (0.3 * rng.normal(size=cfg.d_model)).astype(np.float32)
    y = norm(cfg, p, x)
    assert y.dtype == jnp.float32
    _assert_close(y, ref_norm(x.astype(np.float64), {k: v.astype(np.float64) for k, v in p.items()}, kind))


# ----------------------------------------------------------------------------- attention module


@pytest.mark.parametrize("seq,window", [(1, None), (1, 1), (5, None), (5, 1), (5, 2), (7, 3), (7, 6),
                                        (7, 7), (7, 8), (9, 100), (16, 4)])
def test_sliding_window_mask_matches_brute_force(seq, window):
    mask = attention.sliding_window_mask(seq, window)
    assert mask.shape == (seq, seq) and mask.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(mask), ref_mask(seq, window))


def _qkv(seed, batch=2, seq=10, heads=4, kv_heads=2, hd=8):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(batch, seq, heads, hd)), jnp.float32),
            jnp.asarray(rng.normal(size=(batch, seq, kv_heads, hd)), jnp.float32),
            jnp.asarray(rng.normal(size=(batch, seq, kv_heads, hd)), jnp.float32))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("window", [None, 1, 2, 5, 10, 13])
def test_attend_xla_matches_reference(window, kv_heads):
    q, k, v = _qkv(40 + kv_heads, kv_heads=kv_heads)
    out = attention.attend(q, k, v, window=window, implementation="xla")
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = ref_attend(*(np.asarray(a, np.float64) for a in (q, k, v)), window)
    _assert_close(out, expected)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attend_window_at_least_seq_len_equals_causal_exactly(kv_heads):
    q, k, v = _qkv(50 + kv_heads, kv_heads=kv_heads)
    seq = q.shape[1]
    causal = np.asarray(attention.attend(q, k, v, window=None, implementation="xla"))
    for window in (seq, seq + 1, seq + 50):
        out = np.asarray(attention.attend(q, k, v, window=window, implementation="xla"))
        np.testing.assert_array_equal(out, causal)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attend_window_one_returns_own_value_vector(kv_heads):
    q, k, v = _qkv(60 + kv_heads, kv_heads=kv_heads)
    heads = q.shape[2]
    out = np.asarray(attention.attend(q, k, v, window=1, implementation="xla"))
    group = heads // kv_heads
    for j in range(heads):
        # softmax over a single unmasked key is 1 and the masked ones underflow to 0.
        np.testing.assert_allclose(out[:, :, j], np.asarray(v)[:, :, j // group], rtol=1e-6, atol=1e-6)


def test_attend_rejects_unknown_implementation():
    q, k, v = _qkv(70)
    with pytest.raises(ValueError, match="unknown attention implementation"):
        attention.attend(q, k, v, window=None, implementation="nope")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cudnn attention needs an NVIDIA GPU")
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("window", [None, 1, 3, 64, 100])
def test_attend_cudnn_matches_reference(window, kv_heads):
    """cuDNN's left-only local window must implement the same mask as the xla path (bf16)."""
    q, k, v = (a.astype(jnp.bfloat16) for a in _qkv(80 + kv_heads, seq=64, kv_heads=kv_heads, hd=64))
    out = attention.attend(q, k, v, window=window, implementation="cudnn")
    expected = ref_attend(*(np.asarray(a.astype(jnp.float32), np.float64) for a in (q, k, v)), window)
    # bf16 inputs and output: |cudnn - float64| <= 2e-2 + 2e-2 * |ref| (outputs are O(1)).
    _assert_close(out.astype(jnp.float32), expected, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- parameter tree


def _expected_tree(cfg: ModelConfig):
    L, d, h, kv, hd, f, V = cfg.layers, cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab
    norm_leaf = {"scale": ((L, d), ("layers", "norm"))}
    final_norm = {"scale": ((d,), ("norm",))}
    if cfg.norm == "layernorm":
        norm_leaf["bias"] = ((L, d), ("layers", "norm"))
        final_norm["bias"] = ((d,), ("norm",))
    layers = {
        "attn": {
            "wq": ((L, d, h, hd), ("layers", "embed", "heads", "head_dim")),
            "bq": ((L, h, hd), ("layers", "heads", "head_dim")),
            "wk": ((L, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim")),
            "bk": ((L, kv, hd), ("layers", "kv_heads", "head_dim")),
            "wv": ((L, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim")),
            "bv": ((L, kv, hd), ("layers", "kv_heads", "head_dim")),
            "wo": ((L, h, hd, d), ("layers", "heads", "head_dim", "embed")),
            "bo": ((L, d), ("layers", "embed")),
        },
        "mlp": {
            "w1": ((L, d, f), ("layers", "embed", "mlp")),
            "b1": ((L, f), ("layers", "mlp")),
            "w2": ((L, f, d), ("layers", "mlp", "embed")),
            "b2": ((L, d), ("layers", "embed")),
        },
    }
    if cfg.block == "parallel":
        layers["norm"] = dict(norm_leaf)
    else:
        layers["norm1"], layers["norm2"] = dict(norm_leaf), dict(norm_leaf)
    return {
        "embed": ((V, d), ("vocab", "embed")),
        "layers": layers,
        "final_norm": final_norm,
        "head": ((d, V), ("embed", "vocab")),
    }


@pytest.mark.parametrize("block", ["parallel", "serial"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_parameter_tree_names_shapes_axes(block, norm):
    cfg = _cfg(block=block, norm=norm, layers=3, kv_heads=2, mlp_ratio=2.5, dtype="bfloat16")
    boxed = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))
    boxed = boxed["params"]
    expected = _expected_tree(cfg)

    def flatten(tree, prefix=()):
        out = {}
        for name, sub in tree.items():
            if isinstance(sub, dict):
                out.update(flatten(sub, prefix + (name,)))
            else:
                out[prefix + (name,)] = sub
        return out

    got = flatten(boxed)  # stops at the Partitioned boxes
    want = flatten(expected)  # stops at (shape, names) tuples
    assert sorted(got) == sorted(want)
    for path, (shape, names) in want.items():
        box = got[path]
        assert isinstance(box, nn.Partitioned), path
        assert box.value.shape == shape, (path, box.value.shape, shape)
        assert box.value.dtype == jnp.float32, path  # parameters stay fp32 even with bf16 compute
        assert tuple(box.names) == names, (path, box.names, names)


def test_parameter_init_is_random_and_layers_differ():
    """Distinct layers get distinct initial weights (split_rngs), biases start at zero, scales at one."""
    cfg = _cfg(layers=3)
    args = (jax.random.key(1), jnp.zeros((1, cfg.seq_len), jnp.int32))
    init = jax.jit(Transformer(cfg).init).lower(*args).compile(compiler_options=FAST_COMPILE)
    params = nn.unbox(init(*args))["params"]
    wq = np.asarray(params["layers"]["attn"]["wq"])
    assert not np.allclose(wq[0], wq[1]) and not np.allclose(wq[1], wq[2])
    assert 0.01 < wq.std() < 0.03  # INIT_STD = 0.02
    np.testing.assert_array_equal(np.asarray(params["layers"]["attn"]["bq"]), 0.0)
    np.testing.assert_array_equal(np.asarray(params["layers"]["norm"]["scale"]), 1.0)


# ----------------------------------------------------------------------------- scan: depth-independent HLO


def _lowered_text(cfg: ModelConfig) -> str:
    model = Transformer(cfg)
    tokens = jax.ShapeDtypeStruct((BATCH, cfg.seq_len), jnp.int32)
    params = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens))
    return jax.jit(model.apply).lower(params, tokens).as_text()


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_scan_hlo_size_is_independent_of_depth(block):
    texts = {L: _lowered_text(_cfg(block=block, layers=L)) for L in (2, 8)}
    dots = {L: _count(r"\bdot_general\b", t) for L, t in texts.items()}
    whiles = {L: _count(r"stablehlo\.while\b", t) for L, t in texts.items()}
    # Per layer: q, k, v, o projections, 2 attention einsums, 2 MLP matmuls = 8; plus the LM head.
    assert dots[2] == dots[8], dots
    assert 9 <= dots[2] <= 12, dots
    assert whiles[2] == whiles[8] >= 1, whiles
    # The text itself does not grow with depth (only the trip-count constant changes).
    assert abs(len(texts[8]) - len(texts[2])) < 200


# ----------------------------------------------------------------------------- bf16 compute


@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_bf16_compute_close_to_fp32_and_params_stay_fp32(block):
    cfg32 = _cfg(block=block, window=5, kv_heads=2)
    cfg16 = dataclasses.replace(cfg32, dtype="bfloat16")
    # Smaller random scale (0.1) than the fp32 tests keeps the logits of order one (std ~0.6).
    params = _random_params(cfg32, 81, scale=0.1)
    tokens = _random_tokens(82, (BATCH, cfg32.seq_len), cfg32.vocab)

    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(_param_shapes(cfg16)))

    l32 = np.asarray(_apply(cfg32, params, tokens), np.float64)
    l16 = _apply(cfg16, params, tokens)
    assert l16.dtype == jnp.float32  # logits come back as float32
    l16 = np.asarray(l16, np.float64)
    assert 0.3 < np.std(l32) < 3.0
    err = np.abs(l16 - l32)
    # Tolerance: bf16 keeps 8 significant bits (eps 2^-8 ~ 3.9e-3). Through 2 layers with a bf16
    # residual stream and bf16 logits we allow max |bf16 - fp32| <= 5e-2 absolute (~2.5% of the
    # largest logit here, ~6 eps) and mean |bf16 - fp32| <= 1e-2 (measured: 0.014-0.027 max, ~0.004 mean).
    assert err.max() < 5e-2, err.max()
    assert err.mean() < 1e-2, err.mean()
    # ...but they are not identical: the compute really ran in bf16.
    assert err.max() > 1e-4, err.max()

    # And the gradients w.r.t. the fp32 params are fp32 (dtype only: traced, not compiled).
    batch = _random_tokens(83, (BATCH, cfg16.seq_len + 1), cfg16.vocab)
    grads = jax.eval_shape(jax.grad(lambda p: loss_fn(Transformer(cfg16), p, batch)), params)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_bf16_matmuls_run_in_bf16():
    text = _lowered_text(_cfg(dtype="bfloat16"))
    operands = re.findall(r"stablehlo\.dot_general.*: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
    # Every matmul (q/k/v/o projections, both attention einsums, MLP, LM head) takes bf16 operands
    # (attention scores accumulate in fp32 via preferred_element_type; softmax is fp32).
    assert len(operands) == _count(r"\bdot_general\b", text) >= 9, operands
    assert all(a.endswith("xbf16>") and b.endswith("xbf16>") for a, b in operands), operands
    text32 = _lowered_text(_cfg())
    assert "bf16" not in text32


@pytest.mark.slow
@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_remat_keeps_the_loss_and_gradients_and_stores_less(block):
    """model.remat recomputes in the backward what it does not store: the loss matches the float64
    reference and the gradients equal those of the un-rematerialised model, while the residuals
    autodiff keeps from the forward shrink none > dots > full (counted from `jax.vjp`)."""
    base = _cfg(block=block, window=5, kv_heads=2, activation="gelu_tanh")
    params = _random_params(base, 41)
    batch = _random_tokens(42, (3, base.seq_len + 1), base.vocab)
    grads, stored = {}, {}
    for remat in ("none", "dots", "full"):
        cfg = dataclasses.replace(base, remat=remat)
        loss, grads[remat] = jax.jit(jax.value_and_grad(lambda p, b, c=cfg: loss_fn(Transformer(c), p, b)))(
            params, batch)
        _assert_close(loss, ref_loss(params, batch, base))
        # traced, not run: the pullback's residuals as shapes (the same bytes an eager jax.vjp holds,
        # without executing the forward op by op)
        residuals = jax.eval_shape(lambda p, c=cfg: jax.vjp(lambda q: loss_fn(Transformer(c), q, batch), p)[1], params)
        stored[remat] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(residuals))
    for remat in ("dots", "full"):
        chex.assert_trees_all_close(grads[remat], grads["none"], rtol=1e-5, atol=1e-7)
    assert stored["none"] > stored["dots"] > stored["full"], stored
