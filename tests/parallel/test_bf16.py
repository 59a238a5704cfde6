"""bf16, the dtype every GPU config trains in, on every kind of layout on the CPU.

XLA:CPU aborts the process on some bf16 all-reduces at tp > 1 unless its all-reduce-promotion
pass is skipped (`training.trainer.compiler_options`); these runs are the proof that the workaround holds,
for data, tensor (plain, sequence-parallel, collective matmul) and pipeline parallelism (1F1B
and interleaved; GPipe differs from 1F1B only in tick order) and the Pallas kernels.

Tolerances. Parameters, softmax and the loss are float32; activations and matmul inputs are
bf16 (8 significant bits). Over the 5 steps below, measured on this CPU (jax 0.10.2; `pytest -s`
prints them): bf16 vs float32 on one device differ by at most 5.8e-5 relative in the loss, and
every bf16 layout vs bf16 on one device by 2.3e-5 to 4.7e-5 (the order of sums differs, and tp
sums run in bf16). The loss
is this close because a young model's logits are small, so their bf16 rounding moves the loss
little. The tolerances are about 10x the largest measured difference:
* `BF16_LAYOUTS` = 5e-4 between layouts, `BF16_VS_F32` = 1e-3 against float32,
while the loss itself falls by over 5% in those steps (asserted): a layout that computes
something else — a wrong sharding, a lost reduction — misses by 100x the tolerance.
"""

import functools

import jax
import numpy as np
import pytest

from megascale_jax.training import data
from megascale_jax.config import load_config
from megascale_jax.parallel.mesh import make_mesh
from megascale_jax.training.trainer import build_trainer

BF16_LAYOUTS = 5e-4
BF16_VS_F32 = 1e-3
STEPS = 5

SMALL = ["model.layers=4", "model.d_model=64", "model.heads=8", "model.kv_heads=8", "model.seq_len=32",
         "model.window=12", "train.global_batch=8", "optim.warmup=1", "optim.lr=1e-2", f"train.steps={STEPS}"]
BF16 = ["model.dtype=bfloat16"]

LAYOUTS = {
    "dp2tp4-zero1": ["mesh.dp=2", "mesh.tp=4", "parallel.zero1=true"],
    "tp8-sp": ["mesh.dp=1", "mesh.tp=8", "parallel.sequence_parallel=true"],
    "dp2tp4-collective-matmul": ["mesh.dp=2", "mesh.tp=4", "parallel.sequence_parallel=true",
                                 "parallel.tp_overlap=collective_matmul"],
    "dp2tp4-xla-overlap": ["mesh.dp=2", "mesh.tp=4", "parallel.tp_overlap=xla"],
    # GPipe is not run here: it runs the same chunk programs and collectives, in the same dtypes, as
    # 1F1B, only in another tick order (its float32 equality: tests/parallel/test_pipeline.py).
    "dp2pp2tp2-1f1b": ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "parallel.pp_schedule=1f1b",
                       "parallel.microbatches=2"],
    "pp2tp2-interleaved": ["mesh.dp=1", "mesh.pp=2", "mesh.tp=2", "parallel.pp_schedule=interleaved_1f1b",
                           "parallel.pp_virtual=2", "parallel.microbatches=4"],
    "dp2tp2-pallas": ["mesh.dp=2", "mesh.tp=2", "model.attention=pallas", "model.fused_norm=true",
                      "model.fused_mlp=true"],
}


# Every layout compares against one device's bf16 run and starts from its initial state: one
# xdist worker computes both once.
pytestmark = pytest.mark.xdist_group("bf16_one_device")


@functools.lru_cache(maxsize=None)
def _initial_state(model_overrides: tuple[str, ...]):
    """The initial state on one device, on the host, in canonical layer order. Initialisation does
    not depend on the mesh (tests/parallel/test_parity.py), so every layout starts from this copy
    instead of compiling its own init."""
    cfg = load_config(None, SMALL + ["mesh.dp=1", *model_overrides])
    return jax.device_get(build_trainer(cfg, make_mesh(cfg.mesh)).init())


@functools.lru_cache(maxsize=None)
def losses(overrides: tuple[str, ...]) -> np.ndarray:
    """Per-step losses of a real 5-step run (init, data and optimizer as `train` has them)."""
    cfg = load_config(None, SMALL + list(overrides))
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    batches = data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train")
    initial = _initial_state(tuple(o for o in overrides if o.startswith("model.")))
    state = trainer.to_stored(jax.device_put(initial, trainer.state_shardings))
    out = []
    for step in range(STEPS):
        state, metrics = trainer.train_step(state, data.make_global_batch(batches, step, trainer.batch_sharding))
        out.append(float(metrics["loss"]))
    return np.array(out)


def max_rel(got: np.ndarray, want: np.ndarray) -> float:
    """The measured difference the docstring quotes (`pytest -s` prints it)."""
    return float(np.max(np.abs(got - want) / np.abs(want)))


@pytest.fixture(scope="module")
def one_device_bf16():
    return losses(tuple(BF16 + ["mesh.dp=1"]))


@pytest.mark.slow
def test_bf16_on_one_device_is_close_to_float32_and_learns(one_device_bf16):
    f32 = losses(("mesh.dp=1",))
    assert np.all(np.isfinite(one_device_bf16))
    assert one_device_bf16[-1] < 0.95 * one_device_bf16[0]  # it learns: the tolerances below are small next to that
    print(f"bf16 vs float32, one device: max relative loss difference {max_rel(one_device_bf16, f32):.2e}")
    np.testing.assert_allclose(one_device_bf16, f32, rtol=BF16_VS_F32)
    assert not np.array_equal(one_device_bf16, f32)  # bf16 really ran


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_bf16_trains_on_every_layout_like_one_device(one_device_bf16, layout):
    got = losses(tuple(BF16 + LAYOUTS[layout]))
    assert np.all(np.isfinite(got))
    print(f"bf16 {layout} vs one device: max relative loss difference {max_rel(got, one_device_bf16):.2e}")
    np.testing.assert_allclose(got, one_device_bf16, rtol=BF16_LAYOUTS)


def test_the_cpu_workaround_leaves_gpu_compilation_alone():
    from megascale_jax.training.trainer import compiler_options

    assert compiler_options("cpu") == {"xla_disable_hlo_passes": "all-reduce-promotion"}
    assert compiler_options("gpu") is None and compiler_options("cuda") is None
