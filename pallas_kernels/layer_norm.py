"""LayerNorm with the residual add folded in, in Pallas, forward and backward (`jax.custom_vjp`).

    y, h = layer_norm_residual(x, residual, scale, bias)   # h = x + residual, y = LN(h)
    y    = layer_norm(x, scale, bias)

One pass over each row block reads x (and the residual), writes the normalised output, the sum
(for the next residual connection) and two float32 statistics per row; the backward pass
recomputes x̂ from x (+ residual) and those statistics and writes dx in one more pass, with
per-block partial sums for dscale and dbias reduced by XLA. Statistics are float32 whatever the
input dtype. Rows are flattened over the leading axes and zero-padded to the block size (a zero
row normalises to a finite value and has zero cotangent, so padding never leaks).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import by_platform, gpu_params, pad_axis

DEFAULT_BLOCK_ROWS = {"gpu": 8, "cpu": 256}  # GPU value untuned


class _Cfg(NamedTuple):
    eps: float
    block_rows: int
    residual: bool  # whether a residual is added (and the sum returned)
    out_dtype: jnp.dtype
    interpret: bool


def _fwd_kernel(*refs, cfg: _Cfg):
    if cfg.residual:
        x_ref, r_ref, scale_ref, bias_ref, y_ref, h_ref, mean_ref, rstd_ref = refs
        h = x_ref[...].astype(jnp.float32) + r_ref[...].astype(jnp.float32)
        h_ref[...] = h.astype(h_ref.dtype)
    else:
        x_ref, scale_ref, bias_ref, y_ref, mean_ref, rstd_ref = refs
        h = x_ref[...].astype(jnp.float32)
    mean = h.mean(axis=1)
    centered = h - mean[:, None]
    rstd = jax.lax.rsqrt((centered * centered).mean(axis=1) + cfg.eps)
    y = centered * rstd[:, None] * scale_ref[...].astype(jnp.float32) + bias_ref[...].astype(jnp.float32)
    y_ref[...] = y.astype(y_ref.dtype)
    mean_ref[...], rstd_ref[...] = mean, rstd


def _bwd_kernel(*refs, cfg: _Cfg):
    if cfg.residual:
        x_ref, r_ref, dy_ref, dh_ref, scale_ref, mean_ref, rstd_ref, dx_ref, dscale_ref, dbias_ref = refs
        h = x_ref[...].astype(jnp.float32) + r_ref[...].astype(jnp.float32)
    else:
        x_ref, dy_ref, scale_ref, mean_ref, rstd_ref, dx_ref, dscale_ref, dbias_ref = refs
        h = x_ref[...].astype(jnp.float32)
    rstd = rstd_ref[...][:, None]
    xhat = (h - mean_ref[...][:, None]) * rstd
    dy = dy_ref[...].astype(jnp.float32)
    g = dy * scale_ref[...].astype(jnp.float32)
    # d/dh of (h - mean) * rstd applied to g: rstd * (g - mean(g) - x̂ mean(g x̂)).
    dx = rstd * (g - g.mean(axis=1, keepdims=True) - xhat * (g * xhat).mean(axis=1, keepdims=True))
    if cfg.residual:
        dx = dx + dh_ref[...].astype(jnp.float32)  # the sum h is also an output
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dscale_ref[...] = (dy * xhat).sum(axis=0)
    dbias_ref[...] = dy.sum(axis=0)


def _specs(cfg: _Cfg, d: int):
    rows = pl.BlockSpec((cfg.block_rows, d), lambda i: (i, 0))
    vec = pl.BlockSpec((d,), lambda i: (0,))  # scale / bias: the same for every block
    stat = pl.BlockSpec((cfg.block_rows,), lambda i: (i,))
    partial = pl.BlockSpec((None, d), lambda i: (i, 0))  # one row of partial sums per block
    return rows, vec, stat, partial


def _forward(x, r, scale, bias, cfg: _Cfg):
    n, d = x.shape
    rows, vec, stat, _ = _specs(cfg, d)
    stats = [jax.ShapeDtypeStruct((n,), jnp.float32)] * 2
    y = jax.ShapeDtypeStruct((n, d), cfg.out_dtype)
    if cfg.residual:
        ins, in_specs = (x, r, scale, bias), [rows, rows, vec, vec]
        out_shape, out_specs = [y, jax.ShapeDtypeStruct((n, d), x.dtype), *stats], [rows, rows, stat, stat]
    else:
        ins, in_specs = (x, scale, bias), [rows, vec, vec]
        out_shape, out_specs = [y, *stats], [rows, stat, stat]
    outs = pl.pallas_call(functools.partial(_fwd_kernel, cfg=cfg), grid=(n // cfg.block_rows,),
                          in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=cfg.interpret, compiler_params=gpu_params(cfg.interpret), name="layer_norm_fwd")(*ins)
    return outs if cfg.residual else (outs[0], None, *outs[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ln(x, r, scale, bias, cfg: _Cfg):
    y, h, _, _ = _forward(x, r, scale, bias, cfg)
    return y, h


def _ln_fwd(x, r, scale, bias, cfg: _Cfg):
    y, h, mean, rstd = _forward(x, r, scale, bias, cfg)
    return (y, h), (x, r, scale, bias, mean, rstd)


def _ln_bwd(cfg: _Cfg, residuals, cotangents):
    x, r, scale, bias, mean, rstd = residuals
    dy, dh = cotangents
    n, d = x.shape
    blocks = n // cfg.block_rows
    rows, vec, stat, partial = _specs(cfg, d)
    if cfg.residual:
        ins, in_specs = (x, r, dy, dh, scale, mean, rstd), [rows, rows, rows, rows, vec, stat, stat]
    else:
        ins, in_specs = (x, dy, scale, mean, rstd), [rows, rows, vec, stat, stat]
    partials = jax.ShapeDtypeStruct((blocks, d), jnp.float32)
    dx, dscale, dbias = pl.pallas_call(
        functools.partial(_bwd_kernel, cfg=cfg), grid=(blocks,), in_specs=in_specs,
        out_specs=[rows, partial, partial],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), partials, partials],
        interpret=cfg.interpret, compiler_params=gpu_params(cfg.interpret), name="layer_norm_bwd")(*ins)
    dr = dx.astype(r.dtype) if cfg.residual else None
    return dx, dr, dscale.sum(0).astype(scale.dtype), dbias.sum(0).astype(bias.dtype)


_ln.defvjp(_ln_fwd, _ln_bwd)


def _apply(x, r, scale, bias, eps, block_rows, out_dtype, interpret):
    shape, d = x.shape, x.shape[-1]
    if scale.shape != (d,) or bias.shape != (d,) or (r is not None and r.shape != shape):
        raise ValueError(f"layer_norm: x {shape}, residual {None if r is None else r.shape}, "
                         f"scale {scale.shape}, bias {bias.shape} do not match")
    n = x.size // d

    def build(platform: str, interpret: bool):
        rows = min(block_rows or DEFAULT_BLOCK_ROWS[platform], max(8, pl.next_power_of_2(n)))
        cfg = _Cfg(eps, rows, r is not None, jnp.dtype(out_dtype or x.dtype), interpret)

        def run(x, r, scale, bias):
            flat = lambda a: pad_axis(a.reshape(n, d), 0, rows)  # noqa: E731
            y, h = _ln(flat(x), None if r is None else flat(r), scale, bias, cfg)
            unflat = lambda a: a[:n].reshape(shape)  # noqa: E731
            return unflat(y), None if h is None else unflat(h)
        return run

    return by_platform(build, x, r, scale, bias, interpret=interpret)


def layer_norm_residual(x, residual, scale, bias, *, eps: float = 1e-5, block_rows: int | None = None,
                        out_dtype=None, interpret: bool | None = None):
    """(LN(x + residual) * scale + bias, x + residual); x, residual (..., d), scale, bias (d,).

    The sum is formed in float32, normalised in float32 and returned in x's dtype; y is in
    `out_dtype` (default x's dtype)."""
    return _apply(x, residual, scale, bias, eps, block_rows, out_dtype, interpret)


def layer_norm(x, scale, bias, *, eps: float = 1e-5, block_rows: int | None = None,
               out_dtype=None, interpret: bool | None = None):
    """LN(x) * scale + bias over the last axis, statistics in float32."""
    return _apply(x, None, scale, bias, eps, block_rows, out_dtype, interpret)[0]


def layer_norm_residual_reference(x, residual, scale, bias, *, eps: float = 1e-5, out_dtype=None):
    h = x.astype(jnp.float32) + residual.astype(jnp.float32)
    return layer_norm_reference(h, scale, bias, eps=eps, out_dtype=out_dtype or x.dtype), h.astype(x.dtype)


def layer_norm_reference(x, scale, bias, *, eps: float = 1e-5, out_dtype=None):
    """Pure-jnp LayerNorm in float32 (the same formula as `megascale_jax.model.transformer.Norm`)."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(axis=-1, keepdims=True)
    var = jnp.square(xf - mean).mean(axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)
