"""Incremental decoding with a KV cache: pure functions over the parameter tree `Transformer`
makes, for `python -m megascale_jax.sample` and anyone who wants token ids out of a model.

    cache = init_cache(cfg, batch, total_len)
    logits, cache = forward(cfg, params, cache, tokens, start)   # tokens at positions [start, start+T)
    new_ids = generate(cfg, params, prompt_ids, max_new_tokens, temperature, top_p, seed, eos_id)

The cache holds every layer's rotated k and v, (layers, batch, slots, kv_heads, head_dim), and
the absolute position each slot holds (-1: empty). With a sliding window a token sees only the
previous w-1 tokens and itself, so the cache is a ring buffer of min(w, total_len) slots —
position p lives in slot p mod slots, and memory is O(w) however long the text grows (that is
the point of the window); without one it has total_len slots. `forward` lets T new tokens
attend to the cache and to each other with the mask of `attention.sliding_window_mask` written
over absolute positions (key j visible to query i iff i - w < j <= i), then writes the newest
min(T, slots) of them into their slots. A prompt longer than the window is therefore prefilled
in one call, and positions never collide in a write. Prefill compiles once per prompt length,
the one-token step once.

The layer is transformer.py's own `layer` (with its column/row matmuls, which outside a mesh are
plain local matmuls) given a different attention: the same `attention_heads` (biases, rotary),
then keys from the cache and the new tokens, masked by their absolute positions instead of
sequence indices. The layers run under one `lax.scan` over the stacked axis. Fused kernels are not used (they compute the
same functions as the jnp paths, and interpret mode on the CPU would only be slower).
`tests/model/test_decode.py` checks every position's logits against the full forward.

How long a text may grow: rotary scores depend only on the distance i - j, and a windowed model
never sees a distance of w or more, so past `model.seq_len` it computes what it was trained on —
`generate` continues as long as asked. A model without a window would meet distances it never
saw; `generate` refuses a prompt + continuation longer than seq_len (`length_limit`).

Sampling: greedy (argmax) at temperature 0; else logits / temperature, cut to the nucleus (the
most likely tokens whose probabilities first reach top_p; the most likely token always stays),
drawn with `jax.random.categorical` from a key derived from the seed and the token's index.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from megascale_jax.config import ModelConfig, ParallelConfig
from megascale_jax.model.transformer import attention_heads, embed_tokens, layer, lm_head, norm, project_vocab

_LOCAL = ParallelConfig()  # one device: column/row matmuls are plain matmuls


class KVCache(NamedTuple):
    k: jax.Array  # (layers, batch, slots, kv_heads, head_dim), rotated, in the compute dtype
    v: jax.Array  # (layers, batch, slots, kv_heads, head_dim)
    positions: jax.Array  # (slots,) int32: the absolute position each slot holds, -1 when empty


def cache_slots(cfg: ModelConfig, total_len: int) -> int:
    """Slots a cache for `total_len` positions needs: the window (ring buffer) or every position."""
    return total_len if cfg.window is None else min(cfg.window, total_len)


def init_cache(cfg: ModelConfig, batch: int, total_len: int) -> KVCache:
    shape = (cfg.layers, batch, cache_slots(cfg, total_len), cfg.kv_heads, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, cfg.dtype), v=jnp.zeros(shape, cfg.dtype),  # two buffers: both are donated
                   positions=jnp.full(shape[2], -1, jnp.int32))


def length_limit(cfg: ModelConfig) -> int | None:
    """The longest prompt + continuation `generate` allows: seq_len without a window, else none."""
    return cfg.seq_len if cfg.window is None else None


# ----------------------------------------------------------------------------- the forward


def _attend_cached(c: ModelConfig, q, k, v, q_pos, k_pos):
    """q: (b, T, heads, hd) at positions q_pos (T,); k, v: (b, S, kv_heads, hd) at k_pos (S,),
    -1 for an empty slot. The math of `attention._attend_xla`, masked by absolute position."""
    b, t, heads, hd = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, heads // kv_heads, hd)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * (hd ** -0.5)
    distance = q_pos[:, None] - k_pos[None, :]  # (T, S)
    visible = (k_pos[None, :] >= 0) & (distance >= 0)
    if c.window is not None:
        visible &= distance < c.window
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, t, heads * hd)


def _layer(c: ModelConfig, positions, cache_positions, x, layer_params):
    """One block on T new tokens: (b, T, d) -> (b, T, d), plus this layer's new k and v."""
    p, cache_k, cache_v = layer_params
    new = []  # this layer's rotated k and v, for the cache

    def cached_attention(q, k, v):
        q, k, v = attention_heads(c, q, k, v, p["attn"], positions)
        new.append((k, v))
        keys, values = jnp.concatenate([cache_k, k], axis=1), jnp.concatenate([cache_v, v], axis=1)
        return _attend_cached(c, q, keys, values, positions, jnp.concatenate([cache_positions, positions]))

    y = layer(c, _LOCAL, p, x, cached_attention)
    return y, new[0]


@functools.partial(jax.jit, static_argnames="cfg", donate_argnames="cache")
def forward(cfg: ModelConfig, params, cache: KVCache, tokens, start):
    """tokens (b, T) at positions [start, start + T), after the cache's -> logits (b, T, vocab)
    float32 and the cache with the newest min(T, slots) of them written in."""
    c = dataclasses.replace(cfg, fused_norm=False, fused_mlp=False)
    t, slots = tokens.shape[1], cache.positions.shape[0]
    positions = start + jnp.arange(t, dtype=jnp.int32)
    x = embed_tokens(c, params["embed"], tokens)
    x, (k, v) = jax.lax.scan(functools.partial(_layer, c, positions, cache.positions), x,
                             (params["layers"], cache.k, cache.v))
    logits = project_vocab(c, norm(c, params["final_norm"], x), lm_head(c, params))
    keep = min(t, slots)  # older tokens of a long prefill fall outside every later window
    written = positions[t - keep:]
    slot = written % slots
    cache = KVCache(k=cache.k.at[:, :, slot].set(k[:, :, t - keep:]),
                    v=cache.v.at[:, :, slot].set(v[:, :, t - keep:]),
                    positions=cache.positions.at[slot].set(written))
    return logits, cache


# ----------------------------------------------------------------------------- sampling


def select_token(logits, key, temperature, top_p):
    """Next token ids (b,) from last-position logits (b, vocab): argmax at temperature 0 (a
    Python number), else a draw from softmax(logits / temperature) restricted to the top-p
    nucleus (temperature and top_p may then be traced: one compile serves every setting)."""
    if isinstance(temperature, (int, float)) and temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
    kept = jnp.where(before < top_p, sorted_logits, -jnp.inf)  # the first token has before == 0
    choice = jax.random.categorical(key, kept, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "greedy"), donate_argnames="cache")
def _next(cfg: ModelConfig, params, cache: KVCache, tokens, start, key, temperature, top_p, greedy: bool):
    logits, cache = forward(cfg, params, cache, tokens, start)
    return select_token(logits[:, -1], key, 0 if greedy else temperature, top_p), cache


def generate(cfg: ModelConfig, params, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> list[int]:
    """The ids of up to `max_new_tokens` tokens continuing `prompt_ids`; stops after `eos_id`
    (included, as transformers' `generate` does). `params`: the tree `Transformer(cfg).init`
    makes, unboxed."""
    if not prompt_ids or max_new_tokens < 1:
        raise ValueError("generate needs a non-empty prompt and max_new_tokens >= 1")
    total = len(prompt_ids) + max_new_tokens - 1  # the last token is never fed back
    limit = length_limit(cfg)
    if limit is not None and total + 1 > limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + {max_new_tokens} new tokens exceed model.seq_len="
                         f"{limit} of a model without a sliding window")
    cache = init_cache(cfg, 1, total)
    key = jax.random.key(seed)
    step = functools.partial(_next, cfg, params, temperature=jnp.float32(temperature), top_p=jnp.float32(top_p),
                             greedy=temperature == 0)
    token, cache = step(cache, jnp.asarray([prompt_ids], jnp.int32), jnp.int32(0), jax.random.fold_in(key, 0))
    new = [int(token[0])]
    while len(new) < max_new_tokens and new[-1] != eos_id:
        position = len(prompt_ids) + len(new) - 1
        token, cache = step(cache, token[:, None], jnp.int32(position), jax.random.fold_in(key, len(new)))
        new.append(int(token[0]))
    return new
