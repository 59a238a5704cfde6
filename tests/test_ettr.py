"""bench/ettr.py's accounting, on a hand-written run directory: what each drill cost, and where the
wall time that was not productive went. Expected values are worked out by hand from the events."""

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import ettr  # noqa: E402

T = 1_000_000.0  # the launch's start (time.time())


def write_run(run_dir, events, saves, steps):
    for name, rows in (("events.jsonl", events), ("checkpoints.jsonl", saves), ("metrics.jsonl", steps)):
        with open(os.path.join(run_dir, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def run(tmp_path):
    """Started 40 s after the launch; a kill at step 30 resumed 12 s later from checkpoint 28; a
    straggler flagged 9 s after its drill, evicted and resumed 20 s after the flag; a transient NaN."""
    events = [
        {"time": T + 40, "kind": "started", "step": 1, "since_launch_s": 39.5},
        {"time": T + 100, "kind": "drill", "drill": "kill", "rank": 2, "step": 30},
        {"time": T + 100.1, "kind": "fault", "cause": "crash", "rank": 2, "step": 30, "latency_s": 0.1},
        {"time": T + 103, "kind": "restart", "resume_step": 28, "steps_lost": 2},
        {"time": T + 112, "kind": "resumed", "from_step": 28, "since_fault_s": 12.0},
        {"time": T + 200, "kind": "drill", "drill": "slow", "rank": 1, "step": 80},
        {"time": T + 209, "kind": "straggler", "rank": 1},
        {"time": T + 209.5, "kind": "fault", "cause": "straggler", "rank": 1, "step": 84, "latency_s": 0.5},
        {"time": T + 210, "kind": "evict", "rank": 1},
        {"time": T + 210, "kind": "spare_promoted", "rank": 1},
        {"time": T + 212, "kind": "restart", "resume_step": 84, "steps_lost": 0},
        {"time": T + 229.5, "kind": "resumed", "from_step": 84, "since_fault_s": 20.0},
        {"time": T + 300, "kind": "drill", "drill": "nan", "rank": 0, "step": 120},
        {"time": T + 304, "kind": "nan_triage", "outcome": "transient", "step": 121},
        {"time": T + 400, "kind": "done"},
    ]
    saves = [{"step": s, "block_s": 0.5, "total_s": 1.0} for s in (28, 56, 84, 112)]
    steps = [{"step": s, "step_time_s": 2.0, "loss": 1.0} for s in range(1, 151)]
    write_run(tmp_path, events, saves, steps)
    return tmp_path, events


def test_each_drill_is_costed_from_its_own_events(run):
    _, events = run
    kill, slow, nan = ettr.consequences(events)
    assert (kill["kind"], kill["detected_s"], kill["resumed_s"], kill["steps_lost"], kill["evicted"]) == \
        ("kill", 0.1, 12.0, 2, False)
    assert (slow["detected_s"], slow["resumed_s"], slow["steps_lost"], slow["evicted"], slow["promoted"]) == \
        (9.0, 20.0, 0, True, True)  # a straggler is detected by its `straggler` event, not the fault
    assert (nan["outcome"], nan["detected_s"], nan["steps_lost"]) == ("transient", 4.0, 0)
    assert ettr.per_kind([kill, slow, nan])["kill"] == {"n": 1, "detected_s": 0.1, "resumed_s": 12.0, "steps_lost": 2}


def test_the_budget_names_where_the_unproductive_wall_went(run):
    run_dir, events = run
    busy, records = ettr.productive(str(run_dir))
    assert busy == 300.0
    b = ettr.budget(str(run_dir), T, 400.0, busy, ettr.consequences(events), step_s=2.0)
    # 40 s to the first step; 4 saves x 0.5 s; 12 + 20 s of recovery; 2 steps redone x 2 s
    assert (b["startup_s"], b["checkpoint_blocking_s"], b["recovery_s"], b["redone_steps_s"]) == (40.0, 2.0, 32.0, 4.0)
    assert b["other_s"] == pytest.approx(400 - 300 - 40 - 2 - 32 - 4)
    assert b["share_of_wall"]["productive"] == 0.75 and b["share_of_wall"]["startup"] == 0.1
    assert sum(b["share_of_wall"].values()) == pytest.approx(1.0)
    assert (b["checkpoints"], b["checkpoint_block_s_median"]) == (4, 0.5)


def test_a_run_without_a_started_event_or_checkpoints_still_has_a_budget(tmp_path):
    write_run(tmp_path, [{"time": T + 10, "kind": "done"}], [], [{"step": 1, "step_time_s": 1.0, "loss": 1.0}])
    b = ettr.budget(str(tmp_path), T, 10.0, 1.0, [], step_s=1.0)
    assert b["startup_s"] is None and b["share_of_wall"]["startup"] is None
    assert (b["checkpoint_blocking_s"], b["checkpoints"], b["other_s"]) == (0.0, 0, 9.0)
