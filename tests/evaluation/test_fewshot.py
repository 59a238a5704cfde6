"""Few-shot contexts (evaluation/lm_eval_yaml.py) are lm-evaluation-harness's own: for each task
YAML below, every request our loader makes (context and continuation, item by item) equals the
one lm-eval 0.4.13 builds for the same file (`ConfigurableTask.build_all_requests` after
`set_fewshot_seed(1234)`, as `simple_evaluate` does), text for text. No model is needed: the
requests are the whole of what few-shot changes.

The cases cover each way lm-eval picks its examples: a named few-shot split, the training split
by default, the test split itself (the scored item drawn out), the validation split when nothing
else is named, `first_n`, `samples` listed in the YAML, its delimiters and description, a
loglikelihood task, `--num-fewshot` overriding the YAML's own, and this project's JSONL tasks
(their examples from their own items, as lm-eval reads the YAML they are scored as with
`fewshot_split: test`); seeded random documents."""

import json
import os

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is the reference (pip install -e '.[dev]')")

from megascale_jax.evaluation import evaluator, lm_eval_yaml  # noqa: E402
from megascale_jax.evaluation.tasks import TaskError  # noqa: E402

WORDS = "apple river stone cloud green quick seven orbit lamp metal paper violet".split()


def documents(seed: int, n: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 6))))
        choices = [str(w) for w in rng.choice(WORDS, size=3, replace=False)]
        rows.append({"question": f"Q{i}: {words}?", "choices": choices, "label": int(rng.integers(0, 3)),
                     "target": f" {rng.choice(WORDS)}"})
    return rows


MC = ("output_type: multiple_choice\ndoc_to_text: question\ndoc_to_choice: choices\n"
      "doc_to_target: label\n")
CASES = {
    # name: (splits in data_files, YAML fields, our num_fewshot override)
    "named_split": ({"train": 12, "test": 7}, MC + "test_split: test\nfewshot_split: train\nnum_fewshot: 3\n"
                    "description: \"Pick one.\\n\\n\"\n", None),
    "training_split": ({"train": 9, "test": 6}, MC + "test_split: test\ntraining_split: train\nnum_fewshot: 2\n"
                       "fewshot_delimiter: \"\\n###\\n\"\ntarget_delimiter: \": \"\n", None),
    "test_split_itself": ({"test": 8}, MC + "test_split: test\nfewshot_split: test\nnum_fewshot: 4\n", None),
    "validation_only": ({"validation": 7}, "output_type: loglikelihood\ndoc_to_text: \"{{question}} Answer:\"\n"
                        "doc_to_target: target\nvalidation_split: validation\nnum_fewshot: 2\n", None),
    "first_n": ({"train": 6, "test": 5}, MC + "test_split: test\nnum_fewshot: 2\n"
                "fewshot_config:\n  sampler: first_n\n  split: train\n", None),
    "samples": ({"test": 5}, MC + "test_split: test\nnum_fewshot: 2\nfewshot_config:\n  samples:\n"
                "    - {question: \"Is ice cold?\", choices: [\"yes\", \"no\"], label: 0}\n"
                "    - {question: \"Is fire cold?\", choices: [\"yes\", \"no\"], label: 1}\n"
                "    - {question: \"Two plus two?\", choices: [\"three\", \"four\"], label: 1}\n", None),
    "override": ({"train": 8, "test": 6}, MC + "test_split: test\nfewshot_split: train\n", 3),
}


# This project's JSONL tasks (evaluation/tasks.py), few-shot from their own items: lm-eval reads
# the same file through the YAML it is scored as, with fewshot_split: test.
JSONL = {"jsonl_mc": ("multiple_choice", "doc_to_choice: choices\ndoc_to_target: gold\n", 3),
         "jsonl_loglikelihood": ("loglikelihood", "doc_to_target: target\n", 2)}


def write_jsonl_task(directory, name: str) -> tuple[str, str]:
    """(the JSONL task, the lm-eval YAML of it)."""
    output_type, fields, shots = JSONL[name]
    rows = [{"context": d["question"], "choices": d["choices"], "gold": d["label"]} if output_type == "multiple_choice"
            else {"context": d["question"], "target": d["target"]} for d in documents(len(name), 7)]
    path = directory / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    yaml = directory / f"{name}.yaml"
    yaml.write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\n"
                    f"test_split: test\nfewshot_split: test\nnum_fewshot: {shots}\noutput_type: {output_type}\n"
                    f"doc_to_text: context\n{fields}")
    return str(path), str(yaml)


def write_task(directory, name: str) -> str:
    splits, fields, _ = CASES[name]
    files = {}
    for k, (split, n) in enumerate(splits.items()):
        path = directory / f"{name}_{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in documents(len(name) * 10 + k, n)))
        files[split] = str(path)
    data = "".join(f"    {split}: {path}\n" for split, path in files.items())
    yaml = directory / f"{name}.yaml"
    yaml.write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n{data}{fields}")
    return str(yaml)


def their_requests(task, num_fewshot: int | None) -> list[list[tuple]]:
    """lm-eval's requests for `task`, per doc: (context, continuation) each, as simple_evaluate
    makes them (its num_fewshot set over the YAML's, its few-shot seed 1234)."""
    if num_fewshot is not None:
        task.set_config(key="num_fewshot", value=num_fewshot)
    task.set_fewshot_seed(seed=1234)
    task.build_all_requests(rank=0, world_size=1)
    requests = {}
    for instance in task.instances:
        requests.setdefault(instance.doc_id, []).append(tuple(instance.arguments))
    return [requests[i] for i in sorted(requests)]


@pytest.fixture(scope="module")
def their_tasks(tmp_path_factory):
    """name -> (our task, lm-eval's requests for the same file)."""
    directory = tmp_path_factory.mktemp("fewshot")
    yamls = {name: write_task(directory, name) for name in CASES}
    jsonl = {name: write_jsonl_task(directory, name)[0] for name in JSONL}
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager, get_task_dict

    tasks = get_task_dict([*CASES, *JSONL], TaskManager(include_path=str(directory)))
    out = {}
    for name, task in tasks.items():
        if name in JSONL:
            out[name] = (evaluator.load_task(jsonl[name], num_fewshot=JSONL[name][2]), their_requests(task, None))
        else:
            override = CASES[name][2]
            out[name] = (lm_eval_yaml.load(yamls[name], num_fewshot=override), their_requests(task, override))
    return out


@pytest.mark.slow  # lm-eval and datasets loading nine tasks: ~5 s once
@pytest.mark.xdist_group("fewshot")  # one worker builds the fixture
@pytest.mark.parametrize("name", sorted(CASES) + sorted(JSONL))
def test_every_request_is_lm_evals_own(their_tasks, name):
    ours, theirs = their_tasks[name]
    assert len(ours.items) == len(theirs) > 4
    shots = JSONL[name][2] if name in JSONL else CASES[name][2] or int(CASES[name][1].split("num_fewshot: ")[1].split()[0])
    assert ours.num_fewshot == shots
    for item, requests in zip(ours.items, theirs):
        if ours.output_type == "multiple_choice":
            assert [(item.context, c) for c in item.continuations] == requests
        else:
            assert [(item.context, item.target)] == requests
    # the examples are really there: each context holds `shots` answered examples before its question
    delimiter = "\n###\n" if name == "training_split" else "\n\n"
    assert all(item.context.count(delimiter) >= shots for item in ours.items)


def test_a_few_shot_split_too_small_or_a_bad_sampler_is_one_line(tmp_path):
    path = write_task(tmp_path, "first_n")
    with pytest.raises(TaskError, match="num_fewshot 9 but the few-shot split has 6 documents"):
        lm_eval_yaml.load(path, num_fewshot=9)
    (tmp_path / "bad.yaml").write_text((tmp_path / "first_n.yaml").read_text().replace("first_n", "balanced"))
    with pytest.raises(TaskError, match="sampler 'balanced'"):
        lm_eval_yaml.load(str(tmp_path / "bad.yaml"))
    (tmp_path / "neg.yaml").write_text((tmp_path / "first_n.yaml").read_text().replace("num_fewshot: 2", "num_fewshot: -1"))
    with pytest.raises(TaskError, match="num_fewshot -1 must be a whole number"):
        lm_eval_yaml.load(str(tmp_path / "neg.yaml"))
