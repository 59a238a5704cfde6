"""`train.eval_tasks` end to end: downstream scores while training on a pp x dp x tp mesh equal
what `python -m megascale_jax.evaluate` gives for the same checkpoint on one device; the training
losses are bitwise those of the same run without them; the scores reach metrics.jsonl,
TensorBoard and the report's plot; task files that cannot be scored are a warning each, and the
run goes on."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"), "model.layers=2", "model.d_model=32",
        "model.seq_len=32", "train.global_batch=8", "mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "parallel.microbatches=2",
        "train.steps=4", "train.eval_every=2", "checkpoint.every=4", "train.compile_cache=false",
        "train.sample_at_end=0"]  # tiny_cpu's end-of-run sample: its own test (training/test_sample_at_end.py)
TASKS = ["docs/examples/tasks/python_mc.yaml", "docs/examples/tasks/python_lambada.jsonl"]


def command(module: str, *argv: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_scores_while_training_equal_evaluate_and_leave_the_losses_bitwise(tmp_path):
    shutil.copytree(os.path.join(REPO, "docs", "examples", "tasks"), tmp_path / "docs" / "examples" / "tasks")
    (tmp_path / "broken.jsonl").write_text('{"context": "Q", "choices": ["a"], "gold": 0}\n{"context": \n')
    # two task files that cannot be scored: one warning each, and training goes on with the others
    done = command("megascale_jax.train", "--run-dir", "scored", *TINY,
                   f"train.eval_tasks=[{','.join(TASKS)},missing.jsonl,broken.jsonl]", "train.eval_tasks_every=3",
                   cwd=tmp_path)
    warned = [line for line in done.stderr.splitlines() if line.startswith("warning: train.eval_tasks")]
    assert len(warned) == 2 and "missing.jsonl does not exist" in warned[0] and "broken.jsonl:2" in warned[1], warned
    assert all(line.endswith("that task is not scored, training goes on") for line in warned)
    command("megascale_jax.train", "--run-dir", "plain", *TINY, cwd=tmp_path)
    scored, plain = records(tmp_path / "scored"), records(tmp_path / "plain")
    assert [r["loss"] for r in scored] == [r["loss"] for r in plain]  # bitwise: floats as JSON wrote them
    assert [r.get("val_loss") for r in scored] == [r.get("val_loss") for r in plain]
    assert [r["step"] for r in scored if "downstream" in r] == [3, 4]  # every 3 steps, and the last
    assert [r["step"] for r in scored if "val_loss" in r] == [2, 4]  # the validation loss's own cadence
    ours = scored[-1]["downstream"]
    out = command("megascale_jax.evaluate", "scored", "--tasks", ",".join(TASKS), "--json", "--bootstrap-iters", "0",
                  cwd=tmp_path).stdout
    reference = json.loads(out)
    assert reference["step"] == 4
    compared = 0
    for task, metrics in reference["results"].items():
        for key, value in metrics.items():
            if "," not in key or value == "N/A":
                continue
            name = f"{task}/{key.split(',')[0]}"
            np.testing.assert_allclose(ours[name], value, rtol=1e-5, err_msg=name)
            compared += 1
    assert compared == 7 and set(ours) == {f"{t}/{m}" for t in ("python_mc", "python_lambada")
                                           for m in ("acc", "acc_stderr")} | {
        "python_mc/acc_norm", "python_mc/acc_norm_stderr", "python_lambada/perplexity", "seconds"}
    # TensorBoard and the report's plot
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = event_accumulator.EventAccumulator(str(tmp_path / "scored" / "tensorboard"))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("downstream/python_mc/acc_norm")] == [
        (r["step"], pytest.approx(r["downstream"]["python_mc/acc_norm"])) for r in scored if "downstream" in r]
    command("megascale_jax.report", "scored", cwd=tmp_path)
    assert (tmp_path / "scored" / "report" / "downstream.png").stat().st_size > 10_000
