"""megascale_jax.model.decode against the full forward it must reproduce.

* Cached decoding — a prefill longer than the window, then one token at a time with a few
  multi-token chunks among them, on sequences several windows long so the ring buffer wraps
  over and over — gives every position the logits of `Transformer(cfg).apply` on the whole
  sequence, for the parallel and the serial block and every option the decoder touches (GQA,
  LayerNorm/RMSNorm, GeLU/SwiGLU, biases or none, partial rotary, tied head, rope base, no window).
* Greedy `generate` equals a naive loop that reruns the full forward on the growing sequence and
  takes the argmax, past model.seq_len for a windowed model.
* Sampling: a tiny top-p is greedy, a seed fixes the text, and the nucleus draw's frequencies
  match the renormalised distribution computed in NumPy.

Parameters: the tree `Transformer(cfg).init` makes, drawn at random (no bias zero, no norm scale
one); float32 throughout.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megascale_jax.config import ModelConfig
from megascale_jax.model import decode
from megascale_jax.model.transformer import Transformer

BASE = ModelConfig(layers=2, d_model=32, heads=4, kv_heads=2, vocab=61, seq_len=16, dtype="float32")
CONFIGS = {
    "parallel-layernorm-gelu_tanh-bias-partial_rotary-untied": dataclasses.replace(
        BASE, block="parallel", norm="layernorm", activation="gelu_tanh", bias=True, rope_fraction=0.5,
        tied_embeddings=False, window=5),
    "serial-rmsnorm-swiglu-nobias-tied-rope500k": dataclasses.replace(
        BASE, block="serial", norm="rmsnorm", activation="swiglu", bias=False, tied_embeddings=True,
        rope_base=500000.0, kv_heads=1, window=4),
    "no_window": dataclasses.replace(BASE, window=None, seq_len=32),
}
CHUNKS = [7, 1, 1, 3, 1, 1, 3] + [1] * 12  # 29 tokens: prefill > window, then mostly 1-token steps


def random_params(cfg: ModelConfig, seed: int, scale: float = 0.1):
    """The tree `Transformer(cfg).init` makes, every leaf drawn at random (seeded NumPy, no
    compile): norm scales 1 + N(0, scale^2), everything else, biases included, N(0, scale^2)."""
    tokens = jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32)
    shapes = nn.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens))["params"]
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_unflatten(treedef, [
        (jax.tree_util.keystr(path).endswith("['scale']") + rng.normal(0, scale, x.shape)).astype(np.float32)
        for path, x in leaves])


@functools.lru_cache(maxsize=None)
def full_forward(cfg: ModelConfig):
    """The training forward, jitted once per config: (params, tokens) -> logits."""
    return jax.jit(lambda params, tokens: Transformer(cfg).apply({"params": params}, tokens))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_logits_equal_the_full_forward_at_every_position(name):
    cfg = CONFIGS[name]
    params = random_params(cfg, seed=len(name))
    total = sum(CHUNKS)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab, (2, total)).astype(np.int32)
    cache = decode.init_cache(cfg, batch=2, total_len=total)
    assert cache.k.shape == (cfg.layers, 2, cfg.window or total, cfg.kv_heads, cfg.head_dim)  # O(window) memory
    got, start = [], 0
    for t in CHUNKS:
        logits, cache = decode.forward(cfg, params, cache, jnp.asarray(tokens[:, start:start + t]), jnp.int32(start))
        got.append(np.asarray(logits))
        start += t
    got, want = np.concatenate(got, axis=1), np.asarray(full_forward(cfg)(params, jnp.asarray(tokens)))
    scale = np.abs(want).max()
    assert scale > 1.0  # logits of some size: a tolerance relative to them means something
    np.testing.assert_array_less(np.abs(got - want).max(), 1e-5 * scale)
    if cfg.window is not None:  # the ring buffer holds the newest `window` positions, each in its slot
        held = np.asarray(cache.positions)
        assert sorted(held) == list(range(total - cfg.window, total))
        assert all(held[p % cfg.window] == p for p in held)


def naive_greedy(cfg: ModelConfig, params, prompt: list[int], n: int) -> list[int]:
    """Rerun the full forward on the growing sequence and take the last position's argmax. The
    sequence sits in a fixed-length buffer (one compile): a causal model's logits at position i
    do not depend on what follows it."""
    length = len(prompt) + n
    seq = list(prompt)
    for _ in range(n):
        buffer = np.zeros((1, length), np.int32)
        buffer[0, :len(seq)] = seq
        logits = np.asarray(full_forward(cfg)(params, jnp.asarray(buffer)))
        seq.append(int(np.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt):]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_equals_rerunning_the_full_forward(name):
    cfg = CONFIGS[name]
    params = random_params(cfg, seed=7)
    prompt = np.random.default_rng(2).integers(0, cfg.vocab, 6).tolist()
    new = decode.generate(cfg, params, prompt, 16)
    assert new == naive_greedy(cfg, params, prompt, 16)
    assert len(set(new)) > 1  # not a constant: the comparison would be weak
    if cfg.window is not None:
        assert len(prompt) + len(new) > cfg.seq_len  # a windowed model continues past seq_len


def test_generation_stops_at_end_of_text_and_respects_the_causal_limit():
    cfg = CONFIGS["no_window"]
    params = random_params(cfg, seed=11)
    prompt = [5, 9, 2, 6]
    greedy = decode.generate(cfg, params, prompt, 12)
    first = {token: greedy.index(token) for token in reversed(greedy)}  # each token's first index
    eos, at = max(first.items(), key=lambda item: item[1])
    assert at > 0  # a token that first appears after the start: stopping there is visible
    assert decode.generate(cfg, params, prompt, 12, eos_id=eos) == greedy[:at + 1]  # EOS included, then stop
    assert len(decode.generate(cfg, params, prompt, cfg.seq_len - len(prompt))) == cfg.seq_len - len(prompt)
    with pytest.raises(ValueError, match="seq_len=32"):
        decode.generate(cfg, params, prompt, cfg.seq_len - len(prompt) + 1)


def test_sampling_tiny_top_p_is_greedy_and_the_seed_fixes_the_text():
    cfg = CONFIGS["parallel-layernorm-gelu_tanh-bias-partial_rotary-untied"]
    params = random_params(cfg, seed=11)
    prompt = [5, 9, 2, 6]
    greedy = decode.generate(cfg, params, prompt, 16)
    assert decode.generate(cfg, params, prompt, 16, temperature=1.0, top_p=1e-6, seed=3) == greedy
    sampled = decode.generate(cfg, params, prompt, 16, temperature=1.0, seed=3)
    assert decode.generate(cfg, params, prompt, 16, temperature=1.0, seed=3) == sampled
    assert decode.generate(cfg, params, prompt, 16, temperature=1.0, seed=4) != sampled
    assert sampled != greedy


def test_nucleus_draws_follow_the_renormalised_distribution():
    logits = np.array([2.0, -1.0, 0.5, 1.7, -3.0, 0.0, 1.0], np.float32)
    temperature, top_p, n = 0.7, 0.8, 40_000
    # Reference: softmax(logits / T); the most likely tokens in order until their mass reaches p.
    p = np.exp(logits.astype(np.float64) / temperature)
    p /= p.sum()
    nucleus, mass = [], 0.0
    for i in np.argsort(-p):
        nucleus.append(i)
        mass += p[i]
        if mass >= top_p:
            break
    want = np.zeros_like(p)
    want[nucleus] = p[nucleus] / p[nucleus].sum()
    assert 1 < len(nucleus) < len(p)  # the cut matters and keeps more than one token

    keys = jax.random.split(jax.random.key(0), n)
    draws = jax.jit(jax.vmap(lambda k: decode.select_token(jnp.asarray(logits)[None], k, temperature, top_p)[0]))(keys)
    freq = np.bincount(np.asarray(draws), minlength=len(p)) / n
    assert np.all(freq[want == 0] == 0)
    np.testing.assert_allclose(freq, want, atol=4 * np.sqrt(0.25 / n))
