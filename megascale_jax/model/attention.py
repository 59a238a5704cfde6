"""Causal (optionally sliding-window) attention behind one dispatch point.

`attend(q, k, v, window=w, implementation=...)` with q: (batch, seq, heads, head_dim) and k, v:
(batch, seq, kv_heads, head_dim), kv_heads dividing heads (grouped-query attention). A query at
position i sees keys j with i - w < j <= i: itself and the previous w-1 tokens (window=None:
every earlier token); with `documents` (batch, seq) document ids (`model.document_eos`), only keys
of its own document as well.

* `xla`   — the reference: explicit scores, mask and float32 softmax; runs everywhere. With a
  window much shorter than the sequence it scores each block of queries against only the keys
  its window reaches (`banded_attention`), not every key: n·(block + w - 1) scores, not n².
* `cudnn` — `jax.nn.dot_product_attention(..., implementation="cudnn")` with cuDNN's left-only
  `local_window_size`; NVIDIA GPUs, bf16/fp16 only (checked when the config is validated).
  Documents go in as its boolean `mask` (batch, 1, seq, seq), which jax hands cuDNN as a bias.
* `pallas` — `pallas_kernels.flash_attention`: flash attention that skips KV blocks outside the
  window (interpret mode on the CPU). Documents go in as its `segment_ids`, masked in the kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from megascale_jax.model.documents import same_document
from megascale_jax.model.flops import band_block


def sliding_window_mask(seq_len: int, window: int | None) -> jax.Array:
    """Boolean (seq_len, seq_len) mask: True where query i may attend to key j."""
    positions = jnp.arange(seq_len)
    return window_mask(positions, positions, window)


def window_mask(query_positions: jax.Array, key_positions: jax.Array, window: int | None) -> jax.Array:
    """Boolean (queries, keys) mask of queries and keys at these positions in their sequence:
    True where the key is at or before the query and, with a window, less than `window` before."""
    i = query_positions[:, None]
    j = key_positions[None, :]
    mask = j <= i
    if window is not None:
        mask &= i - j < window
    return mask


def attend(q, k, v, *, window: int | None, implementation: str = "xla", documents=None):
    if implementation == "xla":
        return _attend_xla(q, k, v, window, documents)
    if implementation == "cudnn":
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, mask=None if documents is None else same_document(documents)[:, None],
            local_window_size=None if window is None else (window - 1, 0),
            implementation="cudnn")
    if implementation == "pallas":
        from pallas_kernels import flash_attention  # deferred: only this path needs Pallas
        return flash_attention(q, k, v, window=window, segment_ids=documents)
    raise ValueError(f"unknown attention implementation {implementation!r}")


def _attend_xla(q, k, v, window, documents):
    block = band_block(q.shape[1], window)
    if block is not None:
        return banded_attention(q, k, v, window, block, ids=documents, key_ids=documents)
    mask = sliding_window_mask(q.shape[1], window)
    if documents is not None:
        mask = mask & same_document(documents)
    return masked_attention(q, k, v, mask)


def masked_attention(q, k, v, mask):
    """The XLA reference under any boolean `mask`, (queries, keys) or per row (batch, queries,
    keys): q (batch, queries, heads, head_dim), k and v (batch, keys, kv_heads, head_dim). Every
    query must see at least one key."""
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    # Group query heads by the kv head they share instead of repeating k and v in memory.
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
    scores = scores * (head_dim ** -0.5)
    if mask.ndim == 3:  # (batch, q, s) -> the scores' (batch, kv head, group, q, s)
        mask = mask[:, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(batch, seq, heads, head_dim)


def banded_attention(q, k, v, window: int, block: int, *, first=0, halo: int = 0, ids=None, key_ids=None):
    """Sliding-window attention scoring each block of `block` queries against the block + w - 1
    keys its window reaches, not all of them; equal to `masked_attention` under the window mask.

    q (batch, n, heads, head_dim) at positions first .. first + n - 1 of its sequence; k and v
    (batch, halo + n, kv_heads, head_dim) at positions first - halo ..., `halo` <= window - 1 (a
    context-parallel rank's keys received from the ranks before it, or 0). Keys at positions
    below 0 (none before the sequence's start: a rank's received zeros) are masked, and so are
    positions before first - halo, which the caller did not pass. `ids` (batch, n) and `key_ids`
    (batch, halo + n): document ids, a query seeing only keys of its own document.

    Layout: the keys are padded in front to exactly window - 1 before the queries and cut into
    chunks of `block`; block b's keys are chunk b and the first window - 1 keys of chunk b + 1
    (block >= window - 1), so query i of a block sees its key j exactly when i <= j <= i + w - 1:
    the same band in every block."""
    batch, n, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    blocks, span = n // block, block + window - 1
    pad = window - 1 - halo
    if n % block or pad < 0 or block < window - 1:
        raise ValueError(f"banded attention needs block | queries ({block}, {n}), a halo <= window - 1 "
                         f"({halo}, {window}) and block >= window - 1")

    def per_block(x, fill=0):  # (batch, halo + n, ...) -> (batch, blocks, span, ...)
        tail = (blocks + 1) * block - pad - x.shape[1]
        x = jnp.pad(x, [(0, 0), (pad, tail)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        x = x.reshape(batch, blocks + 1, block, *x.shape[2:])
        return jnp.concatenate([x[:, :blocks], x[:, 1:, :window - 1]], axis=2)

    qb = q.reshape(batch, blocks, block, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("bnqkgd,bnskd->bnkgqs", qb, per_block(k), preferred_element_type=jnp.float32)
    scores = scores * (head_dim ** -0.5)
    i, j = jnp.arange(block)[:, None], jnp.arange(span)[None, :]
    key_positions = first - (window - 1) + block * jnp.arange(blocks)[:, None] + jnp.arange(span)[None, :]
    held = (key_positions >= first - halo) & (key_positions >= 0)  # not the padding, not before the start
    mask = ((j >= i) & (j <= i + window - 1))[None] & held[:, None, :]  # (blocks, q, s)
    if ids is not None:
        same = ids.reshape(batch, blocks, block)[..., :, None] == per_block(key_ids, -1)[..., None, :]
        mask = (mask[None] & same)[:, :, None, None]  # (batch, blocks, 1, 1, q, s)
    else:
        mask = mask[None, :, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bnkgqs,bnskd->bnqkgd", probs, per_block(v))
    return out.reshape(batch, n, heads, head_dim)
