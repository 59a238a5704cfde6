"""Sliding-window flash attention forward as a Triton kernel via `jax_triton.triton_call`.

    triton_flash_attention(q, k, v, window=w)   # same contract as flash_attention

The GPU alternative the benchmark compares with the Pallas kernel. Only the forward pass is
written in Triton; its VJP reuses the Pallas dq and dk/dv kernels of `flash_attention`, which
need exactly what this forward saves (the output and the per-row logsumexp, same layouts). The
KV block range of each query block comes from `kv_block_range`, evaluated by XLA and passed in
as two int32 arrays, so the Triton and Pallas kernels visit the same blocks by construction.

jax-triton and triton are an optional extra (`pip install -e ".[gpu]"`): this module imports
without them and `triton_flash_attention` raises ImportError when called. Not yet run on a GPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels._common import pad_axis
from pallas_kernels.flash_attention import MASKED, _Cfg, kv_block_range, with_pallas_backward

try:
    import jax_triton as jt
    import triton
    import triton.language as tl
except ImportError:  # optional extra
    jt = triton = tl = None


def available() -> bool:
    return jt is not None


if triton is not None:
    _MASKED = tl.constexpr(MASKED)  # Triton kernels may only read constexpr globals

    @triton.jit
    def _fwd_kernel(q_ptr, k_ptr, v_ptr, lo_ptr, hi_ptr, o_ptr, lse_ptr, scale,
                    SEQ: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                    D: tl.constexpr, WINDOW: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        # One program per (query block, batch * head). Arrays are (batch, SEQ, heads, D),
        # contiguous; WINDOW == 0 means plain causal.
        qi = tl.program_id(0)
        b = tl.program_id(1) // HEADS
        h = tl.program_id(1) % HEADS
        kh = h // (HEADS // KV_HEADS)
        rows = qi * BLOCK_Q + tl.arange(0, BLOCK_Q)
        dims = tl.arange(0, D)
        q = tl.load(q_ptr + ((b * SEQ + rows[:, None]) * HEADS + h) * D + dims[None, :])
        m = tl.full((BLOCK_Q,), _MASKED, tl.float32)
        l = tl.zeros((BLOCK_Q,), tl.float32)
        acc = tl.zeros((BLOCK_Q, D), tl.float32)
        for j in range(tl.load(lo_ptr + qi), tl.load(hi_ptr + qi) + 1):
            cols = j * BLOCK_K + tl.arange(0, BLOCK_K)
            kv_offsets = ((b * SEQ + cols[:, None]) * KV_HEADS + kh) * D + dims[None, :]
            k = tl.load(k_ptr + kv_offsets)
            s = tl.dot(q, tl.trans(k)) * scale
            visible = cols[None, :] <= rows[:, None]
            if WINDOW > 0:
                visible = visible & (rows[:, None] - cols[None, :] < WINDOW)
            s = tl.where(visible, s, _MASKED)
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(v_ptr + kv_offsets)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l = l * alpha + tl.sum(p, 1)
            m = m_new
        l = tl.where(l == 0, 1.0, l)
        tl.store(o_ptr + ((b * SEQ + rows[:, None]) * HEADS + h) * D + dims[None, :],
                 (acc / l[:, None]).to(o_ptr.dtype.element_ty))
        tl.store(lse_ptr + (b * HEADS + h) * SEQ + rows, m + tl.log(l))


def _forward(q, k, v, extras, cfg: _Cfg):
    assert extras is None, "the Triton forward takes no segment ids (packed documents) nor offset: use flash_attention"
    batch, seq, heads, d = q.shape
    lo, hi = kv_block_range(jnp.arange(seq // cfg.block_q), seq_len=cfg.seq_len, window=cfg.window,
                            block_q=cfg.block_q, block_k=cfg.block_k)
    return jt.triton_call(
        q, k, v, lo, hi, cfg.scale, kernel=_fwd_kernel,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)],
        grid=(seq // cfg.block_q, batch * heads), num_warps=4 if d <= 64 else 8, num_stages=2,
        SEQ=seq, HEADS=heads, KV_HEADS=k.shape[2], D=d, WINDOW=cfg.window or 0,
        BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k)


_attention = with_pallas_backward(_forward)  # backward: the Pallas dq and dk/dv kernels


def triton_flash_attention(q, k, v, *, window: int | None = None, block_q: int = 128, block_k: int = 64):
    """Causal / sliding-window attention, forward in Triton, backward in Pallas (GPU only).

    head_dim must be a power of two >= 16 (Triton tiles); kv_heads must divide heads."""
    if not available():
        raise ImportError("triton_flash_attention needs jax-triton and triton "
                          "(pip install -e '.[gpu]'); use pallas_kernels.flash_attention instead")
    batch, seq, heads, d = q.shape
    cfg = _Cfg(seq, window, block_q, block_k, d, interpret=False)
    q, k, v = (pad_axis(x, 1, math.lcm(block_q, block_k)) for x in (q, k, v))
    return _attention(q, k, v, None, cfg)[:, :seq]
