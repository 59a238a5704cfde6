"""NaN triage: a non-finite loss or gradient is replayed once before the run is called diverged.

A non-finite step has two very different causes. Bad data or a model that blew up (too high a
learning rate) give the same non-finite value every time the step runs: the run has diverged,
and a restart would replay it bitwise. A flipped bit in a GPU's memory or arithmetic (ByteRobust
reports these as a leading cause of NaNs at scale) happens once: the same step run again is
finite. So the loop runs the step again from the state before it:

* non-finite again → `diverged`: `TrainingDiverged`, the worker exits 3 and the supervisor stops
  (unless diagnostics blame a device);
* finite → `transient`: the hardware is suspect. Every process runs a device self-test (a matmul
  against float64 NumPy on each of its devices) and reports it; the replayed step's result is
  kept and training goes on. The loss is all-reduced, so every process sees the non-finite value
  and no process can tell whose device produced it: all of them test themselves.

The state before the step is still there without a copy: the compiled step keeps its input
state when the result is non-finite, and marks it held (`TrainState.step` = -1 - updates done).
Metrics are fetched one step late, so the next step was already dispatched when the host
notices; a held state passes through it unchanged. `release` turns the held state back into an
ordinary one; the loop then runs the non-finite step and the one after it again, with the
batches it kept for them. Both outcomes are events (`watch.event("nan_triage", ...)`), which
the heartbeat carries to the supervisor's events.jsonl.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from megascale_jax.training.metrics import NonFiniteStep, TrainingDiverged


class NonFiniteTriage:
    """Decides, per non-finite step, between a replay and `diverged`; see the module docstring."""

    def __init__(self, watch, self_test: Callable[[], dict], log: Callable[[str], None]):
        """self_test() -> {"ok": bool, ...}: this process's device check after a transient."""
        self.watch, self.self_test, self.log = watch, self_test, log
        self.replaying: int | None = None  # the step being replayed, until its result is recorded

    def replay_from(self, e: NonFiniteStep) -> int:
        """The step to go back to (updates done before the non-finite one), or raise
        TrainingDiverged when it was non-finite again in its replay."""
        if e.step == self.replaying:
            self.watch.event("nan_triage", outcome="diverged", step=e.step, detail=e.values)
            raise TrainingDiverged(f"{e} (again when replayed: not a transient fault)") from None
        self.replaying = e.step
        self.log(f"warning: non-finite loss or gradient at step {e.step} ({e.values}); replaying it once")
        return e.step - 1

    def on_record(self, record: dict) -> None:
        """A record hook: the replayed step came out finite — a transient fault."""
        if record["step"] != self.replaying:
            return
        self.replaying = None
        test = self.self_test()
        self.log(f"step {record['step']} was finite when replayed (loss {record['loss']:.4f}): a transient "
                 f"fault; device self-test {'passed' if test['ok'] else 'FAILED'}")
        self.watch.event("nan_triage", outcome="transient", step=record["step"], loss=record["loss"],
                         self_test=test)


def release(state, steps_done: int, replicated):
    """`state`, held by a non-finite step (see the module docstring), as the state after
    `steps_done` updates again."""
    step = jax.make_array_from_callback((), replicated, lambda _: np.int32(steps_done))
    return state.replace(step=step)
