"""What runs around the train step on a cadence: evaluation, profiling, checkpoints, log lines.

The loop itself only fetches data, dispatches the step and hands the step to its hooks
(levanter's `add_hook(fn, every=n)`, big_vision's `itstime`), so it reads top to bottom and a
new periodic action is one `add` where the loop is composed, not another branch inside it.

Two kinds, because a step's state and its metrics are ready at different times:
* step hooks (`add`) see the state right after step k was dispatched; `before` runs before the
  step is dispatched (e.g. to start a trace), `run` after. They run in the order added.
* record hooks (`add_record`) see step k's metrics record, which the `MetricsRecorder` makes
  one step late (or at once when a step hook flushes it).

A hook is due at every `every`-th step (0 = never) and, with `at_last`, at the last step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from megascale_jax.training.metrics import itstime


@dataclasses.dataclass(frozen=True)
class Hook:
    name: str
    every: int
    run: Callable[..., None]  # step hooks: run(step, state); record hooks: run(record)
    before: Optional[Callable[[int], None]] = None  # step hooks only: before(step), before dispatch
    at_last: bool = True

    def due(self, step: int, last: int) -> bool:
        return itstime(step, self.every, last if self.at_last else -1)


class Hooks:
    def __init__(self, last: int):
        self.last = last  # the run's last step
        self.step_hooks: list[Hook] = []
        self.record_hooks: list[Hook] = []

    def add(self, name: str, every: int, run: Callable[[int, Any], None],
            before: Callable[[int], None] | None = None, at_last: bool = True) -> None:
        self.step_hooks.append(Hook(name, every, run, before, at_last))

    def add_record(self, name: str, every: int, run: Callable[[dict], None], at_last: bool = True) -> None:
        self.record_hooks.append(Hook(name, every, run, None, at_last))

    def due(self, step: int) -> list[str]:
        """Names of the step hooks due at `step`."""
        return [h.name for h in self.step_hooks if h.due(step, self.last)]

    def before_step(self, step: int) -> None:
        for h in self.step_hooks:
            if h.before is not None and h.due(step, self.last):
                h.before(step)

    def after_step(self, step: int, state) -> None:
        for h in self.step_hooks:
            if h.due(step, self.last):
                h.run(step, state)

    def on_record(self, record: dict) -> None:
        for h in self.record_hooks:
            if h.due(record["step"], self.last):
                h.run(record)
