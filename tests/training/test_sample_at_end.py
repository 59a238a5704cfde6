"""The end-of-run sample (`train.sample_at_end`): a run prints what its model writes after
`train.sample_prompt`, the text `python -m megascale_jax.sample` prints for the same run at the same
settings; a bad value is one line before anything runs. Tiny runs in this process (seconds)."""

import pytest

from megascale_jax import train

TINY = ["train.steps=2", "train.eval_every=0", "model.layers=1", "model.d_model=32", "model.heads=2",
        "model.kv_heads=2", "model.seq_len=32", "model.window=8", "train.global_batch=4", "mesh.dp=2", "mesh.tp=1",
        "observe.timings=false", "observe.tensorboard=false", "train.compile_cache=false"]


def sample_lines(out: str) -> tuple[str, list[str]]:
    """The sample's header and its lines (without their `| ` prefix) from a run's stdout."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("sample: "))
    body = []
    for line in lines[start + 1:]:
        if not line.startswith("| "):
            break
        body.append(line[2:])
    return lines[start], body


@pytest.mark.slow
def test_a_run_ends_with_the_sample_that_the_sample_command_prints(run_main, tmp_path):
    code, out, err = run_main(train.main, ["--run-dir", "run", *TINY, "train.sample_at_end=24",
                                           "train.sample_prompt='class '"], tmp_path)
    assert code == 0, err
    header, body = sample_lines(out)
    assert header == "sample: 24 tokens after 'class ' (temperature 0.8, top-p 0.95, seed 0):"
    assert body[0].startswith("class ")
    assert out.index("done: steps 1-2") < out.index("sample: ")  # after the run's summary line

    pytest.importorskip("tokenizers", reason="the sample command needs tokenizers (pip install -e '.[interop]')")
    from megascale_jax import sample

    code, printed, err = run_main(sample.main, ["run", "--prompt", "class ", "--max-new-tokens", "24",
                                                "--temperature", "0.8", "--top-p", "0.95"], tmp_path)
    assert code == 0, err
    # The sample command prints the continuation alone, from the final checkpoint's parameters.
    assert body == ("class " + printed.removesuffix("\n")).splitlines()


@pytest.mark.slow
def test_a_model_without_a_window_samples_what_fits_its_seq_len(run_main, tmp_path):
    code, out, err = run_main(train.main, ["--run-dir", "run", *TINY, "model.window=null", "train.sample_at_end=100",
                                           "train.sample_prompt='class '"], tmp_path)
    assert code == 0, err
    header, body = sample_lines(out)  # seq_len 32 = the prompt's 6 bytes + 26
    assert header.startswith("sample: 26 tokens after 'class '") and body[0].startswith("class ")


# No sample unless asked (train.sample_at_end=0): asserted on the CLI's smoke run, which trains with
# it (tests/test_cli.py, test_smoke_run_writes_schema_valid_metrics), not on a run of its own.


@pytest.mark.parametrize("override, message", [
    ("train.sample_at_end=-1", "train.sample_at_end=-1 must be >= 0 (0 = no sample)"),
    ("train.sample_prompt=''", "train.sample_prompt is empty"),
])
def test_a_bad_sample_setting_is_one_line_before_anything_runs(run_main, tmp_path, override, message):
    code, out, err = run_main(train.main, ["--run-dir", "run", *TINY, "train.sample_at_end=8", override], tmp_path)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err
    assert not (tmp_path / "run").exists()
