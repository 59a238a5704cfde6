"""`python -m megascale_jax.tokenize` as a user runs it (a scratch directory, relative paths):
the byte-level BPE round-trips every file of the corpus, the token file holds exactly what the
`tokenizers` library encodes, a run on it trains and records the tokenizer in its run directory,
and mistakes are one line with exit 2."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e '.[interop]')")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORDS = ["the", "model", "attention", "window", "pipeline", "tensor", "gradient", "naïve", "über", "日本語",
         "émigré", "x = f(y) + 1;", "\t", "  ", "\n", "ß", "🙂"]


def run(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Six seeded random text files (unicode, code, odd whitespace) under corpus/, tokenized into
    tok/ with a 400-token vocabulary."""
    work = tmp_path_factory.mktemp("tokenize")
    rng = np.random.default_rng(0)
    (work / "corpus" / "sub").mkdir(parents=True)
    texts = {}
    for i in range(6):
        name = f"corpus/{'sub/' if i % 2 else ''}doc{i}.txt"
        texts[name] = " ".join(rng.choice(WORDS, size=400)) + ("" if i % 3 else "\n")
        (work / name).write_text(texts[name], encoding="utf-8")
    done = run("megascale_jax.tokenize", "--input", "corpus/**/*.txt", "--vocab", "400", "--out", "tok", cwd=work)
    return work, texts, done


def test_round_trip_and_the_token_file_holds_what_tokenizers_encodes(corpus):
    work, texts, done = corpus
    assert done.returncode == 0, done.stderr
    meta = json.loads((work / "tok" / "tokens.json").read_text())
    assert meta["token_dtype"] == "uint16" and meta["files"] == 6 and 257 <= meta["vocab"] <= 400
    tok = tokenizers.Tokenizer.from_file(str(work / "tok" / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    expected = []
    for name in sorted(texts, key=lambda n: str(work / n)):  # the files in glob's sorted order
        ids = tok.encode(texts[name]).ids
        assert tok.decode(ids) == texts[name]  # byte-level: every file decodes to itself
        assert len(ids) < len(texts[name].encode("utf-8"))  # the merges compress
        expected += ids + [eos]
    tokens = np.fromfile(work / "tok" / "tokens.bin", dtype=np.uint16)
    np.testing.assert_array_equal(tokens, expected)
    assert meta["tokens"] == len(expected) and meta["end_of_text"] == eos
    assert f"data.source=tokens data.path={os.path.join('tok', 'tokens.bin')} data.token_dtype=uint16" in done.stdout


@pytest.mark.slow
def test_a_run_on_the_token_file_trains_and_records_its_tokenizer(corpus):
    work, _, done = corpus
    meta = json.loads((work / "tok" / "tokens.json").read_text())
    trained = run("megascale_jax.train", "--run-dir", "run", "data.source=tokens", "data.path=tok/tokens.bin",
                  f"model.vocab={meta['vocab']}", "model.seq_len=32", "train.global_batch=8", "train.steps=3",
                  "model.layers=1", "model.d_model=32", "mesh.dp=1", "mesh.tp=1", "checkpoint.every=0",
                  "train.eval_every=0", "train.sample_at_end=0", cwd=work)
    assert trained.returncode == 0, trained.stderr[-2000:]
    recorded = work / "run" / "tokenizer"
    assert (recorded / "tokenizer.json").read_bytes() == (work / "tok" / "tokenizer.json").read_bytes()
    assert json.loads((recorded / "tokens.json").read_text()) == meta


def test_bad_input_is_one_line_and_exit_2_and_nothing_is_replaced(corpus):
    work, _, _ = corpus
    before = (work / "tok" / "tokens.bin").read_bytes()
    (work / "binary").mkdir(exist_ok=True)
    (work / "binary" / "data.parquet").write_bytes(b"PAR1\x15\x04\x15\x10\x15\x14\xff\xfe\0\0PAR1")
    for args, message in [
        (["--input", "nowhere/*.txt", "--vocab", "400", "--out", "x"],
         "error: --input 'nowhere/*.txt' matches no files; pass a glob of local text files"),
        (["--input", "corpus/**/*.txt", "--vocab", "100", "--out", "x"],
         "error: --vocab 100 is below 257 (256 bytes and <|endoftext|>); raise it"),
        (["--input", "corpus/**/*.txt", "--vocab", "400", "--out", "tok"],
         f"error: {os.path.join('tok', 'tokenizer.json')} exists; pass --overwrite to replace it, or another --out"),
        (["--input", "binary/*", "--vocab", "400", "--out", "x"],
         "error: --input 'binary/*': none of the 1 matched files is UTF-8 text (e.g. binary/data.parquet); pass text "
         "files, or encode JSONL/Parquet shards with --tokenizer"),
    ]:
        done = run("megascale_jax.tokenize", *args, cwd=work)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [message], (args, done.stderr)
    assert (work / "tok" / "tokens.bin").read_bytes() == before and not (work / "x").exists()


def test_a_file_that_is_not_utf8_text_is_left_out_with_one_warning(corpus):
    """A binary among the text files (the BPE trainer would stop at its first invalid byte with a
    traceback) is left out, said once; the rest is tokenized."""
    work, texts, _ = corpus
    (work / "mixed").mkdir(exist_ok=True)
    (work / "mixed" / "a.txt").write_text(next(iter(texts.values())), encoding="utf-8")
    (work / "mixed" / "b.txt").write_bytes(b"text, then \xff\xfe not UTF-8")
    done = run("megascale_jax.tokenize", "--input", "mixed/*", "--vocab", "300", "--out", "mixedtok", cwd=work)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"warning: skipped 1 of 2 files that are not UTF-8 text, e.g. {os.path.join('mixed', 'b.txt')}"]
    assert json.loads((work / "mixedtok" / "tokens.json").read_text())["files"] == 1


# ============================================================================ the tokenizer of any run


def test_the_byte_tokenizer_ids_are_the_utf8_bytes_and_decode_round_trips():
    from megascale_jax.training.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    rng = np.random.default_rng(3)
    # Every ASCII character, then seeded random code points from 2-, 3- and 4-byte UTF-8 ranges.
    texts = ["".join(map(chr, range(128))), " ".join(rng.choice(WORDS, size=200))]
    for low, high in [(0x80, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x110000)]:
        texts.append("".join(map(chr, rng.integers(low, high, 300))))
    covered = set()
    for text in texts:
        ids = tok.encode(text).ids
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
        covered |= set(ids)
    assert len(covered) > 200  # nearly every byte value occurs (0xC0, 0xC1, 0xF5-0xFF never do in UTF-8)
    assert tok.get_vocab_size() == 256 and tok.token_to_id("<|endoftext|>") is None
    assert tok.decode(list("é".encode("utf-8"))[:1]) == "\ufffd"  # a cut-off character, not an exception


def test_the_byte_tokenizer_saves_as_a_tokenizer_json_transformers_wraps(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megascale_jax.training.tokenizer import byte_tokenizer

    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = "def naïve(x):\n\treturn '日本語 🙂'"
    assert fast(text)["input_ids"] == list(text.encode("utf-8"))
    assert fast.decode(fast(text)["input_ids"]) == text


def test_run_tokenizer_reads_the_recorded_tokenizer_or_falls_back_to_bytes(corpus, tmp_path):
    from megascale_jax.config import load_config
    from megascale_jax.training.tokenizer import TokenizerError, run_tokenizer

    work, texts, _ = corpus
    text = next(iter(texts.values()))
    byte_level = load_config(None, ["data.source=files", "data.path=corpus/*.txt"], planning=True)
    assert run_tokenizer(str(tmp_path), byte_level).encode(text).ids == list(text.encode("utf-8"))
    on_tokens = load_config(None, ["data.source=tokens", "data.path=tok/tokens.bin", "model.vocab=400"],
                            planning=True)
    with pytest.raises(TokenizerError, match="tokenizer.json does not exist"):
        run_tokenizer(str(tmp_path), on_tokens)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_bytes((work / "tok" / "tokenizer.json").read_bytes())
    recorded = tokenizers.Tokenizer.from_file(str(work / "tok" / "tokenizer.json"))
    assert run_tokenizer(str(tmp_path), on_tokens).encode(text).ids == recorded.encode(text).ids
