"""Fused kernels in Pallas, each beside a pure-jnp reference.

* `flash_attention`  — causal sliding-window flash attention (GQA), custom VJP; blocks wholly
  outside the window are never visited (`visited_kv_blocks` counts them), blocks wholly inside
  it skip the mask (`full_kv_block_range`, `full_q_block_range`, `unmasked_span`).
* `layer_norm`, `layer_norm_residual` — LayerNorm with the residual add folded in.
* `bias_gelu`        — bias add + GeLU (tanh or exact).
* `triton_attention` — optional jax-triton variant; importable without triton installed.

Kernels run in Pallas interpret mode when the program is lowered for the CPU (tests, laptops),
and as GPU kernels when it is lowered for a GPU (`by_platform`), even from a CPU-only host.
"""

from __future__ import annotations

from pallas_kernels.bias_gelu import bias_gelu, bias_gelu_reference
from pallas_kernels.flash_attention import (
    attention_reference, flash_attention, full_kv_block_range, full_q_block_range, kv_block_range, q_block_range,
    unmasked_span, visited_kv_blocks)
from pallas_kernels.layer_norm import (
    layer_norm, layer_norm_reference, layer_norm_residual, layer_norm_residual_reference)

__all__ = [
    "attention_reference", "bias_gelu", "bias_gelu_reference",
    "flash_attention", "full_kv_block_range", "full_q_block_range", "kv_block_range", "layer_norm",
    "layer_norm_reference", "layer_norm_residual", "layer_norm_residual_reference", "q_block_range",
    "unmasked_span", "visited_kv_blocks",
]
