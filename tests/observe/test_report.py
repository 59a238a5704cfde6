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

from megascale_jax.observe import hangs, report, stragglers, timings
from megascale_jax.config import MeshConfig
from megascale_jax.parallel.mesh import make_mesh

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
            out.writerows([k, p, -1, -1, -1, -1, -1, phase, f"{start + offset:.6f}", duration]
                          for k, phase, start, duration in rows)
        with open(os.path.join(timings.timings_dir(run_dir), f"devices-{p}.csv"), "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(timings.DEVICE_COLUMNS)
            out.writerows([[p, f"host{p}", 2 * p + tp, p, 0, 0, tp] for tp in range(2)])


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


def test_a_trailing_window_flags_a_rank_turning_slow_after_six_late_steps(tmp_path):
    """Rank 1 turns 30% of a step late from step 27 on (threshold 20%). Fixed windows see 4 late
    steps of 10 in 21-30 and must wait for 31-40 to end; the supervisor's trailing window (the
    last 10 steps) flags it as soon as 6 of them are late: when the run reaches step 32."""
    for upto, expected in [(31, []), (32, [(1, 23, 32)]), (35, [(1, 26, 35)])]:
        run = tmp_path / str(upto)
        write_synthetic_run(run, [0.0, 0.3, -0.2], lambda p, k: 0.3 * (p == 1 and k >= 27), steps=upto)
        flagged = stragglers.find_stragglers(str(run), threshold=0.2, window=10, trailing=True)
        assert [(s["rank"], s["first_step"], s["last_step"]) for s in flagged] == expected
        fixed = stragglers.find_stragglers(str(run), threshold=0.2, window=10)
        assert [s for s in fixed if s["last_step"] - s["first_step"] == 9] == []  # no whole fixed window yet


def test_the_trailing_window_never_judges_the_warm_up_window(tmp_path):
    """A rank late from the first step: the first 10 steps are warm-up, so the trailing window is
    judged only once it lies wholly after them (steps 11-20)."""
    for upto, expected in [(19, []), (20, [(11, 20)])]:
        run = tmp_path / str(upto)
        write_synthetic_run(run, [0.0, 0.0, 0.0], lambda p, k: 0.3 * (p == 2), steps=upto)
        flagged = stragglers.find_stragglers(str(run), threshold=0.05, window=10, trailing=True)
        assert [(s["first_step"], s["last_step"]) for s in flagged] == expected
        assert {s["rank"] for s in flagged} <= {2}


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


def test_a_cp_mesh_names_each_devices_cp_rank_and_tables_before_cp_read_as_cp_0(tmp_path):
    """dp2 x cp2 x tp2: every device row carries its cp coordinate (the mesh's order, tp innermost),
    labels and the 3D-parallel view name it (a column per cp and tp pair); a device table written
    before the cp axis (no cp column) reads as cp 0, its labels as before."""
    from megascale_jax.observe import report

    mesh = make_mesh(MeshConfig(dp=2, cp=2, tp=2))
    timings.TimingsWriter(str(tmp_path / "cp"), mesh, process=0).close()
    t = timings.read_timings(str(tmp_path / "cp"))
    for d in t.devices:
        assert int(d["device"]) == 4 * int(d["dp"]) + 2 * int(d["cp"]) + int(d["tp"])
    assert report.device_labels(t, [6]) == ["device 6 (dp1 pp0 cp1 tp0)"]
    grid = report.mesh_grid(t)
    assert grid.shape == (2, 1, 2, 2) and (grid == 0).all()
    view = report.parallel_view_text([{"first_step": 1, "last_step": 2, "step_time_s": 0.1}], [{0: "ok"}], grid,
                                     t.hosts())
    assert "mesh dp=2 pp=1 cp=2 tp=2" in view and "cp1 tp0" in view.splitlines()[3], view
    old = tmp_path / "old" / "timings"
    old.mkdir(parents=True)
    (old / "devices-0.csv").write_text("process,host,device,dp,pp,tp\n0,h,0,0,0,0\n0,h,1,0,0,1\n")
    t = timings.read_timings(str(tmp_path / "old"))
    assert report.device_labels(t, [1]) == ["device 1 (dp0 pp0 tp1)"] and report.mesh_grid(t).shape == (1, 1, 1, 2)


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



def test_tensorboard_scalars_on_a_full_disk_are_one_warning_and_come_back_in_a_new_file(tmp_path, monkeypatch):
    """A disk that stops taking events (ENOSPC): one warning, the loop never blocks (tensorboardX's
    threaded writer hung it), and once the disk has room the scalars go on in a new event file;
    TensorBoard reads both, the steps in between missing."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    monkeypatch.setattr(timings.TensorBoardScalars, "FLUSH_S", 0.0)  # every record on disk at once
    warned = []
    writer = timings.TensorBoardScalars(str(tmp_path), warned.append)
    losses = {k: float(np.random.default_rng(k).uniform(2, 5)) for k in range(1, 10)}

    class FullDisk:
        def write(self, data=b""):
            raise OSError(28, "No space left on device")

        flush = close = write

    for k in range(1, 10):
        if k == 4:
            writer.writer._py_recordio_writer._writer = FullDisk()
        if k == 7:
            monkeypatch.setattr(timings.TensorBoardScalars, "RETRY_S", 0.0)  # the disk has room again
        writer.record({"step": k, "loss": losses[k]})
    writer.close()
    assert len(warned) == 1 and warned[0].startswith(f"warning: cannot write {tmp_path / 'tensorboard'}: no space left")
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [s.step for s in scalars] == [1, 2, 3, 7, 8, 9]
    np.testing.assert_allclose([s.value for s in scalars], [losses[k] for k in (1, 2, 3, 7, 8, 9)], rtol=1e-6)


def test_the_tensorboard_writer_does_not_import_torch(tmp_path):
    """tensorboardX imports torch when it is installed (seconds on every rank-0 restart); the
    writer hides it. Checked in a fresh interpreter, where nothing has imported torch yet."""
    pytest.importorskip("torch")
    code = ("import sys\n"
            "from megascale_jax.observe.timings import TensorBoardScalars\n"
            "writer = TensorBoardScalars(sys.argv[1])\n"
            "writer.record({'step': 1, 'loss': 2.5})\n"
            "writer.close()\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
            "import torch  # still importable afterwards\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

# ============================================================================ two real processes

# Windows of 8 steps and a stop at 37: the first window (warm-up) and 4 judged ones, the last
# partial, as 10 and 45 gave, 8 steps sooner.
SLOW, STOP_AT, WINDOW = 0.3, 37, 8


@pytest.mark.slow
def test_two_processes_straggler_then_hang(tmp_path):
    """Rank 1 sleeps 30% of a step before each dispatch; rank 0 finishes step 36 and stops itself
    (SIGSTOP) before step 37. Rank 1 runs on until it needs rank 0: it dispatches 37, and may
    dispatch 38 too (the loop reads step k-1's metrics after dispatching k) before it blocks; where
    exactly depends on XLA:CPU's thread pool, whose threads step 37's stuck collectives hold. The
    report names rank 1 the straggler, rank 0 hung, rank 1 waiting where it arrived."""
    from megascale_jax.cluster.rendezvous import free_port

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
        while not _dispatched(run_dir, 1, STOP_AT):
            assert time.time() < deadline, "rank 1 never dispatched the step rank 0 stopped at"
            time.sleep(0.5)
    finally:
        # Running rank 1 first: killed after rank 0, it can see rank 0's sockets close and record
        # itself "failed" before its own SIGKILL lands (seen once in CI). Stopped rank 0 cannot react.
        for p in reversed(procs):
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)

    rank_1_at = _last_arrival(run_dir, 1)  # read from the rows, before the report reads them
    assert rank_1_at in [(STOP_AT, "dispatch"), (STOP_AT + 1, "data_wait"), (STOP_AT + 1, "dispatch")]
    report.write_report(str(run_dir), window=WINDOW, hang_after=0)
    dispatched = rank_1_at[0] - (rank_1_at[1] == "data_wait")  # the heat map's columns: dispatches
    summary, view = check_report_files(run_dir, [0, 1], dispatched)
    flagged = stragglers.find_stragglers(str(run_dir), threshold=0.05, window=WINDOW)
    assert {s["rank"] for s in flagged} == {1}, summary
    assert len(flagged) >= 3, summary  # of the 4 judged windows (the first is warm-up)
    assert "rank 0 on" in summary and "never arrived" in summary, summary
    states = hangs.rank_states(timings.read_timings(run_dir), time.time(), hang_after=0)
    assert [s.status for s in states] == ["hung", "waiting"], summary
    assert states[0].arrived == (STOP_AT, "data_wait") and states[1].arrived == rank_1_at
    assert "r0:hung" in view and "r1:waiting" in view and "r1:slow" in view
    events = [json.loads(line) for line in open(run_dir / "events.jsonl")]
    assert {(e["kind"], e["rank"]) for e in events} == {("straggler", 1)}


def _last_arrival(run_dir, process: int) -> tuple[int, str]:
    """The last (step, phase) `process` arrived at: its last data_wait or dispatch row."""
    with open(os.path.join(timings.timings_dir(run_dir), f"process-{process}.csv")) as f:
        arrivals = [(int(row["step"]), row["phase"]) for row in csv.DictReader(f)
                    if row.get("phase") in ("data_wait", "dispatch")]
    return arrivals[-1]


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
            csv.writer(f).writerows([k, p, -1, -1, -1, -1, -1, phase, f"{start:.6f}", d] for k, phase, start, d in rows)
    t = timings.read_timings(tmp_path)
    states = hangs.rank_states(t, now=float((t.start + t.duration).max()) + 61, hang_after=60)
    assert [s.status for s in states] == ["waiting", "hung", "waiting"], [s.describe() for s in states]
    assert states[1].arrived == (45, "data_wait") and states[0].arrived == (45, "dispatch")


def _killed_run(run_dir, steps=20):
    """A synthetic 2-rank run killed between steps: no done mark, metrics' last line cut mid-write."""
    write_synthetic_run(run_dir, [0.0, 0.0], lambda p, k: 0.0, steps=steps)
    for p in range(2):
        path = os.path.join(timings.timings_dir(run_dir), f"process-{p}.csv")
        lines = [line for line in open(path).read().splitlines() if "state:done" not in line]
        open(path, "w").write("\n".join(lines) + "\n" + f"{steps},{p},-1,-1")  # a torn CSV row too
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": k, "loss": 5.0 - 0.1 * k, "tokens_per_s": 1000.0 + k}) + "\n"
                     for k in range(1, steps + 1))
        f.write('{"step": 21, "loss": 3.')  # cut by the kill


def test_a_killed_run_with_a_torn_metrics_line_is_reported_as_ended_not_hung(tmp_path):
    _killed_run(tmp_path)
    summary = report.write_report(str(tmp_path), hang_after=1)
    for name in ("heatmap.png", "trace.json", "parallel_view.txt", "parallel_view.png", "throughput.png",
                 "loss.png", "summary.txt"):
        assert os.path.getsize(tmp_path / "report" / name) > 0, name
    assert "ENDED WITHOUT FINISHING" in summary and "killed or crashed" in summary, summary
    assert "waiting" not in summary and "HUNG" not in summary and "not written" not in summary, summary
    assert "waiting" not in (tmp_path / "report" / "parallel_view.txt").read_text()


def test_supervisor_faults_and_restarts_appear_in_summary_trace_and_plot(tmp_path):
    """A supervised run whose rank 1 was SIGKILLed at step 8, restarted from step 4, and later
    exited with code 1 (the give-up): exited with its exit code, never 'hung', restarts listed."""
    _killed_run(tmp_path)
    t0 = 1.7e9
    log = [{"time": t0 + 0.85, "kind": "fault", "cause": "crash", "rank": 1, "exit_code": -9, "step": 8,
            "summary": "crash of rank 1 (killed by SIGKILL)"},
           {"time": t0 + 0.9, "kind": "restart", "cause": "crash", "rank": 1, "resume_step": 4,
            "summary": "restart 1/3 from checkpoint step 4 (4 steps lost)"},
           {"time": t0 + 2.2, "kind": "fault", "cause": "crash", "rank": 1, "exit_code": 1, "step": 20,
            "summary": "crash of rank 1 (exit code 1)"},
           {"time": t0 + 2.3, "kind": "give_up", "summary": "supervisor.max_restarts=1 exhausted"}]
    with open(tmp_path / "events.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in log)
        f.write('{"time": 1.7e9, "kind": "fau')  # torn too
    summary = report.write_report(str(tmp_path), hang_after=1)
    assert "EXITED: rank 0 stopped by the supervisor after rank 1 exited; rank 1 exit code 1" in summary, summary
    assert "after 2 fault(s) and 1 restart(s); the supervisor gave up" in summary, summary
    assert "restart 1/3 from checkpoint step 4" in summary and "hung" not in summary.lower(), summary
    trace = json.load(open(tmp_path / "report" / "trace.json"))["traceEvents"]
    markers = [e["name"] for e in trace if e["ph"] == "i" and e.get("s") == "g"]
    assert [m.split(":")[0] for m in markers] == ["fault", "restart", "fault", "give_up"], markers
    assert matplotlib.image.imread(tmp_path / "report" / "throughput.png").std() > 0


def test_a_restarted_run_that_finished_says_so(tmp_path):
    write_synthetic_run(tmp_path, [0.0, 0.0], lambda p, k: 0.0, steps=10)
    with open(tmp_path / "events.jsonl", "w") as f:
        f.write(json.dumps({"time": 1.7e9 + 0.5, "kind": "fault", "cause": "crash", "rank": 0, "exit_code": -9,
                            "step": 5, "summary": "crash of rank 0"}) + "\n")
        f.write(json.dumps({"time": 1.7e9 + 0.6, "kind": "restart", "resume_step": 4, "summary": "restart 1/3"}) + "\n")
    summary = report.write_report(str(tmp_path), hang_after=1)
    assert "run state: finished after 1 fault(s) and 1 restart(s)" in summary, summary


def test_a_section_that_fails_is_named_and_the_rest_is_written(tmp_path, monkeypatch):
    write_synthetic_run(tmp_path, [0.0, 0.0], lambda p, k: 0.0, steps=10)
    monkeypatch.setattr(report, "write_heatmap", lambda *a: (_ for _ in ()).throw(ValueError("broken\nmore")))
    summary = report.write_report(str(tmp_path), hang_after=1)
    assert "heatmap.png: ValueError: broken" in summary and (tmp_path / "report" / "trace.json").exists()


# ============================================================================ pictures


def _add_profiled_steps(run_dir, processes, steps, phases=(("device_compute", 0.06), ("device_collective", 0.02))):
    """Per-device rows of `phases` (as `observe.profile_every` writes them) for `steps`."""
    for p in range(processes):
        with open(os.path.join(timings.timings_dir(run_dir), f"process-{p}.csv"), "a", newline="") as f:
            csv.writer(f).writerows([k, p, 2 * p + tp, p, 0, 0, tp, phase, 1.7e9 + k * STEP, seconds + 0.01 * tp]
                                    for k in steps for tp in range(2) for phase, seconds in phases)


def _write_metrics(run_dir, steps, mfu):
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": k, "loss": 5.0 - 0.1 * k, "tokens_per_s": 1000.0 + k, "mfu": mfu})
                     + "\n" for k in range(1, steps + 1))


def _report_figures(run_dir, monkeypatch, **kwargs) -> dict:
    """write_report's figures by file name, kept after they are saved."""
    figures, save = {}, report.save_figure

    def keep(fig, out, name):
        figures[name] = fig
        save(fig, out, name)

    monkeypatch.setattr(report, "save_figure", keep)
    summary = report.write_report(str(run_dir), hang_after=1, **kwargs)
    assert "not written" not in summary, summary
    return figures


def _shared_label(ax, axis: str) -> str:
    """The axis label, or that of an axes sharing this axis (shared panels label it once)."""
    siblings = (ax.get_shared_x_axes() if axis == "x" else ax.get_shared_y_axes()).get_siblings(ax)
    return next((label for a in siblings if (label := (a.get_xlabel() if axis == "x" else a.get_ylabel()))), "")


def check_figure(name, fig):
    """Every panel: a title, axis labels, a legend or a labelled colour bar, data, and whole-number
    ticks on a step axis. Returns the panels (colour bars left out)."""
    colorbars = {im.colorbar for ax in fig.axes for im in ax.images + ax.collections if im.colorbar}
    panels = [ax for ax in fig.axes if ax not in {cb.ax for cb in colorbars}]
    assert panels, name
    for ax in panels:
        where = f"{name}, panel {ax.get_title()!r}"
        assert fig.get_suptitle() and ax.get_title(), where
        assert _shared_label(ax, "x") and _shared_label(ax, "y"), where
        assert ax.get_legend() or fig.legends or any(
            cb.mappable.axes is ax and cb.ax.get_ylabel() for cb in colorbars), where
        assert any(np.isfinite(np.asarray(line.get_ydata(), float)).any() for line in ax.lines) or \
            any(np.isfinite(im.get_array()).any() for im in ax.images), f"{where}: empty"
        if "step" in _shared_label(ax, "x"):
            low, high = sorted(ax.get_xlim())
            ticks = [x for x in ax.get_xticks() if low <= x <= high]
            assert ticks and all(float(x).is_integer() for x in ticks), f"{where}: step ticks {ticks}"
    return panels


def test_every_picture_is_titled_labelled_keyed_and_has_no_empty_panel(tmp_path, monkeypatch):
    """A short (3-step) run, so that a step axis left to matplotlib would get ticks at 1.5, 2.5."""
    write_synthetic_run(tmp_path, [0.0, 0.0], lambda p, k: 0.3 * (p == 1), steps=3)
    _add_profiled_steps(tmp_path, 2, [2, 3])
    _write_metrics(tmp_path, 3, mfu=None)  # CPU: no peak FLOP/s, so no MFU
    figures = _report_figures(tmp_path, monkeypatch, window=1)
    assert set(figures) == {"heatmap.png", "device_heatmap.png", "parallel_view.png", "throughput.png", "loss.png"}
    for name, fig in figures.items():
        check_figure(name, fig)
        assert matplotlib.image.imread(tmp_path / "report" / name).std() > 0, name
    assert [ax.get_title() for ax in check_figure("heatmap", figures["heatmap.png"])] == \
        ["arrival lateness vs the other ranks", "step time"]
    assert len(check_figure("device heatmap", figures["device_heatmap.png"])) == 2
    # On CPU the throughput figure is the tokens/s panel alone: no empty MFU panel.
    assert [ax.get_ylabel() for ax in check_figure("throughput", figures["throughput.png"])] == ["tokens/s"]
    assert figures["parallel_view.png"].get_suptitle().endswith("steps 1-3 (all 3 windows)")


def test_throughput_has_an_mfu_panel_where_mfu_is_known(tmp_path, monkeypatch):
    write_synthetic_run(tmp_path, [0.0, 0.0], lambda p, k: 0.0, steps=5)
    _write_metrics(tmp_path, 5, mfu=0.42)
    with open(tmp_path / "events.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in (
            {"time": 1.7e9, "kind": "fault", "cause": "crash", "rank": 1, "exit_code": -9, "step": 3},
            {"time": 1.7e9, "kind": "restart", "resume_step": 2},
            {"time": 1.7e9, "kind": "fault", "cause": "crash", "rank": 1, "exit_code": -9, "step": 4}))
    fig = _report_figures(tmp_path, monkeypatch)["throughput.png"]
    top, bottom = check_figure("throughput", fig)
    assert bottom.get_ylabel() == "MFU, %"
    np.testing.assert_allclose(bottom.lines[0].get_ydata(), 42.0)
    assert top.get_legend_handles_labels()[1] == ["tokens/s", "fault", "restart"]  # one entry per kind


def test_loss_is_drawn_against_step_with_the_validation_loss_where_it_was_measured(tmp_path, monkeypatch):
    rng = np.random.default_rng()
    write_synthetic_run(tmp_path, [0.0, 0.0], lambda p, k: 0.0, steps=6)
    losses = 5.0 - np.cumsum(rng.uniform(0.05, 0.2, size=6))
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for k, loss in enumerate(losses, start=1):
            f.write(json.dumps({"step": k, "loss": float(loss), "tokens_per_s": 1000.0,
                                **({"val_loss": float(loss) + 0.3} if k % 3 == 0 else {})}) + "\n")
    (panel,) = check_figure("loss", _report_figures(tmp_path, monkeypatch)["loss.png"])
    train, val = panel.lines
    assert (train.get_label(), val.get_label()) == ("train loss", "validation loss")
    np.testing.assert_array_equal(train.get_xdata(), np.arange(1, 7))
    np.testing.assert_allclose(train.get_ydata(), losses)
    np.testing.assert_array_equal(val.get_xdata(), [3, 6])
    np.testing.assert_allclose(val.get_ydata(), losses[[2, 5]] + 0.3)


def test_the_parallel_view_says_which_windows_it_shows(tmp_path, monkeypatch):
    write_synthetic_run(tmp_path, [0.0, 0.0], lambda p, k: 0.0, steps=8)
    _write_metrics(tmp_path, 8, mfu=None)
    fig = _report_figures(tmp_path, monkeypatch, window=1)["parallel_view.png"]
    panels = check_figure("parallel view", fig)
    assert len(panels) == report.MAX_VIEW_WINDOWS  # one row per window, one stage
    assert "steps 3-8 of 1-8 (the 6 most recent of 8 windows)" in fig.get_suptitle(), fig.get_suptitle()
    assert [ax.get_title() for ax in panels] == [f"steps {k}-{k}, pp=0" for k in range(3, 9)]


def test_a_heat_map_without_data_for_a_panel_leaves_that_panel_out(tmp_path, monkeypatch):
    """One rank has no peers to be late against; devices without collectives have none profiled."""
    write_synthetic_run(tmp_path, [0.0], lambda p, k: 0.0, steps=4)
    _add_profiled_steps(tmp_path, 1, [2, 4], phases=[("device_compute", 0.06)])
    _write_metrics(tmp_path, 4, mfu=None)
    figures = _report_figures(tmp_path, monkeypatch)
    assert [ax.get_title() for ax in check_figure("heatmap", figures["heatmap.png"])] == ["step time"]
    assert [ax.get_title() for ax in check_figure("device heatmap", figures["device_heatmap.png"])] == ["compute"]


def test_the_supervisors_straggler_check_logs_a_late_rank_once_per_window_of_steps(tmp_path):
    """The driver checks the trailing window every `straggler_check_s`: rank 1, late from step 27
    to the end (45), is logged at step 32 and again only once the window has moved past the one
    logged (steps 33-42), not at every check; with evict_stragglers the first is a fault."""
    from megascale_jax.config import load_config
    from megascale_jax.supervise.detect import StragglerWatch
    from megascale_jax.supervise.events import EventLog

    cfg = load_config(None, ["observe.straggler_window=10", "observe.straggler_threshold=0.2",
                             "supervisor.straggler_check_s=1", "supervisor.evict_stragglers=true"])
    watch, faults = StragglerWatch(cfg, str(tmp_path), EventLog(str(tmp_path))), []
    for n, upto in enumerate(range(30, 46)):  # one check per step the run reached
        write_synthetic_run(tmp_path, [0.0, 0.3, -0.2], lambda p, k: 0.3 * (p == 1 and k >= 27), steps=upto)
        faults.append(watch.check(now=10.0 * (n + 1), since=0.0))
    logged = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert [(e["rank"], e["first_step"], e["last_step"]) for e in logged] == [(1, 23, 32), (1, 33, 42)]
    assert [f.rank for f in faults if f] == [1, 1] and faults.index(next(f for f in faults if f)) == 2
    # A restart resumed from step 20 (a new attempt, timings from its start): the rank now in slot 1
    # is judged afresh, not after the window logged in the attempt before.
    write_synthetic_run(tmp_path, [0.0, 0.3, -0.2], lambda p, k: 0.3 * (p == 1 and k >= 27), steps=32)
    assert watch.check(now=1000.0, since=1.0).rank == 1
