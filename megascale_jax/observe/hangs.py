"""Hang localisation: which rank never arrived where its peers are waiting.

When one process stops (a stuck host, a deadlock), its peers dispatch the next step and block
in its collectives. Each process's timings end where it stopped, so the rank whose last arrival
(the furthest ``data_wait``/``dispatch`` row) is behind the others' is the one that hung, and the
ranks at the furthest arrival are waiting for it. If every rank arrived at the same point, the
hang is inside the step (on the devices) and host timings cannot name a rank.

A run counts as stalled when no process wrote a row for `hang_after` seconds and not every
process reached ``state:done``. A resumed run appends to the same files, so only each process's
rows since its latest ``state:initialising`` mark (its current attempt) are judged.

When a stalled run has every rank at the same furthest point, no rank is behind: the processes
were killed (Ctrl-C before it was handled, SIGKILL, OOM killer), crashed natively, or hang
inside the step on the devices. Timings cannot tell these apart and a killed job is far more
common, so those ranks are "stopped" — not "waiting" for anyone. The report refines this with
the supervisor's events.jsonl (exit codes) when there are any.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

import numpy as np

from megascale_jax.observe.timings import STATE_PREFIX, Timings

ARRIVAL_STAGES = {"data_wait": 0, "dispatch": 1}  # order within one step on the host


@dataclass
class RankState:
    rank: int
    host: str
    status: str  # running | done | failed | interrupted | hung | waiting | stopped
    arrived: tuple[int, str]  # (step, phase) of its furthest arrival
    last_phase: str  # its last row: phase ...
    last_step: int  # ... of this step
    last_time: float  # ... ending at this time (its own clock)
    exit_note: str = ""  # how it exited, when the supervisor saw it (status "exited")

    def describe(self) -> str:
        status = f"{self.status} ({self.exit_note})" if self.exit_note else self.status
        return (f"rank {self.rank} on {self.host}: {status}; arrived at step {self.arrived[0]} "
                f"({self.arrived[1]}); last phase {self.last_phase} of step {self.last_step}")


def rank_states(t: Timings, now: float, hang_after: float) -> list[RankState]:
    """Each process's status and where it stopped (see the module docstring)."""
    hosts = t.hosts()
    ends = t.start + t.duration
    states = []
    for p in t.processes:
        mine = np.flatnonzero(t.process == p)  # never empty: a writer starts with a state row
        starts = mine[t.phase[mine] == STATE_PREFIX + "initialising"]
        if len(starts):  # rows of earlier attempts (their arrivals, failed/done marks) are history
            mine = mine[t.start[mine] >= t.start[starts].max()]
        last = mine[np.argmax(ends[mine])]
        arrivals = [(int(t.step[i]), t.phase[i]) for i in mine if t.phase[i] in ARRIVAL_STAGES]
        seen = set(t.phase[mine])
        ended_by_error = {STATE_PREFIX + s for s in ("failed", "diverged", "unreadable_checkpoint")} & seen
        status = ("done" if STATE_PREFIX + "done" in seen else "failed" if ended_by_error else
                  "interrupted" if STATE_PREFIX + "interrupted" in seen else "running")  # SIGINT/SIGTERM, saved
        states.append(RankState(p, hosts.get(p, "?"), status,
                                max(arrivals, key=_position, default=(0, "none")),
                                str(t.phase[last]), int(t.step[last]), float(ends[last])))
    stalled = all(s.status != "running" or now - s.last_time > hang_after for s in states) \
        and any(s.status == "running" for s in states)
    if stalled:
        running = [s for s in states if s.status == "running"]
        furthest = max(_position(s.arrived) for s in running)
        behind = any(_position(s.arrived) != furthest for s in running)
        for s in running:
            s.status = "hung" if _position(s.arrived) != furthest else "waiting" if behind else "stopped"
    return states


def _position(arrival: tuple[int, str]) -> tuple[int, int]:
    step, phase = arrival
    return step, ARRIVAL_STAGES.get(phase, -1)


def describe_exit(code: int) -> str:
    """A process's exit status as words: `exit code 1`, `killed by SIGKILL`."""
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
