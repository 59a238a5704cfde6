"""What a run's log says as it goes (training/progress.py): the first step's line at once, the
log_every cadence and evaluations, an estimate of the time left on each line, and — with no
terminal to draw a bar on — a line at least every QUIET_LIMIT_S however long log_every is."""

import pytest

from megascale_jax.training import progress
from megascale_jax.training.hooks import Hooks


def record(step: int, step_time_s: float = 2.0, **extra) -> dict:
    return {"step": step, "loss": 5.0 - 0.01 * step, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1000.0,
            "step_time_s": step_time_s, **extra}


@pytest.fixture
def shown(tmp_path, monkeypatch):
    """A Progress of a run resumed at step 10 of 1,000, log_every 100, on a clock the test moves."""
    clock = {"now": 0.0}
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock["now"])
    lines = []
    shown = progress.Progress(str(tmp_path), 10, 1000, True, lines.append)
    shown.terminal = False  # a log file or a pipe, as under nohup or a scheduler
    hooks = Hooks(1000)
    shown.add_hooks(hooks, log_every=100, eval_every=50)
    return shown, hooks, lines, clock


def test_the_first_step_the_cadence_and_evaluations_get_a_line_with_the_time_left(shown):
    shown, hooks, lines, clock = shown
    for step in range(11, 201):
        clock["now"] += 0.1  # fast steps: the quiet limit is never reached
        hooks.on_record(record(step, **({"val_loss": 4.0} if step % 50 == 0 else {})))
    steps = [int(line.split()[1]) for line in lines]
    assert steps == [11, 50, 100, 150, 200]  # the first step, then evaluations and the cadence
    # 989 steps left at the last 20's mean of 2 s: 1,978 s
    assert lines[0].endswith(", eta 32m58s") and lines[-1].endswith(f", eta {progress.format_duration(800 * 2.0)}")
    assert "val_loss 4.0000" in lines[1]


def test_without_a_terminal_the_log_is_never_quiet_for_longer_than_the_limit(shown):
    shown, hooks, lines, clock = shown
    for step in range(11, 60):
        clock["now"] += 7.0  # slow steps: 30 s pass every 5 steps
        hooks.on_record(record(step, step_time_s=7.0))
    steps = [int(line.split()[1]) for line in lines]
    assert steps[0] == 11 and all(b - a <= 5 for a, b in zip(steps, steps[1:])) and len(steps) >= 9


def test_durations_read_as_a_person_reads_them():
    assert [progress.format_duration(s) for s in (4.2, 65, 3725, 0)] == ["4s", "1m05s", "1h02m05s", "0s"]


def test_a_metrics_file_that_cannot_take_a_record_is_one_warning_and_training_goes_on(tmp_path, monkeypatch):
    """metrics.jsonl on a full disk (every append ENOSPC, as the kernel says it): one warning
    line, the records go on in memory and in the log; once the file takes a write again, a later
    failure is said again."""
    import builtins
    import errno

    from megascale_jax import run_dir as run_dirs

    full = {"now": True}
    metrics = str(tmp_path / "metrics.jsonl")

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        if path == metrics and "a" in mode and full["now"]:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(run_dirs, "open", open_on_a_full_disk, raising=False)
    lines, warnings = [], []
    shown = progress.Progress(str(tmp_path), 0, 10, True, lines.append, warnings.append)
    hooks = Hooks(10)
    shown.add_hooks(hooks, log_every=1, eval_every=0)
    for step in range(1, 4):
        hooks.on_record(record(step))
    assert warnings == [f"warning: cannot append to {metrics}: no space left on its disk; "
                        "training goes on, and its log keeps the progress"]
    assert [r["step"] for r in shown.records] == [1, 2, 3] and len(lines) == 3
    full["now"] = False  # space again: the next record is written
    hooks.on_record(record(4))
    full["now"] = True  # and full again: said again
    hooks.on_record(record(5))
    assert len(warnings) == 2 and [r["step"] for r in run_dirs.read_jsonl(metrics)] == [4]
