"""bench/resilience/ettr.py's accounting, on a hand-written run directory: what each drill cost, and
where the wall time that was not productive went. Expected values are worked out by hand from the events."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is not installed: it imports from the checkout's root, as `python -m bench...` runs

from bench.resilience import ettr  # noqa: E402

T = 1_000_000.0  # the launch's start (time.time())


def write_run(run_dir, events, saves, steps):
    for name, rows in (("events.jsonl", events), ("checkpoints.jsonl", saves), ("metrics.jsonl", steps)):
        with open(os.path.join(run_dir, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def run(tmp_path):
    """Started 40 s after the launch; a kill at step 30 resumed 12 s later from checkpoint 28; a
    straggler flagged 9 s after its drill, evicted and resumed 29.5 s after the drill (as the
    supervisor does, a drill's recovery is timed from the drill); a transient NaN."""
    events = [
        {"time": T + 40, "kind": "started", "step": 1, "since_launch_s": 39.5},
        {"time": T + 100, "kind": "drill", "drill": "kill", "rank": 2, "step": 30},
        {"time": T + 100.1, "kind": "fault", "cause": "crash", "rank": 2, "step": 30, "latency_s": 0.1},
        {"time": T + 102, "kind": "diagnosis", "duration_s": 1.9},
        {"time": T + 102.5, "kind": "verdict", "verdict": "process killed", "rank": 2},
        {"time": T + 103, "kind": "restart", "resume_step": 28, "steps_lost": 2},
        {"time": T + 112, "kind": "resumed", "from_step": 28, "since_fault_s": 12.0, "relaunched_after_fault_s": 3.0,
         "phases_s": {"initialising": 1.0, "compiling": 4.0, "training": 8.0}},
        {"time": T + 200, "kind": "drill", "drill": "slow", "rank": 1, "step": 80},
        {"time": T + 209, "kind": "straggler", "rank": 1},
        {"time": T + 209.5, "kind": "fault", "cause": "straggler", "rank": 1, "step": 84, "latency_s": 0.5},
        {"time": T + 209.6, "kind": "verdict", "verdict": "straggler", "rank": 1},
        {"time": T + 210, "kind": "evict", "rank": 1, "host": "h/slot1", "reason": "50% of a step late"},
        {"time": T + 210, "kind": "spare_promoted", "rank": 1},
        {"time": T + 212, "kind": "restart", "resume_step": 84, "steps_lost": 0},
        {"time": T + 229.5, "kind": "resumed", "from_step": 84, "since_fault_s": 29.5, "relaunched_after_fault_s": 2.5,
         "phases_s": {"initialising": 2.0, "compiling": 9.0, "training": 16.0}},
        {"time": T + 300, "kind": "drill", "drill": "nan", "rank": 0, "step": 120},
        {"time": T + 304, "kind": "nan_triage", "outcome": "transient", "step": 121, "verdict": "transient NaN"},
        {"time": T + 400, "kind": "done"},
    ]
    saves = [{"step": s, "block_s": 0.5, "total_s": 1.0} for s in (28, 56, 84, 112)]
    steps = [{"step": s, "step_time_s": 2.0, "loss": 1.0} for s in range(1, 151)]
    write_run(tmp_path, events, saves, steps)
    with open(tmp_path / "snapshots.jsonl", "w") as f:  # memory snapshots every 7 steps, 0.25 s each
        f.writelines(json.dumps({"step": s, "block_s": 0.25}) + "\n" for s in range(7, 151, 7))
    return tmp_path, events


def test_each_drill_is_costed_from_its_own_events(run):
    _, events = run
    kill, slow, nan = ettr.consequences(events)
    assert (kill["kind"], kill["detected_s"], kill["resumed_s"], kill["steps_lost"], kill["evicted"]) == \
        ("kill", 0.1, 12.0, 2, False)
    assert kill["relaunched_s"] == 3.0 and kill["restart_phases_s"]["compiling"] == 4.0
    # every rank training again: launched at 112 - 12 + 3 = 103, training 8 s later, 11 s after the drill
    assert (kill["training_s"], slow["training_s"]) == (11.0, 2.5 + 16.0)
    assert kill["diagnosis_s"] == 1.9 and slow["diagnosis_s"] is None
    assert (slow["detected_s"], slow["resumed_s"], slow["steps_lost"], slow["evicted"], slow["promoted"]) == \
        (9.0, 29.5, 0, True, True)  # a straggler is detected by its `straggler` event, not the fault
    assert (nan["outcome"], nan["detected_s"], nan["steps_lost"]) == ("transient", 4.0, 0)
    # what each was judged to be, and the eviction with its reason (issue 64 items 4, 5)
    assert [kill["verdicts"], slow["verdicts"], nan["verdicts"]] == [["process killed"], ["straggler"], ["transient NaN"]]
    assert slow["evictions"] == [{"rank": 1, "host": "h/slot1", "reason": "50% of a step late"}]
    assert kill["evictions"] == nan["evictions"] == []
    assert ettr.per_kind([kill, slow, nan])["kill"] == {"n": 1, "detected_s": 0.1, "relaunched_s": 3.0, "training_s": 11.0,
                                                    "resumed_s": 12.0, "steps_lost": 2}


def test_the_budget_names_where_the_unproductive_wall_went(run):
    run_dir, events = run
    busy, records = ettr.productive(str(run_dir))
    assert busy == 300.0
    b = ettr.budget(str(run_dir), T, 400.0, busy, ettr.consequences(events), step_s=2.0)
    # 40 s to the first step done (no phases); 4 saves x 0.5 s; 11 + 18.5 s until every rank trained
    # again (not 12 + 29.5 until a step was done: that step is productive); 2 steps redone x 2 s
    assert (b["startup_s"], b["checkpoint_blocking_s"], b["recovery_s"], b["redone_steps_s"]) == (40.0, 2.0, 29.5, 4.0)
    assert b["snapshot_blocking_s"] == 21 * 0.25
    assert b["other_s"] == pytest.approx(400 - 300 - 40 - 2 - 21 * 0.25 - 29.5 - 4)
    assert b["share_of_wall"]["productive"] == 0.75 and b["share_of_wall"]["startup"] == 0.1
    assert sum(b["share_of_wall"].values()) == pytest.approx(1.0)
    assert (b["checkpoints"], b["checkpoint_block_s_median"]) == (4, 0.5)
    assert b["recovery_before_relaunch_s"] == 5.5  # 3 + 2.5 of the 32 s: detection and diagnostics


def test_saves_in_the_background_block_within_their_steps_not_between_them(run):
    """With checkpoint.background_host_copy the saves' blocking is inside the steps' time (the
    loop runs on while the step is on the devices): reported, not subtracted again."""
    run_dir, events = run
    (run_dir / "config.yaml").write_text("checkpoint:\n  background_host_copy: true\n")
    b = ettr.budget(str(run_dir), T, 400.0, 300.0, ettr.consequences(events), step_s=2.0)
    assert (b["checkpoint_blocking_s"], b["snapshot_blocking_s"]) == (0.0, 0.0)
    assert b["blocking_within_steps_s"] == 2.0 + 21 * 0.25
    assert b["other_s"] == pytest.approx(400 - 300 - 40 - 29.5 - 4)
    assert sum(b["share_of_wall"].values()) == pytest.approx(1.0)


def test_a_run_without_a_started_event_or_checkpoints_still_has_a_budget(tmp_path):
    write_run(tmp_path, [{"time": T + 10, "kind": "done"}], [], [{"step": 1, "step_time_s": 1.0, "loss": 1.0}])
    b = ettr.budget(str(tmp_path), T, 10.0, 1.0, [], step_s=1.0)
    assert b["startup_s"] is None and b["share_of_wall"]["startup"] is None
    assert (b["checkpoint_blocking_s"], b["snapshot_blocking_s"], b["checkpoints"], b["other_s"],
            b["recovery_before_relaunch_s"]) == (0.0, 0.0, 0, 9.0, 0.0)


def test_a_fault_no_drill_caused_is_costed_apart(tmp_path):
    """A stall before the first drill (a false alarm on an overloaded host, or a real fault), then
    a kill whose fault is the drill's, then a second fault in the same drill's window."""
    events = [
        {"time": T + 40, "kind": "started", "step": 1, "since_launch_s": 40.0},
        {"time": T + 90, "kind": "fault", "cause": "stall", "rank": 0, "step": 42, "detail": "no step for 10.2s"},
        {"time": T + 136, "kind": "resumed", "from_step": 40, "since_fault_s": 46.0},
        {"time": T + 200, "kind": "drill", "drill": "kill", "rank": 1, "step": 100},
        {"time": T + 200.1, "kind": "fault", "cause": "crash", "rank": 1, "step": 100, "latency_s": 0.1},
        {"time": T + 215, "kind": "resumed", "from_step": 100, "since_fault_s": 15.0},
        {"time": T + 250, "kind": "fault", "cause": "hang", "rank": 2, "step": 120, "detail": "silent"},
        {"time": T + 270, "kind": "resumed", "from_step": 120, "since_fault_s": 20.0},
        {"time": T + 300, "kind": "done"},
    ]
    write_run(tmp_path, events, [], [{"step": s, "step_time_s": 1.0, "loss": 1.0} for s in range(1, 201)])
    assert [(f["cause"], f["step"], f["resumed_s"]) for f in ettr.undrilled_faults(events)] == [
        ("stall", 42, 46.0), ("hang", 120, 20.0)]
    rows = ettr.consequences(events)
    assert [(r["kind"], r["cause"], r["resumed_s"]) for r in rows] == [("kill", "crash", 15.0)]
    b = ettr.budget(str(tmp_path), T, 300.0, 200.0, rows, step_s=1.0)
    assert (b["recovery_s"], b["undrilled_faults_s"]) == (15.0, 66.0)


def test_a_fault_during_a_drills_recovery_is_part_of_it(tmp_path):
    """A damaged newest checkpoint: the drill's kill, then the restart's restore fails on one
    process (a second fault), and the next attempt resumes from the previous checkpoint. One
    recovery, timed from the drill, and no undrilled fault."""
    events = [
        {"time": T + 40, "kind": "started", "step": 1, "since_launch_s": 40.0},
        {"time": T + 100, "kind": "drill", "drill": "corrupt", "step": 50},
        {"time": T + 100.1, "kind": "fault", "cause": "crash", "rank": 0, "step": 50, "latency_s": 0.1},
        {"time": T + 109, "kind": "fault", "cause": "crash", "rank": 0, "step": 48, "latency_s": 0.0},
        {"time": T + 133, "kind": "resumed", "from_step": 40, "since_fault_s": 24.0},
        {"time": T + 250, "kind": "fault", "cause": "hang", "rank": 2, "step": 120, "detail": "silent"},
        {"time": T + 270, "kind": "resumed", "from_step": 120, "since_fault_s": 20.0},
    ]
    assert [(f["cause"], f["step"]) for f in ettr.undrilled_faults(events)] == [("hang", 120)]
    (row,) = ettr.consequences(events)
    assert (row["kind"], row["resumed_s"], row["steps_lost"]) == ("corrupt", 33.0, 10)


def test_startup_phases_are_the_slowest_process_per_attempt(tmp_path):
    """Each attempt's phases from the workers' `start-up phases:` lines, the slowest process's per
    phase; a worker that never got as far (killed before its line) adds nothing."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "worker0.log").write_text(
        "===== attempt 0, job j-0, slots [0, 1] =====\n[rank 0] start-up phases: trainer 1.50s, restore 0.00s\n"
        "===== attempt 1, job j-1, slots [0, 1] =====\nnoise\n[rank 0] start-up phases: trainer 0.40s, restore 0.90s\n")
    (logs / "worker1.log").write_text(
        "===== attempt 0, job j-0, slots [0, 1] =====\nstart-up phases: trainer 1.25s, restore 0.00s\n"
        "===== attempt 1, job j-1, slots [0, 1] =====\nstart-up phases: trainer 0.70s, restore 0.30s\n"
        "===== attempt 2, job j-2, slots [0, 1] =====\nkilled early\n")
    assert ettr.startup_phases(str(tmp_path)) == [{"attempt": 0, "trainer": 1.5, "restore": 0.0},
                                                  {"attempt": 1, "trainer": 0.7, "restore": 0.9}]


def test_each_restart_names_where_its_state_came_from(run):
    """Rank 0's log of the attempt that resumed after a drill says the source: the kill's attempt 1
    restored rank 2 from a peer's copy, the straggler's attempt 2 read a checkpoint; a NaN replay
    restarts nothing."""
    run_dir, events = run
    events = [dict(e, restarts=1 if e["time"] < T + 150 else 2) if e["kind"] == "resumed" else e for e in events]
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "worker0.log").write_text(
        "===== attempt 0, job j-0, slots [0, 1, 2, 3] =====\n[rank 0] mesh ...; initialised\n"
        "===== attempt 1, job j-1, slots [0, 1, 4, 3] =====\n"
        "[rank 0] process 2 restored its memory snapshot of step 28 from the copy held by process 3 (vm/slot3)\n"
        "[rank 0] mesh ...; resumed from memory snapshot step 28; initialised\n"
        "===== attempt 2, job j-2, slots [0, 5, 4, 3] =====\n[rank 0] mesh ...; resumed from checkpoint step 84;\n")
    rows = ettr.consequences(events)
    ettr.add_restore_sources(str(run_dir), events, rows)
    assert [(r["kind"], r["restore_source"]) for r in rows] == [("kill", "peer copy"), ("slow", "disk"), ("nan", None)]


def test_what_the_faults_cost_and_the_fault_rate_each_target_allows():
    """Reference: 990 s of steps in 1000 s of wall (ETTR 99%). Drilled: 900 s in 1000 s with 4
    faults: 90 s lost beyond the reference's 10 s, 22.5 s per fault. ETTR >= 97% leaves the faults
    2% of the wall: one every 22.5 / 0.02 = 1125 s; >= 95%, 4%: every 562.5 s. With a fault every
    120-300 s (210 s on average) from start to end: 99% - 22.5 / 210. Goodput: the drilled run's
    1500 steps at the reference's 0.6 s median in its 1000 s of wall."""
    reference = {"wall_s": 1000.0, "productive_s": 990.0, "ettr": 0.99, "final_loss": 2.0, "step_s_median": 0.6}
    result = {"wall_s": 1000.0, "productive_s": 900.0, "faults_fired": 4, "final_loss": 2.0, "fault_every_s": [120, 300],
              "steps": 1500}
    got = ettr.compare(result, reference)
    assert got["goodput"] == pytest.approx(0.9)
    assert got["final_loss_equal"] and got["fault_cost_s"] == pytest.approx(90.0)
    assert got["fault_cost_per_fault_s"] == pytest.approx(22.5)
    assert got["mtbf_for_97_s"] == pytest.approx(1125.0) and got["mtbf_for_95_s"] == pytest.approx(562.5)
    assert got["ettr_at_mean_fault_interval"] == pytest.approx(0.99 - 22.5 / 210)
    assert ettr.compare(result, {**reference, "ettr": 0.96})["mtbf_for_97_s"] is None


def test_a_reference_is_borrowed_only_from_a_fault_free_run_of_the_same_job(tmp_path, capsys):
    """Another seed's fault-free run serves a result of the same job (overrides, processes, steps):
    compared as if run for it, and marked borrowed; from another job, or from a result without one,
    one line and exit 2, the result unchanged."""
    job = {"config": ["mesh.dp=2", "train.steps=1500"], "nprocs": 2, "steps": 1500}
    reference = {"wall_s": 1000.0, "productive_s": 990.0, "ettr": 0.99, "final_loss": 2.0, "step_s_median": 0.6,
                 "goodput": 0.92}
    paths = {name: tmp_path / f"{name}.json" for name in ("drilled", "seed0", "other_job", "none")}
    docs = {"drilled": {**job, "wall_s": 1000.0, "productive_s": 900.0, "faults_fired": 4, "final_loss": 2.0,
                        "fault_every_s": [120, 300], "reference": None},
            "seed0": {**job, "reference": reference}, "other_job": {**job, "nprocs": 4, "reference": reference},
            "none": {**job, "reference": None}}
    for name, doc in docs.items():
        paths[name].write_text(json.dumps(doc))
    for lender, why in (("other_job", "its nprocs differ"), ("none", "it has none")):
        with pytest.raises(SystemExit) as stop:
            ettr.reference_for(str(paths["drilled"]), str(paths[lender]))
        assert stop.value.code == 2 and why in capsys.readouterr().err
        assert json.loads(paths["drilled"].read_text()) == docs["drilled"]
    ettr.reference_for(str(paths["drilled"]), str(paths["seed0"]))
    got = json.loads(paths["drilled"].read_text())
    assert got["reference"]["borrowed_from"] == os.path.relpath(paths["seed0"])
    assert got["final_loss_equal"] and got["fault_cost_per_fault_s"] == pytest.approx(22.5)
    assert got["goodput"] == pytest.approx(1500 * 0.6 / 1000)
    paths["seed2"] = tmp_path / "seed2.json"  # borrowed from a borrower: still named by the run's own file
    paths["seed2"].write_text(json.dumps(docs["drilled"]))
    ettr.reference_for(str(paths["seed2"]), str(paths["drilled"]))
    assert json.loads(paths["seed2"].read_text())["reference"]["borrowed_from"] == os.path.relpath(paths["seed0"])


def test_start_up_ends_when_every_rank_trains_not_when_the_first_step_is_done(tmp_path):
    """`started` comes once a step is done (at T + 40, 39.5 s after the launch at T + 0.5); every
    rank was training 31 s after that launch, so start-up is 31.5 s and the step is productive."""
    events = [{"time": T + 40, "kind": "started", "step": 1, "since_launch_s": 39.5,
               "phases_s": {"initialising": 3.0, "compiling": 20.0, "training": 31.0}}, {"time": T + 50, "kind": "done"}]
    write_run(tmp_path, events, [], [{"step": s, "step_time_s": 1.0, "loss": 1.0} for s in range(1, 11)])
    b = ettr.budget(str(tmp_path), T, 50.0, 10.0, [], step_s=1.0)
    assert b["startup_s"] == 31.5 and b["other_s"] == pytest.approx(50 - 10 - 31.5)


def test_slow_spells_are_the_runs_of_windows_over_the_quiet_step():
    """Steps of 0.5 s with 0.8 s from step 201 to 300 and one slow step at 50 (a restart's first
    step, not a spell): one spell, its steps and median."""
    times = [0.5] * 400
    times[49] = 3.0
    times[200:300] = [0.8] * 100
    records = [{"step": n + 1, "step_time_s": t} for n, t in enumerate(times)]
    assert ettr.slow_spells(records) == [[201, 300, 0.8]]
    assert ettr.slow_spells(records[:10]) == []


def test_cpu_load_counts_a_reaped_grandchild_as_the_job():
    """The job: a process whose child burns 0.3 s of CPU and is reaped before the job ends (its time
    is then the job's reaped children's). Counted by CPU time, not by the wall clock."""
    from bench.resilience.cpu_load import CpuLoad, process_table, tree_ticks

    burn = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass"
    job = subprocess.Popen([sys.executable, "-c", f"import subprocess,sys; subprocess.run([sys.executable,'-c',{burn!r}])"])
    with CpuLoad(job.pid, every_s=0.05) as load:
        job.wait()
    assert load.summary()["job_core_s"] >= 0.3
    table = {10: (1, 5), 11: (10, 7), 12: (11, 3), 13: (1, 100)}  # 13 is not under 10
    assert tree_ticks(10, table) == 15
    assert os.getpid() in process_table()


def test_cpu_samples_are_kept_as_ten_second_averages_weighted_by_length():
    from bench.resilience.cpu_load import binned

    samples = [{"t": 4.0, "dt": 4.0, "job_cores": 2.0, "foreign_cores": 0.0, "steal_cores": 0.0},
               {"t": 9.0, "dt": 5.0, "job_cores": 0.2, "foreign_cores": 1.0, "steal_cores": 0.5},
               {"t": 12.0, "dt": 3.0, "job_cores": 1.0, "foreign_cores": 0.3, "steal_cores": 0.0}]
    assert binned(samples) == [[9.0, 1.0, 0.56, 0.28], [12.0, 1.0, 0.3, 0.0]]
