"""Per-device busy time from profiler traces: the interval arithmetic on hand-made ops, and a real
trace of a pp=4 pipeline step cut into the schedule table's ticks (no timing is asserted: only
which stage ran matmuls in which tick, which the table decides)."""

import jax
import pytest

from megascale_jax import data, device_profile, pipeline
from megascale_jax.config import load_config
from megascale_jax.device_profile import Op
from megascale_jax.mesh import make_mesh
from megascale_jax.train import build_trainer


def test_busy_is_the_union_of_compute_ops():
    ops = [Op(0, "while.2", 0, 100),  # a container: only what runs inside it counts
           Op(0, "fusion.1", 10, 30), Op(0, "conditional.1.clone", 25, 60), Op(0, "dot.3", 25, 40),
           Op(0, "ynn_fusion", 35, 50),  # overlaps dot.3: [25, 50) once
           Op(0, "ppermute.14", 50, 90),  # waiting for a peer is not busy
           Op(0, "copy", 95, 99)]
    assert device_profile.busy_ns(ops) == (30 - 10) + (50 - 30) + (99 - 95)
    assert [o.kind for o in ops[2:6]] == ["conditional", "dot", "ynn_fusion", "ppermute"]


def test_lockstep_bubble_counts_idle_cells_and_waiting_for_the_slowest_stage():
    # 2 stages x 3 ticks; tick lengths 1, 3, 3 -> step 7; useful work 1+3 + 1+3 = 8 of 2*7 = 14.
    working = [[True, True, False], [False, True, True]]
    assert device_profile.lockstep_bubble([[1, 3, 0], [0, 1, 3]], working) == pytest.approx(3 / 7)
    # Junk computed in a cell the table leaves idle is still bubble.
    assert device_profile.lockstep_bubble([[1, 3, 2], [0.5, 1, 3]], working) == pytest.approx(3 / 7)


def test_per_tick_needs_a_permute_per_tick():
    ops = [Op(1, "ppermute.3", 0, 1), Op(1, "fusion", 1, 2), Op(1, "ppermute.3", 2, 3)]
    assert [len(c) for c in device_profile.per_tick(ops, ticks=2)] == [1, 2]
    with pytest.raises(ValueError, match="ran once per tick"):
        device_profile.per_tick(ops, ticks=3)


def is_matmul(op: Op) -> bool:
    # XLA:CPU names its matmuls "dot" or, through XNNPACK, "ynn_fusion".
    return op.kind == "dot" or op.kind.startswith("ynn")


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_a_traced_pipeline_step_runs_matmuls_exactly_in_the_tables_working_ticks(tmp_path, schedule, virtual):
    cfg = load_config(None, ["model.layers=8", "model.d_model=32", "model.heads=4", "model.kv_heads=2",
                             "model.seq_len=16", "train.global_batch=4", "mesh.dp=1", "mesh.pp=4", "mesh.tp=1",
                             "mesh.cpu_devices=4", f"parallel.pp_schedule={schedule}",
                             f"parallel.pp_virtual={virtual}", "parallel.microbatches=4"])
    mesh = make_mesh(cfg.mesh)
    trainer = build_trainer(cfg, mesh)
    params = trainer.init().params
    batches = data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train")
    batch = jax.device_put(batches.rows(5, 0, cfg.train.global_batch), trainer.batch_sharding)
    step = jax.jit(lambda p, b: pipeline.loss_and_grads(cfg, mesh, p, b))
    with jax.set_mesh(mesh):
        jax.block_until_ready(step(params, batch))
        with jax.profiler.trace(str(tmp_path)):
            for _ in range(2):
                jax.block_until_ready(step(params, batch))
    ops = device_profile.read_ops(device_profile.latest_trace(str(tmp_path)))
    table = pipeline.schedule_for(cfg)
    assert sorted(ops) == [0, 1, 2, 3]
    for stage in range(4):
        cut = device_profile.per_tick(ops[stage], table.ticks, steps=2)
        assert len(cut) == 2 * table.ticks
        for k, cell in enumerate(cut):
            t = k % table.ticks
            working = table.forward[t][stage] is not None or table.backward[t][stage] is not None
            assert any(map(is_matmul, cell)) == working, (stage, t)
            assert device_profile.busy_ns(cell) > 0  # even an idle cell does bookkeeping
