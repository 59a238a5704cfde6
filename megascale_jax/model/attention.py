"""Causal (optionally sliding-window) attention behind one dispatch point.

`attend(q, k, v, window=w, implementation=...)` with q: (batch, seq, heads, head_dim) and k, v:
(batch, seq, kv_heads, head_dim), kv_heads dividing heads (grouped-query attention). A query at
position i sees keys j with i - w < j <= i: itself and the previous w-1 tokens (window=None:
every earlier token); with `documents` (batch, seq) document ids (`model.document_eos`), only keys
of its own document as well.

* `xla`   — the reference: explicit scores, mask and float32 softmax; runs everywhere.
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
