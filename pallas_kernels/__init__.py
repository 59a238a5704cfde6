"""Fused kernels in Pallas, each beside a pure-jnp reference.

* `flash_attention`  — causal sliding-window flash attention (GQA), custom VJP; blocks wholly
  outside the window are never visited (`visited_kv_blocks` counts them).
* `layer_norm`, `layer_norm_residual` — LayerNorm with the residual add folded in.
* `bias_gelu`        — bias add + GeLU (tanh or exact).
* `triton_attention` — optional jax-triton variant; importable without triton installed.

Kernels run in Pallas interpret mode when the default backend is the CPU (tests, laptops), and
compile for the GPU otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def default_interpret(interpret: bool | None) -> bool:
    """`interpret=None` means: interpret on the CPU backend, compile elsewhere."""
    return jax.default_backend() == "cpu" if interpret is None else interpret


def pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """Zero-pad `axis` of `x` up to a multiple of `multiple` (no-op when it already is one)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


# Imported after the helpers above, which the kernel modules use.
from pallas_kernels.bias_gelu import bias_gelu, bias_gelu_reference  # noqa: E402
from pallas_kernels.flash_attention import (  # noqa: E402
    attention_reference, flash_attention, kv_block_range, q_block_range, visited_kv_blocks)
from pallas_kernels.layer_norm import (  # noqa: E402
    layer_norm, layer_norm_reference, layer_norm_residual, layer_norm_residual_reference)

__all__ = [
    "attention_reference", "bias_gelu", "bias_gelu_reference", "default_interpret",
    "flash_attention", "kv_block_range", "layer_norm", "layer_norm_reference",
    "layer_norm_residual", "layer_norm_residual_reference", "pad_axis", "q_block_range",
    "visited_kv_blocks",
]
