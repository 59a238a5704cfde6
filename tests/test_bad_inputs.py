"""The bad-input campaign: every command given the mistakes users make — malformed YAML and JSON,
wrong types, out-of-range values, missing, unreadable, binary and truncated files, damaged run
directories, tokenizers and checkpoints — answers each with one line (`error: ...`, no traceback),
exit code 2, and nothing written or changed: the scratch directory (a trained run among its files)
hashes the same before and after every case. Counts by kind in docs/testing.md.

Each case runs the command's main() in this process (`run_main`), so the ~130 cases cost seconds.
"""

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megascale_jax import evaluate, export_hf, plan, sample, tokenize, train
from megascale_jax.model import flops
from megascale_jax.observe import report
from megascale_jax.supervise import diagnose, launch

TINY = ["model.layers=1", "model.d_model=32", "model.seq_len=16", "train.global_batch=8", "mesh.dp=8", "mesh.tp=1",
        "train.eval_every=0", "train.log_every=1", "model.window=null",  # no window: export_hf can export it
        "train.sample_at_end=0"]


def tree_digest(root: Path) -> str:
    """Every path under `root` with its bytes (and a directory's listing): what a case must not change."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file() and not path.is_symlink():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A user's directory: a trained run (`run/`, 2 steps, a checkpoint), and files that are wrong
    in every way a case needs."""
    root = tmp_path_factory.mktemp("bad_inputs")
    done = subprocess.run([sys.executable, "-m", "megascale_jax.train", "--run-dir", "run", *TINY, "train.steps=2",
                           "checkpoint.every=2"], cwd=root, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    (root / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (root / "list.yaml").write_text("- a\n- b\n")
    (root / "broken.yaml").write_text("model:\n  layers: [1, 2\n  d_model: 3\n")
    (root / "unknown_section.yaml").write_text("modle:\n  layers: 2\n")
    (root / "wrong_type.yaml").write_text("model:\n  layers: two\n")
    (root / "tab.yaml").write_text("model:\n\tlayers: 2\n")
    (root / "text.txt").write_text("some text\n" * 50)
    (root / "odd.bin").write_bytes(b"\x01\x02\x03")  # 3 bytes: not whole uint16 tokens
    (root / "big_ids.bin").write_bytes((60000).to_bytes(2, "little") * 400)  # ids past a 1,024 vocabulary
    (root / "bad.jsonl").write_text("{not json\n[1, 2]\n")
    (root / "nofield.jsonl").write_text(json.dumps({"content": "hello"}) + "\n")
    (root / "truncated.jsonl.gz").write_bytes(gzip.compress(b'{"text": "hello"}\n' * 100)[:40])
    (root / "binary.jsonl").write_bytes(bytes(range(256)) * 4)
    (root / "not_a_tokenizer.json").write_text('{"this": "is not a tokenizer"}')
    (root / "truncated_tokenizer.json").write_text('{"version": "1.0", "model": {')
    (root / "a_directory.yaml").mkdir()
    (root / "metrics_only").mkdir()
    (root / "metrics_only" / "metrics.jsonl").write_text("{broken json\n")
    (root / "no_checkpoint").mkdir()
    (root / "no_checkpoint" / "config.yaml").write_text((root / "run" / "config.yaml").read_text())
    (root / "a_file").write_text("not a directory\n")
    tasks = root / "tasks"  # downstream task files, each wrong in one way (evaluate, train.eval_tasks)
    tasks.mkdir()
    mc = {"context": "Q", "choices": ["a", "b"], "gold": 1}
    for name, rows in {"ok.jsonl": [mc], "empty_choices.jsonl": [mc, {**mc, "choices": []}],
                       "gold.jsonl": [{**mc, "gold": 5}], "gold_type.jsonl": [{**mc, "gold": "zzz"}],
                       "no_context.jsonl": [{"choices": ["a"], "gold": 0}], "mixed.jsonl": [mc, {"text": "doc"}],
                       "list.jsonl": [[1, 2]], "empty_target.jsonl": [{"context": "Q", "target": ""}]}.items():
        (tasks / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "empty.jsonl").write_text("")
    (tasks / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    (tasks / "binary.jsonl").write_bytes(bytes(range(256)) * 4)
    (tasks / "gen.yaml").write_text("task: gen\ndataset_path: json\ndataset_kwargs:\n  data_files: tasks/ok.jsonl\n"
                                    "test_split: train\noutput_type: generate_until\n")
    (tasks / "no_data.yaml").write_text("task: nd\ndataset_path: json\ndataset_kwargs:\n  data_files: tasks/nope.jsonl\n"
                                        "test_split: train\noutput_type: multiple_choice\n")
    (tasks / "hub.yaml").write_text("task: hub\ndataset_path: hellaswag\noutput_type: multiple_choice\n")
    (tasks / "broken.yaml").write_text("task: [x\n")
    (tasks / "list.yaml").write_text("- a\n- b\n")
    (tasks / "tasks.txt").write_text("not a task file\n")
    code, _, err = run(tokenize.main, ["--input", "text.txt", "--vocab", "300", "--out", "tok"], root)  # a real tokenizer
    assert code == 0, err
    # the run with its only checkpoint damaged: each of its arrays' data files cut in half
    shutil.copytree(root / "run", root / "damaged_run")
    for data in (root / "damaged_run" / "checkpoints" / "2" / "state").rglob("d/*"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    shutil.copytree(root / "run", root / "no_meta_run")
    shutil.rmtree(root / "no_meta_run" / "checkpoints" / "2" / "meta")
    return root


def cases() -> list[tuple[str, object, list[str]]]:
    """(kind, main, argv): each a mistake a user makes, in the scratch directory."""
    out = []

    def add(kind, main, *argv):
        out.append((kind, main, list(argv)))

    # ---- train: the config file
    for name in ("missing.yaml", "binary.bin", "list.yaml", "broken.yaml", "unknown_section.yaml",
                 "wrong_type.yaml", "tab.yaml", "a_directory.yaml"):
        add("config file", train.main, "--config", name)
    # ---- train: overrides of the wrong shape or type, or out of range
    for override in ("mesh.dp", "dp=2", "mesh..dp=2", ".dp=2", "modle.layers=2", "model.layer=2", "model.layers=two",
                     "model.layers=2.5", "model.layers=true", "optim.lr=fast", "train.donate=3", "model.dtype=float16",
                     "model.attention=flash", "model.block=diagonal", "optim.name=sgd", "model.window=[",
                     "data.mix=[a.bin]", "data.mix={a.bin: 1, b: [}", "mesh.dp={a: 1}", "model.norm=null"):
        add("override", train.main, override)
    for override in ("train.steps=-1", "train.global_batch=0", "model.layers=0", "model.d_model=30", "model.heads=0",
                     "model.seq_len=0", "optim.lr=-1", "optim.warmup=-1", "data.val_fraction=1.5", "data.val_fraction=-0.1",
                     "model.window=0", "train.seed=-1", "checkpoint.every=-1", "checkpoint.keep=0",
                     "checkpoint.memory_every=-2", "checkpoint.device_copy_gib=-1", "data.prefetch=-1",
                     "mesh.dp=3", "mesh.tp=3", "mesh.pp=0", "parallel.microbatches=0", "model.kv_heads=3",
                     "train.log_every=-1", "model.loss_chunks=0", "model.scan_unroll=0", "supervisor.heartbeat_s=0",
                     "model.mlp_ratio=0", "model.vocab=0", "optim.clip=-1", "train.global_batch=7"):
        add("out of range", train.main, override)
    # ---- train: data that is missing, binary, truncated or too little
    for data in (["data.source=files", "data.path=nothing/*.txt"], ["data.source=files"],
                 ["data.source=tokens", "data.path=missing.bin"], ["data.source=tokens", "data.path=odd.bin"],
                 ["data.source=tokens", "data.path=big_ids.bin", "model.vocab=1024"],
                 ["data.source=tokens", "data.path=text.txt"],
                 ["data.source=files", "data.path=binary.bin"],
                 ["data.source=jsonl", "data.path=bad.jsonl"],
                 ["data.source=jsonl", "data.path=missing/*.jsonl", "data.tokenizer=run/tokenizer.json"],
                 ["data.source=jsonl", "data.path=text.txt", "data.tokenizer=not_a_tokenizer.json"],
                 ["data.source=jsonl", "data.path=nofield.jsonl", "data.tokenizer=missing_tokenizer.json"],
                 ["data.source=parquet", "data.path=bad.jsonl", "data.tokenizer=not_a_tokenizer.json"],
                 ["data.source=tokens", "data.mix={missing.bin: 1}"], ["data.source=tokens", "data.mix={odd.bin: 0}"],
                 ["data.source=stdlib", "model.vocab=100"], ["data.source=files", "data.path=text.txt", "model.seq_len=4096"]):
        add("data", train.main, *data)
    # ---- train: run directories, and a refused resume of the trained run
    add("run directory", train.main, "--run-dir", "a_file")
    add("run directory", train.main, "--run-dir", "run", *TINY, "model.d_model=64")
    add("run directory", train.main, "--run-dir", "run", *TINY, "model.layers=2")
    add("run directory", train.main, "--run-dir", "run", *TINY, "model.vocab=1024")
    add("checkpoint", train.main, "--run-dir", "run", *TINY, "--resume-step", "7")
    add("checkpoint", train.main, "--run-dir", "no_checkpoint", *TINY, "--resume-step", "1")
    add("command line", train.main, "--bogus")
    add("command line", train.main, "--num-processes", "zero")
    # ---- sample and export_hf
    for main, extra in ((sample.main, ["--prompt", "x"]), (export_hf.main, ["hf_out"])):
        add("run directory", main, "missing_run", *extra)
        add("run directory", main, "a_file", *extra)
        add("run directory", main, "no_checkpoint", *extra)
        add("run directory", main, "metrics_only", *extra)
        add("checkpoint", main, "run", "--step", "7", *extra)
        add("checkpoint", main, "run", "--step", "-1", *extra)
        add("command line", main, "run", "--step", "two", *extra)
    for damaged in ("damaged_run", "no_meta_run"):
        add("checkpoint", sample.main, damaged, "--prompt", "x", "--max-new-tokens", "4")
        add("checkpoint", export_hf.main, damaged, "hf_out")
    add("command line", sample.main, "--prompt", "x")
    add("command line", export_hf.main, "--step", "2")
    for argv in (["--max-new-tokens", "-1"], ["--max-new-tokens", "0"], ["--temperature", "-1"], ["--top-p", "2"],
                 ["--top-p", "0"], ["--prompt", ""], ["--seed", "x"]):
        add("out of range", sample.main, "run", *(["--prompt", "x"] if "--prompt" not in argv else []), *argv)
    add("run directory", export_hf.main, "run", "a_file")
    add("run directory", export_hf.main, "run", "run")
    add("command line", export_hf.main, "run", "hf_out", "--dtype", "float16")
    # ---- evaluate
    for name in ("missing.jsonl", "empty_choices.jsonl", "gold.jsonl", "gold_type.jsonl", "no_context.jsonl",
                 "mixed.jsonl", "list.jsonl", "empty_target.jsonl", "empty.jsonl", "broken.jsonl", "binary.jsonl",
                 "gen.yaml", "no_data.yaml", "hub.yaml", "broken.yaml", "list.yaml", "tasks.txt"):
        add("task file", evaluate.main, "run", "--tasks", f"tasks/{name}")
    # (train.eval_tasks naming these is one warning each, and training goes on: tests/evaluation)
    for argv in (["missing_run", "--tasks", "tasks/ok.jsonl"], ["a_file", "--tasks", "tasks/ok.jsonl"],
                 ["no_checkpoint", "--tasks", "tasks/ok.jsonl"], ["metrics_only", "--tasks", "tasks/ok.jsonl"],
                 ["run", "--tasks", "tasks/ok.jsonl", "--step", "7"], ["run", "--tasks", ","],
                 ["run", "--tasks", "tasks/ok.jsonl", "--batch-size", "0"], ["run", "--tasks", "tasks/ok.jsonl", "--limit", "-3"],
                 ["run", "--tasks", "tasks/ok.jsonl", "--bootstrap-iters", "-1"], ["run"], ["--tasks", "tasks/ok.jsonl"],
                 ["run", "--tasks", "tasks/ok.jsonl", "--num-fewshot", "-1"],
                 ["run", "--tasks", "tasks/ok.jsonl", "--num-fewshot", "2"]):
        add("evaluate", evaluate.main, *argv)
    for damaged in ("damaged_run", "no_meta_run"):
        add("checkpoint", evaluate.main, damaged, "--tasks", "tasks/ok.jsonl")
    for override in ("train.eval_tasks_every=-1", "train.eval_tasks={a: 1}", "train.eval_tasks=[[a]]"):
        add("out of range", train.main, *TINY, override)
    # ---- tokenize
    for argv in (["--input", "nothing/*.txt", "--vocab", "300", "--out", "tok2"],
                 ["--input", "binary.bin", "--vocab", "300", "--out", "tok2"],
                 ["--input", "text.txt", "--vocab", "10", "--out", "tok2"],
                 ["--input", "text.txt", "--vocab", "300", "--out", "a_file"],
                 ["--input", "bad.jsonl", "--tokenizer", "not_a_tokenizer.json", "--out", "tok2"],
                 ["--input", "bad.jsonl", "--tokenizer", "truncated_tokenizer.json", "--out", "tok2"],
                 ["--input", "bad.jsonl", "--tokenizer", "missing.json", "--out", "tok2"],
                 ["--input", "bad.jsonl", "--tokenizer", "binary.bin", "--out", "tok2"],
                 ["--input", "bad.jsonl", "--tokenizer", "tok/tokenizer.json", "--out", "tok2"],
                 ["--input", "binary.jsonl", "--tokenizer", "tok/tokenizer.json", "--out", "tok2"],
                 ["--input", "truncated.jsonl.gz", "--tokenizer", "tok/tokenizer.json", "--out", "tok2"],
                 ["--input", "nofield.jsonl", "--tokenizer", "tok/tokenizer.json", "--out", "tok2"],
                 ["--input", "text.txt", "--tokenizer", "tok/tokenizer.json", "--out", "tok2"],
                 ["--input", "bad.jsonl", "--tokenizer", "tok/tokenizer.json", "--out", "tok2", "--eos", "<nope>"],
                 ["--input", "text.txt", "--vocab", "300", "--out", "tok2", "--workers", "-1"],
                 ["--input", "text.txt", "--vocab", "many", "--out", "tok2"], ["--vocab", "300"], ["--bogus"]):
        add("tokenize", tokenize.main, *argv)
    # ---- report, plan, flops, launch, diagnose
    for argv in (["missing_run"], ["a_file"], ["no_checkpoint"], ["metrics_only"], ["run", "--bogus"]):
        add("report", report.main, *argv)
    config = ["--config", "run/config.yaml"]
    for argv in (["--gpu", "b200", "--gpus", "8", *config], ["--gpu", "h200", "--gpus", "0", *config],
                 ["--gpu", "h200", "--gpus", "3", *config, "mesh.tp=2"], ["--gpu", "h200", "--gpus", "eight", *config],
                 ["--gpu", "h200", "--gpus", "8", *config, "model.layers=two"],
                 ["--gpu", "h200", "--gpus", "8", "--config", "broken.yaml"],
                 ["--gpu", "h200", "--gpus", "8", "--config", "missing.yaml"],
                 ["--gpu", "h200", "--gpus", "8", "--config", "binary.bin"],
                 ["--gpu", "h200", "--gpus", "8", *config, "model.dtype=bfloat16", "--plot", "a_file/x.png"], ["--bogus"],
                 ["--gpu", "h200", "--gpus", "8", *config, "mesh.tp=0"],
                 ["--gpu", "h200", "--gpus", "8", *config, "model.dtype=bfloat16", "model.d_model=65536",
                  "model.heads=64", "train.global_batch=4096"]):
        add("plan", plan.main, *argv)
    for argv in (["--config", "broken.yaml"], [*config, "model.layers=-1"], ["--bogus"], [*config, "model.heads=zero"],
                 ["--config", "missing.yaml"]):
        add("flops", flops.main, *argv)
    for argv in (["--nprocs", "0", "--run-dir", "launched"], ["--nprocs", "two"],
                 ["--nprocs", "2", "--spares", "-1", "--run-dir", "launched"],
                 ["--nprocs", "2", "--redis", "redis://user:secret@localhost:1", "--run-dir", "launched"],
                 ["--nprocs", "2", "--redis", "http://localhost:1", "--run-dir", "launched"], ["--bogus"],
                 ["--nprocs", "2", "--run-dir", "launched", "--config", "broken.yaml"],
                 ["--nprocs", "2", "--run-dir", "launched", "model.layers=two"],
                 ["--nprocs", "2", "--run-dir", "a_file"], ["--nprocs", "3", "--run-dir", "launched"]):
        add("launch", launch.main, *argv)
    for argv in (["--bogus"], ["--redis", "redis://user:secret@localhost:1"]):
        add("diagnose", diagnose.main, *argv)
    return out


CASES = cases()


def test_the_campaign_tries_at_least_100_inputs_across_every_command():
    commands = {main.__module__ for _, main, _ in CASES}
    assert len(CASES) >= 100 and len(commands) >= 10, (len(CASES), commands)


def run(main, argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """main(argv) from `cwd`: (exit code, stdout, stderr), argparse's SystemExit included."""
    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's (cli.ArgumentParser), after its one line
                code = e.code
    finally:
        os.chdir(before)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("kind,main,argv", CASES, ids=[f"{k}:{m.__module__.split('.')[-1]}:{' '.join(a)[:60]}"
                                                       for k, m, a in CASES])
def test_a_bad_input_is_one_line_exit_2_and_nothing_changed(scratch, kind, main, argv):
    before = tree_digest(scratch)
    code, out, err = run(main, argv, scratch)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out[-2000:], err[-2000:])
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    # the error's one line, after at most one warning (e.g. tokenize leaving a binary file out)
    assert [line for line in lines if line.startswith("error:")] == lines[-1:] and len(lines) <= 2, err
    assert tree_digest(scratch) == before, "the case wrote or changed files"


def test_a_run_directory_in_use_is_refused_and_left_as_it_was(scratch):
    """The lock refusal: `run/` held (here by this process, as a live run would hold it) — train
    and launch on it are one line, exit 2, and the directory hashes the same (its lock record too)."""
    from megascale_jax import run_dir as run_dirs

    lock = run_dirs.RunDirLock(str(scratch / "run")).acquire()
    try:
        before = tree_digest(scratch)
        for main, argv in ((train.main, ["--run-dir", "run", *TINY, "train.steps=4"]),
                           (launch.main, ["--nprocs", "2", "--run-dir", "run"])):
            code, out, err = run(main, argv, scratch)
            lines = [line for line in err.splitlines() if line.strip()]
            assert code == 2 and len(lines) == 1 and "is in use by" in lines[0], err
            assert tree_digest(scratch) == before
    finally:
        lock.release()
