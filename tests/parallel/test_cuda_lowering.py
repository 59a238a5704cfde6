"""The complete train step lowered for CUDA on this CPU-only machine: GPU code checked without a GPU.

`Trainer.train_step.trace(state, batch).lower(lowering_platforms=("cuda",))` runs every
lowering rule a GPU run would (sharding, collectives, the Pallas kernels' GPU lowering) but
compiles nothing, so no GPU or CUDA plugin is needed. What is asserted:

* every Pallas kernel the config uses appears as a Triton GPU kernel custom call
  (`__gpu$xla.gpu.triton`, named by its `pallas_call(name=...)`), none is missing;
* no kernel is lowered as an interpreted loop: the step has exactly as many `stablehlo.while`
  loops as the same step with XLA attention and no fused kernels (the layer scan, the pipeline);
  lowered for the CPU instead, the same step has no GPU call and more loops (the interpreter),
  so the check can tell the two apart (`pallas_kernels._common.by_platform` picks per lowering platform).

Covers jax 0.10.2 (CI) here; the GPU machines run jax 0.11.2, where the Pallas Triton lowering
is deprecated but present. Mosaic GPU, the default for a `pallas_call` without Triton
`compiler_params`, rejects these kernels (see `pallas_kernels._common.gpu_params`).
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from megascale_jax.config import load_config
from megascale_jax.parallel.mesh import make_mesh
from megascale_jax.training.trainer import build_trainer

TINY = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.kv_heads=2", "model.seq_len=32",
        "model.window=12", "train.global_batch=8", "train.steps=2"]
KERNELS = ["model.attention=pallas", "model.fused_norm=true", "model.fused_mlp=true"]
NO_KERNELS = ["model.attention=xla", "model.fused_norm=false", "model.fused_mlp=false"]
FUSED = {"layer_norm_fwd", "layer_norm_bwd", "bias_gelu_fwd", "bias_gelu_bwd"}
ATTENTION = {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkdv"}

LAYOUTS = {
    "tp-none": ["mesh.dp=4", "mesh.tp=2", "parallel.tp_overlap=none"],
    "tp-collective-matmul": ["mesh.dp=4", "mesh.tp=2", "parallel.tp_overlap=collective_matmul",
                             "parallel.sequence_parallel=true"],
    "tp-xla": ["mesh.dp=4", "mesh.tp=2", "parallel.tp_overlap=xla"],
    "pp2-1f1b": ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "parallel.pp_schedule=1f1b", "parallel.microbatches=2"],
    "tp-none-remat": ["mesh.dp=4", "mesh.tp=2", "parallel.tp_overlap=none", "model.remat=dots"],
}
TRITON_CALL = "custom_call @__gpu$xla.gpu.triton"
# The tests share lowered steps (`_lowered_step`'s cache: the XLA-only steps they compare against,
# tp-none's by three tests): one xdist worker lowers each once.
pytestmark = pytest.mark.xdist_group("cuda_lowering_steps")


def lowered_step(overrides: list[str], platform: str = "cuda") -> str:
    """StableHLO text of one train step of `overrides` lowered for `platform` (abstract inputs)."""
    return _lowered_step(tuple(overrides), platform)


@functools.lru_cache(maxsize=None)
def _lowered_step(overrides: tuple[str, ...], platform: str) -> str:
    cfg = load_config(None, TINY + list(overrides))
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         jax.eval_shape(trainer.init), trainer.state_shardings)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32,
                                 sharding=trainer.batch_sharding)
    return trainer.train_step.trace(state, batch).lower(lowering_platforms=(platform,)).as_text()


def triton_kernels(text: str) -> list[str]:
    """Names of the Pallas kernels lowered as Triton GPU custom calls, one entry per call."""
    names = []
    for line in text.splitlines():
        if TRITON_CALL in line:
            found = re.search(r'\bname = "(\w+)"', line)
            names.append(found.group(1) if found else "?")
    return names


def loops(text: str) -> int:
    return text.count("stablehlo.while")


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernels_lower_as_triton_gpu_kernels(layout):
    text = lowered_step(LAYOUTS[layout] + KERNELS)
    assert set(triton_kernels(text)) == FUSED | ATTENTION
    assert loops(text) == loops(lowered_step(LAYOUTS[layout] + NO_KERNELS))


def test_fused_kernels_with_xla_attention():
    text = lowered_step(LAYOUTS["tp-none"] + ["model.attention=xla", "model.fused_norm=true",
                                              "model.fused_mlp=true"])
    assert set(triton_kernels(text)) == FUSED
    assert loops(text) == loops(lowered_step(LAYOUTS["tp-none"] + NO_KERNELS))


@pytest.mark.slow
def test_lowered_for_the_cpu_the_same_step_interprets_its_kernels():
    """The discriminating counterpart: the platform, not the host, picks interpret mode."""
    text = lowered_step(LAYOUTS["tp-none"] + KERNELS, platform="cpu")
    assert triton_kernels(text) == []
    assert loops(text) > loops(lowered_step(LAYOUTS["tp-none"] + NO_KERNELS, platform="cpu"))


def test_cudnn_attention_lowers_or_skips_for_lack_of_the_cuda_plugin():
    try:
        text = lowered_step(LAYOUTS["tp-none"] + ["model.attention=cudnn"])
    except RuntimeError as e:
        # jax.nn.dot_product_attention(implementation="cudnn") asks the CUDA plugin for the
        # cuDNN version while tracing (check_cudnn_version), before any lowering.
        if "cuDNN is not detected" not in str(e):
            raise
        pytest.skip(f"attention=cudnn needs the CUDA plugin even to lower: {e}")
    assert "__cudnn$fmha" in text


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_attention_kernels_pipelining_depth_reaches_the_triton_call(stages):
    """flash_attention(num_stages=...), which the kernel bench sweeps on a GPU, lowers for CUDA
    with that depth in the Triton call (forward here; the backward's calls share `_call`)."""
    from pallas_kernels import flash_attention

    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    step = jax.jit(lambda q, k, v: flash_attention(q, k, v, window=64, num_stages=stages))
    text = step.trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    assert triton_kernels(text) == ["flash_attention_fwd"]
    assert set(re.findall(r"num_stages = (\d+) : i32", text)) == {str(stages)}


def test_the_attention_kernels_with_documents_lower_as_triton_kernels_taking_the_segment_ids():
    """flash_attention(segment_ids=...) (packed documents kept apart, `model.document_eos`): the
    forward, dq and dk/dv kernels all lower for CUDA, each taking the (batch, seq) int32 ids
    twice (the queries' rows and the keys' columns: two block specs of one array)."""
    from pallas_kernels import flash_attention

    q, kv = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16), jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 256), jnp.int32)
    loss = lambda q, k, v, ids: flash_attention(q, k, v, window=64, segment_ids=ids).astype(jnp.float32).sum()
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = step.trace(q, kv, kv, ids).lower(lowering_platforms=("cuda",)).as_text()
    assert sorted(triton_kernels(text)) == sorted(ATTENTION)
    calls = [line for line in text.splitlines() if TRITON_CALL in line]
    assert all(line.count("tensor<2x256xi32>") >= 2 for line in calls), calls
    assert loops(text) == 0  # no interpreted kernel
