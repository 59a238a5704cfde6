"""`train.eval_tasks`: downstream scores while training, on the training mesh, as
lm-evaluation-harness scores them.

    train.eval_tasks=[tasks/hellaswag.yaml,tasks/lambada.jsonl] train.eval_tasks_every=500

The tasks are the files `python -m megascale_jax.evaluate` reads (`megascale_jax.evaluation`),
tokenized once at start-up with the run's own tokenizer, before anything compiles, into lm-eval's
requests; a task file that cannot be scored is one warning line and left out, and training goes on. Every `eval_tasks_every` steps and at the
last step the current parameters score them: rows of `model.seq_len + 1` tokens in batches of
`train.global_batch`, the training batch's shape and sharding, through `Trainer.score_rows` (the
model's forward on the mesh, through the pipeline's forward-only schedule at pp > 1; one
compiled function, as `eval_loss`). The scores go into that step's metrics record,

    "downstream": {"mc/acc": 0.42, "mc/acc_stderr": 0.03, "mc/acc_norm": ..., "lambada/perplexity": ...}

and so into metrics.jsonl, TensorBoard (`downstream/mc/acc`) and the report's plot. Nothing in the
train state, the data order or the random keys is touched: the losses are bitwise the same with
and without it. Perplexity's bootstrap standard error (lm-eval's 100,000 resamples, seconds a task)
is left to `evaluate`; the means' standard errors are exact and cheap, and are logged.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from megascale_jax import cli
from megascale_jax.config import Config, ConfigError

logger = cli.get_logger("downstream")


def run_tokenizer_of(cfg: Config, token_file: str | None):
    """(the tokenizer the run's ids mean, lm-eval's prefix token) from the data the run reads: the
    byte tokenizer for the text sources, else the tokenizer.json beside the token file (what
    `tokenize` and the jsonl/parquet sources write, and the run directory records)."""
    from megascale_jax.training.tokenizer import (BYTE_LEVEL_SOURCES, TOKENIZER_FILE, byte_tokenizer,
                                                  end_of_text_beside, prefix_token)

    if cfg.data.source in BYTE_LEVEL_SOURCES:
        tokenizer = byte_tokenizer()
        return tokenizer, prefix_token(tokenizer, None)
    from tokenizers import Tokenizer

    token_file = token_file or (next(iter(cfg.data.mix)) if cfg.data.mix else cfg.data.path)
    directory = os.path.dirname(os.path.abspath(token_file))
    path = os.path.join(directory, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"train.eval_tasks needs the tokenizer the run's ids mean, and {token_file} has no "
                          f"{TOKENIZER_FILE} beside it; put it there (python -m megascale_jax.tokenize writes one)")
    tokenizer = Tokenizer.from_file(path)
    return tokenizer, prefix_token(tokenizer, end_of_text_beside(directory))


def prepare(cfg: Config, token_file: str | None) -> list:
    """Each of `train.eval_tasks` read and tokenized into its requests (`evaluator.prepare`). A task
    file that cannot be scored (missing, malformed: file:line, no items, a choice the tokenizer
    cannot encode, a name given twice) is one warning line and left out: a mistake in an
    evaluation does not stop a training run (issue 60), and the run's own config was checked."""
    if not cfg.train.eval_tasks:
        return []
    from megascale_jax.evaluation import evaluator, requests
    from megascale_jax.evaluation.tasks import TaskError

    try:
        tokenizer, prefix = run_tokenizer_of(cfg, token_file)
    except ConfigError as e:
        logger.warning(f"warning: {e}; no downstream task is scored, training goes on")
        return []
    encoder = requests.for_tokenizer(tokenizer, prefix)
    prepared, names = [], set()
    for path in cfg.train.eval_tasks:
        try:
            task = evaluator.prepare(evaluator.load_task(path), encoder, cfg.model.seq_len)
            if not task.task.items:
                raise TaskError(f"task file {path} has no items")
            if task.task.name in names:
                raise TaskError(f"task file {path}: a task named {task.task.name!r} is listed already; each "
                                "task's name keys its scores")
        except TaskError as e:
            logger.warning(f"warning: train.eval_tasks: {e}; that task is not scored, training goes on")
            continue
        prepared.append(task)
        names.add(task.task.name)
    if prepared:
        cadence = (f"every {cfg.train.eval_tasks_every} steps and at the last" if cfg.train.eval_tasks_every
                   else "at the last step")
        logger.info("downstream: " + ", ".join(
            f"{p.task.name} ({len(p.task.items):,} items, {len(p.requests):,} requests"
            + (f", {p.truncated:,} cut to model.seq_len" if p.truncated else "") + ")" for p in prepared)
            + f"; scored {cadence}")
    return prepared


class Downstream:
    """The tasks' scores for the parameters of a step, as fields of its metrics record."""

    def __init__(self, cfg: Config, prepared: list, score_rows, batch_sharding):
        self.cfg, self.prepared, self.score_rows, self.batch_sharding = cfg, prepared, score_rows, batch_sharding

    def scores(self, params) -> dict:
        from megascale_jax.evaluation import evaluator
        from megascale_jax.evaluation.scoring import as_batch

        def score_batch(tokens, targets, mask):
            batch = self._global(as_batch(tokens, targets))
            summed, greedy = self.score_rows(params, batch, self._global(mask))
            return np.asarray(summed), np.asarray(greedy)

        t0, found = time.perf_counter(), {}
        for prepared in self.prepared:
            result = evaluator.score(prepared, score_batch, self.cfg.train.global_batch, self.cfg.model.seq_len,
                                     bootstrap_iters=0)
            for metric, (value, stderr) in result.metrics.items():
                found[f"{result.name}/{metric}"] = float(value)
                if stderr is not None:
                    found[f"{result.name}/{metric}_stderr"] = float(stderr)
        found["seconds"] = round(time.perf_counter() - t0, 3)
        return {"downstream": found}

    def _global(self, rows: np.ndarray) -> jax.Array:
        """`rows` (every process holds them all) as one array sharded like the training batch."""
        return jax.make_array_from_callback(rows.shape, self.batch_sharding, lambda index: rows[index])
