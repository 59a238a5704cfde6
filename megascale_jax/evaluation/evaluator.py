"""A task set scored end to end: items -> requests -> batches -> metrics.

Two halves, so that every mistake is found before the model is touched: `prepare` tokenises a
task into its requests (and refuses a continuation the tokenizer cannot encode, or one longer
than the model); `score` runs them through the caller's `score_batch` (`batching`) and
aggregates lm-eval's metrics (`metrics`). `python -m megascale_jax.evaluate` prepares every task,
then reads the checkpoint, then scores; the training loop can prepare once at start-up and score
at each evaluation step. `load_task` reads a task file of either format.
"""

from __future__ import annotations

import dataclasses
import os

from megascale_jax.evaluation import batching, lm_eval_yaml, metrics, tasks
from megascale_jax.evaluation.requests import Encoder, Request, item_requests, truncated
from megascale_jax.evaluation.tasks import MULTIPLE_CHOICE, Task


@dataclasses.dataclass(frozen=True)
class Prepared:
    task: Task
    requests: tuple[Request, ...]
    owners: tuple[int, ...]  # the item each request belongs to
    truncated: int  # requests lm-eval cuts from the left to the model's length


@dataclasses.dataclass(frozen=True)
class TaskResult:
    name: str
    version: str | None
    output_type: str
    metrics: dict  # metric -> (value, stderr or None)
    items: int
    requests: int
    truncated: int
    loglikelihoods: list  # per item: its choices' log-likelihoods (multiple choice) or its own
    num_fewshot: int = 0


def load_task(path: str, limit: int | None = None, num_fewshot: int | None = None) -> tasks.Task:
    """A task from a `.jsonl` file (the schema above) or an lm-eval task `.yaml`; `num_fewshot`
    overrides a YAML task's own; a JSONL task draws its examples from its own items."""
    if not os.path.isfile(path):
        raise tasks.TaskError(f"task file {path} does not exist; pass a .jsonl task file or an lm-eval task .yaml")
    if path.endswith((".yaml", ".yml")):
        return lm_eval_yaml.load(path, limit, num_fewshot)
    if path.endswith((".jsonl", ".json")):
        task = tasks.load_jsonl(path, limit)
        return lm_eval_yaml.with_examples(task, path, num_fewshot) if num_fewshot else task
    raise tasks.TaskError(f"task file {path}: unknown format; pass a .jsonl task file or an lm-eval task .yaml/.yml")


def prepare(task: Task, encoder: Encoder, max_length: int) -> Prepared:
    requests, owners = [], []
    for i, item in enumerate(task.items):
        made = item_requests(item, encoder, max_length, task.where(i))
        requests += made
        owners += [i] * len(made)
    return Prepared(task, tuple(requests), tuple(owners), sum(truncated(r, max_length) for r in requests))


def score(prepared: Prepared, score_batch: batching.ScoreBatch, batch_size: int, max_length: int,
          bootstrap_iters: int = metrics.BOOTSTRAP_ITERS) -> TaskResult:
    task = prepared.task
    logprobs, greedy = batching.score(prepared.requests, score_batch, batch_size, max_length)
    per_item = [[] for _ in task.items]
    greedy_item = [True] * len(task.items)
    for owner, ll, g in zip(prepared.owners, logprobs, greedy):
        per_item[owner].append(float(ll))
        greedy_item[owner] = greedy_item[owner] and bool(g)
    # one value an item, except multiple choice's one per choice: a rolling document's windows sum
    lls = per_item if task.output_type == MULTIPLE_CHOICE else [sum(v) for v in per_item]
    return TaskResult(task.name, task.version, task.output_type,
                      metrics.aggregate(task, lls, greedy_item, bootstrap_iters), len(task.items),
                      len(prepared.requests), prepared.truncated, lls, task.num_fewshot)
