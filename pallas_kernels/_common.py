"""Helpers the kernels share: where a kernel runs (interpret vs GPU, by lowering platform), the
Pallas Triton compiler params, padding to whole blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def by_platform(build, *args, interpret: bool | None = None):
    """`build(platform, interpret)(*args)`, platform "cpu" or "gpu" (it picks the default tiles).

    interpret=None: the choice is made when the program is *lowered*, for the platform it is
    lowered for — `lax.platform_dependent` traces both variants and lowers only the matching one
    (the CPU one in interpret mode, the GPU one as a real Pallas GPU kernel). Deciding at trace
    time from `jax.default_backend()` names the host instead, and is wrong whenever the two
    differ: lowering for CUDA on a CPU-only CI machine (tests/parallel/test_cuda_lowering.py) would embed
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
