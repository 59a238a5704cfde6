"""`train --resume-step N`: a run continued from an older committed checkpoint than its newest —
the newer ones set aside (renamed STEP.set-aside, not deleted), the steps after N trained again
exactly as the first time (bitwise), every step once in metrics.jsonl. (A step with no committed
checkpoint is one line and nothing changed: tests/test_bad_inputs.py.)"""

import json
import os
import subprocess
import sys

import pytest

TINY = ["model.layers=1", "model.d_model=32", "model.seq_len=16", "train.global_batch=8", "mesh.dp=8", "mesh.tp=1",
        "train.eval_every=0", "checkpoint.every=2", "train.steps=6", "train.sample_at_end=0"]


def train(run_dir, *extra):
    return subprocess.run([sys.executable, "-m", "megascale_jax.train", "--run-dir", str(run_dir), *TINY, *extra],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def records(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_resume_from_an_older_checkpoint_sets_the_newer_aside_and_retrains_the_same_steps(tmp_path):
    run_dir = tmp_path / "run"
    first = train(run_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {r["step"]: (r["loss"], r["grad_norm"]) for r in records(run_dir)}
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4", "6"]

    again = train(run_dir, "--resume-step", "4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from checkpoint step 4" in again.stdout + again.stderr
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4", "6", "6.set-aside"]
    after = records(run_dir)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5, 6]  # each step once
    assert {r["step"]: (r["loss"], r["grad_norm"]) for r in after} == before  # steps 5 and 6 as the first time
