"""Bias add + GeLU (tanh or exact) in Pallas, forward and backward (`jax.custom_vjp`).

    y = bias_gelu(x, bias, approximate=True)    # gelu(x + bias); x (..., f), bias (f,)

The forward pass reads x once and writes y; the backward pass recomputes z = x + bias and
writes dx = dy · gelu'(z) in one pass (nothing but x is saved); dbias is dx summed over rows
by XLA. Math in float32, outputs in x's dtype. Rows and columns are zero-padded to the blocks.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import by_platform, gpu_params, pad_axis

DEFAULT_BLOCKS = {"gpu": (8, 1024), "cpu": (256, 1024)}  # (rows, cols); GPU values untuned
_TANH_C = math.sqrt(2 / math.pi)


class _Cfg(NamedTuple):
    approximate: bool
    block_rows: int
    block_cols: int
    interpret: bool


def gelu_and_grad(z, approximate: bool):
    """(gelu(z), gelu'(z)) in float32; shared by both kernels."""
    if approximate:  # 0.5 z (1 + tanh(c (z + 0.044715 z³)))
        t = jnp.tanh(_TANH_C * (z + 0.044715 * z * z * z))
        grad = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _TANH_C * (1 + 3 * 0.044715 * z * z)
        return 0.5 * z * (1 + t), grad
    cdf = 0.5 * (1 + jax.lax.erf(z * (1 / math.sqrt(2))))  # z Φ(z)
    return z * cdf, cdf + z * jnp.exp(-0.5 * z * z) * (1 / math.sqrt(2 * math.pi))


def _fwd_kernel(x_ref, b_ref, y_ref, *, cfg: _Cfg):
    z = x_ref[...].astype(jnp.float32) + b_ref[...].astype(jnp.float32)[None, :]
    y_ref[...] = gelu_and_grad(z, cfg.approximate)[0].astype(y_ref.dtype)


def _bwd_kernel(x_ref, b_ref, dy_ref, dx_ref, *, cfg: _Cfg):
    z = x_ref[...].astype(jnp.float32) + b_ref[...].astype(jnp.float32)[None, :]
    dx_ref[...] = (dy_ref[...].astype(jnp.float32) * gelu_and_grad(z, cfg.approximate)[1]).astype(dx_ref.dtype)


def _call(kernel, cfg: _Cfg, x, n_in, name):
    n, f = x.shape
    tile = pl.BlockSpec((cfg.block_rows, cfg.block_cols), lambda i, j: (i, j))
    vec = pl.BlockSpec((cfg.block_cols,), lambda i, j: (j,))
    in_specs = [tile, vec] + [tile] * (n_in - 2)
    return pl.pallas_call(functools.partial(kernel, cfg=cfg),
                          grid=(n // cfg.block_rows, f // cfg.block_cols), in_specs=in_specs,
                          out_specs=tile, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=cfg.interpret, compiler_params=gpu_params(cfg.interpret), name=name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bias_gelu(x, bias, cfg: _Cfg):
    return _call(_fwd_kernel, cfg, x, 2, "bias_gelu_fwd")(x, bias)


def _bias_gelu_fwd(x, bias, cfg: _Cfg):
    return _bias_gelu(x, bias, cfg), (x, bias)


def _bias_gelu_bwd(cfg: _Cfg, residuals, dy):
    x, bias = residuals
    dx = _call(_bwd_kernel, cfg, x, 3, "bias_gelu_bwd")(x, bias, dy)
    return dx, dx.astype(jnp.float32).sum(axis=0).astype(bias.dtype)


_bias_gelu.defvjp(_bias_gelu_fwd, _bias_gelu_bwd)


def bias_gelu(x, bias, *, approximate: bool = True, block_rows: int | None = None,
              block_cols: int | None = None, interpret: bool | None = None):
    """gelu(x + bias) with `jax.nn.gelu`'s `approximate` meaning (True = tanh form)."""
    shape, f = x.shape, x.shape[-1]
    if bias.shape != (f,):
        raise ValueError(f"bias_gelu: bias {bias.shape} must be ({f},) for x {shape}")
    n = x.size // f

    def build(platform: str, interpret: bool):
        default_rows, default_cols = DEFAULT_BLOCKS[platform]
        rows = min(block_rows or default_rows, max(8, pl.next_power_of_2(n)))
        cols = min(block_cols or default_cols, max(8, pl.next_power_of_2(f)))
        cfg = _Cfg(approximate, rows, cols, interpret)

        def run(x, bias):
            x2 = pad_axis(pad_axis(x.reshape(n, f), 0, rows), 1, cols)
            y = _bias_gelu(x2, pad_axis(bias, 0, cols), cfg)
            return y[:n, :f].reshape(shape)
        return run

    return by_platform(build, x, bias, interpret=interpret)


def bias_gelu_reference(x, bias, *, approximate: bool = True):
    """Pure-jnp reference: `jax.nn.gelu` in float32, output in x's dtype."""
    z = x.astype(jnp.float32) + bias.astype(jnp.float32)
    return jax.nn.gelu(z, approximate=approximate).astype(x.dtype)
