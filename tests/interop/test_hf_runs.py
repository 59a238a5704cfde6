"""What a user types: train, `python -m megascale_jax.export_hf`, load it in transformers, generate
the same text, start a new run from it with `model.init_from` — from a scratch directory with
relative paths.

The trained model is Mistral-shaped (serial, RMSNorm, SwiGLU, no biases, GQA, sliding window 16
< seq_len 64), trained for 3 steps on dp2 x pp2 x tp2 with the interleaved schedule (so the
pipeline stores its layers out of network order) and, as the reference, on one device.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers", reason="the interop extra (transformers) is not installed")
from safetensors.numpy import load_file  # noqa: E402

from megascale_jax import export_hf, sample  # noqa: E402
from megascale_jax.model import decode  # noqa: E402
from megascale_jax.training import trained  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = ["model.layers=4", "model.d_model=64", "model.heads=4", "model.kv_heads=2", "model.seq_len=64",
         "model.block=serial", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
         "model.window=16", "model.mlp_hidden=128"]
SHORT = ["train.steps=3", "train.global_batch=8", "train.eval_every=0", "checkpoint.every=3", "optim.warmup=1",
         "parallel.microbatches=2", "observe.timings=false", "observe.tensorboard=false"]
LAYOUTS = {"one": ["mesh.dp=1", "mesh.pp=1", "mesh.tp=1", "parallel.zero1=false"],
           "mesh": ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "parallel.pp_schedule=interleaved_1f1b",
                    "parallel.pp_virtual=2"]}


def train(cwd: Path, run_dir: str, overrides: list[str]) -> subprocess.CompletedProcess:
    # No end-of-run sample (tiny_cpu's 200 tokens: two compiles and 200 decode steps a run): these
    # tests read checkpoints and exports; the sample is held to the `sample` command in
    # tests/training/test_sample_at_end.py.
    return subprocess.run([sys.executable, "-m", "megascale_jax.train", "--run-dir", run_dir, "train.sample_at_end=0",
                           *overrides],
                          cwd=cwd, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, run_main):
    """Two trained runs (dp2 x pp2 x tp2 interleaved, and one device) in a scratch directory."""
    cwd = tmp_path_factory.mktemp("hf")
    for name, layout in LAYOUTS.items():
        r = train(cwd, f"run_{name}", MODEL + SHORT + layout)
        assert r.returncode == 0, r.stderr[-3000:]
    for name in LAYOUTS:
        code, out, err = run_main(export_hf.main, [f"run_{name}", f"hf_{name}"], cwd)
        assert code == 0, err
        assert "as MistralForCausalLM" in out
    return cwd


pytestmark = pytest.mark.xdist_group("hf-runs")


@pytest.mark.slow
def test_export_from_a_3d_mesh_equals_export_from_one_device(scratch):
    mesh, one = load_file(str(scratch / "hf_mesh/model.safetensors")), load_file(str(scratch / "hf_one/model.safetensors"))
    assert sorted(mesh) == sorted(one) and len(one) == 3 + 4 * 9  # embed, norm, head; 9 tensors per layer
    for name in one:  # the numerical contract: every layout trains like one device (fp32, ~1e-5)
        np.testing.assert_allclose(mesh[name], one[name], rtol=1e-4, atol=2e-6, err_msg=name)


@pytest.mark.slow
def test_transformers_loads_the_export_and_generates_what_sample_prints(scratch, run_main):
    directory = str(scratch / "hf_mesh")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    text = "def main():\n    return 'naïve ünïcode'\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok(text)["input_ids"] == list(text.encode())  # byte-level runs: token id = byte

    prompt = "import os\nimport sys\n\ndef "
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    run = trained.load(str(scratch / "run_mesh"))
    ours = decode.generate(run.cfg.model, run.params, list(prompt.encode()), 32)
    assert ours == theirs, (ours, theirs)  # prompt 27 + 32 tokens: the window of 16 slides all the way

    code, out, err = run_main(sample.main, ["run_mesh", "--prompt", prompt, "--max-new-tokens", "32"], scratch)
    assert code == 0, err
    assert tok.decode(theirs) in out


@pytest.mark.slow
def test_sharded_export_loads_and_imports(scratch, run_main):
    code, out, err = run_main(export_hf.main, ["run_one", "hf_sharded", "--max-shard-gb", "0.0001"], scratch)
    assert code == 0, err
    files = sorted(os.listdir(scratch / "hf_sharded"))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    weight_map = json.loads((scratch / "hf_sharded/model.safetensors.index.json").read_text())["weight_map"]
    single = load_file(str(scratch / "hf_one/model.safetensors"))
    assert sorted(weight_map) == sorted(single)
    tokens = torch.as_tensor(np.random.default_rng(0).integers(0, 256, (1, 64)))
    with torch.no_grad():
        a = transformers.AutoModelForCausalLM.from_pretrained(str(scratch / "hf_sharded"))(tokens).logits
        b = transformers.AutoModelForCausalLM.from_pretrained(str(scratch / "hf_one"))(tokens).logits
    assert torch.equal(a, b)


@pytest.mark.slow
def test_init_from_on_another_mesh_then_export_is_bitwise(scratch, run_main):
    """A new run from the export, on dp4 x tp2 with ZeRO-1: its first update has lr 0 (warmup),
    so its checkpoint holds the imported weights, and exporting it gives the same bytes."""
    r = train(scratch, "run_imported", MODEL + ["train.steps=1", "train.global_batch=8", "train.eval_every=0",
                                                  "checkpoint.every=1", "optim.warmup=5", "mesh.dp=4", "mesh.pp=1",
                                                  "mesh.tp=2", "parallel.zero1=true", "model.init_from=hf_mesh"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "initialised from the Hugging Face model in hf_mesh" in r.stdout + r.stderr
    code, _, err = run_main(export_hf.main, ["run_imported", "hf_again"], scratch)
    assert code == 0, err
    again, source = load_file(str(scratch / "hf_again/model.safetensors")), load_file(str(scratch / "hf_mesh/model.safetensors"))
    assert sorted(again) == sorted(source)
    for name in source:
        np.testing.assert_array_equal(again[name], source[name], err_msg=name)


@pytest.mark.slow
def test_export_of_a_bpe_run_carries_its_tokenizer(scratch, run_main):
    """A run on `tokenize`'s token file exports that BPE, with <|endoftext|> as HF's eos token."""
    from megascale_jax import tokenize

    corpus = scratch / "corpus"
    corpus.mkdir()
    for source in sorted((REPO / "megascale_jax").glob("*.py")):
        (corpus / source.name).write_text(source.read_text())
    code, _, err = run_main(tokenize.main, ["--input", "corpus/*.py", "--vocab", "320", "--out", "tok"], scratch)
    assert code == 0, err
    r = train(scratch, "run_bpe", MODEL + SHORT + LAYOUTS["one"] + ["data.source=tokens", "data.path=tok/tokens.bin",
                                                                     "model.vocab=320", "model.layers=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    code, _, err = run_main(export_hf.main, ["run_bpe", "hf_bpe"], scratch)
    assert code == 0, err

    tok = transformers.AutoTokenizer.from_pretrained(str(scratch / "hf_bpe"))
    config = json.loads((scratch / "hf_bpe/config.json").read_text())
    assert tok.eos_token == "<|endoftext|>" and config["eos_token_id"] == tok.eos_token_id
    from tokenizers import Tokenizer
    text = (corpus / "sample.py").read_text()[:2000]
    assert tok(text)["input_ids"] == Tokenizer.from_file(str(scratch / "tok/tokenizer.json")).encode(text).ids
    assert tok.decode(tok(text)["input_ids"]) == text

    ids = tok("def main(", return_tensors="pt")["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(scratch / "hf_bpe"))
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    run = trained.load(str(scratch / "run_bpe"))
    assert decode.generate(run.cfg.model, run.params, ids[0].tolist(), 16, eos_id=tok.eos_token_id) == theirs


@pytest.mark.slow
def test_a_run_started_from_hf_resumes_without_the_hf_directory(scratch):
    """init_from is read once, at step 0: the resumed run's weights are in its checkpoint."""
    import shutil

    shutil.copytree(scratch / "hf_one", scratch / "hf_moved")
    start = MODEL + LAYOUTS["one"] + ["train.global_batch=8", "train.eval_every=0", "checkpoint.every=1",
                                      "model.layers=4", "model.init_from=hf_moved"]
    r = train(scratch, "run_resumed", start + ["train.steps=1"])
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.rmtree(scratch / "hf_moved")
    r = train(scratch, "run_resumed", start + ["train.steps=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from checkpoint step 1" in r.stdout + r.stderr


# ----------------------------------------------------------------------------- bad input


def one_line_error(code: int, err: str, *needles: str):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.slow
def test_export_refuses_an_occupied_target_unless_overwrite(scratch, run_main):
    target = scratch / "hf_occupied"
    code, _, err = run_main(export_hf.main, ["run_one", "hf_occupied"], scratch)
    assert code == 0, err
    before = (target / "model.safetensors").stat().st_mtime_ns
    one_line_error(*run_main(export_hf.main, ["run_one", "hf_occupied"], scratch)[::2], "already holds a model",
                   "--overwrite")
    assert (target / "model.safetensors").stat().st_mtime_ns == before
    code, out, err = run_main(export_hf.main, ["run_one", "hf_occupied", "--overwrite", "--dtype", "bfloat16"], scratch)
    assert code == 0 and "parameters, bfloat16) to hf_occupied" in out, err
    from safetensors.torch import load_file as load_torch
    half, full = (load_torch(str(scratch / d / "model.safetensors")) for d in ("hf_occupied", "hf_one"))
    assert len(full) > 5 and all(torch.equal(half[name], t.to(torch.bfloat16)) for name, t in full.items())


@pytest.mark.slow
def test_export_bad_input_is_one_line(scratch, run_main):
    one_line_error(*run_main(export_hf.main, ["run_one", "x", "--step", "2"], scratch)[::2],
                   "--step 2", "committed: 3")
    one_line_error(*run_main(export_hf.main, ["no_such_run", "x"], scratch)[::2], "does not exist")
    # The default model (parallel block with a sliding window) has no exact HF architecture.
    (scratch / "run_default").mkdir()
    from megascale_jax.config import load_config, save_config
    save_config(load_config(None), str(scratch / "run_default/config.yaml"))
    one_line_error(*run_main(export_hf.main, ["run_default", "x"], scratch)[::2], "model.window=64", "PhiForCausalLM")
    assert not (scratch / "x").exists()


@pytest.mark.slow
def test_init_from_mismatch_is_one_line_before_compiling(scratch):
    r = train(scratch, "run_bad", MODEL + SHORT + ["model.layers=2", "model.window=32", "model.init_from=hf_one"])
    one_line_error(r.returncode, r.stderr, "model.layers=4", "model.window=16")
    assert not (scratch / "run_bad").exists()
