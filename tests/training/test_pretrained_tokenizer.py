"""`python -m megascale_jax.tokenize --tokenizer PATH --input 'shards/*'`: a corpus's JSONL (plain,
gzip, zstd) and Parquet shards encoded with a model's own tokenizer, as a user runs it (a scratch
directory, relative paths). The token file must hold exactly what `tokenizers` and `transformers`
encode, document by document in shard order, each ended by the tokenizer's end-of-document token
(and begun by its BOS where it defines one), whatever the worker count; a run trains on it; bad
input is one line, or skipped and counted."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e '.[interop]')")
pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is not installed (pip install -e '.[data]')")
zstandard = pytest.importorskip("zstandard", reason="zstandard is not installed (pip install -e '.[data]')")
import pyarrow as pa  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = ["the", "model", "attention", "window", "naïve", "日本語", "x = f(y) + 1;", "\n", "🙂", "über"]


def run(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "megascale_jax.tokenize", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def documents(rng, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 60)))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A Llama-style tokenizer (BOS added by its post-processor, `</s>` as the config's EOS) saved
    as a Hugging Face directory, and four shards of seeded random documents, one per format, with
    two bad JSONL lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    work = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    docs = {name: documents(rng, n) for name, n in
            (("a.jsonl", 7), ("b.jsonl.gz", 5), ("c.jsonl.zst", 4), ("d.parquet", 6))}
    (work / "train.txt").write_text("\n".join(d for ds in docs.values() for d in ds), encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(work / "train.txt")], trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                            show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(work / "model")
    shards = work / "shards"
    shards.mkdir()
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs["a.jsonl"])]
    lines[2:2] = ["{not json", json.dumps({"body": "no text field"})]  # lines 3 and 4: skipped, counted
    (shards / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with gzip.open(shards / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs["b.jsonl.gz"])
    (shards / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": d}) + "\n" for d in docs["c.jsonl.zst"]).encode()))
    pq.write_table(pa.table({"text": docs["d.parquet"], "n": list(range(6))}), shards / "d.parquet")
    return work, docs


def expected_ids(work, docs) -> np.ndarray:
    """transformers' encoding of each document (its BOS included), `</s>` after each, shards in name order."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(work / "model"), local_files_only=True)
    eos = hf.convert_tokens_to_ids("</s>")
    ids = [i for name in sorted(docs) for d in docs[name] for i in [*hf(d)["input_ids"], eos]]
    return np.asarray(ids)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_token_file_holds_the_tokenizers_own_ids_document_by_document(corpus, workers):
    work, docs = corpus
    out = f"tok{workers}"
    done = run("--tokenizer", "model", "--input", "shards/*", "--out", out, "--workers", str(workers), cwd=work)
    assert done.returncode == 0, done.stderr
    meta = json.loads((work / out / "tokens.json").read_text())
    tokens = np.fromfile(work / out / "tokens.bin", dtype=meta["token_dtype"])
    np.testing.assert_array_equal(tokens, expected_ids(work, docs))
    assert meta["documents"] == sum(len(d) for d in docs.values()) and meta["bad_lines_skipped"] == 2
    vocab = tokenizers.Tokenizer.from_file(str(work / "model" / "tokenizer.json")).get_vocab_size()
    assert meta["end_of_text"] == 1 and meta["shards"] == 4 and meta["vocab"] == vocab
    assert "skipped 2 bad lines" in done.stderr and "a.jsonl:3: not JSON" in done.stderr
    assert f"data.path={out}/tokens.bin" in done.stdout
    # the tokenizer goes with the tokens, so a run on them records what its ids mean
    assert (work / out / "tokenizer.json").read_bytes() == (work / "model" / "tokenizer.json").read_bytes()


@pytest.mark.slow
def test_a_run_trains_on_the_token_file_and_refuses_a_vocabulary_smaller_than_the_tokenizers(corpus):
    work, _ = corpus
    assert run("--tokenizer", "model", "--input", "shards/*", "--out", "tokrun", cwd=work).returncode == 0
    common = ["-m", "megascale_jax.train", "--run-dir", "runs/r", "data.source=tokens", "data.path=tokrun/tokens.bin",
              "train.steps=2", "train.global_batch=8", "model.seq_len=32", "mesh.dp=4", "mesh.tp=2",
              "train.eval_batches=1", "checkpoint.every=0"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    small = subprocess.run([sys.executable, *common, "model.vocab=256"], cwd=work, env=env, capture_output=True,
                           text=True, timeout=600)
    assert small.returncode == 2 and "model.vocab=256" in small.stderr and len(small.stderr.strip().splitlines()) == 1
    ok = subprocess.run([sys.executable, *common, "model.vocab=320"], cwd=work, env=env, capture_output=True,
                        text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr
    assert (work / "runs" / "r" / "tokenizer" / "tokenizer.json").is_file()


@pytest.mark.parametrize("args, says", [
    (["--input", "nothing/*.jsonl"], "matches no files"),
    (["--input", "shards/d.parquet", "--text-field", "body"], "has no column 'body' (its columns: text, n)"),
    (["--input", "shards/a.jsonl", "--stop-at-bad-line"], "a.jsonl:3: not JSON"),
    (["--input", "shards/*", "--eos", "<nope>"], "'<nope>' is not in"),
    (["--input", "bad/binary.jsonl"], "is not UTF-8 text"),
    (["--input", "bad/empty.jsonl"], "no document in any of its 1 shards"),
    (["--input", "bad/notes.txt"], "neither JSONL"),
])
def test_bad_input_is_one_line_and_exit_2(corpus, args, says):
    work, _ = corpus
    (work / "bad").mkdir(exist_ok=True)
    (work / "bad" / "binary.jsonl").write_bytes(b"PAR1\0\x15\x04\x15\x10\x4c\0\0\x80")
    (work / "bad" / "empty.jsonl").write_bytes(b"")
    (work / "bad" / "notes.txt").write_text("text")
    done = run("--tokenizer", "model", *args, "--out", "never", cwd=work)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (work / "never" / "tokens.bin").exists()


def test_a_tokenizer_path_that_is_not_one_is_one_line(corpus):
    work, _ = corpus
    (work / "empty_dir").mkdir(exist_ok=True)
    done = run("--tokenizer", "empty_dir", "--input", "shards/*", "--out", "never", cwd=work)
    assert done.returncode == 2 and "empty_dir has no tokenizer.json" in done.stderr


# ----------------------------------------------------------------------------- data.source=jsonl|parquet


def source_config(work, source: str, path: str, **extra):
    from megascale_jax.config import load_config

    overrides = {"data.source": source, "data.path": str(work / path), "data.tokenizer": str(work / "model"),
                 "data.cache_dir": str(work / "cache"), "model.vocab": 320,
                 "data.tokenize_workers": 1, **extra}  # in this process: no worker pool left behind
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def test_a_jsonl_source_trains_on_the_tokenizers_ids_tokenized_once(corpus):
    """`data.source=jsonl`: the loader's tokens are transformers' ids of every document of the JSONL
    shards (plain, gzip, zstd) in shard order, each ended by `</s>`; the second load maps the
    cached file (not tokenized again); a changed shard is tokenized again; Parquet likewise."""
    from megascale_jax.training import data

    work, docs = corpus
    cfg = source_config(work, "jsonl", "shards/*.jsonl*")
    first = data.load_corpus(cfg)
    jsonl = {name: d for name, d in docs.items() if "jsonl" in name}
    np.testing.assert_array_equal(first.tokens, expected_ids(work, jsonl))
    assert "3 jsonl shards, 16 documents" in first.description and "2 bad lines skipped" in first.description
    written = os.stat(first.token_file).st_mtime_ns
    again = data.load_corpus(cfg)
    assert again.token_file == first.token_file and os.stat(again.token_file).st_mtime_ns == written
    assert (work / "cache").is_dir() and not [p for p in os.listdir(work / "cache") if p.startswith(".")]
    parquet = data.load_corpus(source_config(work, "parquet", "shards/*.parquet"))
    np.testing.assert_array_equal(parquet.tokens, expected_ids(work, {"d.parquet": docs["d.parquet"]}))
    (work / "shards2").mkdir(exist_ok=True)
    (work / "shards2" / "a.jsonl").write_text(json.dumps({"text": docs["a.jsonl"][0]}) + "\n", encoding="utf-8")
    one = data.load_corpus(source_config(work, "jsonl", "shards2/a.jsonl"))
    (work / "shards2" / "a.jsonl").write_text(json.dumps({"text": docs["a.jsonl"][1]}) + "\n", encoding="utf-8")
    changed = data.load_corpus(source_config(work, "jsonl", "shards2/a.jsonl"))
    assert changed.token_file != one.token_file
    np.testing.assert_array_equal(changed.tokens, expected_ids(work, {"a.jsonl": docs["a.jsonl"][1:2]}))


@pytest.mark.parametrize("source, path, extra, says", [
    ("jsonl", "shards/*", {}, "d.parquet, which is not jsonl; narrow the glob, or set data.source=parquet"),
    ("jsonl", "nothing/*.jsonl", {}, "matches no files"),
    ("jsonl", "shards/*.jsonl*", {"model.vocab": 256}, "tokens but model.vocab=256; set model.vocab="),
    ("parquet", "shards/*.parquet", {"data.text_field": "body"}, "has no column 'body'"),
    ("jsonl", "shards/a.jsonl", {"data.stop_at_bad_line": "true"}, "a.jsonl:3: not JSON"),
    ("jsonl", "shards/*.jsonl*", {"data.eos": "<nope>"}, "'<nope>' is not in"),
])
def test_a_corpus_the_loader_cannot_use_is_one_line_and_nothing_cached(corpus, tmp_path, source, path, extra, says):
    from megascale_jax.training import data

    work, _ = corpus
    cfg = source_config(work, source, path, **{"data.cache_dir": str(tmp_path / "cache"), **extra})
    with pytest.raises(data.DataError, match=None) as raised:
        data.load_corpus(cfg)
    message = str(raised.value)
    assert says in message and "\n" not in message and "--" not in message, message
    assert not (tmp_path / "cache").exists() or os.listdir(tmp_path / "cache") == []


def test_a_jsonl_source_without_its_tokenizer_is_refused_before_anything_runs(corpus):
    from megascale_jax.config import ConfigError, load_config

    work, _ = corpus
    with pytest.raises(ConfigError, match="data.source=jsonl needs data.tokenizer=PATH"):
        load_config(None, ["data.source=jsonl", f"data.path={work}/shards/*.jsonl"])
    # documents kept apart (the default) on every layout: through the pipeline, in the Pallas kernel
    shards = [f"data.path={work}/shards/*.jsonl*", f"data.tokenizer={work}/model"]
    load_config(None, ["data.source=jsonl", *shards, "mesh.pp=2", "mesh.dp=1", "parallel.microbatches=2"])
    load_config(None, ["data.source=jsonl", *shards, "model.attention=pallas"])


@pytest.mark.slow
def test_a_run_trains_on_jsonl_shards_and_records_their_tokenizer(corpus):
    """What a user types, from the corpus's directory with relative paths: train on the shards with
    the model directory's tokenizer; the run records that tokenizer (which `sample` decodes with)
    and keeps the documents apart at its end-of-document token."""
    work, _ = corpus
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-m", "megascale_jax.train", "--run-dir", "runs/j", "data.source=jsonl",
                           "data.path=shards/*.jsonl*", "data.tokenizer=model", "data.cache_dir=cache2",
                           "model.vocab=320", "train.steps=2", "train.global_batch=4", "model.seq_len=16",
                           "mesh.dp=2", "mesh.tp=1", "data.val_fraction=0", "train.eval_batches=0",
                           "checkpoint.every=0"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "3 jsonl shards, 16 documents" in done.stderr + done.stdout
    recorded = work / "runs" / "j" / "tokenizer" / "tokenizer.json"
    assert recorded.read_bytes() == (work / "model" / "tokenizer.json").read_bytes()
    # documents kept apart by default: the run's config names the tokenizer's end-of-document token
    import yaml
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(work / "model"), local_files_only=True).convert_tokens_to_ids("</s>")
    assert yaml.safe_load((work / "runs" / "j" / "config.yaml").read_text())["model"]["document_eos"] == eos


@pytest.mark.slow
def test_a_hugging_face_llama_continued_on_jsonl_shards_generates_in_transformers_what_sample_prints(corpus, run_main):
    """Issue 58, item 5, as a user types it from the corpus's directory: a Llama-shaped Hugging Face
    directory (a small random LlamaForCausalLM saved with the tokenizer trained above) continued
    on the JSONL shards with its own tokenizer (`model.init_from`, `data.source=jsonl`,
    `data.tokenizer`), exported (`export_hf`), loaded by transformers with the exported tokenizer:
    its greedy continuation of a prompt is the text `sample` prints, and the tokenizer's `</s>`
    is the export's EOS."""
    import torch
    import transformers

    from megascale_jax import export_hf, sample

    work, _ = corpus
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(work / "model"), local_files_only=True)
    vocab = len(hf_tok)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False,
                                      bos_token_id=hf_tok.convert_tokens_to_ids("<s>"), eos_token_id=hf_tok.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(work / "llama")
    hf_tok.save_pretrained(work / "llama")
    model = [f"model.vocab={vocab}", "model.d_model=64", "model.layers=2", "model.heads=4", "model.kv_heads=2",
             "model.block=serial", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
             "model.mlp_hidden=128", "model.seq_len=32", "model.window=null"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, "-m", "megascale_jax.train", "--run-dir", "runs/llama", *model,
                           "model.init_from=llama", "data.source=jsonl", "data.path=shards/*.jsonl*",
                           "data.tokenizer=llama", "data.cache_dir=cache4", "train.steps=3", "train.global_batch=4",
                           "mesh.dp=2", "mesh.tp=1", "data.val_fraction=0", "train.eval_batches=0", "checkpoint.every=3",
                           "optim.warmup=1"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "initialised from the Hugging Face model in llama" in done.stdout + done.stderr
    code, _, err = run_main(export_hf.main, ["runs/llama", "hf_llama"], work)
    assert code == 0, err

    tok = transformers.AutoTokenizer.from_pretrained(str(work / "hf_llama"))
    assert tok.eos_token == "</s>" and json.loads((work / "hf_llama" / "config.json").read_text())["eos_token_id"] == \
        tok.eos_token_id
    prompt = "the model attention"
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tok.convert_tokens_to_ids("<s>")  # its post-processor's BOS, as in training
    lm = transformers.AutoModelForCausalLM.from_pretrained(str(work / "hf_llama"))
    with torch.no_grad():
        theirs = lm.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, ids.shape[1]:].tolist()
    code, out, err = run_main(sample.main, ["runs/llama", "--prompt", prompt, "--max-new-tokens", "12"], work)
    assert code == 0, err
    assert tok.decode(theirs) in out, (tok.decode(theirs), out)
