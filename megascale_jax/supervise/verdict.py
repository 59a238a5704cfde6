"""What happened, in one line: the verdict on a fault, from the evidence the driver holds.

Every fault the driver handles ends in one `verdict` event in `RUN_DIR/events.jsonl` — what
happened (one of `KINDS`), to which rank, and which slots are excluded for it and why — judged
from three pieces of evidence, none enough alone:
* the detector's `Fault` (detect.py): its cause, the exit code, the detail;
* the hosts the driver cannot reach (`lost`: rank -> host): a lost machine, whose processes and
  memory are gone. It is named by that, and diagnostics never run there — they could not on a
  real cluster, and a stand-in that did would speak for a machine that is not there (the ETTR
  drill once called a lost host "wrong values in collectives": silent data corruption);
* the diagnostics' findings (diagnose.Report.faulty, rank -> why), run on the reachable slots.
A worker-side fault the driver does not restart for says its verdict in its own event: a NaN
replayed finite (`nan_triage`, "transient NaN"), a dead Redis (`redis_restart`, "Redis lost").

A dead process is a "process killed" (by a signal: the devices it leaves behind test healthy),
never "wrong values"; only the diagnostics' evidence of a broken device makes a "faulty device".
Persistent faults exclude their slot (policy.py decides, the verdict records it): a lost host, a
faulty device, an evicted straggler. Transient ones never do: a kill, a hang, a stall, a NaN.
Pure: no processes, no Redis, no files (tests/supervise/test_verdict.py).
"""

from __future__ import annotations

import dataclasses
import signal

from megascale_jax.observe.hangs import describe_exit
from megascale_jax.supervise.detect import Fault

HOST_LOST = "host lost"
# What a verdict can say, each with whether it excludes the slot (docs/supervision.md's table).
KINDS = {
    HOST_LOST: True,  # the machine is gone: its processes and its memory
    "faulty device": True,  # diagnostics, or a self-test after a NaN, found the slot broken
    "straggler": True,  # evicted for arriving late (supervisor.evict_stragglers)
    "process killed": False,  # ended by a signal; its devices test healthy
    "crash": False,  # exited with an error of its own (an abort, an exception)
    "hang": False,  # heartbeats stopped (a stopped or frozen process)
    "stall": False,  # heartbeats on, steps not (a stuck collective, a restore that never ends)
    "diverged": False,  # non-finite again when replayed, on healthy devices
    "damaged checkpoint": False,  # the newest checkpoint unreadable: the one before is used
    "checkpoint not saved": False,  # the final checkpoint could not be written (a full disk)
    "config error": False,  # a user mistake, or a control plane the worker refused to trust
    "transient NaN": False,  # finite when replayed (the workers' nan_triage event)
    "Redis lost": False,  # the embedded server died and was restarted (redis_restart event)
}
OWN_CAUSES = {"unreadable_checkpoint": "damaged checkpoint", "not_saved": "checkpoint not saved",
              "config_error": "config error", "diverged": "diverged", "hang": "hang", "stall": "stall"}


@dataclasses.dataclass(frozen=True)
class Verdict:
    kind: str  # one of KINDS
    rank: int | None
    summary: str  # one line, naming the rank, the evidence and what is done


def host_lost(host: str) -> str:
    """A lost host's finding, as the evictions and diagnosis events say it."""
    return f"{HOST_LOST}: {host} unreachable, its processes and memory gone"


def judge(fault: Fault, findings: dict[int, str] | None, excluded: dict[int, str] | None = None) -> Verdict:
    """The verdict on `fault`: `findings` are the diagnostics' (rank -> why, lost hosts' first;
    None: not run), `excluded` the slots the policy excludes for it (rank -> why)."""
    diagnosed, findings, excluded = findings is not None, findings or {}, excluded or {}
    process = f"its process {describe_exit(fault.exit_code)}" if fault.exit_code is not None else ""
    lost = {r: why for r, why in findings.items() if why.startswith(HOST_LOST)}
    broken = {r: why for r, why in findings.items() if r not in lost}
    if fault.cause in ("unreadable_checkpoint", "not_saved", "config_error"):  # the data or the user, not a machine
        kind, rank, what = OWN_CAUSES[fault.cause], fault.rank, fault.error or fault.detail
    elif lost:
        rank = fault.rank if fault.rank in lost else min(lost)
        kind, what = HOST_LOST, _with(lost[rank].removeprefix(f"{HOST_LOST}: "), process if rank == fault.rank else "")
    elif broken or fault.cause == "device":
        rank = fault.rank if fault.rank in broken or not broken else min(broken)
        why = broken.get(rank, fault.detail)
        kind, what = "faulty device", _with(f"fails diagnostics: {why}" if rank in broken else why,
                                            process if rank == fault.rank else "")
    elif fault.cause == "straggler":
        kind, rank, what = "straggler", fault.rank, fault.detail
    elif fault.cause in OWN_CAUSES:
        kind, rank, what = OWN_CAUSES[fault.cause], fault.rank, fault.detail
    elif fault.exit_code is not None and fault.exit_code < 0 and fault.exit_code != -signal.SIGABRT:
        kind, rank, what = "process killed", fault.rank, f"{describe_exit(fault.exit_code)}"
    else:  # an abort or an error exit: the worker's own line says why
        kind, rank, what = "crash", fault.rank, _with(fault.detail, fault.error)
    healthy = "; diagnostics: every rank healthy" if diagnosed and not findings and \
        kind not in ("damaged checkpoint", "checkpoint not saved", "config error") else ""
    done = "; excluded: " + ", ".join(f"rank {r} ({why})" for r, why in sorted(excluded.items())) if excluded \
        else "; no slot excluded"
    return Verdict(kind, rank, f"{kind}: rank {rank}: {what}{healthy}{done}")


def _with(what: str, more: str) -> str:
    return f"{what}; {more}" if more else what
