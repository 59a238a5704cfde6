"""The verdict on every drill kind (supervise/verdict.py, issue 64 item 4), from the evidence each
drill leaves — the detector's Fault, the exit code, the diagnostics workers' results as they write
them to Redis — and what is excluded for it (item 5: a transient fault never excludes its slot).

The expected verdicts are written by hand from what each drill injects (supervise/drills.py), as
docs/supervision.md's table says them; no processes. The same verdicts on real drills: kill, stop,
redis, nan and host in tests/supervise/test_supervisor.py's drill fixtures.
"""

import json
import signal
import types

import pytest

from megascale_jax.config import load_config
from megascale_jax.supervise import diagnose
from megascale_jax.supervise.detect import Fault, log_worker_events
from megascale_jax.supervise.drills import Drill, Drills
from megascale_jax.supervise.events import EventLog
from megascale_jax.supervise.placement import Placement, Shape
from megascale_jax.supervise.policy import Restart, Shrink, Spare
from megascale_jax.supervise.supervisor import Job, Supervisor
from megascale_jax.supervise.transport import RedisLink
from megascale_jax.supervise.verdict import KINDS, host_lost, judge

OVERRIDES = ["model.layers=2", "mesh.dp=2", "mesh.tp=1", "mesh.pp=1", "train.global_batch=8",
             "supervisor.evict_stragglers=true"]
KILLED = "killed by SIGKILL"


def result(rank, blamed=(), ok=True, seconds=0.01):
    """One diagnostics worker's result, as worker_main writes it to Redis (2 ranks over dp)."""
    return {"rank": rank, "host": "h", "pid": 100 + rank, "self_test": {"ok": ok, "seconds": seconds, "gflops": 3.0},
            "axes": {"dp": {"ok": not blamed, "errors": [], "blamed_ranks": list(blamed), "allreduce_ms": 1.0,
                            "busbw_gbps": 0.5}}}


HEALTHY = diagnose.Report(2, {0: result(0), 1: result(1)}, {}, 0.5)
# `faulty:1`: rank 1 adds 1000 to its values; both ranks' all-gathers see its slot wrong.
WRONG_VALUES = diagnose.Report(2, {0: result(0, blamed=[1]), 1: result(1, blamed=[1])}, {}, 0.5)


class Group:
    """The signals a drill sends, kept instead of sent."""

    def __init__(self):
        self.sent = []

    def signal(self, rank, sig):
        self.sent.append((rank, sig))


@pytest.fixture
def make(tmp_path, monkeypatch):
    """A supervisor on 2 ranks + `spares` (only its decision and bookkeeping: no processes, no
    Redis), the `drill` fired at step 9; diagnose.run answers `report`, its calls kept."""
    def build(drill, report=HEALTHY, spares=1):
        cfg = load_config(None, OVERRIDES)
        s = Supervisor.__new__(Supervisor)
        s.job = Job(cfg, str(tmp_path), 2, [], "job", {}, diagnose_args=[])
        s.events, s.faults, s.diagnose_pool = EventLog(str(tmp_path)), [], None
        s.placement, s.shape, s.devices_per_process = Placement(2, spares, host="h"), Shape(2, 2, 1), 1
        s.redis = types.SimpleNamespace(url="redis://unused")
        s.drills = Drills([Drill.parse(drill)] if drill else [], cfg, str(tmp_path))
        if drill:
            assert s.drills.fire(Group(), {0: {"state": "training"}, 1: {"state": "training"}}, 9, s.placement, 2,
                                 None, 0.0)
        s.calls = []
        monkeypatch.setattr(diagnose, "run", lambda *args, **kw: s.calls.append(args) or report)
        return s
    return build


def decided(s, fault, restarts=0):
    """The supervisor's action for `fault` and the verdict event it logged."""
    s.faults.append(fault)
    action = s._decide(fault, restarts)
    with open(s.events.path) as f:
        verdicts = [e for e in map(json.loads, f) if e["kind"] == "verdict"]
    assert len(verdicts) == 1, verdicts
    return action, verdicts[0]


def crash(rank, code=-signal.SIGKILL, cause="crash", detail=KILLED, error=""):
    return Fault(cause, rank, detail, at=10.0, detected=10.1, step=9, exit_code=code, error=error)


def test_a_lost_host_is_host_lost_and_never_wrong_values(make):
    """Issue 64's report: a lost host read as "wrong values in collectives over dp (seen by rank
    0)". The `host` drill broke the slot like `faulty`'s, so a stand-in process there fed wrong
    values into the diagnostics. Now the lost slot is unreachable: no diagnostics run (they need
    every host), the verdict names the lost host and its killed process, its slot is excluded."""
    s = make("host:1@9")
    assert s.drills.diagnosis_env(s.placement) == {}  # nothing there contributes wrong values
    action, said = decided(s, crash(1))
    assert s.calls == []  # diagnostics not run: one host of the mesh is gone
    why = host_lost("h/slot1")
    assert action == Spare({1: why})
    assert (said["verdict"], said["rank"], said["excluded"], said["action"]) == ("host lost", 1, {"1": why}, "spare")
    assert said["summary"] == f"host lost: rank 1: h/slot1 unreachable, its processes and memory gone; its process " \
                              f"{KILLED}; excluded: rank 1 ({why})"
    assert "wrong values" not in said["summary"]


def test_a_lost_host_with_no_spare_left_shrinks_the_job(make):
    s = make("host:1@9", spares=0)
    action, said = decided(s, crash(1))
    assert action == Shrink({1: host_lost("h/slot1")}, Shape(1, 1, 2)) and said["verdict"] == "host lost"


def test_a_faulty_slot_is_a_faulty_device_named_by_its_peer(make):
    s = make("faulty:1@9", report=WRONG_VALUES)
    assert s.drills.diagnosis_env(s.placement) == {diagnose.FAULT_ENV: "1"}
    action, said = decided(s, crash(1))
    assert len(s.calls) == 1
    why = "wrong values in collectives over dp (seen by rank 0)"
    assert action == Spare({1: why})
    assert said["summary"] == f"faulty device: rank 1: fails diagnostics: {why}; its process {KILLED}; " \
                              f"excluded: rank 1 ({why})"


def test_a_killed_process_is_process_killed_and_keeps_its_slot(make):
    action, said = decided(make("kill:1@9"), crash(1))
    assert action == Restart() and said["excluded"] == {} and said["action"] == "restart"
    assert said["summary"] == f"process killed: rank 1: {KILLED}; diagnostics: every rank healthy; no slot excluded"


def test_two_broken_slots_at_once_are_both_named(make):
    s = make(None, report=diagnose.Report(2, {0: result(0, blamed=[0, 1]), 1: result(1, blamed=[0, 1])}, {}, 0.5),
             spares=2)
    s.drills.broken_slots = {0, 1}
    assert s.drills.diagnosis_env(s.placement) == {diagnose.FAULT_ENV: "0,1"}  # before: rank 0's only
    action, said = decided(s, crash(0))
    assert action == Spare({0: "wrong values in collectives over dp (seen by rank 0)",
                            1: "wrong values in collectives over dp (seen by rank 0)"})
    assert (said["verdict"], said["rank"], sorted(said["excluded"])) == ("faulty device", 0, ["0", "1"])


# Each drill kind's evidence, recorded as the detector and the diagnostics give it, and the
# verdict and exclusion expected (docs/supervision.md, "What each drill is judged to be").
DRILLS = [
    # (drill, the fault detected, the diagnostics' findings (None: not run), verdict, excluded)
    ("kill", crash(1), {}, "process killed", False),
    ("host", crash(1), {1: host_lost("h/slot1")}, "host lost", True),
    ("faulty", crash(1), WRONG_VALUES.faulty(), "faulty device", True),
    ("slow", Fault("straggler", 1, "50% of a step late over steps 11-20 (threshold 20%)", 10.0, 10.1, step=20),
     {}, "straggler", True),
    ("stop", Fault("hang", 0, "no heartbeat for 4.1s (last state training, step 9)", 10.0, 14.1, step=9), {},
     "hang", False),
    # `corrupt`: rank 0 killed (judged as `kill`), then the restart finds the damage (exit code 4)
    ("corrupt", crash(1, 4, "unreadable_checkpoint", "the newest checkpoint is unreadable (see its log)",
                      "error: checkpoint step 16 is unreadable on process 1: state: checksum mismatch"), None,
     "damaged checkpoint", False),
    # a NaN that does not replay finite: a fault, diagnosed, not retried on healthy devices
    ("nan (diverged)", crash(0, 3, "diverged", "non-finite loss or gradient norm (see its log)"), {}, "diverged",
     False),
]


@pytest.mark.parametrize("drill, fault, findings, kind, excluded", DRILLS, ids=[d[0] for d in DRILLS])
def test_each_drill_kind_is_judged_as_what_was_injected(drill, fault, findings, kind, excluded):
    cfg = load_config(None, OVERRIDES)
    from megascale_jax.supervise import policy

    slots = policy.Slots(spares=1, healthy=3, shape=Shape(2, 2, 1), devices_per_process=1)
    action = policy.decide(fault, None, 0, cfg, slots, faulty=findings)
    evicted = getattr(action, "evict", {})
    said = judge(fault, findings, evicted)
    assert said.kind == kind and said.rank == fault.rank, said
    assert bool(evicted) == excluded == KINDS[kind], (action, said)  # transient faults keep their slot
    assert said.summary.startswith(f"{kind}: rank {fault.rank}: ")
    assert ("wrong values" in said.summary) == (drill == "faulty")  # a dead process or host never is


def test_a_transient_nan_says_its_verdict_and_excludes_nothing(tmp_path):
    """`nan:1`: the workers replay the step, finite, and say so in their heartbeats (every rank
    the same triage, with its own self-test). One `nan_triage` event with the verdict, no fault;
    a failed self-test instead is a faulty device (the driver's fault, its slot excluded)."""
    events = EventLog(str(tmp_path))

    def monitor(ok):
        triage = {"id": 1, "kind": "nan_triage", "outcome": "transient", "step": 3, "loss": 2.5,
                  "self_test": {"ok": ok, "seconds": 0.01, "gflops": 3.0}}
        return types.SimpleNamespace(records={r: {"events": [triage]} for r in (0, 1)}, events_seen=set(),
                                     triaged=set())

    assert log_worker_events(monitor(True), events) is None
    fault = log_worker_events(monitor(False), events)
    with open(events.path) as f:
        logged = [json.loads(line) for line in f]
    assert [e.get("verdict") for e in logged] == ["transient NaN", None]
    assert (fault.cause, fault.rank) == ("device", 0)
    said = judge(fault, {}, {0: fault.detail})
    assert said.kind == "faulty device" and "self-test failed after a transient NaN at step 3" in said.summary


def test_a_damaged_checkpoint_gone_past_in_the_attempt_says_its_verdict_once(tmp_path):
    """`corrupt` when the damage reads as wrong values: every process finds the mismatch, moves the
    checkpoint aside and restores the one before in the same attempt (no exit 4, no restart), and
    says so in its heartbeat; the driver logs it once, with the verdict that names the fault."""
    events = EventLog(str(tmp_path))
    found = {"id": 0, "kind": "damaged_checkpoint", "step": 16, "error": "checksum mismatch in 1 arrays, e.g. .step"}
    monitor = types.SimpleNamespace(records={r: {"events": [found]} for r in (0, 1)}, events_seen=set(), triaged=set())
    assert log_worker_events(monitor, events) is None
    assert log_worker_events(monitor, events) is None  # seen: not again
    with open(events.path) as f:
        logged = [json.loads(line) for line in f]
    assert [(e["kind"], e["verdict"], e["step"]) for e in logged] == [("damaged_checkpoint", "damaged checkpoint", 16)]
    assert "checksum mismatch" in logged[0]["summary"] and "in this attempt" in logged[0]["summary"]


def test_a_dead_redis_says_its_verdict(tmp_path):
    """`redis`: the embedded server killed; the driver restarts it, no fault, no restart."""
    class Server:
        started = False

        def alive(self):
            return self.started

        def start(self):
            self.started = True

    link = RedisLink.__new__(RedisLink)
    link.server, link.events, link.restarted_at = Server(), EventLog(str(tmp_path)), None
    link.keep_alive(types.SimpleNamespace(grace=lambda now: None), now=5.1, died_at=5.0)
    with open(link.events.path) as f:
        (restart,) = [json.loads(line) for line in f]
    assert (restart["kind"], restart["verdict"]) == ("redis_restart", "Redis lost")
