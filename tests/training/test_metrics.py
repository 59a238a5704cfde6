"""The metrics recorder: one step late, flushed on demand, divergence named by step."""

import math

import jax.numpy as jnp
import numpy as np
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
    for k, r in enumerate(records, 1):  # throughput over the steps recorded so far (a window of up to 8)
        assert r["tokens_per_s"] == pytest.approx(1024 * k / sum(x["step_time_s"] for x in records[:k]))
        assert r["mfu"] == pytest.approx(1e-6 * r["tokens_per_s"])
    assert [c for c in watch.calls if c[0] in ("step", "record")] == [("step", 1), ("record", 1), ("step", 2), ("record", 2)]


def test_a_host_that_sees_a_step_finish_late_makes_no_throughput_outlier(monkeypatch):
    """Steps take 0.1 s on the devices; the host sees step 3 finish 0.15 s late, when step 4 is
    done too. One step's time reads 0.25 s then ~0 s; the rate stays within 2x of the steady one."""
    from megascale_jax.training import metrics as metrics_module
    clock = {"now": 0.0}
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: clock["now"])
    recorder, records, _ = make()
    # when the host fetches step k - 1 (pushing step k): 0.1 s apart, but step 3 is seen at 0.45
    seen = {2: 0.1, 3: 0.2, 4: 0.45, 5: 0.4501, **{k: 0.4501 + 0.1 * (k - 5) for k in range(6, 14)}}
    for step in range(1, 13):
        clock["now"] = seen.get(step, 0.0)
        recorder.push(step, metrics(5.0), 0.0)
    clock["now"] = seen[13]
    recorder.flush()
    times = [r["step_time_s"] for r in records]
    assert times[3] == pytest.approx(0.0001)  # the step the host saw late-and-done: raw, as measured
    steady = 1024 / 0.1
    assert all(0.5 * steady <= r["tokens_per_s"] <= 2 * steady for r in records), [r["tokens_per_s"] for r in records]
    assert records[-1]["tokens_per_s"] == pytest.approx(steady)  # 8 steady steps: the window forgot the pair
    assert records[3]["tokens_per_s"] == pytest.approx(1024 * 4 / sum(times[:4]))


def test_a_non_finite_loss_names_its_step():
    recorder, records, _ = make()
    recorder.push(7, metrics(float("nan")), 0.0)
    with pytest.raises(TrainingDiverged, match="at step 7: training diverged; lower optim.lr"):
        recorder.flush()
    assert records == []


@pytest.mark.parametrize("every, expected", [(0, [10]), (3, [3, 6, 9, 10]), (5, [5, 10])])
def test_cadence_every_n_steps_and_at_the_last(every, expected):
    assert [s for s in range(1, 11) if itstime(s, every, last=10)] == expected



def test_step_times_add_up_to_the_wall_when_writing_a_record_takes_time(monkeypatch):
    """Finish-to-finish: the host writing step k's record (0.03 s here) while step k + 1 runs is
    in step k + 1's time, so the step times of a run with no evaluation or save add up to its
    wall; an evaluation's time is still left out."""
    from megascale_jax.training import metrics as metrics_module
    clock = {"now": 0.0}
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: clock["now"])
    records = []

    def write(record):  # on_record: metrics.jsonl, the log line, the progress bar
        records.append(record)
        clock["now"] += 0.03

    recorder = MetricsRecorder(1024, None, "lower optim.lr", LoopObserver(), lambda params: 1.0, write)
    recorder.restart_clock()
    rng = np.random.default_rng(0)
    for step in range(1, 10):
        clock["now"] += float(rng.uniform(0.05, 0.2))  # until step - 1 is seen finished
        recorder.push(step, metrics(5.0), 0.0)
    clock["now"] += 0.1
    recorder.flush(params="params")  # step 9, evaluated: the evaluation and its record are left out
    wall_to_step_9 = clock["now"] - 0.03
    clock["now"] += 0.5
    recorder.push(10, metrics(4.0), 0.0)
    recorder.flush()
    assert sum(r["step_time_s"] for r in records[:9]) == pytest.approx(wall_to_step_9)
    assert records[9]["step_time_s"] == pytest.approx(0.5)


def test_finite_steps_tickets_wait_for_their_step_and_abandon_only_what_was_not_finite():
    """A background save's ticket (saving.py) says True once its step is recorded finite; a
    non-finite step abandons the tickets of it and after it, not those before; a ticket taken
    after a replay waits for the replayed step; close() abandons what still waits."""
    from megascale_jax.training.metrics import FiniteSteps

    finite = FiniteSteps()
    before, bad, after = finite.ticket(15), finite.ticket(16), finite.ticket(17)
    finite.recorded(15)
    finite.not_finite(16)
    assert before() is True and bad() is False and after() is False
    replayed = finite.ticket(16)
    finite.recorded(16)
    assert replayed() is True
    waiting = finite.ticket(20)
    finite.recorded(19)
    finite.close()
    assert waiting() is False and finite.ticket(18)() is True


def test_eval_batches_0_records_the_same_steps_without_compiling_or_running_a_validation(run_main, tmp_path):
    """train.eval_batches=0: no validation loss, and no evaluation step compiled (its start-up
    phase is absent, where a run with a validation lists it: tests/supervise/test_compile_cache.py);
    the records come at the steps they would with one."""
    import json

    from megascale_jax import train

    tiny = ["train.steps=3", "train.eval_every=2", "train.log_every=1", "model.layers=1", "model.d_model=32",
            "model.heads=2", "model.kv_heads=2", "model.seq_len=32", "train.global_batch=2", "mesh.dp=1", "mesh.tp=1",
            "mesh.cpu_devices=1", "observe.timings=false", "observe.tensorboard=false", "train.compile_cache=false",
            "checkpoint.every=0", "train.sample_at_end=0", "train.eval_batches=0"]
    code, out, err = run_main(train.main, ["--run-dir", "run", *tiny], tmp_path)
    assert code == 0, err
    startup = next(line for line in out.splitlines() if "start-up phases" in line)
    assert "train_step" in startup and "eval_loss" not in startup, startup
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and not any("val_loss" in r for r in records)
    assert all(math.isfinite(r["loss"]) for r in records)
