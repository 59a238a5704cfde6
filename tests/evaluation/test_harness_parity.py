"""Parity with lm-evaluation-harness itself: a tiny BPE model trained with the project's CLI,
exported with `export_hf`, scored by lm-eval's HFLM (in this process, CPU, float32) and by
`python -m megascale_jax.evaluate` on the same local task YAMLs — synthetic items drawn from a
seeded RNG, contexts up to ~10x model.seq_len (left truncation), some ending in whitespace, one
empty, choices with non-ASCII characters (acc_norm's characters vs bytes). Asserted: the same
choice picked for every item, acc/acc_norm equal, every log-likelihood within 1e-4 relative, the
aggregates and perplexity's bootstrap stderr equal to lm-eval's, truncation counted; and the
same again two-shot (`--num-fewshot 2` against lm-eval's `num_fewshot=2`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval (the dev extra) is not installed")
pytest.importorskip("transformers", reason="the interop extra is not installed")
pytest.importorskip("accelerate", reason="lm-eval's HF model needs accelerate")

from megascale_jax import evaluate, export_hf, tokenize  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 32
TRAIN = ["model.layers=2", "model.d_model=32", "model.heads=2", "model.kv_heads=1", f"model.seq_len={SEQ_LEN}",
         "model.block=serial", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
         "model.mlp_hidden=64", "model.vocab=320", "data.source=tokens", "data.path=tok/tokens.bin",
         "train.steps=20", "train.global_batch=4", "train.eval_every=0", "checkpoint.every=20", "optim.warmup=1",
         "mesh.dp=1", "mesh.pp=1", "mesh.tp=1", "parallel.zero1=false", "observe.timings=false",
         "observe.tensorboard=false", "train.sample_at_end=0"]
BOOTSTRAP = 1000
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("harness-parity")]


def synthetic_tasks(text: str, out: Path, seed: int = 0) -> list[str]:
    """Three task YAMLs (multiple choice, LAMBADA-style, rolling) over JSONL drawn from `text`."""
    rng = np.random.default_rng(seed)

    def piece(lo, hi):
        start = int(rng.integers(0, len(text) - hi))
        return text[start:start + int(rng.integers(lo, hi))]

    mc = []
    for i in range(24):
        context = "" if i == 0 else piece(5, 300) + (" " if i % 5 == 1 else "")
        choices = [piece(1, 20) + ("ü" * int(rng.integers(0, 4)) if rng.random() < 0.3 else "")
                   for _ in range(int(rng.integers(2, 5)))]
        mc.append({"context": context, "choices": choices, "gold": int(rng.integers(0, len(choices)))})
    words = [w for w in text.split() if w.isidentifier()]
    ll = [{"context": piece(5, 300), "target": " " + words[int(rng.integers(0, len(words)))]} for _ in range(16)]
    rolling = [{"text": piece(20, 400)} for _ in range(4)]
    kinds = {"par_mc": ("multiple_choice", mc, 'doc_to_text: "{{context}}"\ndoc_to_choice: choices\ndoc_to_target: gold\n'
                        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
             "par_lambada": ("loglikelihood", ll, "doc_to_text: context\ndoc_to_target: target\n"),
             "par_rolling": ("loglikelihood_rolling", rolling, "doc_to_text: ''\ndoc_to_target: text\n")}
    paths = []
    for name, (output_type, rows, fields) in kinds.items():
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                          f"    test: {data}\ntest_split: test\noutput_type: {output_type}\n" + fields)
        paths.append(str(out / f"{name}.yaml"))
    return paths


@pytest.fixture(scope="module")
def scored(tmp_path_factory, run_main):
    """(our results JSON, lm-eval's results with samples, the tasks' YAML directory)."""
    cwd = tmp_path_factory.mktemp("parity")
    (cwd / "corpus").mkdir()
    text = ""
    for source in sorted((REPO / "megascale_jax").glob("*.py")):
        (cwd / "corpus" / source.name).write_text(source.read_text())
        text += source.read_text()
    code, _, err = run_main(tokenize.main, ["--input", "corpus/*.py", "--vocab", "320", "--out", "tok"], cwd)
    assert code == 0, err
    done = subprocess.run([sys.executable, "-m", "megascale_jax.train", "--run-dir", "run", *TRAIN], cwd=cwd,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    code, _, err = run_main(export_hf.main, ["run", "hf"], cwd)
    assert code == 0, err
    tasks = cwd / "tasks"
    tasks.mkdir()
    paths = synthetic_tasks(text, tasks)

    code, out, err = run_main(evaluate.main, ["run", "--tasks", ",".join(paths), "--json", "--batch-size", "8",
                                              "--bootstrap-iters", str(BOOTSTRAP)], cwd)
    assert code == 0, err
    ours = json.loads(out)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    os.environ["DISABLE_MULTIPROC"] = "1"  # lm-eval's bootstrap without forking this (JAX) process: the same draws
    from lm_eval.models.huggingface import HFLM

    hflm = HFLM(pretrained=str(cwd / "hf"), device="cpu", dtype="float32", batch_size=8)
    theirs = lm_eval.simple_evaluate(model=hflm, tasks=[Path(p).stem for p in paths],
                                     task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
                                     bootstrap_iters=BOOTSTRAP)
    return ours, theirs, hflm, cwd


def their_lls(theirs, task):
    samples = sorted(theirs["samples"][task], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) if isinstance(r[0], (tuple, list)) else float(r[0]) for r in s["resps"]]
            for s in samples]


def our_lls(cwd, task, num_fewshot=None):
    """Per item log-likelihoods from the library (the CLI prints only aggregates)."""
    from megascale_jax.evaluation import evaluator, requests, scoring
    from megascale_jax.training import trained
    from megascale_jax.training.tokenizer import END_OF_TEXT, run_tokenizer

    run = trained.load(str(cwd / "run"))
    tokenizer = run_tokenizer(str(cwd / "run"), run.cfg)
    encoder = requests.for_tokenizer(tokenizer, tokenizer.token_to_id(END_OF_TEXT))
    prepared = evaluator.prepare(evaluator.load_task(str(cwd / "tasks" / f"{task}.yaml"), num_fewshot=num_fewshot),
                                 encoder, SEQ_LEN)
    result = evaluator.score(prepared, scoring.one_device_scorer(run.cfg.model, run.params), 8, SEQ_LEN, 0)
    return result.loglikelihoods, prepared


def test_multiple_choice_picks_the_same_choice_for_every_item(scored):
    ours, theirs, _, cwd = scored
    mine, prepared = our_lls(cwd, "par_mc")
    other = their_lls(theirs, "par_mc")
    for item, a, b in zip(prepared.task.items, mine, other):
        np.testing.assert_allclose(a, b, rtol=1e-4)
        assert np.argmax(a) == np.argmax(b)
        characters = np.array([len(c) for c in item.choices], float)
        assert np.argmax(np.array(a) / characters) == np.argmax(np.array(b) / characters)
    for metric in ("acc", "acc_norm"):
        assert ours["results"]["par_mc"][f"{metric},none"] == theirs["results"]["par_mc"][f"{metric},none"]
        assert ours["results"]["par_mc"][f"{metric}_stderr,none"] == pytest.approx(
            theirs["results"]["par_mc"][f"{metric}_stderr,none"], rel=1e-9)


def test_loglikelihood_and_rolling_match(scored):
    ours, theirs, _, cwd = scored
    for task in ("par_lambada", "par_rolling"):
        mine, _ = our_lls(cwd, task)
        np.testing.assert_allclose(mine, [x[0] for x in their_lls(theirs, task)], rtol=1e-4)
    lam, their_lam = ours["results"]["par_lambada"], theirs["results"]["par_lambada"]
    assert lam["acc,none"] == their_lam["acc,none"]
    assert lam["perplexity,none"] == pytest.approx(their_lam["perplexity,none"], rel=1e-4)
    assert lam["perplexity_stderr,none"] == pytest.approx(their_lam["perplexity_stderr,none"], rel=1e-3)
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert ours["results"]["par_rolling"][f"{metric},none"] == pytest.approx(
            theirs["results"]["par_rolling"][f"{metric},none"], rel=1e-4)
        assert theirs["results"]["par_rolling"][f"{metric}_stderr,none"] == "N/A"
        assert ours["results"]["par_rolling"][f"{metric}_stderr,none"] == "N/A"


def test_requests_are_lm_evals_and_truncation_is_counted(scored):
    """Every request's tokens equal what HFLM's own `loglikelihood` encoding makes of it
    (`TemplateLM._encode_pair`, the prefix token for the empty context), and the truncated
    count is the number of them longer than max_length + 1 (HFLM's condition)."""
    ours, _, hflm, cwd = scored
    assert hflm.max_length == SEQ_LEN
    for task in ("par_mc", "par_lambada"):
        _, prepared = our_lls(cwd, task)
        pairs = [(item.context, c) for item in prepared.task.items
                 for c in getattr(item, "continuations", None) or [getattr(item, "target", None)]]
        theirs = []
        for context, continuation in pairs:
            if context == "":
                theirs.append(([hflm.prefix_token_id], hflm.tok_encode(continuation, add_special_tokens=False)))
            else:
                theirs.append(hflm._encode_pair(context, continuation))
        assert [(list(r.context), list(r.continuation)) for r in prepared.requests] == theirs
        longer = sum(len(c) + len(k) > hflm.max_length + 1 for c, k in theirs)
        assert ours["truncated"][task] == {"requests": len(theirs), "truncated": longer} and longer > 0


def test_two_shot_scores_are_lm_evals(scored, run_main):
    """`--num-fewshot 2` (lm-eval's `num_fewshot=2`): the same examples before every item
    (tests/evaluation/test_fewshot.py holds the texts), so the same log-likelihoods within 1e-4,
    the same choice picked, acc and acc_norm equal, on the multiple-choice and LAMBADA-style tasks."""
    _, _, hflm, cwd = scored
    tasks = ["par_mc", "par_lambada"]
    code, out, err = run_main(evaluate.main, ["run", "--tasks", ",".join(f"tasks/{t}.yaml" for t in tasks), "--json",
                                              "--num-fewshot", "2", "--bootstrap-iters", "0"], cwd)
    assert code == 0, err
    ours = json.loads(out)
    from lm_eval.tasks import TaskManager

    theirs = lm_eval.simple_evaluate(model=hflm, tasks=tasks, task_manager=TaskManager(include_path=str(cwd / "tasks")),
                                     num_fewshot=2, log_samples=True, bootstrap_iters=0)
    assert ours["n-shot"] == {t: 2 for t in tasks} and all(theirs["n-shot"][t] == 2 for t in tasks)
    for task in tasks:
        mine, prepared = our_lls(cwd, task, num_fewshot=2)
        other = their_lls(theirs, task)
        assert all("\n\n" in item.context for item in prepared.task.items)  # the examples are there
        for a, b in zip(mine, other):
            np.testing.assert_allclose(a, b[0] if task == "par_lambada" else b, rtol=1e-4)
            if task == "par_mc":
                assert np.argmax(a) == np.argmax(b)
        for metric in ("acc", "acc_norm") if task == "par_mc" else ("acc",):
            assert ours["results"][task][f"{metric},none"] == theirs["results"][task][f"{metric},none"]
