"""What a task is once loaded, and the project's own JSONL task file.

A task is a name, an lm-evaluation-harness `output_type`, the metrics to report and its items,
already rendered to strings: everything after this point (requests, scores, metrics) is the same
whether the task came from our JSONL or from an lm-eval YAML (`lm_eval_yaml`). Rendering first
also means every mistake in a task file (a bad line, an empty choice list, a gold index out of
range) is found before a model is read or a step is compiled.

The JSONL schema, one item a line, every line of a file of one kind (the file's stem names the
task):

  multiple choice   {"context": "The sky is", "choices": ["blue", "green"], "gold": 0}
                    scored as lm-eval scores `output_type: multiple_choice` with
                    doc_to_text=context, doc_to_choice=choices, doc_to_target=gold and the
                    default target_delimiter " ": each continuation is " " + choice.
  loglikelihood     {"context": "He opened the", "target": " door"}   (LAMBADA-style)
                    the target is scored as written (lm-eval adds no delimiter to a
                    loglikelihood request): give it its leading space.
  rolling           {"text": "A whole document ..."}
                    `loglikelihood_rolling`: the document's perplexity in model-length windows.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Union

MULTIPLE_CHOICE, LOGLIKELIHOOD, ROLLING = "multiple_choice", "loglikelihood", "loglikelihood_rolling"
OUTPUT_TYPES = (MULTIPLE_CHOICE, LOGLIKELIHOOD, ROLLING)
# lm-eval's DEFAULT_METRIC_REGISTRY (api/registry.py): what a task without a metric_list reports
DEFAULT_METRICS = {MULTIPLE_CHOICE: ("acc", "acc_norm"), LOGLIKELIHOOD: ("perplexity", "acc"),
                   ROLLING: ("word_perplexity", "byte_perplexity", "bits_per_byte")}
# what each output type can report here (lm-eval's process_results computes these from the
# log-likelihoods alone; its other metrics need generation or sklearn)
SUPPORTED_METRICS = {MULTIPLE_CHOICE: ("acc", "acc_norm", "acc_bytes"), LOGLIKELIHOOD: ("perplexity", "acc"),
                     ROLLING: ("word_perplexity", "byte_perplexity", "bits_per_byte")}


class TaskError(ValueError):
    """A task file a user gave is wrong: one line, naming file:line where there is one."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """One multiple-choice item: `continuations[i]` is what is scored (target_delimiter +
    choice i), `choices[i]` the bare choice lm-eval normalises acc_norm and acc_bytes by."""
    context: str
    choices: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int


@dataclasses.dataclass(frozen=True)
class Continuation:
    """One loglikelihood item: log P(target | context), and whether greedy decoding gives it."""
    context: str
    target: str


@dataclasses.dataclass(frozen=True)
class Document:
    """One rolling-loglikelihood item: the whole text's log-likelihood."""
    text: str


Item = Union[Choice, Continuation, Document]


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    output_type: str
    metrics: tuple[str, ...]
    items: tuple[Item, ...]
    version: str | None = None
    locations: tuple[str, ...] = ()  # file:line of each item, for messages
    num_fewshot: int = 0  # the few-shot examples already in each item's context (lm_eval_yaml)

    def where(self, i: int) -> str:
        return self.locations[i] if i < len(self.locations) else f"{self.name}: item {i + 1}"


def choice_item(where: str, context: str, choices, gold, delimiter: str = " ") -> Choice:
    """A checked multiple-choice item; `gold` an index (or, as lm-eval allows, the gold choice's
    text). `where`: file:line for the error."""
    if not isinstance(choices, (list, tuple)) or not all(isinstance(c, str) for c in choices):
        raise TaskError(f"{where}: choices must be a list of strings, got {choices!r}")
    if not choices:
        raise TaskError(f"{where}: the choice list is empty; give at least one choice")
    if isinstance(gold, str):  # lm-eval's process_results: a string gold is looked up among the choices
        if gold not in choices:  # lm-eval scores such an item 0 with a warning; here it is a mistake
            raise TaskError(f"{where}: gold {gold!r} is not one of the choices {list(choices)!r}")
        gold = choices.index(gold)
    if isinstance(gold, bool) or not isinstance(gold, int):
        raise TaskError(f"{where}: gold must be an integer index into the choices, got {gold!r}")
    if not 0 <= gold < len(choices):
        raise TaskError(f"{where}: gold index {gold} is out of range for {len(choices)} choices "
                        f"(0..{len(choices) - 1})")
    return Choice(context, tuple(choices), tuple(f"{delimiter}{c}" for c in choices), gold)


def read_json_lines(path: str) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSON Lines file."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise TaskError(f"{path}:{number}: not valid JSON ({e.msg}); one JSON object a line") from None
                if not isinstance(row, dict):
                    raise TaskError(f"{path}:{number}: a line must be a JSON object, got {type(row).__name__}")
                rows.append((number, row))
    except UnicodeDecodeError:
        raise TaskError(f"{path}: not UTF-8 text; a task file is JSON Lines") from None
    except OSError as e:
        raise TaskError(f"cannot read task file {path} ({e.strerror})") from None
    return rows


def _kind(row: dict) -> str | None:
    if "choices" in row:
        return MULTIPLE_CHOICE
    if "target" in row:
        return LOGLIKELIHOOD
    if "text" in row:
        return ROLLING
    return None


def _string(where: str, row: dict, key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise TaskError(f"{where}: {key!r} must be a string, got {value!r}")
    return value


def load_jsonl(path: str, limit: int | None = None) -> Task:
    """The task in a JSONL file of the schema above; its first `limit` items if given."""
    rows = read_json_lines(path)
    if not rows:
        raise TaskError(f"{path}: the task file has no items")
    kind = None
    items, locations = [], []
    for number, row in rows[:limit]:
        where = f"{path}:{number}"
        locations.append(where)
        this = _kind(row)
        if this is None:
            raise TaskError(f"{where}: an item needs \"choices\" (multiple choice), \"target\" (loglikelihood) "
                            f"or \"text\" (rolling loglikelihood); got keys {sorted(row)}")
        if kind is not None and this != kind:
            raise TaskError(f"{where}: a {this} item in a file of {kind} items; one kind a file")
        kind = this
        if kind == MULTIPLE_CHOICE:
            if "gold" not in row:
                raise TaskError(f"{where}: a multiple-choice item needs \"gold\", the right choice's index")
            items.append(choice_item(where, _string(where, row, "context"), row["choices"], row["gold"]))
        elif kind == LOGLIKELIHOOD:
            items.append(Continuation(_string(where, row, "context"), _string(where, row, "target")))
        else:
            items.append(Document(_string(where, row, "text")))
    name = os.path.splitext(os.path.basename(path))[0]
    return Task(name, kind, DEFAULT_METRICS[kind], tuple(items), locations=tuple(locations))
