"""The metrics recorder: one step late, flushed on demand, divergence named by step."""

import jax.numpy as jnp
import pytest

from megascale_jax.training.metrics import MetricsRecorder, TrainingDiverged, itstime
from megascale_jax.training.observers import LoopObserver


class Seen(LoopObserver):
    def __init__(self):
        self.calls = []

    def phase(self, step, name, start, duration):
        self.calls.append((name, step))

    def record(self, record):
        self.calls.append(("record", record["step"]))


def metrics(loss):
    return {"loss": jnp.float32(loss), "grad_norm": jnp.float32(2.0), "lr": jnp.float32(1e-3)}


def make(evaluated=()):
    watch, records = Seen(), []
    recorder = MetricsRecorder(tokens_per_step=1024, mfu_per_token_s=1e-6, lr_hint="lower optim.lr", watch=watch,
                               evaluate=lambda params: evaluated.append(params) or 3.25, on_record=records.append)
    return recorder, records, watch


def test_a_step_is_recorded_once_the_next_was_dispatched_or_when_flushed():
    evaluated = []
    recorder, records, watch = make(evaluated)
    recorder.push(1, metrics(5.0), 0.01)
    assert records == []  # held: fetching now would stall the host on a running step
    recorder.push(2, metrics(4.5), 0.02)
    assert [r["step"] for r in records] == [1]
    recorder.flush(params="params of step 2")
    recorder.flush()  # nothing held: a no-op
    assert [r["step"] for r in records] == [1, 2] and evaluated == ["params of step 2"]
    first, second = records
    assert (first["loss"], first["data_wait_s"], "val_loss" in first) == (5.0, 0.01, False)
    assert (second["loss"], second["val_loss"], second["grad_norm"], second["lr"]) == (4.5, 3.25, 2.0, pytest.approx(1e-3))
    for r in records:
        assert r["tokens_per_s"] == pytest.approx(1024 / r["step_time_s"])
        assert r["mfu"] == pytest.approx(1e-6 * r["tokens_per_s"])
    assert [c for c in watch.calls if c[0] in ("step", "record")] == [("step", 1), ("record", 1), ("step", 2), ("record", 2)]


def test_a_non_finite_loss_names_its_step():
    recorder, records, _ = make()
    recorder.push(7, metrics(float("nan")), 0.0)
    with pytest.raises(TrainingDiverged, match="at step 7: training diverged; lower optim.lr"):
        recorder.flush()
    assert records == []


@pytest.mark.parametrize("every, expected", [(0, [10]), (3, [3, 6, 9, 10]), (5, [5, 10])])
def test_cadence_every_n_steps_and_at_the_last(every, expected):
    assert [s for s in range(1, 11) if itstime(s, every, last=10)] == expected
