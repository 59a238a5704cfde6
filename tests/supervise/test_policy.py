"""The supervisor's recovery decision (supervise/policy.py) as a table: a fault, the one before it,
the restarts so far, the config, the slots and the diagnostics' verdict in; the action out.

The expected actions are written from the rules in policy.py's docstring (and the give-up
messages the driver prints), not computed: no processes, no Redis, no files.

The config is tiny_cpu's: mesh dp=4 x tp=2 (8 devices), train.global_batch=16, one microbatch,
supervisor.max_restarts=3, on_no_spare=shrink. With 4 processes (2 devices each) a replica holds
4 rows per microbatch; shrinking keeps those 4 rows and the 16-row global batch: dp=3 does not
divide it (16 % 12), so the next shape is dp=2 on 2 processes with 2 microbatches.
"""

import signal

import pytest

from megascale_jax.config import load_config
from megascale_jax.supervise.detect import Fault
from megascale_jax.supervise.placement import Shape
from megascale_jax.supervise.policy import Diagnose, Done, GiveUp, Restart, Shrink, Slots, Spare, decide

FOUR = Shape(nprocs=4, dp=4, microbatches=1)
ABORT = "F1122 17:01:02.123456   48213 hlo_instruction.cc:1615] Invalid binary instruction opcode copy"
ABORT_AGAIN = "F1123 09:12:44.000001     771 hlo_instruction.cc:1615] Invalid binary instruction opcode copy"
CONFIG_ERROR = "a worker rejected the config or data (see its log); not retried"
DIVERGED = ("non-finite loss, again when the worker replayed the step, with healthy devices: a restart would "
            "replay it; lower optim.lr or tighten optim.clip")
NO_SPARE_STOP = "a faulty rank was excluded and no spare is left (supervisor.on_no_spare=stop)"


def cfg(*overrides):
    return load_config(None, list(overrides))


def slots(spares=0, nprocs=4, shape=FOUR):
    """`nprocs` ranks running plus `spares` standing by, none excluded yet."""
    return Slots(spares=spares, healthy=nprocs + spares, shape=shape, devices_per_process=8 // nprocs)


def crash(rank=1, step=7, error="", code=-signal.SIGKILL, cause="crash"):
    return Fault(cause, rank, "killed by SIGKILL", at=10.0, detected=10.1, error=error, step=step, exit_code=code)


def fault(cause, rank=1, detail="", step=7):
    return Fault(cause, rank, detail, at=10.0, detected=10.5, step=step)


CASES = [
    # (id, fault, previous fault, restarts, config overrides, slots, diagnostics' verdict, expected)
    ("finished", None, None, 2, [], slots(), None, Done("training finished after 2 restart(s)")),
    ("finished-after-faults", None, crash(), 1, [], slots(), None, Done("training finished after 1 restart(s)")),
    # Diagnostics run before anything a device could be blamed for.
    ("crash-diagnosed-first", crash(), None, 0, [], slots(), None, Diagnose()),
    ("crash-restarts", crash(), None, 0, [], slots(), {}, Restart()),
    ("crash-last-restart-left", crash(), None, 2, [], slots(), {}, Restart()),
    ("hang-restarts", fault("hang", 0), None, 1, [], slots(), {}, Restart()),
    ("stall-restarts", fault("stall", 1), None, 0, [], slots(), {}, Restart()),
    # unreadable_checkpoint: the data is at fault, not a machine: restarted at once, not diagnosed,
    # even at the same step with the same error line as before (each attempt moved one checkpoint aside).
    ("unreadable-checkpoint-restarts", crash(code=4, cause="unreadable_checkpoint", error="error: checkpoint step 16"),
     None, 0, [], slots(), None, Restart()),
    ("unreadable-checkpoint-again", crash(code=4, cause="unreadable_checkpoint", error="error: checkpoint step 16"),
     crash(code=4, cause="unreadable_checkpoint", error="error: checkpoint step 16"), 1, [], slots(), None, Restart()),
    ("unreadable-checkpoint-max-restarts", crash(code=4, cause="unreadable_checkpoint"), None, 3, [], slots(), None,
     GiveUp("supervisor.max_restarts=3 exhausted")),
    # config_error: a user mistake, never retried, never diagnosed.
    ("config-error", crash(code=2, cause="config_error"), None, 0, [], slots(), None, GiveUp(CONFIG_ERROR)),
    ("config-error-diagnosed-anyway", crash(code=2, cause="config_error"), None, 0, [], slots(1), {1: "bad"},
     GiveUp(CONFIG_ERROR)),
    # not_saved: the final checkpoint hit a full disk; a restart would fail the same way until space is freed.
    ("final-checkpoint-not-saved", crash(code=5, cause="not_saved"), None, 0, [], slots(1), None,
     GiveUp("the final checkpoint could not be written (see the worker's last line); free space on the checkpoint "
            "disk and run the same command again: it resumes from the newest good one")),
    # diverged: a restart replays the same data, so only a blamed device makes it worth one.
    ("diverged-diagnosed-first", crash(code=3, cause="diverged"), None, 0, [], slots(), None, Diagnose()),
    ("diverged-healthy", crash(code=3, cause="diverged"), None, 0, [], slots(1), {}, GiveUp(DIVERGED)),
    ("diverged-device-spare", crash(code=3, cause="diverged"), None, 0, [], slots(1), {1: "matmul wrong"},
     Spare({1: "matmul wrong"})),
    ("diverged-device-shrink", crash(code=3, cause="diverged"), None, 0, [], slots(0), {1: "matmul wrong"},
     Shrink({1: "matmul wrong"}, Shape(nprocs=2, dp=2, microbatches=2))),
    ("diverged-device-stop", crash(code=3, cause="diverged"), None, 0, ["supervisor.on_no_spare=stop"], slots(0),
     {1: "matmul wrong"}, GiveUp(NO_SPARE_STOP, {1: "matmul wrong"})),
    # Too many restarts: give up, excluding nothing.
    ("max-restarts", crash(), None, 3, [], slots(), {}, GiveUp("supervisor.max_restarts=3 exhausted")),
    ("max-restarts-0", crash(), None, 0, ["supervisor.max_restarts=0"], slots(), {},
     GiveUp("supervisor.max_restarts=0 exhausted")),
    ("max-restarts-before-eviction", crash(), None, 3, [], slots(1), {1: "bad"},
     GiveUp("supervisor.max_restarts=3 exhausted")),
    ("diverged-healthy-before-max-restarts", crash(code=3, cause="diverged"), None, 3, [], slots(), {},
     GiveUp(DIVERGED)),
    # A deterministic crash: the same exit at the same step with the same error line (glog's time
    # and thread id aside) is given up at once, before diagnostics.
    ("repeated-abort", crash(error=ABORT_AGAIN, code=-6, cause="aborted", step=3),
     crash(error=ABORT, code=-6, cause="aborted", step=3), 1, [], slots(), None,
     GiveUp(f"the same aborted twice at step 3 ({ABORT_AGAIN}); it is deterministic, a restart would repeat it")),
    ("repeated-abort-with-restarts-left", crash(error=ABORT, code=-6, cause="aborted", step=3),
     crash(error=ABORT, code=-6, cause="aborted", step=3), 1, ["supervisor.max_restarts=5"], slots(), None,
     GiveUp(f"the same aborted twice at step 3 ({ABORT}); it is deterministic, a restart would repeat it")),
    ("abort-at-another-step", crash(error=ABORT, code=-6, cause="aborted", step=5),
     crash(error=ABORT, code=-6, cause="aborted", step=3), 1, [], slots(), None, Diagnose()),
    ("abort-with-another-error", crash(error=ABORT.replace("copy", "add"), code=-6, cause="aborted", step=3),
     crash(error=ABORT, code=-6, cause="aborted", step=3), 1, [], slots(), {}, Restart()),
    ("kill-twice-no-error-line", crash(step=3), crash(step=3), 1, [], slots(), {}, Restart()),
    ("abort-then-crash", crash(error=ABORT, step=3), crash(error=ABORT, code=-6, cause="aborted", step=3), 1, [],
     slots(), {}, Restart()),
    ("hang-twice-no-exit", fault("hang", 0, step=3), fault("hang", 0, step=3), 1, [], slots(), {}, Restart()),
    # Ranks blamed: spares first, then a smaller mesh, or a stop.
    ("crash-blamed-spare", crash(), None, 0, [], slots(1), {1: "psum wrong"}, Spare({1: "psum wrong"})),
    ("crash-blamed-shrink", crash(), None, 0, [], slots(0), {1: "psum wrong"},
     Shrink({1: "psum wrong"}, Shape(nprocs=2, dp=2, microbatches=2))),
    ("two-blamed-one-spare-shrink", crash(), None, 0, [], slots(1), {0: "slow", 1: "psum wrong"},
     Shrink({0: "slow", 1: "psum wrong"}, Shape(nprocs=2, dp=2, microbatches=2))),
    ("two-blamed-two-spares", crash(), None, 0, [], slots(2), {0: "slow", 1: "psum wrong"},
     Spare({0: "slow", 1: "psum wrong"})),
    ("crash-blamed-stop", crash(), None, 0, ["supervisor.on_no_spare=stop"], slots(0), {1: "psum wrong"},
     GiveUp(NO_SPARE_STOP, {1: "psum wrong"})),
    # 2 processes of 4 devices: dp=2 fills the one healthy process.
    ("shrink-onto-one-process", crash(), None, 0, [], slots(0, nprocs=2, shape=Shape(2, 4, 1)), {1: "psum wrong"},
     Shrink({1: "psum wrong"}, Shape(nprocs=1, dp=2, microbatches=2))),
    # A failed self-test or an evicted straggler blames its own rank, whatever diagnostics say.
    ("device-self-test", fault("device", 0, "self-test failed"), None, 0, [], slots(1), {},
     Spare({0: "self-test failed"})),
    ("device-diagnosis-kept", fault("device", 0, "self-test failed"), None, 0, [], slots(1), {0: "matmul wrong"},
     Spare({0: "matmul wrong"})),
    ("device-and-another-blamed", fault("device", 0, "self-test failed"), None, 0, [], slots(2), {1: "psum wrong"},
     Spare({0: "self-test failed", 1: "psum wrong"})),
    ("straggler-logged-only", fault("straggler", 1, "40% late"), None, 0, [], slots(1), {}, Restart()),
    ("straggler-evicted", fault("straggler", 1, "40% late"), None, 0, ["supervisor.evict_stragglers=true"], slots(1),
     {}, Spare({1: "40% late"})),
    ("straggler-evicted-shrink", fault("straggler", 1, "40% late"), None, 0, ["supervisor.evict_stragglers=true"],
     slots(0), {}, Shrink({1: "40% late"}, Shape(nprocs=2, dp=2, microbatches=2))),
]


@pytest.mark.parametrize("fault_, previous, restarts, overrides, slots_, faulty, expected",
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_decide(fault_, previous, restarts, overrides, slots_, faulty, expected):
    assert decide(fault_, previous, restarts, cfg(*overrides), slots_, faulty=faulty) == expected


def test_a_mesh_that_cannot_shrink_gives_up_with_the_fix_and_excludes_the_slot_even_so():
    # one replica over 2 processes, one slot bad: no replica to drop
    one_replica = cfg("mesh.dp=1")
    action = decide(crash(), None, 0, one_replica, slots(0, nprocs=2, shape=Shape(2, 1, 1)), faulty={0: "bad"})
    assert isinstance(action, GiveUp) and action.evict == {0: "bad"}
    assert action.reason.startswith("mesh.dp=1 cannot shrink") and "supervisor.on_no_spare=stop" in action.reason
    # 1 process of 8 devices, its slot bad: no healthy slot at all, said as such (not a shrink's
    # arithmetic, whose advice — another global batch — could not help)
    for shape, config in ((Shape(1, 4, 1), cfg()), (Shape(1, 1, 1), one_replica)):
        action = decide(crash(), None, 0, config, slots(0, nprocs=1, shape=shape), faulty={0: "bad"})
        assert isinstance(action, GiveUp) and action.evict == {0: "bad"}
        assert action.reason.startswith("no healthy slot is left to run on"), action.reason


def test_the_verdict_passed_in_is_not_changed():
    verdict = {}
    assert decide(fault("device", 0, "self-test failed"), None, 0, cfg(), slots(1), faulty=verdict) \
        == Spare({0: "self-test failed"})
    assert verdict == {}


# ------------------------------------------------ which exit is the fault (supervise/detect.py)

def test_an_exit_that_names_its_cause_is_blamed_before_a_plain_crash_and_an_abort():
    from megascale_jax.supervise.detect import exit_fault
    fault = exit_fault({0: 1, 1: 4, 2: -signal.SIGABRT}, at=1.0, now=1.5)
    assert (fault.rank, fault.cause, fault.exit_code) == (1, "unreadable_checkpoint", 4)
    fault = exit_fault({0: -signal.SIGABRT, 3: 1}, at=1.0, now=1.5)
    assert (fault.rank, fault.cause) == (3, "crash")


class ExitingGroup:
    """A WorkerGroup stand-in whose workers exit on a schedule: exit_codes() is called repeatedly."""

    def __init__(self, nprocs, schedule):
        self.processes, self.schedule, self.calls = [None] * nprocs, schedule, 0

    def exit_codes(self):
        self.calls += 1
        return next(codes for after, codes in reversed(self.schedule) if self.calls >= after)


def test_a_python_exception_waits_briefly_for_the_peer_exit_that_explains_it_a_kill_does_not():
    from megascale_jax.supervise.detect import with_explained_exit
    later = ExitingGroup(3, [(0, {0: 1}), (3, {0: 1, 1: 4})])  # rank 1's exit 4 is seen on the 3rd look
    assert with_explained_exit(later, {0: 1}) == {0: 1, 1: 4}
    killed = ExitingGroup(3, [(0, {0: -signal.SIGKILL})])
    assert with_explained_exit(killed, {0: -signal.SIGKILL}) == {0: -signal.SIGKILL} and killed.calls <= 1


def test_a_raised_loop_is_the_exit_that_names_its_cause_when_its_own_process_says_it():
    """A worker whose loop raised beats `failed` before it exits; when its own exit names the cause
    (4: an unreadable checkpoint), that is the fault; its plain exit 1 is not (a peer is waited for)."""
    from megascale_jax.supervise.detect import Fault, peer_exit
    raised = Fault("crash", 1, "the training loop raised (see its log)", at=1.0, detected=1.2)
    own = ExitingGroup(2, [(0, {}), (2, {1: 4})])
    fault = peer_exit(own, raised, at=1.0)
    assert (fault.rank, fault.cause, fault.exit_code) == (1, "unreadable_checkpoint", 4)
    plain = ExitingGroup(2, [(0, {1: 1})])
    assert peer_exit(plain, raised, at=1.0) is None  # after the 1 s grace: no peer exited


def test_a_rank_that_said_its_checkpoint_is_unreadable_is_awaited_for_its_exit():
    from megascale_jax.supervise.detect import await_exit
    assert await_exit(ExitingGroup(2, [(0, {}), (3, {1: 4})]), 1) == 4
    assert await_exit(ExitingGroup(2, [(0, {0: 0})]), 1) is None  # still running after the grace
