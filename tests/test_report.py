"""Timings, straggler detection, hang localisation and the report.

Synthetic runs (CSV files written here, with known clock offsets and a known late rank) test the
statistics exactly and fast; one real two-process run with injected faults tests the whole path.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import matplotlib.image
import numpy as np
import pytest

from megascale_jax import hangs, report, stragglers, timings
from megascale_jax.config import MeshConfig
from megascale_jax.mesh import make_mesh

STEP = 0.1  # seconds per synthetic step


def write_synthetic_run(run_dir, offsets, late, steps=40, stop=None, seed=0):
    """Timings of len(offsets) lockstep processes: process p arrives `late[p](k)` step times after
    its peers and its clock reads `offsets[p]` seconds ahead. `stop=(p, k)`: p stops after its
    data_wait of step k, the others block in step k-1 after dispatching k."""
    rng = np.random.default_rng(seed)
    os.makedirs(timings.timings_dir(run_dir), exist_ok=True)
    t0 = 1.7e9
    for p, offset in enumerate(offsets):
        rows = [(0, "state:training", t0 - 1, 0.0)]
        for k in range(1, steps + 1):
            arrive = t0 + (k - 1) * STEP + 0.003 + rng.uniform(0, 0.002) + late(p, k) * STEP
            rows.append((k, "data_wait", arrive - 0.001, 0.001))
            if stop and stop == (p, k):
                break
            rows.append((k, "dispatch", arrive, 0.002))
            if stop and k == stop[1]:
                break
            end = t0 + k * STEP + 0.01 + rng.uniform(0, 0.001)
            rows.append((k, "step", end - STEP, STEP))
        if not stop:
            rows.append((steps, "state:done", t0 + (steps + 1) * STEP, 0.0))
        with open(os.path.join(timings.timings_dir(run_dir), f"process-{p}.csv"), "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(timings.COLUMNS)
            out.writerows([k, p, -1, -1, -1, -1, phase, f"{start + offset:.6f}", duration]
                          for k, phase, start, duration in rows)
        with open(os.path.join(timings.timings_dir(run_dir), f"devices-{p}.csv"), "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(timings.DEVICE_COLUMNS)
            out.writerows([[p, f"host{p}", 2 * p + tp, p, 0, tp] for tp in range(2)])


OFFSETS = [0.0, 0.75, -0.4, 3.0]


def test_clock_offsets_are_estimated_from_step_ends(tmp_path):
    write_synthetic_run(tmp_path, OFFSETS, lambda p, k: 0.2 * (p == 2))
    estimated = stragglers.clock_offsets(timings.read_timings(tmp_path))
    np.testing.assert_allclose(estimated, OFFSETS, atol=1e-3)


def test_the_late_rank_and_no_other_is_flagged(tmp_path):
    write_synthetic_run(tmp_path, OFFSETS, lambda p, k: 0.2 * (p == 2))
    flagged = stragglers.find_stragglers(str(tmp_path), threshold=0.05, window=10)
    # The first window is warm-up and not judged (find_stragglers is what the supervisor acts on).
    assert [(s["rank"], s["first_step"], s["last_step"]) for s in flagged] == \
        [(2, 11, 20), (2, 21, 30), (2, 31, 40)]
    np.testing.assert_allclose([s["lateness"] for s in flagged], 0.2, atol=0.02)
    assert stragglers.find_stragglers(str(tmp_path), threshold=0.3, window=10) == []

    # Without the offsets, rank 1's and rank 3's clocks alone would make them "late".
    t = timings.read_timings(tmp_path)
    naive = stragglers.window_lateness(t, np.zeros(len(OFFSETS)), 10)
    assert naive[0]["lateness"][3] > 1


def test_a_rank_is_flagged_only_in_the_windows_where_it_is_late(tmp_path):
    write_synthetic_run(tmp_path, [0.0, 0.2, 0.1], lambda p, k: 0.1 * (p == 0 and k > 20))
    flagged = stragglers.find_stragglers(str(tmp_path), threshold=0.05, window=10)
    assert [(s["rank"], s["first_step"]) for s in flagged] == [(0, 21), (0, 31)]


def test_events_are_appended_once_and_a_torn_row_is_skipped(tmp_path):
    write_synthetic_run(tmp_path, [0.0, 0.0, 0.0], lambda p, k: 0.3 * (p == 1))
    with open(os.path.join(timings.timings_dir(tmp_path), "process-1.csv"), "a") as f:
        f.write("41,1,-1,-1,-1,-1,dispa")  # killed mid-write
    with open(tmp_path / "events.jsonl", "w") as f:
        f.write(json.dumps({"time": 1.0, "kind": "restart", "rank": 0}) + "\n")
    flagged = stragglers.find_stragglers(str(tmp_path), threshold=0.05, window=10)
    stragglers.append_events(str(tmp_path), flagged)
    stragglers.append_events(str(tmp_path), flagged)
    events = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert [(e["kind"], e["rank"]) for e in events] == [("restart", 0)] + [("straggler", 1)] * 3
    assert all({"time", "kind", "rank", "host", "first_step", "last_step"} <= set(e) for e in events[1:])


@pytest.mark.parametrize("stopped", [0, 2])
def test_the_stopped_rank_is_hung_and_the_others_wait(tmp_path, stopped):
    write_synthetic_run(tmp_path, OFFSETS[:3], lambda p, k: 0.0, stop=(stopped, 25))
    t = timings.read_timings(tmp_path)
    last = float((t.start + t.duration).max())
    assert {s.status for s in hangs.rank_states(t, now=last + 1, hang_after=60)} == {"running"}
    states = hangs.rank_states(t, now=last + 61, hang_after=60)
    assert [s.status for s in states] == ["hung" if p == stopped else "waiting" for p in range(3)]
    assert states[stopped].arrived == (25, "data_wait")
    assert all(s.arrived == (25, "dispatch") for s in states if s.rank != stopped)


def check_report_files(run_dir, ranks, steps):
    """The trace loads and is ordered, the PNGs decode, the heat map is ranks × steps."""
    out = os.path.join(run_dir, "report")
    trace = json.load(open(os.path.join(out, "trace.json")))["traceEvents"]
    timed = [e for e in trace if e["ph"] in ("X", "i")]
    assert {e["pid"] for e in timed} == set(ranks)
    for track in {(e["pid"], e["tid"]) for e in timed}:
        ts = [e["ts"] for e in timed if (e["pid"], e["tid"]) == track]
        assert ts == sorted(ts)
    assert min(e["ts"] for e in timed) == 0  # µs since the run's first row
    assert all(e["dur"] >= 0 for e in timed if e["ph"] == "X")
    assert np.loadtxt(os.path.join(out, "heatmap.csv"), delimiter=",", ndmin=2).shape == (len(ranks), steps)
    for name in ("heatmap.png", "parallel_view.png"):
        image = matplotlib.image.imread(os.path.join(out, name))
        assert image.ndim == 3 and min(image.shape[:2]) > 100 and image.std() > 0
    return open(os.path.join(out, "summary.txt")).read(), open(os.path.join(out, "parallel_view.txt")).read()


def test_report_on_a_synthetic_hang(tmp_path):
    write_synthetic_run(tmp_path, OFFSETS[:3], lambda p, k: 0.3 * (p == 1), stop=(1, 25))
    report.write_report(str(tmp_path), threshold=0.05, window=10, hang_after=1)
    summary, view = check_report_files(tmp_path, [0, 1, 2], 25)
    assert "STRAGGLER rank 1 on host1" in summary and "STRAGGLER rank 0" not in summary
    assert "never arrived" in summary and "rank 1 on host1: hung" in summary
    last_window = view.split("steps 21-25")[1]
    assert "r1:hung" in last_window and "r0:waiting" in last_window and "r2:waiting" in last_window


def test_timings_writer_rows_and_device_table(tmp_path):
    mesh = make_mesh(MeshConfig(dp=2, pp=2, tp=2))
    writer = timings.TimingsWriter(str(tmp_path), mesh, process=0)
    writer.state("training", 0)
    writer.phase(1, "dispatch", 100.25, 0.5)
    writer.phase(1, "step", 100.0, 1.5)
    writer.close()
    t = timings.read_timings(tmp_path)
    assert list(t.phase) == ["state:training", "dispatch", "step"]
    np.testing.assert_allclose(t.duration, [0.0, 0.5, 1.5])
    devices = t.devices
    assert len(devices) == 8
    for d in devices:  # tp innermost, then pp, then dp
        assert int(d["device"]) == 4 * int(d["dp"]) + 2 * int(d["pp"]) + int(d["tp"])


def test_tensorboard_scalars_read_back(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    writer = timings.TensorBoardScalars(str(tmp_path))
    rng = np.random.default_rng(1)
    records = [{"step": k, "loss": float(rng.uniform(2, 5)), "lr": float(rng.uniform(0, 1e-3)),
                "grad_norm": float(rng.uniform(0, 3)), "mfu": float(rng.uniform(0, 0.6)),
                "tokens_per_s": float(rng.uniform(1e3, 1e4)), "step_time_s": float(rng.uniform(0.1, 1))}
               for k in range(1, 6)]
    for r in records:
        writer.record(r)
    writer.close()
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for tag in ("loss", "lr", "grad_norm", "mfu", "tokens_per_s", "step_time_s"):
        scalars = events.Scalars(f"train/{tag}")
        assert [s.step for s in scalars] == [r["step"] for r in records]
        np.testing.assert_allclose([s.value for s in scalars], [r[tag] for r in records], rtol=1e-6)


# ============================================================================ two real processes

SLOW, STOP_AT = 0.3, 45


@pytest.mark.slow
def test_two_processes_straggler_then_hang(tmp_path):
    """Rank 1 sleeps 30% of a step before each dispatch; rank 0 stops itself (SIGSTOP) at step 45.
    The report names rank 1 the straggler, rank 0 hung, rank 1 waiting."""
    from megascale_jax.rendezvous import free_port

    run_dir = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MEGASCALE_FAULT_SLOW": f"1:{SLOW}",
           "MEGASCALE_FAULT_STOP": f"0:{STOP_AT}"}
    address = f"127.0.0.1:{free_port()}"
    args = ["mesh.cpu_devices=4", "mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "parallel.microbatches=2",
            "model.layers=2", "model.d_model=64", "model.seq_len=64", "train.global_batch=8",
            "train.steps=60", "checkpoint.every=0", "train.eval_every=0"]
    logs = [open(tmp_path / f"out{i}.txt", "w") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "megascale_jax.train", "--run-dir", str(run_dir),
                               "--coordinator", address, "--num-processes", "2", "--process-id", str(i), *args],
                              env=env, stdout=logs[i], stderr=subprocess.STDOUT) for i in range(2)]
    try:
        deadline = time.time() + 400
        while not _stopped(procs[0].pid):
            assert time.time() < deadline and all(p.poll() is None for p in procs), \
                [open(tmp_path / f"out{i}.txt").read()[-3000:] for i in range(2)]
            time.sleep(0.5)
        while not _dispatched(run_dir, 1, STOP_AT):  # rank 1 dispatches step 45 and blocks on rank 0
            assert time.time() < deadline, "rank 1 never dispatched the step rank 0 stopped at"
            time.sleep(0.5)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)

    report.write_report(str(run_dir), window=10, hang_after=0)
    summary, view = check_report_files(run_dir, [0, 1], STOP_AT)
    flagged = stragglers.find_stragglers(str(run_dir), threshold=0.05, window=10)
    assert {s["rank"] for s in flagged} == {1}, summary
    assert len(flagged) >= 3, summary  # of the 4 judged windows (the first is warm-up)
    assert "rank 0 on" in summary and "never arrived" in summary, summary
    states = hangs.rank_states(timings.read_timings(run_dir), time.time(), hang_after=0)
    assert [s.status for s in states] == ["hung", "waiting"], summary
    assert states[0].arrived == (STOP_AT, "data_wait") and states[1].arrived == (STOP_AT, "dispatch")
    assert "r0:hung" in view and "r1:waiting" in view and "r1:slow" in view
    events = [json.loads(line) for line in open(run_dir / "events.jsonl")]
    assert {(e["kind"], e["rank"]) for e in events} == {("straggler", 1)}


def _dispatched(run_dir, process: int, step: int) -> bool:
    with open(os.path.join(timings.timings_dir(run_dir), f"process-{process}.csv")) as f:
        return any(row.get("phase") == "dispatch" and row.get("step") == str(step) for row in csv.DictReader(f))


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_resumed_run_is_judged_on_its_current_attempt_only(tmp_path):
    """Attempt 1 ran to step 50 (and wrote state:done); attempt 2 resumed from step 40 into the
    same files and rank 1 stopped at step 45. Stale rows of attempt 1 (its arrivals up to 50, its
    done mark) must not hide the hang."""
    write_synthetic_run(tmp_path, [0.0, 0.0, 0.0], lambda p, k: 0.0, steps=50)
    t1 = 1.7e9 + 100.0
    for p in range(3):
        rows = [(0, "state:initialising", t1, 0.0), (40, "state:training", t1 + 1, 0.0)]
        for k in range(41, 46):
            arrive = t1 + 2 + (k - 41) * STEP
            rows.append((k, "data_wait", arrive - 0.001, 0.001))
            if (p, k) == (1, 45):
                break
            rows.append((k, "dispatch", arrive, 0.002))
            if k < 45:
                rows.append((k, "step", arrive, STEP))
        with open(os.path.join(timings.timings_dir(tmp_path), f"process-{p}.csv"), "a", newline="") as f:
            csv.writer(f).writerows([k, p, -1, -1, -1, -1, phase, f"{start:.6f}", d] for k, phase, start, d in rows)
    t = timings.read_timings(tmp_path)
    states = hangs.rank_states(t, now=float((t.start + t.duration).max()) + 61, hang_after=60)
    assert [s.status for s in states] == ["waiting", "hung", "waiting"], [s.describe() for s in states]
    assert states[1].arrived == (45, "data_wait") and states[0].arrived == (45, "dispatch")
