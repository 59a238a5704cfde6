"""`python -m megascale_jax.evaluate`'s mistakes: one `error:` line, exit 2, before a parameter is
read (the run here has a config and no checkpoint, so reaching the checkpoint is its own error)."""

import json

import pytest

from megascale_jax import evaluate


@pytest.fixture
def scratch(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run/config.yaml").write_text("model:\n  layers: 1\n  seq_len: 16\n")  # byte-level data
    rows = {"ok.jsonl": [{"context": "Q", "choices": ["a", "b"], "gold": 1}],
            "empty_choices.jsonl": [{"context": "Q", "choices": ["a"], "gold": 0}, {"context": "Q", "choices": [], "gold": 0}],
            "gold.jsonl": [{"context": "Q", "choices": ["a", "b"], "gold": 5}]}
    for name, items in rows.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in items))
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    (tmp_path / "gen.yaml").write_text("task: gen\ndataset_path: json\ndataset_kwargs:\n  data_files: ok.jsonl\n"
                                       "test_split: train\noutput_type: generate_until\n")
    return tmp_path


@pytest.mark.parametrize("argv, needles", [
    (["nowhere", "--tasks", "ok.jsonl"], ["run directory 'nowhere' does not exist"]),
    (["run", "--tasks", "ok.jsonl"], ["has no committed checkpoint"]),
    (["run", "--tasks", "ok.jsonl,missing.jsonl"], ["task file missing.jsonl does not exist"]),
    (["run", "--tasks", "broken.jsonl"], ["broken.jsonl:2: not valid JSON"]),
    (["run", "--tasks", "gen.yaml"], ["output_type 'generate_until' is not supported", "multiple_choice"]),
    (["run", "--tasks", "empty_choices.jsonl"], ["empty_choices.jsonl:2: the choice list is empty"]),
    (["run", "--tasks", "gold.jsonl"], ["gold.jsonl:1: gold index 5 is out of range for 2 choices"]),
    (["run", "--tasks", "ok.jsonl", "--batch-size", "0"], ["--batch-size 0"]),
    (["run", "--tasks", "ok.jsonl", "--limit", "0"], ["--limit 0"]),
])
def test_bad_input_is_one_line(scratch, run_main, argv, needles):
    code, _, err = run_main(evaluate.main, argv, scratch)
    one_line(code, err, needles)


def test_a_missing_option_is_one_line(capsys):
    with pytest.raises(SystemExit) as exited:  # argparse's errors leave through cli.ArgumentParser.error
        evaluate.main(["run"])
    one_line(exited.value.code, capsys.readouterr().err, ["--tasks", "python -m megascale_jax.evaluate --help"])


def one_line(code, err, needles):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
