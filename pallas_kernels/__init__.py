"""Fused kernels in Pallas, each beside a pure-jnp reference.

* `flash_attention`  — causal sliding-window flash attention (GQA), custom VJP; blocks wholly
  outside the window are never visited (`visited_kv_blocks` counts them).
* `layer_norm`, `layer_norm_residual` — LayerNorm with the residual add folded in.
* `bias_gelu`        — bias add + GeLU (tanh or exact).
* `triton_attention` — optional jax-triton variant; importable without triton installed.

Kernels run in Pallas interpret mode when the program is lowered for the CPU (tests, laptops),
and as GPU kernels when it is lowered for a GPU (`by_platform`), even from a CPU-only host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def by_platform(build, *args, interpret: bool | None = None):
    """`build(platform, interpret)(*args)`, platform "cpu" or "gpu" (it picks the default tiles).

    interpret=None: the choice is made when the program is *lowered*, for the platform it is
    lowered for — `lax.platform_dependent` traces both variants and lowers only the matching one
    (the CPU one in interpret mode, the GPU one as a real Pallas GPU kernel). Deciding at trace
    time from `jax.default_backend()` names the host instead, and is wrong whenever the two
    differ: lowering for CUDA on a CPU-only CI machine (tests/test_cuda_lowering.py) would embed
    interpreted loops, and `jax.export` for several platforms would get one variant for all.
    interpret=True/False forces one mode (tests), with the host's default tiles."""
    if interpret is not None:
        return build("cpu" if jax.default_backend() == "cpu" else "gpu", interpret)(*args)
    return jax.lax.platform_dependent(*args, cpu=build("cpu", True), default=build("gpu", False))


def gpu_params(interpret: bool, **triton_options):
    """compiler_params selecting the Pallas Triton lowering on a GPU (None in interpret mode).

    Needed even without options: with compiler_params=None, jax >= 0.10 lowers a `pallas_call`
    for CUDA through Mosaic GPU (`jax_pallas_use_mosaic_gpu` defaults to True), which rejects
    these kernels ("No support for axes yet" on a row reduction). They are written in Triton's
    style: whole-block loads, reductions over a block axis, dynamic loop bounds. The Triton
    lowering is deprecated since jax 0.11 but present through 0.11.x; see the `gpu` extra's pin."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(**triton_options)


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
    "attention_reference", "bias_gelu", "bias_gelu_reference", "by_platform", "gpu_params",
    "flash_attention", "kv_block_range", "layer_norm", "layer_norm_reference",
    "layer_norm_residual", "layer_norm_residual_reference", "pad_axis", "q_block_range",
    "visited_kv_blocks",
]
