"""One place that turns a step's device metrics into a record, one step late.

Fetching a step's loss blocks the host until that step is done; doing it right after the
dispatch would leave the devices idle while the host logs and fetches the next batch. So the
recorder holds step k's metrics (`push`) and fetches them only after step k+1 was dispatched,
when k is done anyway. Steps that must be complete before the loop goes on — an evaluation, a
profiled step (traced alone), an interrupt, a save that copies on the host — call `flush`, which
records the held step at once. A save in the background does not wait: it asks `finite` (a
`FiniteSteps`) before it commits, so that nothing saved is newer than the metrics on disk or of a
step whose loss was not seen finite, and the devices run on meanwhile.

A record is `{step, loss, grad_norm, lr, step_time_s, tokens_per_s, mfu, data_wait_s}` plus
`val_loss` when the step was evaluated. Step time is finish-to-finish, so it covers the whole
step however the host and devices overlapped; an evaluation or a checkpoint's blocking between two
steps is not in it (`restart_clock` after them). A non-finite loss or gradient norm raises
`NonFiniteStep` (a `TrainingDiverged`) naming the step; the loop replays it once (triage.py).

Throughput (`tokens_per_s`, `mfu`) is over the last `THROUGHPUT_WINDOW` recorded steps of this
process, not over one step's time: "finished" means "seen finished by the host", and a host that
looks late (a GC pause, a background thread holding the GIL, a restore still releasing buffers)
makes one step look long and the next, already done on the devices, look nearly free — one step's
rate read 25-50x the steady rate right after a resume (issue 43). Over a window such a pair's sum
is right. The window starts empty in every process, so a resumed run's rate counts only steps it
ran itself.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Any, Callable

import jax


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf."""


class NonFiniteStep(TrainingDiverged):
    """Step `step`'s loss or gradient norm is NaN/inf (the loop may replay it: training.triage)."""

    def __init__(self, message: str, step: int, values: dict):
        super().__init__(message)
        self.step, self.values = step, values


THROUGHPUT_WINDOW = 8  # steps: short enough that a change of pace shows within a log interval


class FiniteSteps:
    """The steps the loop has recorded with a finite loss and gradient norm, for saves in the
    background to wait on before they commit (saving.py). A non-finite step abandons the saves of
    it and after it (the loop replays it: their states are not the ones it goes on from);
    `close` (the loop ended) abandons those still waiting."""

    def __init__(self):
        self._changed = threading.Condition()
        self._through = 0  # recorded finite up to here
        self._not_finite: list[int] = []  # every step found non-finite, in order
        self._closed = False

    def ticket(self, step: int) -> Callable[[], bool]:
        """For a save of `step` dispatched now: a call that blocks until the loop has recorded
        `step` and says whether it was finite (False: abandoned)."""
        seen = len(self._not_finite)  # those before the save are history: their replays passed

        def wait() -> bool:
            with self._changed:
                def abandoned():
                    return any(bad <= step for bad in self._not_finite[seen:])
                self._changed.wait_for(lambda: abandoned() or self._through >= step or self._closed)
                return self._through >= step and not abandoned()
        return wait

    def recorded(self, step: int) -> None:
        with self._changed:
            self._through = max(self._through, step)
            self._changed.notify_all()

    def not_finite(self, step: int) -> None:
        with self._changed:
            self._not_finite.append(step)
            self._through = min(self._through, step - 1)
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


def itstime(step: int, every: int, last: int) -> bool:
    """The cadence of every periodic action: every `every` steps (0 = never) and at the last step."""
    return step == last or (every > 0 and step % every == 0)


class MetricsRecorder:
    def __init__(self, tokens_per_step: int, mfu_per_token_s: float | None, lr_hint: str, watch,
                 evaluate: Callable, on_record: Callable[[dict], None],
                 describe_data: Callable[[int], dict] | None = None):
        """evaluate(params) -> validation loss; on_record(record) is called once per step, in order.
        lr_hint names the settings to change when training diverges. describe_data(step): fields
        the data adds to the step's record (a mixture's realised proportions)."""
        self.tokens_per_step, self.mfu_per_token_s, self.lr_hint = tokens_per_step, mfu_per_token_s, lr_hint
        self.watch, self.evaluate, self.on_record = watch, evaluate, on_record
        self.describe_data = describe_data or (lambda step: {})
        self.held: tuple | None = None  # (step, metrics, data_wait) not fetched yet
        self.finite = FiniteSteps()
        self.last_finish = time.perf_counter()
        self.recent_step_times: collections.deque[float] = collections.deque(maxlen=THROUGHPUT_WINDOW)

    def restart_clock(self) -> None:
        """The next step's time starts now (after compiling and restoring)."""
        self.last_finish = time.perf_counter()

    def push(self, step: int, metrics, data_wait: float) -> None:
        """Step `step` was dispatched: record the step held before it, hold this one."""
        self.flush()
        self.held = (step, metrics, data_wait)

    def flush(self, params=None, evaluate: Callable[[Any], dict] | None = None) -> None:
        """Record the held step now; with `params`, evaluate them too: `evaluate(params)` gives the
        fields it adds to the record (default: the validation loss)."""
        if self.held is None:
            return
        (step, metrics, data_wait), self.held = self.held, None
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        step_time = now - self.last_finish
        self.watch.phase(step, "step", time.time() - step_time, step_time)
        if not (math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])):
            self.finite.not_finite(step)
            raise NonFiniteStep(f"loss={values['loss']} grad_norm={values['grad_norm']} at step {step}: "
                                f"training diverged; {self.lr_hint}", step,
                                {"loss": values["loss"], "grad_norm": values["grad_norm"]})
        self.recent_step_times.append(step_time)
        tokens_per_s = self.tokens_per_step * len(self.recent_step_times) / sum(self.recent_step_times)
        record = {"step": step, **values, "step_time_s": step_time, "tokens_per_s": tokens_per_s,
                  "mfu": None if self.mfu_per_token_s is None else self.mfu_per_token_s * tokens_per_s,
                  "data_wait_s": data_wait, **self.describe_data(step)}
        # The next step's clock starts when this one was seen finished, not once its record is
        # written: the next step is already running on the devices meanwhile (it was dispatched
        # before this fetch), so writing the record is inside it, not between steps.
        self.last_finish = now
        if params is not None:  # left out of the step time: the clock restarts after it
            self.watch.state("evaluating", step)
            t_eval = time.time()
            record.update(evaluate(params) if evaluate else {"val_loss": self.evaluate(params)})
            self.watch.phase(step, "eval", t_eval, time.time() - t_eval)
            self.watch.state("training", step)
        self.watch.record(record)
        self.on_record(record)
        self.finite.recorded(step)  # after the record is written: a save waiting on it commits now
        if params is not None:
            self.last_finish = time.perf_counter()
