"""Causal sliding-window flash attention in Pallas, forward and backward (`jax.custom_vjp`).

    flash_attention(q, k, v, window=w)   q: (batch, seq, heads, head_dim)
                                         k, v: (batch, seq, kv_heads, head_dim)
    flash_attention(q, k, v, window=w, segment_ids=ids)   ids: (batch, seq) int
    flash_attention(q, k, v, q_offset=r, ...)   k, v longer than q: query i at key position r + i

A query at position i sees keys j with i - w < j <= i (window=None: every j <= i), exactly like
`megascale_jax.model.attention.attend`. Query heads h = kv * group + g share kv head `kv` (GQA).
With `segment_ids` (packed documents, `model.document_eos`: `documents.layout(...).ids`) it sees
only keys of its own segment as well: every kernel (forward, dq, dk/dv) loads the ids of its
query rows and key columns beside q and k and masks the scores of other segments, in the masked
blocks with the band's mask and in the band's inside on their own (there the band cuts nothing,
but a document boundary may). Blocks are visited as without segments: a block wholly of other
documents is masked, not skipped. Every query sees its own key, so no row is empty; a row whose
first visited blocks hold only other documents accumulates garbage under the running max
`MASKED` until its own document's scores arrive and `alpha = exp(MASKED - m)` = 0 wipes it, as
for the window's far edge.

Each program owns one query block and runs an online softmax (FlashAttention-2) over the KV
blocks that intersect its window: `kv_block_range` gives that inclusive range from the block
index, so blocks wholly outside the window are never loaded and the cost is O(s·w), not O(s²).
Of those, only the blocks the band's edges cut (the diagonal, the window's far end) build and
apply the mask: the blocks wholly inside it (`full_kv_block_range`, `full_q_block_range`) run
an unmasked loop, as FlashAttention-2's Triton kernels split theirs (at seq 32,768, window 4,096
and (128, 64) tiles, 94% of the visited blocks).
The forward pass saves the per-row logsumexp; the backward pass recomputes the probabilities
from it in two kernels: dq (loop over the same KV range) and dk/dv (loop over the transposed
range, `q_block_range`, and over the query heads of the GQA group). `visited_kv_blocks` counts
the (query block, KV block) pairs with the same helper the kernels use for their loop bounds.

Sequences are zero-padded to a multiple of both block sizes. Padded keys are invisible to real
queries by causality (j <= i < seq_len), padded query rows are sliced off, and their cotangent
is zero, so they contribute nothing to dk/dv.

Lowered for the CPU the kernels run in Pallas interpret mode. Lowered for a GPU they go through
the Pallas Triton backend (`pallas.triton.CompilerParams`); tests/parallel/test_cuda_lowering.py lowers
them for CUDA on a CPU-only machine. On an H200 (2026-11-23, docs/gpu.md) they ran at 0.96-1.16x
cuDNN's speed at 2k tokens and 0.50-0.86x beyond, at num_stages=2 only.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import by_platform, gpu_params, pad_axis

# Finite "minus infinity": exp(MASKED - m) underflows to 0 without producing NaNs from inf - inf.
MASKED = -0.7 * float(np.finfo(np.float32).max)

# (block_q, block_k) per backend. GPU values are the usual FlashAttention-2 Triton starting
# point for head_dim 128; they have not been tuned on a GPU yet.
DEFAULT_BLOCKS = {"gpu": (128, 64), "cpu": (128, 128)}


# ---------------------------------------------------------------------------------------------
# Block ranges: the single source of truth for which blocks are visited.
# ---------------------------------------------------------------------------------------------

def _div(a, b: int):
    # Non-negative integer division; `lax.div` (truncating) lowers everywhere, `//` may not.
    return lax.div(a, jnp.asarray(b, a.dtype))


def kv_block_range(q_block, *, seq_len: int, window: int | None, block_q: int, block_k: int, q_offset=0):
    """Inclusive range (lo, hi) of KV blocks that query block `q_block` must visit.

    Query row r (r < seq_len real rows) sits at position p = q_offset + r and sees keys
    max(p - w + 1, 0) .. p, so the block needs the KV blocks covering [max(first - w + 1, 0),
    last] of its rows' positions. Empty (hi < lo) for a block of padding rows only. Works on
    traced int32 scalars (kernels; `q_offset` may be traced too) and int32 arrays (counting).
    """
    row = jnp.asarray(q_block, jnp.int32) * block_q
    first = q_offset + row
    last = q_offset + jnp.minimum(row + block_q, seq_len) - 1
    lo = jnp.zeros_like(first) if window is None else _div(jnp.maximum(first - window + 1, 0), block_k)
    hi = jnp.where(row < seq_len, _div(last, block_k), lo - 1)
    return lo, hi


def q_block_range(kv_block, *, seq_len: int, window: int | None, block_q: int, block_k: int, q_offset=0):
    """Inclusive range (lo, hi) of query blocks that see KV block `kv_block`: the transpose of
    `kv_block_range` (the dk/dv kernel's loop bounds). Keys first..last are seen by real rows at
    positions max(first, q_offset) .. min(last + w - 1, q_offset + seq_len - 1)."""
    first = jnp.asarray(kv_block, jnp.int32) * block_k
    end = q_offset + seq_len - 1  # the last real row's position
    reach = end if window is None else jnp.minimum(first + block_k - 1 + window - 1, end)
    start = jnp.maximum(first, q_offset)
    lo = _div(start - q_offset, block_q)
    hi = jnp.where(start <= reach, _div(jnp.asarray(reach - q_offset, jnp.int32), block_q), lo - 1)
    return lo, hi


def full_kv_block_range(q_block, *, window: int | None, block_q: int, block_k: int, q_offset=0):
    """Inclusive range (lo, hi) of KV blocks whose every key every row of query block `q_block`
    sees (key block wholly at or below the block's first row's position, and within the window of
    its last): the kernels skip the mask there. May be empty or reach past `kv_block_range`;
    `unmasked_span` clamps it into the visited range."""
    first = q_offset + jnp.asarray(q_block, jnp.int32) * block_q
    last = first + block_q - 1
    hi = _div(first + 1, block_k) - 1
    if window is None:
        return jnp.zeros_like(first), hi
    return jnp.where(last - window >= 0, _div(jnp.maximum(last - window, 0), block_k) + 1, 0), hi


def full_q_block_range(kv_block, *, window: int | None, block_q: int, block_k: int, q_offset=0):
    """The transpose of `full_kv_block_range`: inclusive range of query blocks every row of which
    sees every key of KV block `kv_block` (the dk/dv kernel's unmasked steps); row i at position
    q_offset + i."""
    first = jnp.asarray(kv_block, jnp.int32) * block_k - q_offset  # key positions in row indices
    last = first + block_k - 1
    lo = _div(jnp.maximum(last, 0) + block_q - 1, block_q)
    if window is None:
        return lo, jnp.full_like(first, np.iinfo(np.int32).max - 1)
    reach = first + window - block_q  # a query block starting at i·block_q <= reach ends within the window
    return lo, jnp.where(reach >= 0, _div(jnp.maximum(reach, 0), block_q), -1)


def unmasked_span(lo, hi, full_lo, full_hi):
    """Split the visited range lo..hi into masked [lo, a), unmasked [a, b), masked [b, hi + 1)."""
    a = jnp.clip(full_lo, lo, hi + 1)
    return a, jnp.clip(full_hi + 1, a, hi + 1)


def _band_loop(lo, hi, full, body, init):
    """`body(j, carry, masked)` over the visited blocks lo..hi: unmasked on the span `full` (a
    `full_*_block_range`) covers, masked before and after it."""
    a, b = unmasked_span(lo, hi, *full)
    carry = lax.fori_loop(lo, a, functools.partial(body, masked=True), init)
    carry = lax.fori_loop(a, b, functools.partial(body, masked=False), carry)
    return lax.fori_loop(b, hi + 1, functools.partial(body, masked=True), carry)


def visited_kv_blocks(seq_len: int, window: int | None, block_q: int, block_k: int) -> int:
    """Number of (query block, KV block) pairs the forward kernel visits, from `kv_block_range`."""
    padded = _padded_len(seq_len, block_q, block_k)
    lo, hi = kv_block_range(jnp.arange(padded // block_q), seq_len=seq_len, window=window,
                            block_q=block_q, block_k=block_k)
    return int(np.maximum(np.asarray(hi) - np.asarray(lo) + 1, 0).sum())


def _padded_len(seq_len: int, block_q: int, block_k: int) -> int:
    return -(-seq_len // math.lcm(block_q, block_k)) * math.lcm(block_q, block_k)


def _visible(rows, cols, window):
    """(len(rows), len(cols)) mask: query row i sees key j iff i - w < j <= i."""
    mask = cols[None, :] <= rows[:, None]
    if window is not None:
        mask &= rows[:, None] - cols[None, :] < window
    return mask


# ---------------------------------------------------------------------------------------------
# Kernels. Refs carry one (batch, head) slice: q/o/do (block_q, d), k/v (seq, d), lse (block_q,).
# ---------------------------------------------------------------------------------------------

class _Cfg(NamedTuple):
    seq_len: int  # real (unpadded) length of the queries
    window: int | None
    block_q: int
    block_k: int
    head_dim: int
    interpret: bool
    num_stages: int = 2  # Triton's software-pipelining depth (the GPU lowering's; ignored in interpret mode)
    segments: bool = False  # whether the kernels take segment (document) ids of queries and keys
    offset: bool = False  # whether the kernels take the queries' offset into the keys (else 0)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


def _dot_t(a, b):
    """a @ b.T with float32 accumulation."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _tdot(a, b):
    """a.T @ b with float32 accumulation."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


class Extras(NamedTuple):
    """What the kernels take beside q, k and v: the queries' and the keys' segment ids ((batch,
    q_len) and (batch, kv_len) int32, or None) and the queries' offset into the keys ((1,) int32,
    or None: aligned, query i at key position i). Integers: not differentiated."""
    q_segments: jax.Array | None = None
    k_segments: jax.Array | None = None
    offset: jax.Array | None = None


def _extra_refs(refs, cfg: _Cfg):
    """A kernel's refs after q, k, v: (query rows' segment ids, keys' segment ids, the queries'
    offset, the rest); the ids None without segments, the offset 0 without one."""
    q_seg, k_seg, refs = (refs[0], refs[1], refs[2:]) if cfg.segments else (None, None, refs)
    offset, refs = (refs[0][0], refs[1:]) if cfg.offset else (0, refs)
    return q_seg, k_seg, offset, refs


def _block_mask(rows, cols, cfg: _Cfg, masked: bool, q_seg, k_seg):
    """Which scores of a (rows, cols) block are visible: the band's mask where `masked`, queries
    and keys of one segment where there are segments; None where every score is."""
    visible = _visible(rows, cols, cfg.window) if masked else None
    if q_seg is not None:
        same = q_seg[:, None] == k_seg[None, :]
        visible = same if visible is None else visible & same
    return visible


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, cfg: _Cfg):
    q_seg_ref, k_seg_ref, offset, (o_ref, lse_ref) = _extra_refs(refs, cfg)
    bq, bk = cfg.block_q, cfg.block_k
    qi = pl.program_id(2)
    q = q_ref[...]
    q_seg = None if q_seg_ref is None else q_seg_ref[...]
    rows = offset + qi * bq + jnp.arange(bq)  # the rows' positions among the keys
    lo, hi = kv_block_range(qi, seq_len=cfg.seq_len, window=cfg.window, block_q=bq, block_k=bk, q_offset=offset)
    full = full_kv_block_range(qi, window=cfg.window, block_q=bq, block_k=bk, q_offset=offset)

    def body(j, carry, masked: bool):
        acc, m, l = carry
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        s = _dot_t(q, k) * cfg.scale
        # blocks inside the band are wholly visible but for other segments: no band mask there
        k_seg = None if k_seg_ref is None else k_seg_ref[pl.ds(j * bk, bk)]
        visible = _block_mask(rows, j * bk + jnp.arange(bk), cfg, masked, q_seg, k_seg)
        if visible is not None:
            s = jnp.where(visible, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)  # rescales what was accumulated under the old max
        p = jnp.exp(s - m_new[:, None])
        return alpha[:, None] * acc + _dot(p.astype(v.dtype), v), m_new, alpha * l + p.sum(axis=1)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), MASKED, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = _band_loop(lo, hi, full, body, init)
    l = jnp.where(l == 0, 1.0, l)  # rows that visited nothing (padding only)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dq_kernel(q_ref, k_ref, v_ref, *refs, cfg: _Cfg):
    q_seg_ref, k_seg_ref, offset, (do_ref, lse_ref, delta_ref, dq_ref) = _extra_refs(refs, cfg)
    bq, bk = cfg.block_q, cfg.block_k
    qi = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    q_seg = None if q_seg_ref is None else q_seg_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    rows = offset + qi * bq + jnp.arange(bq)
    lo, hi = kv_block_range(qi, seq_len=cfg.seq_len, window=cfg.window, block_q=bq, block_k=bk, q_offset=offset)
    full = full_kv_block_range(qi, window=cfg.window, block_q=bq, block_k=bk, q_offset=offset)

    def body(j, dq, masked: bool):
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        p = jnp.exp(_dot_t(q, k) * cfg.scale - lse[:, None])
        k_seg = None if k_seg_ref is None else k_seg_ref[pl.ds(j * bk, bk)]
        visible = _block_mask(rows, j * bk + jnp.arange(bk), cfg, masked, q_seg, k_seg)
        if visible is not None:
            p = jnp.where(visible, p, 0.0)
        ds = p * (_dot_t(do, v) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = _band_loop(lo, hi, full, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(q_ref, k_ref, v_ref, *refs, cfg: _Cfg):
    # q/do refs: (seq, group, d) — every query head sharing this kv head; lse/delta: (group, seq);
    # segment ids: the queries' (seq,), this block's keys' (block_k,).
    q_seg_ref, k_seg_ref, offset, (do_ref, lse_ref, delta_ref, dk_ref, dv_ref) = _extra_refs(refs, cfg)
    bq, bk = cfg.block_q, cfg.block_k
    kj = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    k_seg = None if k_seg_ref is None else k_seg_ref[...]
    cols = kj * bk + jnp.arange(bk)
    lo, hi = q_block_range(kj, seq_len=cfg.seq_len, window=cfg.window, block_q=bq, block_k=bk, q_offset=offset)
    full = full_q_block_range(kj, window=cfg.window, block_q=bq, block_k=bk, q_offset=offset)

    def body(i, carry, masked: bool):
        dk, dv = carry
        q_seg = None if q_seg_ref is None else q_seg_ref[pl.ds(i * bq, bq)]
        visible = _block_mask(offset + i * bq + jnp.arange(bq), cols, cfg, masked, q_seg, k_seg)
        for g in range(q_ref.shape[1]):  # static: the GQA group is small
            q = q_ref[pl.ds(i * bq, bq), g, :]
            do = do_ref[pl.ds(i * bq, bq), g, :]
            lse = lse_ref[g, pl.ds(i * bq, bq)]
            delta = delta_ref[g, pl.ds(i * bq, bq)]
            p = jnp.exp(_dot_t(q, k) * cfg.scale - lse[:, None])
            if visible is not None:
                p = jnp.where(visible, p, 0.0)
            dv = dv + _tdot(p.astype(do.dtype), do)
            ds = p * (_dot_t(do, v) - delta[:, None])
            dk = dk + _tdot(ds.astype(q.dtype), q)
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = _band_loop(lo, hi, full, body, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_call wrappers on padded arrays, and the custom VJP.
# ---------------------------------------------------------------------------------------------

def _call(kernel, cfg: _Cfg, grid, in_specs, out_specs, out_shape, name):
    # The Pallas Triton lowering (`gpu_params` says why not Mosaic GPU).
    params = gpu_params(cfg.interpret, num_warps=4 if cfg.head_dim <= 64 else 8, num_stages=cfg.num_stages)
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=cfg.interpret, compiler_params=params, name=name)


def _specs(b_q, kv_seq, d, group):
    """BlockSpecs over the (batch, heads, q blocks) grid."""
    per_q = pl.BlockSpec((None, b_q, None, d), lambda b, h, i: (b, i, h, 0))
    per_kv = pl.BlockSpec((None, kv_seq, None, d), lambda b, h, i: (b, 0, h // group, 0))
    per_row = pl.BlockSpec((None, None, b_q), lambda b, h, i: (b, h, i))
    return per_q, per_kv, per_row


def _extra_specs(extras: Extras | None, cfg: _Cfg, by_query_block: bool):
    """(in_specs, arrays) of what a kernel takes after q, k, v (`_extra_refs`): the segment ids —
    over a (batch, heads, q blocks) grid the query block's ids and the whole row's for the keys,
    over (batch, kv heads, kv blocks) the whole row's for the queries and the key block's — then
    the queries' offset."""
    specs, arrays = [], []
    if cfg.segments:
        q_seg, k_seg = extras.q_segments, extras.k_segments
        if by_query_block:
            specs += [pl.BlockSpec((None, cfg.block_q), lambda b, h, i: (b, i)),
                      pl.BlockSpec((None, k_seg.shape[1]), lambda b, h, i: (b, 0))]
        else:
            specs += [pl.BlockSpec((None, q_seg.shape[1]), lambda b, h, i: (b, 0)),
                      pl.BlockSpec((None, cfg.block_k), lambda b, h, i: (b, i))]
        arrays += [q_seg, k_seg]
    if cfg.offset:
        specs.append(pl.BlockSpec((1,), lambda b, h, i: (0,)))
        arrays.append(extras.offset)
    return specs, arrays


def _forward(q, k, v, extras: Extras | None, cfg: _Cfg):
    batch, seq, heads, d = q.shape
    group = heads // k.shape[2]
    per_q, per_kv, per_row = _specs(cfg.block_q, k.shape[1], d, group)
    extra_specs, extra = _extra_specs(extras, cfg, by_query_block=True)
    return _call(
        _fwd_kernel, cfg, (batch, heads, seq // cfg.block_q), [per_q, per_kv, per_kv, *extra_specs],
        [per_q, per_row],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)],
        "flash_attention_fwd")(q, k, v, *extra)


def _backward(q, k, v, extras: Extras | None, o, lse, do, cfg: _Cfg):
    batch, seq, heads, d = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    # delta_i = sum_d dO_id O_id: the softmax-backward row term, one cheap fused XLA reduction.
    delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), o.astype(jnp.float32))

    per_q, per_kv, per_row = _specs(cfg.block_q, k.shape[1], d, group)
    extra_specs, extra = _extra_specs(extras, cfg, by_query_block=True)
    dq = _call(_dq_kernel, cfg, (batch, heads, seq // cfg.block_q),
               [per_q, per_kv, per_kv, *extra_specs, per_q, per_row, per_row], per_q,
               jax.ShapeDtypeStruct(q.shape, q.dtype), "flash_attention_dq")(q, k, v, *extra, do, lse, delta)

    # Grid over (batch, kv heads, kv blocks); each program sees the whole group of query heads.
    group_q = pl.BlockSpec((None, seq, group, d), lambda b, h, j: (b, 0, h, 0))
    group_row = pl.BlockSpec((None, group, seq), lambda b, h, j: (b, h, 0))
    per_k = pl.BlockSpec((None, cfg.block_k, None, d), lambda b, h, j: (b, j, h, 0))
    extra_specs, extra = _extra_specs(extras, cfg, by_query_block=False)
    dk, dv = _call(_dkdv_kernel, cfg, (batch, kv_heads, k.shape[1] // cfg.block_k),
                   [group_q, per_k, per_k, *extra_specs, group_q, group_row, group_row], [per_k, per_k],
                   [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
                   "flash_attention_dkdv")(q, k, v, *extra, do, lse, delta)
    return dq, dk, dv


def with_pallas_backward(forward):
    """Attention whose forward is `forward(q, k, v, extras, cfg) -> (o, lse)` and whose gradient
    is the Pallas dq and dk/dv kernels (shared by the Pallas and the Triton forward). `extras`:
    an `Extras` (segment ids, the queries' offset) or None; not differentiated."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
    def attention(q, k, v, extras, cfg: _Cfg):
        return forward(q, k, v, extras, cfg)[0]

    def attention_fwd(q, k, v, extras, cfg: _Cfg):
        o, lse = forward(q, k, v, extras, cfg)
        return o, (q, k, v, extras, o, lse)

    def attention_bwd(cfg: _Cfg, residuals, do):
        return *_backward(*residuals, do, cfg), None  # no cotangent for the integer ids and offset

    attention.defvjp(attention_fwd, attention_bwd)
    return attention


_flash = with_pallas_backward(_forward)


def flash_attention(q, k, v, *, window: int | None = None, segment_ids=None, q_offset=None, kv_segment_ids=None,
                    block_q: int | None = None, block_k: int | None = None, num_stages: int = 2,
                    interpret: bool | None = None):
    """Causal (window=None) or sliding-window attention; same contract as `attention_reference`.
    segment_ids: (batch, seq) integer ids of the packed documents (queries and keys alike, as in
    self-attention); a query sees keys of its own segment only. None: one sequence.

    q_offset: None — queries and keys aligned, of one length (self-attention). Otherwise the
    queries are a contiguous run of the keys' positions: query i sits at key position
    q_offset + i (an int, or an int32 scalar traced at run time, e.g. a context-parallel rank's
    slice start), keys may be longer than queries, and q_offset + q_len <= kv_len must hold.
    The kernels visit only the key blocks the queries' windows reach, as without an offset. Then
    `segment_ids` are the queries' (batch, q_len) and `kv_segment_ids` the keys' (batch, kv_len).

    block_q, block_k: tile sizes (default per backend, `DEFAULT_BLOCKS`), clamped to the padded
    sequence for short inputs. num_stages: the Triton lowering's pipelining depth on a GPU (2
    as run on the H200; Hopper's Triton attention tutorials use 3-4). interpret: None = Pallas
    interpret mode iff lowered for the CPU.
    """
    batch, seq, heads, d = q.shape
    kv_len = k.shape[1]
    if (k.shape != v.shape or k.shape[0] != batch or k.shape[3] != d or heads % k.shape[2]
            or (kv_len != seq if q_offset is None else kv_len < seq)):
        raise ValueError(f"flash_attention: q {q.shape} and k/v {k.shape}/{v.shape} need k == v "
                         f"shapes, equal batch/head_dim, kv_heads dividing heads and equal lengths "
                         f"(keys at least as long with a q_offset)")
    if window is not None and window < 1:
        raise ValueError(f"flash_attention: window={window} must be >= 1 or None")
    if isinstance(q_offset, int) and not 0 <= q_offset <= kv_len - seq:
        raise ValueError(f"flash_attention: q_offset={q_offset} must be in [0, {kv_len - seq}] "
                         f"(queries within the {kv_len} keys' positions)")
    kv_segment_ids = segment_ids if kv_segment_ids is None and q_offset is None else kv_segment_ids
    for name, ids, length in (("segment_ids", segment_ids, seq), ("kv_segment_ids", kv_segment_ids, kv_len)):
        if ids is not None and (ids.shape != (batch, length) or not jnp.issubdtype(ids.dtype, jnp.integer)):
            raise ValueError(f"flash_attention: {name} {ids.shape} {ids.dtype} must be "
                             f"integers of shape {(batch, length)}")
    if (segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("flash_attention: segment ids for the queries and the keys, or for neither")
    cap = max(8, pl.next_power_of_2(max(seq, kv_len)))  # no point in blocks longer than the sequence
    segments = segment_ids is not None

    def build(platform: str, interpret: bool):
        default_q, default_k = DEFAULT_BLOCKS[platform]
        bq, bk = min(block_q or default_q, cap), min(block_k or default_k, cap)
        cfg = _Cfg(seq, window, bq, bk, d, interpret, num_stages, segments=segments, offset=q_offset is not None)

        def run(q, k, v, *rest):
            pad = functools.partial(pad_axis, axis=1, multiple=math.lcm(bq, bk))
            q, k, v = pad(q), pad(k), pad(v)
            q_seg, k_seg = (pad(x).astype(jnp.int32) for x in rest[:2]) if segments else (None, None)
            offset = rest[-1] if cfg.offset else None
            extras = Extras(q_seg, k_seg, offset) if segments or cfg.offset else None
            return _flash(q, k, v, extras, cfg)[:, :seq]
        return run

    extra = (segment_ids, kv_segment_ids) if segments else ()
    if q_offset is not None:
        extra += (jnp.reshape(jnp.asarray(q_offset, jnp.int32), (1,)),)
    return by_platform(build, q, k, v, *extra, interpret=interpret)


def attention_reference(q, k, v, *, window: int | None = None):
    """Pure-jnp reference: explicit scores, mask and float32 softmax (GQA by head grouping)."""
    batch, seq, heads, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, d)
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) * d ** -0.5
    pos = jnp.arange(seq)
    s = jnp.where(_visible(pos, pos, window), s, MASKED)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32))
    return o.reshape(batch, seq, heads, d).astype(q.dtype)
