"""FP8 matrix products for the layers' GEMMs (`model.fp8`), with current scaling.

    y = fp8_matmul(x, w)     # x (..., k) bf16, w (k, n) float32 parameters -> (..., n) in x.dtype

Forward: x and w are each scaled by their own amax into float8_e4m3fn (the format with more
mantissa, for values), multiplied, and the product scaled back. Backward: the output's gradient
goes into float8_e5m2 (more range, for gradients), and both products take one FP8 operand of
each kind, as Transformer Engine and torchao's float8 training do. The forward keeps its FP8
operands (one byte an element) for the backward.

Why the arithmetic is written as dequantize-then-dot: XLA's GPU GEMM rewriter turns
`dot(convert(f8) * scale, convert(f8) * scale)` into cuBLASLt's FP8 GEMM
(`__cublas$lt$matmul$f8`) with the scales as its arguments, and an unmatched pattern silently
stays a bf16 GEMM: `plan --compile` counts the `cublas-fp8` GEMMs, and tests/aot asserts them.
On the CPU the same code runs through float8 emulation, for tests.

Current scaling (each tensor's amax in the step that uses it) costs a reduction pass over each
operand that delayed scaling (an amax history kept in the state) avoids; it needs no state, so
checkpoints, the optimizer and the gradient norm are those of a bf16 run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def quantize(x, fmt):
    """(x in `fmt`, its float32 scale): x / scale fills `fmt`'s range at x's largest magnitude."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.maximum(amax, 1e-12) / jnp.finfo(fmt).max.astype(jnp.float32)
    return (x.astype(jnp.float32) / scale).astype(fmt), scale


def dequantize(q, scale, dtype):
    return q.astype(dtype) * scale.astype(dtype)


def _dot(a, b, dtype):
    """a (..., k) @ b (k, n), accumulated in float32, returned in `dtype`."""
    return jax.lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(dtype)


@jax.custom_vjp
def fp8_matmul(x, w):
    return _fp8_matmul_fwd(x, w)[0]


def _fp8_matmul_fwd(x, w):
    (xq, xs), (wq, ws) = quantize(x, E4M3), quantize(w, E4M3)
    y = _dot(dequantize(xq, xs, x.dtype), dequantize(wq, ws, x.dtype), x.dtype)
    return y, (xq, xs, wq, ws, jnp.zeros((0,), w.dtype))  # the last: w's dtype, no bytes


def _fp8_matmul_bwd(residuals, g):
    xq, xs, wq, ws, w_dtype = residuals
    gq, gs = quantize(g, E5M2)
    gd = dequantize(gq, gs, g.dtype)
    dx = _dot(gd, dequantize(wq, ws, g.dtype).T, g.dtype)
    x2 = dequantize(xq, xs, g.dtype).reshape(-1, xq.shape[-1])
    dw = _dot(x2.T, gd.reshape(-1, gd.shape[-1]), w_dtype.dtype)
    return dx, dw


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)
