"""bench/training/lamb_batch.py, the LAMB-at-4x-batch study: its comparison (difference of means
against 2 x the standard error), its learning-rate choice, a tiny study end to end in this process
(every arm sees the same tokens; the summary is the runs' own numbers), and bad input refused in
one line before anything runs."""

import json
import math
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # bench/ is not installed: it imports from the checkout's root, as `python -m bench...` runs

from bench.training import lamb_batch  # noqa: E402

TINY_MODEL = ["model.layers=1", "model.d_model=32", "model.heads=2", "model.kv_heads=2", "model.seq_len=32",
              "model.window=8"]


def test_compare_is_the_difference_of_means_against_twice_its_standard_error():
    lamb, adamw = [1.50, 1.52, 1.51], [1.49, 1.50, 1.53]
    result = lamb_batch.compare(lamb, adamw)
    se = math.sqrt(np.var(lamb, ddof=1) / 3 + np.var(adamw, ddof=1) / 3)
    assert result["difference"] == pytest.approx(np.mean(lamb) - np.mean(adamw))
    assert result["noise"] == pytest.approx(2 * se)
    assert result["not_worse"] and not result["worse"]
    worse = lamb_batch.compare([1.60, 1.61, 1.62], adamw)
    assert worse["worse"] and not worse["not_worse"] and worse["difference"] == pytest.approx(0.1033333, abs=1e-6)
    better = lamb_batch.compare([1.30, 1.31, 1.32], adamw)  # better than the reference by far: no loss
    assert better["not_worse"] and better["difference"] < -better["noise"]


def test_the_chosen_learning_rate_is_the_best_finished_run_and_an_edge_is_flagged():
    sweep = [{"lr": 1e-3, "final_val_loss": 2.0}, {"lr": 2e-3, "final_val_loss": 1.8},
             {"lr": 4e-3, "final_val_loss": None}]  # diverged
    assert lamb_batch.choose_lr(sweep) == (2e-3, False)
    assert lamb_batch.choose_lr(sweep[:2]) == (2e-3, True)  # the best is the largest tried
    with pytest.raises(RuntimeError, match="every learning rate diverged"):
        lamb_batch.choose_lr([{"lr": 1.0, "final_val_loss": None}])


@pytest.mark.slow
def test_a_tiny_study_compares_the_arms_on_the_same_tokens(tmp_path, capsys):
    out = tmp_path / "lamb_batch.json"
    code = lamb_batch.main(["--batch", "2", "--large-steps", "4", "--evals", "2", "--seeds", "2",
                            "--val-sequences", "4", "--adamw-lrs", "1e-3", "3e-3", "--lamb-lrs", "2e-2",
                            "--adamw-4b-lrs", "3e-3", "--out", str(out), *TINY_MODEL])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    runs = result["runs"]
    # The sweep at seed 0, then the winner at seed 1: 2 + 1 + 1 + 1 + 1 + 1 runs.
    assert [(r["arm"], r["seed"]) for r in runs] == [
        ("adamw_B", 0), ("adamw_B", 0), ("adamw_B", 1), ("lamb_4B", 0), ("lamb_4B", 1), ("adamw_4B", 0),
        ("adamw_4B", 1)]
    # Same tokens at every evaluation point: the B arm takes 4x the steps of 4x smaller batches.
    assert {tuple(t for t, _ in r["curve"]) for r in runs} == {(0, 4 * 8 * 32 // 2, 4 * 8 * 32)}
    assert {(r["arm"], r["batch"], r["steps"]) for r in runs} == {
        ("adamw_B", 2, 16), ("lamb_4B", 8, 4), ("adamw_4B", 8, 4)}
    assert result["study"]["tokens_per_run"] == 4 * 8 * 32
    # The chosen rate is the sweep's best at seed 0; the summary and the claim are those runs' numbers.
    sweep = {r["lr"]: r["final_val_loss"] for r in runs if r["arm"] == "adamw_B" and r["seed"] == 0}
    assert result["chosen_lr"]["adamw_B"] == min(sweep, key=sweep.get)
    finals = {a: [r["final_val_loss"] for r in runs if r["arm"] == a and r["lr"] == result["chosen_lr"][a]]
              for a in ("adamw_B", "lamb_4B", "adamw_4B")}
    assert result["final_val_loss"]["lamb_4B"]["seeds"] == finals["lamb_4B"]
    assert result["claim_lamb_4B_vs_adamw_B"] == lamb_batch.compare(finals["lamb_4B"], finals["adamw_B"])
    assert result["control_adamw_4B_vs_adamw_B"] == lamb_batch.compare(finals["adamw_4B"], finals["adamw_B"])
    assert (tmp_path / "lamb_batch.png").stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--batch", "6", "--dp", "4", "--microbatches", "4"],
     "error: --batch 6: the 4x arms' batch 24 does not divide by --dp 4 x --microbatches 4 = 16; pass a --batch that "
     "is a multiple of 4, or change --dp/--microbatches"),
    (["--batch", "6", "--dp", "4"],
     "error: --batch 6 does not divide by --dp 4 (the AdamW@B arm splits it over dp); pass a --batch that is a "
     "multiple of 4"),
    (["--lamb-lrs", "1e-2", "0"],
     "error: --lamb-lrs 0.0: every learning rate in a sweep must be > 0; drop or raise it"),
    (["--adamw-lrs=-1e-3"],
     "error: --adamw-lrs -0.001: every learning rate in a sweep must be > 0; drop or raise it"),
])
def test_bad_input_is_one_line_naming_the_fix_before_anything_runs(tmp_path, capsys, argv, message):
    out = tmp_path / "never.json"
    assert lamb_batch.main([*argv, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [message] and captured.out == ""
    assert not out.exists() and not (tmp_path / "never.png").exists()
