"""`python -m megascale_jax.sample` as a user runs it: a tiny run trained on 2 simulated devices in a
scratch directory (relative paths), then continued on one device. The printed text is what
`model.decode.generate` makes from the checkpoint's parameters; sampling is seeded; every mistake
is one `error:` line with exit 2.

The trained run is shared (module fixture, one xdist group); mistakes go through `sample.main` in
this process, the first success and one mistake through the real command line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e '.[interop]')")

from megascale_jax import sample  # noqa: E402
from megascale_jax.model import decode  # noqa: E402
from megascale_jax.training import trained  # noqa: E402
from megascale_jax.training.tokenizer import byte_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 32
TINY = ["train.sample_at_end=0", "train.steps=4", "checkpoint.every=2", "train.eval_every=0", "model.layers=2", "model.d_model=64",
        f"model.seq_len={SEQ_LEN}", "model.window=8", "train.global_batch=4", "mesh.dp=2", "mesh.tp=1",
        "observe.timings=false", "observe.tensorboard=false"]

pytestmark = pytest.mark.xdist_group("sample-run")


def command(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture
def run_sample(run_main):
    """`run_sample(argv, cwd)`: sample.main in this process, from `cwd`."""
    return lambda argv, cwd: run_main(sample.main, argv, cwd)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A scratch directory holding `run`, trained for 4 steps with checkpoints at steps 2 and 4."""
    cwd = tmp_path_factory.mktemp("sample")
    done = command("megascale_jax.train", "--run-dir", "run", *TINY, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return cwd


@pytest.mark.slow
def test_sample_prints_the_greedy_continuation_of_the_checkpoint(scratch):
    done = command("megascale_jax.sample", "run", "--prompt", "def ", "--max-new-tokens", "8", cwd=scratch)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    run = trained.load(str(scratch / "run"))
    assert run.step == 4
    new = decode.generate(run.cfg.model, run.params, list(b"def "), 8)
    assert len(new) == 8
    assert done.stdout == byte_tokenizer().decode(new) + "\n"


def test_sampling_is_seeded_and_runs_past_seq_len_with_a_window(scratch, run_sample):
    prompt = "import os\n" * 3  # 30 tokens; + 40 new > seq_len 32: the window of 8 slides on
    args = ["run", "--prompt", prompt, "--max-new-tokens", "40", "--temperature", "1.0", "--top-p", "0.95"]
    first = run_sample([*args, "--seed", "1"], scratch)
    assert first[0] == 0, first[2]
    assert run_sample([*args, "--seed", "1"], scratch) == first
    assert run_sample([*args, "--seed", "2"], scratch)[1] != first[1]
    greedy = run_sample(["run", "--prompt", prompt, "--max-new-tokens", "40", "--step", "2"], scratch)
    assert greedy[0] == 0 and greedy[1] != first[1]


def causal_run(scratch: Path) -> str:
    """A copy of the run's config without a window (and no checkpoint): length checks come first."""
    target = scratch / "causal"
    if not target.exists():
        target.mkdir()
        cfg = yaml.safe_load((scratch / "run" / "config.yaml").read_text())
        cfg["model"]["window"] = None
        (target / "config.yaml").write_text(yaml.safe_dump(cfg))
    return "causal"


def no_checkpoint_run(scratch: Path) -> str:
    target = scratch / "untrained"
    if not target.exists():
        target.mkdir()
        shutil.copyfile(scratch / "run" / "config.yaml", target / "config.yaml")
    return "untrained"


MISTAKES = [
    (lambda s: ["nowhere", "--prompt", "x"], "run directory 'nowhere' does not exist"),
    (lambda s: [no_checkpoint_run(s), "--prompt", "x"], "has no committed checkpoint"),
    (lambda s: ["run", "--prompt", "x", "--step", "1"], "--step 1: no committed checkpoint at that step"),
    (lambda s: ["run", "--prompt", "x" * (SEQ_LEN + 1)],
     f"--prompt is {SEQ_LEN + 1} tokens, more than model.seq_len={SEQ_LEN}"),
    (lambda s: ["run", "--prompt", ""], "--prompt is empty"),
    (lambda s: ["run", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0: generate at least 1 token"),
    (lambda s: ["run", "--prompt", "x", "--temperature", "-1"], "--temperature -1.0: must be >= 0"),
    (lambda s: ["run", "--prompt", "x", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (lambda s: ["run", "--prompt", "x", "--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    (lambda s: [causal_run(s), "--prompt", "x" * 30, "--max-new-tokens", "3"],
     f"the prompt's 30 tokens + 3 exceed model.seq_len={SEQ_LEN}, the longest text a model without a sliding "
     "window can continue; pass --max-new-tokens 2 or less"),
]


@pytest.mark.parametrize("index", range(len(MISTAKES)))
def test_mistakes_are_one_line_and_exit_2(scratch, index, run_sample):
    argv, message = MISTAKES[index]
    code, out, err = run_sample(argv(scratch), scratch)
    assert code == 2 and out == "", (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_a_mistake_on_the_real_command_line(scratch):
    done = command("megascale_jax.sample", "nowhere", "--prompt", "x", cwd=scratch)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: run directory 'nowhere' does not exist; pass the --run-dir of a training run"]
    done = command("megascale_jax.sample", "run", cwd=scratch)  # --prompt missing: one line (cli.ArgumentParser)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == ["error: the following arguments are required: --prompt "
                                                "(python -m megascale_jax.sample --help lists the options)"]


def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before_in_one_line(scratch, run_sample, tmp_path):
    """As `train` resumes: the newest checkpoint (4) is damaged, so sample says so in one line and
    continues the prompt from step 2, moving nothing aside; asked for step 4 by name, it is one
    line and exit 2 naming the step that reads."""
    shutil.copytree(scratch / "run", tmp_path / "run")
    for chunk in (tmp_path / "run" / "checkpoints" / "4" / "state").rglob("d/*"):
        os.truncate(chunk, 10)
    code, out, err = run_sample(["run", "--prompt", "def ", "--max-new-tokens", "8"], tmp_path)
    assert code == 0, err
    (line,) = [l for l in err.splitlines() if l.strip()]
    assert line.startswith("warning: checkpoint step 4 in ") and line.endswith(
        "; using step 2, the newest before it (--step N picks another)") and "TensorStore({" not in line, line
    at_2 = trained.load(str(scratch / "run"), 2)
    assert out == byte_tokenizer().decode(decode.generate(at_2.cfg.model, at_2.params, list(b"def "), 8)) + "\n"
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2", "4"]  # nothing moved
    code, out, err = run_sample(["run", "--prompt", "def ", "--step", "4"], tmp_path)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: checkpoint step 4 in ") and err.strip().endswith(
        "; pass --step with an older one (2)"), err


def test_the_model_comes_from_the_checkpoint_not_from_a_config_yaml_rewritten_since(scratch, run_sample, tmp_path):
    """A config.yaml a later command rewrote (another d_model, more layers) does not make a healthy
    checkpoint unreadable: sample and trained.load read the model the checkpoint was written with."""
    import yaml

    shutil.copytree(scratch / "run", tmp_path / "run")
    config = tmp_path / "run" / "config.yaml"
    raw = yaml.safe_load(config.read_text())
    written = dict(raw["model"])
    raw["model"].update(d_model=2 * written["d_model"], layers=written["layers"] + 1)
    config.write_text(yaml.safe_dump(raw))
    code, out, err = run_sample(["run", "--prompt", "def ", "--max-new-tokens", "8"], tmp_path)
    assert code == 0, err
    loaded = trained.load(str(tmp_path / "run"))
    assert (loaded.cfg.model.d_model, loaded.cfg.model.layers) == (written["d_model"], written["layers"])
    original = trained.load(str(scratch / "run"))
    assert out == byte_tokenizer().decode(decode.generate(original.cfg.model, original.params, list(b"def "), 8)) + "\n"
