"""Task files: our JSONL schema and lm-eval YAMLs with local data, rendered as lm-eval renders them,
and each mistake one line naming file:line."""

import json

import pytest

from megascale_jax.evaluation.evaluator import load_task
from megascale_jax.evaluation.tasks import Choice, Continuation, Document, TaskError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_kinds(tmp_path):
    mc = load_task(write_jsonl(tmp_path / "mc.jsonl", [{"context": "Q", "choices": ["x", "y"], "gold": 1}]))
    assert (mc.name, mc.output_type, mc.metrics) == ("mc", "multiple_choice", ("acc", "acc_norm"))
    assert mc.items == (Choice("Q", ("x", "y"), (" x", " y"), 1),)
    ll = load_task(write_jsonl(tmp_path / "lambada.jsonl", [{"context": "He opened the", "target": " door"}] * 3), limit=2)
    assert ll.output_type == "loglikelihood" and ll.items == (Continuation("He opened the", " door"),) * 2
    roll = load_task(write_jsonl(tmp_path / "wiki.jsonl", [{"text": "doc"}]))
    assert roll.metrics == ("word_perplexity", "byte_perplexity", "bits_per_byte") and roll.items == (Document("doc"),)


@pytest.mark.parametrize("rows, message", [
    ([{"context": "Q", "choices": [], "gold": 0}], "bad.jsonl:1: the choice list is empty"),
    ([{"context": "Q", "choices": ["a"], "gold": 0}, {"context": "Q", "choices": ["a", "b"], "gold": 2}],
     "bad.jsonl:2: gold index 2 is out of range for 2 choices"),
    ([{"context": "Q", "choices": ["a"]}], "bad.jsonl:1: a multiple-choice item needs \"gold\""),
    ([{"context": "Q", "target": " t"}, {"text": "x"}], "bad.jsonl:2: a loglikelihood_rolling item in a file of"),
    ([{"question": "Q"}], "bad.jsonl:1: an item needs \"choices\""),
    ([], "has no items"),
])
def test_jsonl_mistakes(tmp_path, rows, message):
    with pytest.raises(TaskError, match=message):
        load_task(write_jsonl(tmp_path / "bad.jsonl", rows))


def test_jsonl_that_is_not_json_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": oops}\n')
    with pytest.raises(TaskError, match=r"bad.jsonl:3: not valid JSON"):
        load_task(str(path))


def yaml_task(tmp_path, body, rows, name="t"):
    data = write_jsonl(tmp_path / f"{name}_data.jsonl", rows)
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    f"test_split: test\n" + body)
    return str(path)


ARC_LIKE = """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{choices.label.index(answerKey)}}"
doc_to_choice: "{{choices.text}}"
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
"""


def test_yaml_with_jinja_templates_as_arc_writes_them(tmp_path):
    row = {"question": "Which is a gas?", "choices": {"text": ["ice", "steam"], "label": ["A", "B"]}, "answerKey": "B"}
    task = load_task(yaml_task(tmp_path, ARC_LIKE, [row]))
    assert (task.name, task.version, task.metrics) == ("t", "1.0", ("acc", "acc_norm"))
    assert task.items == (Choice("Question: Which is a gas?\nAnswer:", ("ice", "steam"), (" ice", " steam"), 1),)


def test_yaml_fields_delimiter_description_and_include(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("output_type: multiple_choice\ntarget_delimiter: ''\ndescription: 'Pick: '\n")
    body = f"include: {base.name}\ndoc_to_text: ctx\ndoc_to_choice: opts\ndoc_to_target: label\n"
    task = load_task(yaml_task(tmp_path, body, [{"ctx": "Q", "opts": ["a", "b"], "label": 0}]))
    # fields taken as they are; the description rendered before the text; the delimiter ''
    assert task.items == (Choice("Pick: Q", ("a", "b"), ("a", "b"), 0),) and task.version == "Yaml"


def test_yaml_lambada_and_rolling(tmp_path):
    lambada = ('output_type: loglikelihood\ndoc_to_text: "{{text.split(\' \')[:-1]|join(\' \')}}"\n'
               'doc_to_target: "{{\' \'+text.split(\' \')[-1]}}"\n')
    task = load_task(yaml_task(tmp_path, lambada, [{"text": "he opened the door"}], "lam"))
    assert task.items == (Continuation("he opened the", " door"),) and task.metrics == ("perplexity", "acc")
    rolling = "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: page\n"
    assert load_task(yaml_task(tmp_path, rolling, [{"page": "a b"}], "wiki")).items == (Document("a b"),)


@pytest.mark.parametrize("body, message", [
    ("output_type: generate_until\n", "output_type 'generate_until' is not supported; supported: multiple_choice"),
    ("output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: g\nmetric_list:\n"
     "  - metric: f1\n", "metric 'f1' is not supported for output_type multiple_choice; supported: acc, acc_norm"),
    ("output_type: multiple_choice\nprocess_docs: !function utils.process_docs\n", "process_docs is not supported"),
    ("output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: '{{missing}}'\n",
     "t_data.jsonl:1: doc_to_target '{{missing}}': 'missing' is undefined"),
    ("output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: g\nnum_fewshot: 5\n",
     "num_fewshot 5 but the few-shot split has 1 documents"),
    ("output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: g\nnum_fewshot: 1\n"
     "fewshot_config:\n  fewshot_indices: [0]\n", "fewshot_config.fewshot_indices is not supported"),
    ("output_type: [unclosed\n", r"t.yaml:\d+: not valid YAML"),
])
def test_yaml_mistakes(tmp_path, body, message):
    with pytest.raises(TaskError, match=message):
        load_task(yaml_task(tmp_path, body, [{"q": "Q", "c": ["a", "b"], "g": 0}]))


def test_yaml_that_would_download_is_refused(tmp_path):
    path = tmp_path / "hub.yaml"
    path.write_text("task: hub\ndataset_path: allenai/ai2_arc\noutput_type: multiple_choice\ndoc_to_choice: c\n"
                    "test_split: test\n")
    with pytest.raises(TaskError, match="is not local; nothing is downloaded"):
        load_task(str(path))


def test_unknown_files(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        load_task(str(tmp_path / "nope.jsonl"))
    (tmp_path / "t.csv").write_text("a,b\n")
    with pytest.raises(TaskError, match="unknown format"):
        load_task(str(tmp_path / "t.csv"))
