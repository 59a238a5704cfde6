"""An lm-evaluation-harness task YAML whose data is a local JSON/JSONL file, read as lm-eval reads it.

The same file then runs in both: `lm_eval --model hf --include_path DIR --tasks NAME` and
`python -m megascale_jax.evaluate RUN_DIR --tasks DIR/NAME.yaml`. What lm-eval does (0.4.13,
`api/task.py` ConfigurableTask, `tasks/_yaml_loader.load_yaml`, `utils.apply_template`):

* `include:` merges the named YAMLs first (paths relative to this file), local keys winning.
* the data: `dataset_path: json` with `dataset_kwargs: {data_files: ...}` (Hugging Face
  `datasets`' JSON builder: a string or list is the split "train", a mapping names the splits;
  relative paths are read from the current directory, as `datasets` reads them). The items are
  `test_split`'s if set, else `validation_split`'s (`Task.eval_docs`). Keys an item lacks are
  None, as the builder's table fills them. Nothing is downloaded: any other `dataset_path` is
  refused.
* `doc_to_text`, `doc_to_target`, `doc_to_choice`: the name of a field (taken as is) or a Jinja
  template, rendered with lm-eval's environment (StrictUndefined, trailing newline kept, its
  `regex_replace` filter). A rendered target of digits is the gold index when the task has
  choices; a rendered choice list is a Python literal (`ast.literal_eval`).
* the context is `description` + the few-shot examples + doc_to_text (no chat template), a
  choice's continuation `target_delimiter` (default " ") + the choice; a loglikelihood
  request's continuation is doc_to_target as rendered, with no delimiter; a rolling request's
  text is doc_to_target (its few-shot examples are never used).
* few-shot (`num_fewshot`, or `--num-fewshot` as lm-eval's `--num_fewshot`; `with_examples` for
  this project's JSONL tasks, as the YAML of `JSONL_FIELDS` with `fewshot_split: test`): each
  example is doc_to_text + target_delimiter + its answer (the gold choice's text, or
  doc_to_target) + fewshot_delimiter (default two newlines). They come from `fewshot_config`'s
  `split` or its `samples`, else `fewshot_split`, else the training split, the validation split,
  the test split in that order (`Task.fewshot_docs`); drawn by `random.Random(1234)` (the
  evaluator's `fewshot_random_seed`), one draw a scored item in the items' order: `rnd.sample`
  of n, or of n + 1 less the scored item where the few-shot split is named and is the test split
  (`ContextSampler.sample`), or the first n (`sampler: first_n`).

What would need Python from the task's directory (`!function`, process_docs) or generation is
refused with the key that needs it, before anything is scored.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import random

import yaml

from megascale_jax.evaluation import tasks as task_types
from megascale_jax.evaluation.tasks import LOGLIKELIHOOD, MULTIPLE_CHOICE, OUTPUT_TYPES, ROLLING, TaskError

# the aggregation lm-eval registers for each metric (api/metrics.py register_metric)
AGGREGATION = {"acc": "mean", "acc_norm": "mean", "acc_bytes": "mean", "perplexity": "perplexity",
               "word_perplexity": "weighted_perplexity", "byte_perplexity": "weighted_perplexity",
               "bits_per_byte": "bits_per_byte"}
# keys whose meaning needs the task's own Python or generation
UNSUPPORTED = ("process_docs", "process_results", "custom_dataset", "doc_to_image", "doc_to_audio", "gen_prefix",
               "use_prompt")
FEWSHOT_SEED = 1234  # lm-eval's DEFAULT_OTHER_SEED, simple_evaluate's fewshot_random_seed
# fewshot_config's keys this loader does as lm-eval does (FewshotConfig); the others need Python
FEWSHOT_KEYS = ("sampler", "split", "samples", "fewshot_delimiter", "target_delimiter", "doc_to_text",
                "doc_to_choice", "doc_to_target")


class _Function:
    """A `!function module.name` tag: kept as a marker so that using it is one clear error."""

    def __init__(self, name: str):
        self.name = name


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))


def read_config(path: str, seen: frozenset = frozenset()) -> dict:
    """The YAML at `path` with its `include:`s merged in (lm-eval's load_yaml)."""
    path = os.path.abspath(path)
    if path in seen:
        raise TaskError(f"{path}: include cycle")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = yaml.load(f, Loader=_Loader)  # noqa: S506 (a SafeLoader with one tag added)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        raise TaskError(f"{path}:{mark.line + 1 if mark else '?'}: not valid YAML ({e.problem})") from None
    except OSError as e:
        raise TaskError(f"cannot read task file {path} ({e.strerror})") from None
    if not isinstance(cfg, dict):
        raise TaskError(f"{path}: an lm-eval task YAML is a mapping of keys (task, dataset_path, ...)")
    includes = cfg.pop("include", None)
    if includes is None:
        return cfg
    merged = {}
    for include in includes if isinstance(includes, list) else [includes]:
        target = include if os.path.isabs(include) else os.path.join(os.path.dirname(path), include)
        if not os.path.isfile(target):
            raise TaskError(f"{path}: include {include!r}: {target} does not exist")
        merged.update(read_config(target, seen | {path}))
    merged.update(cfg)
    return merged


def data_file(path: str, cfg: dict, split: str | None = None) -> str:
    """The local file holding the task's evaluation split (or `split`)."""
    if cfg.get("dataset_path") != "json":
        raise TaskError(f"{path}: dataset_path {cfg.get('dataset_path')!r} is not local; nothing is downloaded: use "
                        "dataset_path: json with dataset_kwargs: {data_files: {test: FILE.jsonl}}")
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if files is None:
        raise TaskError(f"{path}: dataset_kwargs.data_files is missing; name the local .jsonl file")
    split = split or cfg.get("test_split") or cfg.get("validation_split")
    if split is None:
        raise TaskError(f"{path}: neither test_split nor validation_split is set; name the split to evaluate")
    if not isinstance(files, dict):
        files = {"train": files}  # datasets: bare data_files are the split "train"
    if split not in files:
        raise TaskError(f"{path}: split {split!r} is not in data_files (splits: {', '.join(map(str, files))})")
    chosen = files[split]
    if isinstance(chosen, list):
        if len(chosen) != 1:
            raise TaskError(f"{path}: data_files[{split!r}] lists {len(chosen)} files; give one")
        chosen = chosen[0]
    if not os.path.isfile(chosen):
        raise TaskError(f"{path}: data file {chosen} does not exist (relative paths are read from the current "
                        "directory, as lm-eval reads them)")
    return chosen


def read_docs(path: str) -> list[tuple[str, dict]]:
    """(file:line, doc) for each item of a JSON Lines file or a JSON array, every doc holding
    every key any of them has (None where it lacks one), as `datasets` builds its table."""
    with open(path, encoding="utf-8") as f:
        head = f.read(1 << 12).lstrip()
    if head.startswith("["):
        try:
            with open(path, encoding="utf-8") as f:
                rows = json.load(f)
        except ValueError as e:
            raise TaskError(f"{path}: not valid JSON ({e})") from None
        located = [(f"{path}: item {i}", row) for i, row in enumerate(rows)]
        if not all(isinstance(row, dict) for _, row in located):
            raise TaskError(f"{path}: every item of the JSON array must be an object")
    else:
        located = [(f"{path}:{number}", row) for number, row in task_types.read_json_lines(path)]
    features = {}
    for _, row in located:
        features.update(dict.fromkeys(row))
    return [(where, {**features, **row}) for where, row in located]


_ENV = None


def render(template: str, doc: dict, where: str, key: str) -> str:
    """`template` rendered as lm-eval renders it (utils.apply_template, its module's `env`)."""
    global _ENV
    try:
        import jinja2
    except ImportError:
        raise TaskError(f"{where}: {key} is a Jinja template and jinja2 is not installed; pip install jinja2") from None
    if _ENV is None:
        import re

        _ENV = jinja2.Environment(loader=jinja2.BaseLoader, undefined=jinja2.StrictUndefined,
                                  keep_trailing_newline=True)
        _ENV.filters["regex_replace"] = lambda s, pattern, repl, count=0: re.sub(pattern, repl, s, count=count)
    try:
        return _ENV.from_string(template).render(**doc)
    except jinja2.TemplateError as e:
        raise TaskError(f"{where}: {key} {template!r}: {e}") from None


def _field(cfg: dict, key: str, doc: dict, where: str):
    spec = cfg.get(key)
    if isinstance(spec, _Function):
        raise TaskError(f"{where}: {key} is `!function {spec.name}`, Python code this loader does not run")
    if isinstance(spec, str) and spec in doc:
        return doc[spec], False  # a field's value, as is
    if isinstance(spec, str):
        return render(spec, doc, where, key), True
    return spec, False


def text(cfg: dict, doc: dict, where: str) -> str:
    value, rendered = _field(cfg, "doc_to_text", doc, where)
    if (rendered and value.isdigit() and cfg.get("doc_to_choice") is not None) or isinstance(value, int):
        raise TaskError(f"{where}: doc_to_text gives an index ({value!r}): a multiple-input task (one context per "
                        "choice, like winogrande) is not supported")
    if not isinstance(value, str):
        raise TaskError(f"{where}: doc_to_text gives {value!r}, not a string")
    return value


def target(cfg: dict, doc: dict, where: str):
    """doc_to_target as lm-eval's ConfigurableTask.doc_to_target returns it."""
    value, rendered = _field(cfg, "doc_to_target", doc, where)
    if rendered:
        if value.isdigit() and cfg.get("doc_to_choice") is not None:
            return ast.literal_eval(value)
        if len(value) >= 2 and value[0] == "[" and value[-1] == "]":
            try:
                return ast.literal_eval(value)
            except (SyntaxError, ValueError):
                return value
    return value


def choices(cfg: dict, doc: dict, where: str):
    spec = cfg.get("doc_to_choice")
    if isinstance(spec, dict):
        return list(spec.values())
    value, rendered = _field(cfg, "doc_to_choice", doc, where)
    if rendered:
        try:
            return ast.literal_eval(value)
        except (SyntaxError, ValueError):
            raise TaskError(f"{where}: doc_to_choice renders to {value!r}, not a Python list of strings") from None
    return value


def metrics(path: str, cfg: dict, output_type: str) -> tuple[str, ...]:
    listed = cfg.get("metric_list")
    if listed is None:
        return task_types.DEFAULT_METRICS[output_type]
    supported = task_types.SUPPORTED_METRICS[output_type]
    names = []
    for entry in listed if isinstance(listed, list) else [listed]:
        name = entry.get("metric") if isinstance(entry, dict) else None
        if name not in supported:
            raise TaskError(f"{path}: metric {name!r} is not supported for output_type {output_type}; supported: "
                            f"{', '.join(supported)}")
        aggregation = entry.get("aggregation", AGGREGATION[name])
        if aggregation != AGGREGATION[name]:
            raise TaskError(f"{path}: metric {name} with aggregation {aggregation!r}: only lm-eval's own "
                            f"({AGGREGATION[name]}) is supported")
        names.append(name)
    return tuple(names)


def check_supported(path: str, cfg: dict) -> str:
    """The task's output_type, after refusing what this loader cannot do as lm-eval does."""
    output_type = cfg.get("output_type", "generate_until")  # lm-eval's TaskConfig default
    if output_type not in OUTPUT_TYPES:
        raise TaskError(f"{path}: output_type {output_type!r} is not supported; supported: {', '.join(OUTPUT_TYPES)}")
    for key in UNSUPPORTED:
        if cfg.get(key) is not None:
            raise TaskError(f"{path}: {key} is not supported (it needs the task's own Python code or "
                            "generation); remove it or pre-process the data file")
    shots = cfg.get("num_fewshot")
    if shots is not None and (isinstance(shots, bool) or not isinstance(shots, int) or shots < 0):
        raise TaskError(f"{path}: num_fewshot {shots!r} must be a whole number >= 0")
    fewshot = cfg.get("fewshot_config")
    if fewshot is not None and not isinstance(fewshot, dict):
        raise TaskError(f"{path}: fewshot_config must be a mapping of keys ({', '.join(FEWSHOT_KEYS)})")
    for key in fewshot or {}:
        if key not in FEWSHOT_KEYS:
            raise TaskError(f"{path}: fewshot_config.{key} is not supported; supported: {', '.join(FEWSHOT_KEYS)}")
    if (fewshot or {}).get("sampler", "default") not in ("default", "first_n"):
        raise TaskError(f"{path}: fewshot_config.sampler {fewshot['sampler']!r}: lm-eval's are default and first_n")
    if (cfg.get("repeats") or 1) != 1:
        raise TaskError(f"{path}: repeats {cfg['repeats']}: only 1 is supported")
    if output_type == MULTIPLE_CHOICE and cfg.get("doc_to_choice") is None:
        raise TaskError(f"{path}: a multiple_choice task needs doc_to_choice")
    return output_type


def item(cfg: dict, output_type: str, doc: dict, where: str, examples: str = "") -> task_types.Item:
    """The scored item of `doc`; `examples`: its few-shot examples, as `fewshot_text` writes them."""
    if output_type == ROLLING:
        document = target(cfg, doc, where)
        if not isinstance(document, str):
            raise TaskError(f"{where}: doc_to_target gives {document!r}, not the text to score")
        return task_types.Document(document)
    description = cfg.get("description") or ""
    context = (render(description, doc, where, "description") if description else "") + examples + text(cfg, doc, where)
    if output_type == LOGLIKELIHOOD:
        continuation = target(cfg, doc, where)
        if not isinstance(continuation, str):
            raise TaskError(f"{where}: doc_to_target gives {continuation!r}, not the continuation to score")
        return task_types.Continuation(context, continuation)
    delimiter = cfg.get("target_delimiter", " ")
    return task_types.choice_item(where, context, choices(cfg, doc, where), target(cfg, doc, where), delimiter)


def fewshot_pool(path: str, cfg: dict) -> tuple[list[tuple[str, dict]], str | None]:
    """(the docs few-shot examples are drawn from, the split lm-eval's FewshotConfig names or
    None): fewshot_config's split, else its samples, else fewshot_split, else the training,
    validation, test split (ConfigurableTask.fewshot_docs, Task.fewshot_docs)."""
    own = cfg.get("fewshot_config") or {}
    split = own.get("split", cfg.get("fewshot_split"))
    if split is None and own.get("samples") is not None:
        samples = own["samples"]
        if not isinstance(samples, list) or not all(isinstance(d, dict) for d in samples):
            raise TaskError(f"{path}: fewshot_config.samples must be a list of mappings (documents)")
        return [(f"{path}: fewshot_config.samples[{i}]", d) for i, d in enumerate(samples)], None
    fallback = cfg.get("training_split") or cfg.get("validation_split") or cfg.get("test_split")
    return read_docs(data_file(path, cfg, split or fallback)), split


def fewshot_text(cfg: dict, examples: list[tuple[str, dict]]) -> str:
    """The examples as lm-eval's fewshot_context writes them (build_qa_turn, no gen_prefix): each
    doc_to_text + target_delimiter + its answer + fewshot_delimiter."""
    own = {**cfg, **(cfg.get("fewshot_config") or {})}
    out = []
    for where, doc in examples:
        q = text(own, doc, where)
        a = target(own, doc, where)
        c = choices(own, doc, where) if own.get("doc_to_choice") is not None else None
        if a is None or a == "":
            out.append(q)
            continue
        answer = c[a] if (c and isinstance(a, int)) else a[0] if isinstance(a, list) else a
        if not isinstance(answer, str):
            raise TaskError(f"{where}: the few-shot example's answer is {answer!r}, not a string")
        out.append(q + own.get("target_delimiter", " ") + answer + own.get("fewshot_delimiter", "\n\n"))
    return "".join(out)


def draw_examples(pool: list[tuple[str, dict]], n: int, eval_doc: dict | None, rnd: random.Random,
                  first_n: bool) -> list[tuple[str, dict]]:
    """lm-eval's ContextSampler.sample (or FirstNSampler's), over (where, doc) pairs: the same
    draws, as `random.sample` picks by position."""
    if first_n:
        kept = [pair for pair in pool if eval_doc is None or pair[1] != eval_doc]
        if n > len(kept):
            raise TaskError(f"{pool[0][0] if pool else 'the few-shot split'}: {n} few-shot examples asked for, "
                            f"{len(kept)} available")
        return kept[:n]
    if eval_doc is None:
        return [pool[i] for i in rnd.sample(range(len(pool)), n)]
    drawn = [i for i in rnd.sample(range(len(pool)), n + 1) if pool[i][1] != eval_doc][:n]
    if len(drawn) < n:  # the pool holds the scored doc more than once: draw again without any copy
        drawn = rnd.sample([i for i, (_, doc) in enumerate(pool) if doc != eval_doc], n)
    return [pool[i] for i in drawn]


def load(path: str, limit: int | None = None, num_fewshot: int | None = None) -> task_types.Task:
    """The task of an lm-eval YAML; `num_fewshot` overrides its own (lm-eval's --num_fewshot)."""
    cfg = read_config(path)
    if num_fewshot is not None:
        cfg["num_fewshot"] = num_fewshot
    output_type = check_supported(path, cfg)
    reported = metrics(path, cfg, output_type)
    docs = read_docs(data_file(path, cfg))
    if not docs:
        raise TaskError(f"{path}: the task's data file has no items")
    shots = cfg.get("num_fewshot") or 0
    examples = [""] * len(docs[:limit])
    if shots and output_type != ROLLING:
        pool, split = fewshot_pool(path, cfg)
        # the scored doc is kept out only where the few-shot split is named and is the test split
        exclude = split == cfg.get("test_split")
        if len(pool) < shots + exclude:
            raise TaskError(f"{path}: num_fewshot {shots} but the few-shot split has {len(pool)} documents")
        rnd, first_n = random.Random(FEWSHOT_SEED), (cfg.get("fewshot_config") or {}).get("sampler") == "first_n"
        examples = [fewshot_text(cfg, draw_examples(pool, shots, doc if exclude else None, rnd, first_n))
                    for _, doc in docs[:limit]]
    items = tuple(item(cfg, output_type, doc, where, shown) for (where, doc), shown in zip(docs[:limit], examples))
    name = cfg.get("task") or os.path.splitext(os.path.basename(path))[0]
    version = (cfg.get("metadata") or {}).get("version", "Yaml")  # lm-eval's ConfigurableTask.VERSION
    return task_types.Task(str(name), output_type, reported, items, str(version),
                           tuple(where for where, _ in docs[:limit]), shots)


# A task of this project's JSONL schema read as the lm-eval YAML it is scored as (evaluation.tasks),
# its few-shot examples drawn from its own file, each item's own left out (fewshot_split: test).
JSONL_FIELDS = {MULTIPLE_CHOICE: {"doc_to_text": "context", "doc_to_choice": "choices", "doc_to_target": "gold"},
                LOGLIKELIHOOD: {"doc_to_text": "context", "doc_to_target": "target"}}


def with_examples(task: task_types.Task, path: str, shots: int) -> task_types.Task:
    """A JSONL `task` (read from `path`, already checked) with `shots` (> 0) examples before each
    item, as lm-eval would give the YAML `JSONL_FIELDS` names with `fewshot_split: test`. The file
    is read again for its raw documents: the examples' answers are rendered from them, as lm-eval
    renders them, not from the checked items."""
    if task.output_type == ROLLING:  # a rolling document's score has no context to put them in
        return dataclasses.replace(task, num_fewshot=shots)
    cfg = {**JSONL_FIELDS[task.output_type], "test_split": "test", "fewshot_split": "test"}
    pool = read_docs(path)
    if len(pool) < shots + 1:
        raise TaskError(f"{path}: {shots} few-shot examples asked for, but the file has {len(pool)} items "
                        "(each item's own is left out)")
    rnd = random.Random(FEWSHOT_SEED)
    items = []
    for scored, (_, doc) in zip(task.items, pool):
        examples = fewshot_text(cfg, draw_examples(pool, shots, doc, rnd, first_n=False))
        items.append(dataclasses.replace(scored, context=examples + scored.context))
    return dataclasses.replace(task, items=tuple(items), num_fewshot=shots)
