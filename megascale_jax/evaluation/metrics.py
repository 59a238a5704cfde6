"""Per-item scores and their aggregates, computed as lm-evaluation-harness 0.4.13 computes them.

Per item (`ConfigurableTask.process_results`, api/task.py):

* multiple_choice: lls = each choice's log-likelihood. acc: argmax(lls) == gold.
  acc_norm: argmax(lls / len(choice)) == gold, where len is the choice's length in CHARACTERS
  (`completion_len = [float(len(i)) for i in choices]`: a Python str's len, of the bare choice,
  without the target delimiter). acc_bytes divides by the choice's UTF-8 byte length instead.
  (lm-eval's docs speak of byte-length normalisation; its code normalises acc_norm by characters,
  and the code is followed here: the two differ only for non-ASCII choices.) Ties go to the
  first choice (np.argmax).
* loglikelihood: perplexity collects the log-likelihood, acc whether the continuation is the
  greedy one (LAMBADA's last-word accuracy).
* loglikelihood_rolling: (log-likelihood, words) and (log-likelihood, bytes) of the document,
  words = len(re.split(r"\\s+", text)) (`Task.count_words`), bytes = its UTF-8 length.

Aggregates (api/metrics.py): mean for the accuracies; perplexity = exp(-mean(ll));
word/byte_perplexity = exp(-sum(ll) / sum(count)) (`weighted_perplexity`); bits_per_byte =
-sum(ll) / sum(bytes) / ln 2.

Standard errors (`stderr_for_metric`, evaluator_utils._compute_task_aggregations): a mean's is
the sample standard deviation over sqrt(n) (`mean_stderr`); perplexity's is lm-eval's
bootstrap (`bootstrap_stderr`: resamples drawn by `random.Random(i).choices` for chunk i of 1,000,
the sample standard deviation of the resampled perplexities), reproduced draw for draw here
(`bootstrap_perplexity_stderr`); the weighted perplexities and bits_per_byte have none ("N/A",
None here), and neither has any metric of a single item.
"""

from __future__ import annotations

import math
import random
import re
from typing import Sequence

import numpy as np

from megascale_jax.evaluation.tasks import LOGLIKELIHOOD, MULTIPLE_CHOICE, ROLLING, Choice, Document, Task

BOOTSTRAP_ITERS = 100_000  # lm-eval's simple_evaluate default
_CHUNK = 1000  # bootstrap_stderr's chunk: min(1000, iters) resamples a seed


def choice_scores(item: Choice, lls: Sequence[float]) -> dict[str, float]:
    lls = np.asarray(lls, np.float64)
    characters = np.array([float(len(c)) for c in item.choices])
    utf8 = np.array([float(len(c.encode("utf-8"))) for c in item.choices])
    return {"acc": float(np.argmax(lls) == item.gold), "acc_norm": float(np.argmax(lls / characters) == item.gold),
            "acc_bytes": float(np.argmax(lls / utf8) == item.gold)}


def count_words(text: str) -> int:
    return len(re.split(r"\s+", text))


def mean_stderr(values: Sequence[float]) -> float | None:
    n = len(values)
    if n < 2:
        return None
    values = np.asarray(values, np.float64)
    return float(np.sqrt(np.sum((values - values.mean()) ** 2) / (n - 1)) / np.sqrt(n))


def python_random_uniforms(seed: int, count: int) -> np.ndarray:
    """The first `count` values of `random.Random(seed).random()`, drawn by numpy: Python seeds
    its MT19937 (its state is taken from Python itself, so the seeding is Python's), and both
    build a double from two 32-bit draws as ((a >> 5) * 2^26 + (b >> 6)) / 2^53, as numpy's
    legacy RandomState does."""
    state = random.Random(seed).getstate()[1]  # 624 words and the position
    generator = np.random.RandomState()
    generator.set_state(("MT19937", np.array(state[:-1], dtype=np.uint32), state[-1]))
    return generator.random_sample(count)


def bootstrap_perplexity_stderr(lls: Sequence[float], iters: int = BOOTSTRAP_ITERS) -> float | None:
    """lm-eval's bootstrap_stderr(perplexity, lls, iters): chunk i draws min(1000, iters)
    resamples of len(lls) with random.Random(i).choices (index floor(random() * n))."""
    n = len(lls)
    if n < 2 or iters <= 0:
        return None
    values = np.asarray(lls, np.float64)
    chunk = min(_CHUNK, iters)
    resampled = []
    for i in range(iters // chunk):
        picks = np.floor(python_random_uniforms(i, chunk * n) * n).astype(np.int64).reshape(chunk, n)
        resampled.append(np.exp(-values[picks].mean(axis=1)))
    res = np.concatenate(resampled)
    return float(np.sqrt(np.sum((res - res.mean()) ** 2) / (len(res) - 1)))


def aggregate(task: Task, lls: Sequence, greedy: Sequence, bootstrap_iters: int = BOOTSTRAP_ITERS
              ) -> dict[str, tuple[float, float | None]]:
    """metric -> (value, stderr or None) over the task's items. For multiple choice `lls[i]` is
    item i's list of choice log-likelihoods; otherwise item i's log-likelihood, and `greedy[i]`
    its is_greedy (loglikelihood tasks)."""
    out = {}
    if task.output_type == MULTIPLE_CHOICE:
        per_item = [choice_scores(item, ll) for item, ll in zip(task.items, lls)]
        for name in task.metrics:
            values = [s[name] for s in per_item]
            out[name] = (float(np.mean(values)), mean_stderr(values))
    elif task.output_type == LOGLIKELIHOOD:
        values = np.asarray(lls, np.float64)
        for name in task.metrics:
            if name == "perplexity":
                out[name] = (math.exp(-values.mean()), bootstrap_perplexity_stderr(values, bootstrap_iters))
            else:
                accs = [float(g) for g in greedy]
                out[name] = (float(np.mean(accs)), mean_stderr(accs))
    elif task.output_type == ROLLING:
        values = np.asarray(lls, np.float64)
        docs: Sequence[Document] = task.items
        words = sum(count_words(d.text) for d in docs)
        utf8 = sum(len(d.text.encode("utf-8")) for d in docs)
        total = float(values.sum())
        for name in task.metrics:
            value = {"word_perplexity": lambda: math.exp(-total / words),
                     "byte_perplexity": lambda: math.exp(-total / utf8),
                     "bits_per_byte": lambda: -total / utf8 / math.log(2)}[name]()
            out[name] = (value, None)
    else:
        raise ValueError(f"unknown output_type {task.output_type!r}")
    return out
