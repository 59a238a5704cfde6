"""Metrics against hand-computed values and float64 references; the bootstrap against the
standard library's random drawing as lm-eval draws (and lm-eval itself where installed)."""

import math
import random
import statistics

import numpy as np
import pytest

from megascale_jax.evaluation import metrics
from megascale_jax.evaluation.tasks import Choice, Continuation, Document, Task


def choice(choices, gold):
    return Choice("q", tuple(choices), tuple(" " + c for c in choices), gold)


def test_acc_norm_divides_by_characters_and_acc_bytes_by_utf8_bytes():
    # "ü" is 1 character and 2 bytes; lls chosen so the three normalisations pick three answers
    item = choice(["üüüü", "abc", "z"], gold=0)
    lls = [-10.0, -7.0, -2.6]
    # acc: argmax lls = 2. per char: -2.5, -2.333, -2.6 -> 1. per byte: -1.25, -2.333, -2.6 -> 0
    assert metrics.choice_scores(item, lls) == {"acc": 0.0, "acc_norm": 0.0, "acc_bytes": 1.0}
    assert metrics.choice_scores(choice(["üüüü", "abc", "z"], 1), lls)["acc_norm"] == 1.0
    assert metrics.choice_scores(choice(["a", "b"], 0), [-1.0, -1.0])["acc"] == 1.0  # ties: the first


def test_aggregates_and_stderr_by_hand():
    rng = np.random.default_rng(4)
    items = tuple(choice(["a", "bb", "ccc"], int(g)) for g in rng.integers(0, 3, 9))
    lls = rng.normal(-5, 2, (9, 3)).tolist()
    out = metrics.aggregate(Task("mc", "multiple_choice", ("acc", "acc_norm"), items), lls, [False] * 9)
    accs = [float(np.argmax(ll) == it.gold) for it, ll in zip(items, lls)]
    assert out["acc"][0] == pytest.approx(sum(accs) / 9)
    assert out["acc"][1] == pytest.approx(statistics.stdev(accs) / 3)

    lls = rng.normal(-3, 1, 7)
    task = Task("ll", "loglikelihood", ("perplexity", "acc"), tuple(Continuation("c", " t") for _ in range(7)))
    greedy = [True, False, False, True, False, False, False]
    out = metrics.aggregate(task, lls, greedy, bootstrap_iters=0)
    assert out["perplexity"] == (pytest.approx(math.exp(-sum(lls) / 7)), None)
    assert out["acc"] == (pytest.approx(2 / 7), pytest.approx(statistics.stdev([float(g) for g in greedy]) / 7 ** .5))


def test_rolling_perplexities_weight_by_words_and_bytes():
    docs = (Document("one two  three"), Document("naïve\ttext"))  # 3 words (\s+), 2 words; 14 and 11 bytes
    lls = [-20.0, -9.0]
    out = metrics.aggregate(Task("r", "loglikelihood_rolling", ("word_perplexity", "byte_perplexity",
                                                                "bits_per_byte"), docs), lls, [False, False])
    assert out["word_perplexity"] == (pytest.approx(math.exp(29 / 5)), None)
    assert out["byte_perplexity"] == (pytest.approx(math.exp(29 / 25)), None)
    assert out["bits_per_byte"] == (pytest.approx(29 / 25 / math.log(2)), None)


def python_bootstrap(lls, iters):
    """lm-eval's bootstrap_stderr(perplexity, ...) written with the standard library."""
    res = []
    chunk = min(1000, iters)
    for i in range(iters // chunk):
        rnd = random.Random(i)
        for _ in range(chunk):
            sample = rnd.choices(lls, k=len(lls))
            res.append(math.exp(-sum(sample) / len(sample)))
    return statistics.stdev(res)


def test_perplexity_stderr_is_lm_evals_bootstrap_draw_for_draw():
    lls = np.random.default_rng(5).normal(-4, 1.5, 13).tolist()
    assert metrics.bootstrap_perplexity_stderr(lls, 2000) == pytest.approx(python_bootstrap(lls, 2000), rel=1e-10)
    assert metrics.bootstrap_perplexity_stderr(lls[:1], 2000) is None


def test_perplexity_stderr_matches_lm_eval(monkeypatch):
    lm_metrics = pytest.importorskip("lm_eval.api.metrics", reason="lm-eval is not installed")
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # the same draws, without a process pool
    lls = np.random.default_rng(6).normal(-2, 1, 11).tolist()
    theirs = lm_metrics.bootstrap_stderr(lm_metrics.perplexity, lls, iters=3000)
    assert metrics.bootstrap_perplexity_stderr(lls, 3000) == pytest.approx(theirs, rel=1e-10)
