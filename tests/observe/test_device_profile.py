"""Per-device busy time from profiler traces: the interval arithmetic on hand-made ops, a real
trace of a pp=4 pipeline step cut into the schedule table's ticks (no timing is asserted: only
which stage ran matmuls in which tick, which the table decides), and sampled profiling in the
train loop (`observe.profile_every`) through to the report's device heat map."""

import csv
import json
import os

import jax
import numpy as np
import pytest

from megascale_jax.training import data
from megascale_jax.observe import device_profile
from megascale_jax.parallel import pipeline
from megascale_jax.config import load_config
from megascale_jax.observe.device_profile import Op
from megascale_jax.parallel.mesh import make_mesh
from megascale_jax.training.trainer import build_trainer


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
    # Idle cells: stage 1 in tick 0 (1), stage 0 in tick 2 (3) -> 4/14; stage 1 waits 2 in tick 1 -> 2/14.
    working = [[True, True, False], [False, True, True]]
    bubble = device_profile.lockstep_bubble([[1, 3, 0], [0, 1, 3]], working)
    assert bubble == pytest.approx({"total": 6 / 14, "idle": 4 / 14, "imbalance": 2 / 14})
    # Junk computed in a cell the table leaves idle is still bubble.
    assert device_profile.lockstep_bubble([[1, 3, 2], [0.5, 1, 3]], working) == pytest.approx(bubble)


def test_per_tick_needs_a_permute_per_tick():
    ops = [Op(1, "ppermute.3", 0, 1), Op(1, "fusion", 1, 2), Op(1, "ppermute.3", 2, 3)]
    assert [len(c) for c in device_profile.per_tick(ops, ticks=2)] == [1, 2]
    with pytest.raises(ValueError, match="ran once per tick"):
        device_profile.per_tick(ops, ticks=3)


def is_matmul(op: Op) -> bool:
    # XLA:CPU names its matmuls "dot" or, through XNNPACK, "ynn_fusion".
    return op.kind == "dot" or op.kind.startswith("ynn")


@pytest.mark.slow
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
            # Only the tick loop's two permutes (activations on, cotangents back): the v > 1
            # weight re-layout before the loop is in no tick.
            assert sum(o.kind in device_profile.PERMUTES for o in cell) == 2, (stage, t)
            assert device_profile.busy_ns(cell) > 0  # even an idle cell does bookkeeping


# ============================================================================ sampled steps in training


@pytest.mark.slow
def test_profiled_steps_write_device_rows_that_the_report_reads(tmp_path):
    """observe.profile_every=2 over 4 steps on dp=2 x tp=2: every mesh device gets compute,
    collective and span rows for steps 2 and 4, with its own coordinates; the report draws the
    device heat map; every step is still recorded once, in order."""
    from megascale_jax.observe import report, timings
    from megascale_jax.train import prepare_run_dir, train

    cfg = load_config(None, ["model.layers=2", "model.d_model=32", "model.heads=4", "model.kv_heads=2",
                             "model.seq_len=16", "train.global_batch=4", "train.steps=4", "train.eval_every=0",
                             "mesh.dp=2", "mesh.pp=1", "mesh.tp=2", "mesh.cpu_devices=4", "checkpoint.every=0",
                             "observe.profile_every=2", "observe.tensorboard=false"])
    tokens = data.load_tokens(cfg)
    run_dir, _ = prepare_run_dir(str(tmp_path / "run"), cfg, None)
    records = train(cfg, run_dir, data.SequenceBatches.from_config(cfg, tokens, "train"),
                    data.SequenceBatches.from_config(cfg, tokens, "val"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]

    t = timings.read_timings(run_dir)
    table = {int(d["device"]): (int(d["dp"]), int(d["pp"]), int(d["tp"])) for d in t.devices}
    assert len(table) == 4
    compute, devices, steps = t.device_matrix("device_compute")
    collective, _, _ = t.device_matrix("device_collective")
    span, _, _ = t.device_matrix("device_span")
    assert devices.tolist() == sorted(table) and steps.tolist() == [2, 4]
    assert (compute > 0).all() and (collective > 0).all()  # dp=2 and tp=2 both all-reduce
    assert (compute <= span * (1 + 1e-9)).all() and (collective <= span * (1 + 1e-9)).all()
    with open(os.path.join(run_dir, "timings", "process-0.csv")) as f:
        rows = [r for r in csv.DictReader(f) if int(r["device"]) >= 0]
    assert len(rows) == 2 * 4 * 3
    assert all(table[int(r["device"])] == (int(r["dp"]), int(r["pp"]), int(r["tp"])) for r in rows)

    summary = report.write_report(run_dir)
    assert "device compute (4 devices, profiled steps [2, 4]" in summary
    assert os.path.getsize(os.path.join(run_dir, "report", "device_heatmap.png")) > 0
    assert not os.listdir(os.path.join(run_dir, "profiles", "process-0"))  # traces are not kept


def write_slow_device_rows(run_dir: str) -> None:
    """Synthetic timings on dp=2 x tp=2 (one process): device 3 computes 30% longer at every
    profiled step; every process arrives on time."""
    from megascale_jax.observe import timings
    from megascale_jax.config import MeshConfig

    mesh = make_mesh(MeshConfig(dp=2, pp=1, tp=2, cpu_devices=4))
    writer = timings.TimingsWriter(run_dir, mesh, process=0)
    rng = np.random.default_rng(3)
    for step in range(1, 31):
        writer.phase(step, "dispatch", 1.7e9 + step, 0.001)
        writer.phase(step, "step", 1.7e9 + step, 1.0)
        if step % 10 == 0:
            for device in range(4):
                compute = 0.5 * (1.3 if device == 3 else 1.0) * rng.uniform(0.99, 1.01)
                writer.device_phase(step, device, "device_compute", 1.7e9 + step, compute)
                writer.device_phase(step, device, "device_collective", 1.7e9 + step, 0.1)
    writer.close()


def test_a_device_that_computes_slowly_is_named(tmp_path):
    from megascale_jax.observe import report, stragglers, timings

    write_slow_device_rows(str(tmp_path))
    t = timings.read_timings(str(tmp_path))
    slow = stragglers.slow_devices(t, threshold=0.05)
    assert [device for device, _ in slow] == [3] and slow[0][1] == pytest.approx(0.3, abs=0.03)
    assert report.device_labels(t, [3]) == ["device 3 (dp1 pp0 tp1)"]
    assert stragglers.find_stragglers(t, 0.05, 10) == []  # on time: invisible to arrival lateness


def test_the_supervisor_logs_a_slow_device_once_and_evicts_it_when_configured(tmp_path, monkeypatch):
    from megascale_jax.supervise.supervisor import Job, Supervisor

    write_slow_device_rows(str(tmp_path))
    cfg = load_config(None, ["supervisor.straggler_check_s=1", "supervisor.evict_stragglers=true",
                             "observe.straggler_window=10"])
    job = Job(cfg, str(tmp_path), nprocs=1, worker_args=[], job_id="slow", env={}, diagnose_args=None)
    monkeypatch.setenv("MEGASCALE_REDIS_PASSWORD", "unused")  # the job's Redis needs one (cluster/redis_auth.py)
    supervisor = Supervisor(job, "redis://127.0.0.1:1")  # the check reads timings only, never Redis
    fault = supervisor._check_stragglers(now=100.0)
    assert (fault.cause, fault.rank) == ("straggler", 0) and "device 3 (dp1 pp0 tp1)" in fault.detail
    assert supervisor._check_stragglers(now=200.0) is None  # logged and acted on once
    with open(tmp_path / "events.jsonl") as f:
        events = [json.loads(line) for line in f]
    assert [(e["kind"], e["device"], e["tp"]) for e in events] == [("slow_device", 3, 1)]
