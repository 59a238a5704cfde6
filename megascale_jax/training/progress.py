"""What a run tells its user as it goes: start-up laps, one log line every `train.log_every`
steps (and at evaluations, and for the run's first step, with an estimate of the time left), the
metrics records in `metrics.jsonl`, a progress bar on a terminal — and, where there is none (a log
file, a pipe), a line at least every `QUIET_LIMIT_S`, so a log never goes silent for a long
`log_every` — and the one summary line every run ends with.

Only process 0 writes `metrics.jsonl` and draws the bar; every process keeps its records (the
loop returns them).
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from megascale_jax import run_dir as run_dirs
from megascale_jax.training.hooks import Hooks
from megascale_jax.training.metrics import itstime

QUIET_LIMIT_S = 30.0  # without a terminal, the longest a run goes without a log line
ETA_WINDOW = 20  # steps whose mean time estimates the time left


class StartupClock:
    """Seconds spent in each phase of a start or restart, in order, for the log."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = now - self._last
        self._last = now

    def summary(self) -> str:
        return "start-up phases: " + ", ".join(f"{phase} {s:.2f}s" for phase, s in self.laps.items())


class Progress:
    """The records of the steps this process ran, and their lines, file and bar."""

    def __init__(self, run_dir: str, start: int, last: int, is_main: bool, log: Callable[[str], None],
                 warn: Callable[[str], None] | None = None):
        from tqdm import tqdm

        self.run_dir, self.start, self.last, self.is_main, self.log = run_dir, start, last, is_main, log
        self.warn = warn or log
        self.records: list[dict] = []
        self.terminal = sys.stderr.isatty()
        self.logged_at = time.monotonic()
        if is_main:  # records after the step resumed from belong to a run that no checkpoint holds
            run_dirs.keep_records_up_to(run_dirs.metrics_path(run_dir), start)
        # A progress bar on a terminal only: in a log file its redraws are noise (log lines remain).
        self.bar = tqdm(total=last, initial=start, disable=not (is_main and self.terminal),
                        unit="step", dynamic_ncols=True)

    def add_hooks(self, hooks: Hooks, log_every: int, eval_every: int) -> None:
        hooks.add_record("metrics", 1, self.keep)
        hooks.add_record("log", 1, lambda record: self.log_line(record) if self.due(record, log_every) else None)

    def due(self, record: dict, log_every: int) -> bool:
        """A step gets a log line on the `log_every` cadence, when it was evaluated, when it is
        the run's first (seconds after the start, not `log_every` steps), and, without a
        terminal, when the log has been quiet for `QUIET_LIMIT_S`."""
        step = record["step"]
        return (itstime(step, log_every, self.last) or "val_loss" in record or "downstream" in record
                or step == self.start + 1
                or (not self.terminal and time.monotonic() - self.logged_at >= QUIET_LIMIT_S))

    def keep(self, record: dict) -> None:
        """metrics.jsonl and the progress bar."""
        self.records.append(record)
        if self.is_main:
            run_dirs.append_jsonl(run_dirs.metrics_path(self.run_dir), [record], self.warn)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")

    def log_line(self, record: dict) -> None:
        val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
        self.log(f"step {record['step']:5d} loss {record['loss']:.4f}{val} grad_norm {record['grad_norm']:.3f} "
                 f"lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s{self.eta(record['step'])}")
        if "downstream" in record:  # the scores, not their standard errors (metrics.jsonl has both)
            scores = {k: v for k, v in record["downstream"].items() if not k.endswith("_stderr") and k != "seconds"}
            self.log(f"step {record['step']:5d} downstream: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items())
                     + f" ({record['downstream']['seconds']:.1f} s)")
        self.logged_at = time.monotonic()

    def eta(self, step: int) -> str:
        """', eta 12m05s': the steps left at the mean time of the last `ETA_WINDOW` (evaluations,
        checkpoints and other pauses aside); nothing at the last step."""
        recent = [r["step_time_s"] for r in self.records[-ETA_WINDOW:]]
        if step >= self.last or not recent:
            return ""
        return f", eta {format_duration((self.last - step) * sum(recent) / len(recent))}"

    def close(self) -> None:
        self.bar.close()


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m05s', 65 -> '1m05s', 4.2 -> '4s'."""
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def run_summary(records: list[dict], start: int, wall_s: float, tokens_per_step: int) -> str:
    """The one line every run ends with: steps, wall time, final losses, mean throughput."""
    if not records:
        return f"nothing to train: already at step {start}"
    val = [r["val_loss"] for r in records if "val_loss" in r]
    tokens_per_s = tokens_per_step * len(records) / sum(r["step_time_s"] for r in records)
    return (f"done: steps {start + 1}-{records[-1]['step']} in {wall_s:.1f}s; final loss {records[-1]['loss']:.4f}"
            + (f", val_loss {val[-1]:.4f}" if val else "") + f"; mean {tokens_per_s:.0f} tokens/s")
