"""Things that watch the training loop from the side: phase timings and TensorBoard scalars
(`timings.py`), heartbeats to the supervisor (`heartbeat.py`).

The loop calls every observer on the host at fixed points; an observer never touches device
arrays, so watching adds no device synchronisation to the hot path. Times are wall-clock
seconds (`time.time()`), the only clock that can be compared across processes (after the
report estimates each process's offset).
"""

from __future__ import annotations

from typing import Any


class LoopObserver:
    """No-op base; override what you need."""

    def state(self, state: str, step: int, error: str = "") -> None:
        """The loop entered `state` (initialising, compiling, training, checkpointing, evaluating,
        done, diverged, unreadable_checkpoint, failed); `step` = updates finished so far (-1 when it
        ended by an error); `error`: the line that says why it ended, when it knows one."""

    def phase(self, step: int, name: str, start: float, duration: float) -> None:
        """Phase `name` of step `step` (data_wait, dispatch, step, checkpoint, eval) ran from
        `start` for `duration` seconds. `step` is the full step: finish minus previous finish."""

    def before_step(self, step: int) -> None:
        """Called right before step `step` is dispatched (fault injection hooks in here)."""

    def device_phase(self, step: int, device: int, name: str, start: float, duration: float) -> None:
        """Phase `name` (device_compute, device_collective, device_span) of global device `device`
        in step `step`, from a profiled step (`observe.profile_every`)."""

    def record(self, record: dict[str, Any]) -> None:
        """The metrics record of a finished step (the line written to metrics.jsonl)."""

    def event(self, kind: str, **fields) -> None:
        """Something the supervisor should log in events.jsonl (e.g. `nan_triage`)."""

    def close(self) -> None:
        """The loop ended (normally or not); flush and release."""


class Observers(LoopObserver):
    """Fans every call out to a list of observers."""

    def __init__(self, observers: list[LoopObserver]):
        self.observers = observers

    def state(self, state, step, error=""):
        for o in self.observers:
            o.state(state, step, error)

    def phase(self, step, name, start, duration):
        for o in self.observers:
            o.phase(step, name, start, duration)

    def before_step(self, step):
        for o in self.observers:
            o.before_step(step)

    def device_phase(self, step, device, name, start, duration):
        for o in self.observers:
            o.device_phase(step, device, name, start, duration)

    def record(self, record):
        for o in self.observers:
            o.record(record)

    def event(self, kind, **fields):
        for o in self.observers:
            o.event(kind, **fields)

    def close(self):
        for o in self.observers:
            o.close()
