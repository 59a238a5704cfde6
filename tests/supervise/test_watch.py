"""The SLURM step's hang watcher (supervise/watch.py) without a cluster: its decision on fake
heartbeats and clocks, the event it records and the scancel it runs. The watcher under a real
scheduler, with a task wedged: tests/cluster/test_slurm.py."""

import json

from megascale_jax.cluster.rendezvous import heartbeat_key
from megascale_jax.supervise import watch
from megascale_jax.supervise.detect import HeartbeatMonitor
from megascale_jax.supervise.events import EventLog

JOB = "slurm-7-0"


class FakeRedis:
    """What the monitor reads: MGET of the heartbeat keys."""

    def __init__(self):
        self.values = {}

    def mget(self, keys):
        return [self.values.get(k) for k in keys]


class Step:
    """Two tasks beating every second (seq always advances, as the heartbeat thread's does)."""

    def __init__(self, tmp_path, hang_timeout_s=10.0, startup_timeout_s=300.0):
        self.redis, self.seq, self.t = FakeRedis(), 0, 0.0
        monitor = HeartbeatMonitor(self.redis, JOB, 2, hang_timeout_s, startup_timeout_s, now=0.0)
        self.watch = watch.StepWatch(monitor, EventLog(str(tmp_path)))

    def beat(self, states, steps, ranks=(0, 1), **fields):
        self.seq += 1
        for rank in ranks:
            record = {"rank": rank, "pid": 1, "host": "h", "seq": self.seq, "time": 0.0, "state": states[rank],
                      "step": steps[rank], **fields}
            self.redis.values[heartbeat_key(JOB, rank)] = json.dumps(record).encode()

    def run(self, seconds, states, steps, **fields):
        """Beat and judge every second for `seconds`; the first fault, or None."""
        for _ in range(int(seconds)):
            self.t += 1.0
            self.beat(states, steps, **fields)
            if fault := self.watch.judge(self.t):
                return fault
        return None


def test_a_step_that_stops_while_heartbeats_go_on_is_a_stall_after_the_hang_timeout_not_in_startup(tmp_path):
    step = Step(tmp_path)
    # Joining, restoring and compiling for 60 s (over the 10 s timeout), heartbeats going on: start-up.
    assert step.run(20, ("initialising",) * 2, (0, 0)) is None
    assert step.run(40, ("compiling",) * 2, (10, 10)) is None  # restored at 10, compiling
    # The first step after compiling may take the startup time; then steps every second.
    assert step.run(30, ("training",) * 2, (10, 10)) is None
    for s in range(11, 20):
        assert step.run(1, ("training",) * 2, (s, s)) is None
    # A checkpoint longer than the timeout restarts the step clock: no stall.
    assert step.run(15, ("checkpointing",) * 2, (19, 19)) is None
    assert step.run(1, ("training",) * 2, (20, 20)) is None
    # Then rank 1 deadlocks before step 22 and rank 0 waits in its collective: both keep beating.
    assert step.run(1, ("training",) * 2, (21, 21)) is None
    wedged_at = step.t
    fault = step.run(30, ("training",) * 2, (21, 21))
    assert fault.cause == "stall" and fault.at == wedged_at
    assert 10.0 < fault.detected - wedged_at <= 11.0  # supervisor.hang_timeout_s, the stall floor
    event = step.watch.record(fault, fault.detected, job=JOB, restarts=0, slurm_steps=["7.0"])
    [written] = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert written == json.loads(json.dumps(event))
    assert written["kind"] == "fault" and written["detected_by"] == "watch" and written["step"] == 21
    assert written["stuck_ranks"] == [0, 1] and written["ranks"]["1"]["state"] == "training"
    assert written["ranks"]["1"]["no_progress_s"] == 11.0 and written["ranks"]["1"]["silent_s"] == 0.0
    assert written["summary"].startswith("stall of rank ") and "no progress on rank(s) 0, 1" in written["summary"]


def test_silence_is_a_hang_a_stop_request_is_not_judged_and_done_ranks_are_not_hung(tmp_path):
    step = Step(tmp_path)
    assert step.run(5, ("training",) * 2, (5, 5)) is None
    for s in range(6, 9):
        assert step.run(1, ("training",) * 2, (s, s)) is None
    # Rank 1 stopped (SIGSTOP): its record stops changing.
    silent_from = step.t
    for _ in range(12):
        step.t += 1.0
        step.beat(("training",) * 2, (8, 8), ranks=(0,))
        if fault := step.watch.judge(step.t):
            break
    assert (fault.cause, fault.rank, fault.at) == ("hang", 1, silent_from)
    assert step.watch.stuck(step.t) == [0, 1]

    # Every task asked to stop (scancel, a preemption): checkpointing the step in flight, then
    # `interrupted`, beats ending as they exit: nothing is judged.
    step = Step(tmp_path / "stop")
    for s in range(1, 6):
        assert step.run(1, ("training",) * 2, (s, s)) is None
    step.run(1, ("interrupted", "training"), (5, 5))
    assert step.run(60, ("interrupted", "training"), (5, 5)) is None

    # A rank done waits for its peers at JAX's shutdown: not hung, however long.
    step = Step(tmp_path / "done")
    for s in range(1, 6):
        assert step.run(1, ("training",) * 2, (s, s)) is None
    assert step.run(1, ("done", "training"), (5, 6)) is None
    assert step.run(1, ("done", "done"), (5, 6)) is None
    assert step.watch.judge(step.t + 600) is None


def test_an_end_said_in_a_heartbeat_is_judged_at_once_a_raised_loop_after_the_exit_grace(tmp_path):
    step = Step(tmp_path)
    assert step.run(5, ("compiling",) * 2, (10, 10)) is None
    fault = step.run(1, ("compiling", "unreadable_checkpoint"), (10, 10), error="error: checkpoint 10 is unreadable")
    assert (fault.cause, fault.rank, fault.error) == ("unreadable_checkpoint", 1, "error: checkpoint 10 is unreadable")

    step = Step(tmp_path / "raised")
    for s in range(1, 4):
        assert step.run(1, ("training",) * 2, (s, s)) is None
    raised_at = step.t + 1.0
    fault = step.run(10, ("training", "failed"), (3, 3))
    assert fault.cause == "crash" and fault.rank == 1 and fault.detected - raised_at >= watch.EXIT_GRACE_S


def test_end_step_sigkills_the_step_of_that_name():
    calls = []

    class Done:
        def __init__(self, stdout="", returncode=0):
            self.stdout, self.returncode = stdout, returncode

    def run(argv, **_):
        calls.append(argv)
        if argv[0] == "squeue":
            return Done("7.batch batch\n7.2 slurm-7-0.1-diagnose\n7.3 slurm-7-0.1\n")
        return Done()

    assert watch.end_step("7", "slurm-7-0.1", run=run) == ["7.3"]
    assert calls == [["squeue", "-h", "--steps", "-j", "7", "-o", "%i %j"], ["scancel", "--signal=KILL", "7.3"]]
    assert watch.end_step("7", "gone", run=run, tries=1) == []


def test_outside_a_slurm_job_the_watcher_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    code = watch.main(["--run-dir", str(tmp_path), "--redis", "redis://127.0.0.1:1", "--job", JOB, "--nprocs", "2"])
    assert code == 2
    assert capsys.readouterr().err == "error: no SLURM job: run inside one (SLURM_JOB_ID) or pass --slurm-job\n"
