"""A model's own tokenizer (a `tokenizer.json`, or a Hugging Face model directory holding one),
loaded offline, and a corpus's documents encoded with it into the flat token file that
`data.source=tokens` reads (`python -m megascale_jax.tokenize --tokenizer PATH --input GLOB`).

Ids are the tokenizer's own: `Tokenizer.encode(text)` with its special tokens, exactly as
`transformers` encodes the text (its post-processor adds a BOS where the tokenizer defines one,
Llama's `<s>`); then the end-of-document token follows each document, unless the encoding already
ends with it. Which token that is: the directory's `tokenizer_config.json` `eos_token`, else the
first of the usual names the vocabulary has (`<|endoftext|>`, `</s>`, `<|end_of_text|>`,
`<eos>`), else `--eos` must name it.

Shards are encoded in parallel, one worker process per shard at a time (`workers`, one core each),
each writing its part; the parts join in shard order, so the token file does not depend on the
worker count. With one worker `tokenizers` uses a thread per core itself.
Memory per worker is one batch of documents and its ids, whatever the corpus's size.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import tempfile

import numpy as np

from megascale_jax.training import documents
from megascale_jax.training.tokenizer import TOKENIZER_FILE, TokenizerError, output_files, sha256, token_dtype

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
# A worker encodes documents in batches of at most this many, or this much text, whichever comes
# first: `tokenizers`' encodings hold ~100 bytes a token (ids, offsets, the token strings), so 256
# long documents (5 MB of text) held ~1 GB while encoded; 1 MiB holds tens of MB. Both the cached
# and the streamed mode's workers batch this way.
BATCH_DOCUMENTS = 256
BATCH_BYTES = 1 << 20


def document_batches(path: str, field: str, bad: documents.BadLines):
    """A shard's documents in batches of at most BATCH_DOCUMENTS or ~BATCH_BYTES of text:
    (texts, their bytes of UTF-8), the last batch possibly empty."""
    batch, size = [], 0
    for text in documents.read_documents(path, field, bad):
        batch.append(text)
        size += len(text.encode("utf-8", "surrogatepass"))
        if len(batch) == BATCH_DOCUMENTS or size >= BATCH_BYTES:
            yield batch, size
            batch, size = [], 0
    yield batch, size


def tokenizer_file(path: str) -> str:
    """The tokenizer.json that `path` names: the file itself, or the one in a model directory."""
    candidate = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(candidate):
        where = f"{path} has no {TOKENIZER_FILE}" if os.path.isdir(path) else f"{path} does not exist"
        raise TokenizerError(f"--tokenizer: {where}; pass a tokenizer.json or a Hugging Face model directory with "
                             "one (a fast tokenizer: transformers' save_pretrained writes it)")
    return candidate


def load(path: str):
    """The `tokenizers.Tokenizer` of `path` (a tokenizer.json or a model directory), offline."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(tokenizer_file(path))
    except Exception as e:  # tokenizers raises its own Exception for a file it cannot parse
        if isinstance(e, TokenizerError):
            raise
        raise TokenizerError(f"--tokenizer {path}: not a tokenizer.json `tokenizers` can read "
                             f"({str(e).splitlines()[0][:200]})") from None


def end_of_document(path: str, tokenizer, named: str | None = None) -> int:
    """The id of the token that ends each document (module docstring)."""
    config = os.path.join(path, "tokenizer_config.json") if os.path.isdir(path) else ""
    token = named
    if token is None and config and os.path.isfile(config):
        with open(config) as f:
            eos = json.load(f).get("eos_token")
        token = eos.get("content") if isinstance(eos, dict) else eos
    for name in [token] if token else EOS_NAMES:
        if (found := tokenizer.token_to_id(name)) is not None:
            return found
    if token:
        raise TokenizerError(f"the end-of-document token {token!r} is not in {path}'s vocabulary; pass --eos with "
                             "one it has")
    raise TokenizerError(f"cannot tell {path}'s end-of-document token (none of {', '.join(EOS_NAMES)} is in its "
                         "vocabulary, and no tokenizer_config.json names one); pass --eos TOKEN")


def encode_documents(tokenizer, texts: list[str], eos: int) -> list[list[int]]:
    """Each text's ids as the tokenizer encodes it, the end-of-document id after each."""
    out = []
    for encoding in tokenizer.encode_batch(texts):
        ids = encoding.ids
        out.append(ids if ids and ids[-1] == eos else [*ids, eos])
    return out


def _encode_shard(job: tuple) -> tuple[str, int, int, int, str, int]:
    """One worker's shard: its tokens written to `part` in `dtype`. Returns (part, tokens,
    documents, bad lines, the first bad line, bytes of text)."""
    tokenizer_path, shard, field, eos, dtype, part, stop_at_bad_line = job
    tokenizer = load(tokenizer_path)
    bad = documents.BadLines(stop_at_bad_line)
    tokens = docs = text_bytes = 0
    with open(part, "wb") as out:
        for batch, size in document_batches(shard, field, bad):
            text_bytes += size
            tokens, docs = _write(out, tokenizer, batch, eos, dtype, tokens, docs)
    return part, tokens, docs, bad.count, bad.first, text_bytes


def _write(out, tokenizer, batch: list[str], eos: int, dtype: str, tokens: int, docs: int) -> tuple[int, int]:
    for ids in encode_documents(tokenizer, batch, eos) if batch else []:
        np.asarray(ids, dtype=dtype).tofile(out)
        tokens += len(ids)
        docs += 1
    return tokens, docs


@contextlib.contextmanager
def _environment(**values):
    """`values` set in os.environ (which spawned workers inherit) for the block, then restored."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def tokenize_corpus(tokenizer_path: str, pattern: str, out_dir: str, field: str = "text", workers: int = 1,
                    eos_token: str | None = None, stop_at_bad_line: bool = False, overwrite: bool = False,
                    log=print) -> dict:
    """Encode every shard `pattern` matches into out_dir/tokens.bin, with tokenizer.json and
    tokens.json beside it (as `python -m megascale_jax.tokenize` writes them). Returns tokens.json."""
    tokenizer = load(tokenizer_path)
    eos = end_of_document(tokenizer_path, tokenizer, eos_token)
    shards = documents.shard_paths(pattern)
    made = not os.path.exists(out_dir)
    targets = output_files(out_dir, overwrite)
    try:
        return _tokenize_shards(tokenizer, tokenizer_path, shards, pattern, targets, out_dir, field, workers, eos,
                                stop_at_bad_line, log)
    except BaseException:
        if made:  # a refused corpus leaves no directory behind
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _tokenize_shards(tokenizer, tokenizer_path: str, shards: list[str], pattern: str, targets: list[str], out_dir: str,
                     field: str, workers: int, eos: int, stop_at_bad_line: bool, log) -> dict:
    dtype = token_dtype(tokenizer.get_vocab_size())
    with tempfile.TemporaryDirectory(prefix=".parts-", dir=out_dir) as parts:
        jobs = [(tokenizer_path, shard, field, eos, dtype, os.path.join(parts, f"{i:06d}.bin"), stop_at_bad_line)
                for i, shard in enumerate(shards)]
        if workers > 1:
            # one core a worker: `tokenizers` would otherwise start a thread per core in each
            with _environment(RAYON_NUM_THREADS="1"), multiprocessing.get_context("spawn").Pool(workers) as pool:
                results = pool.map(_encode_shard, jobs, chunksize=1)
        else:
            results = [_encode_shard(job) for job in jobs]
        empty = [shard for shard, (_, tokens, *_) in zip(shards, results) if tokens == 0]
        if len(empty) == len(shards):
            raise TokenizerError(f"--input {pattern!r}: no document in any of its {len(shards)} shards")
        if empty:
            log(f"warning: {len(empty)} of {len(shards)} shards hold no document (empty, or every line bad), "
                f"e.g. {empty[0]}")
        with open(os.path.join(parts, "all.bin"), "wb") as joined:
            for part, *_ in results:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, joined)
        os.replace(os.path.join(parts, "all.bin"), targets[1])
    shutil.copyfile(tokenizer_file(tokenizer_path), targets[0])
    bad = sum(r[3] for r in results)
    if bad:
        log(f"warning: skipped {bad:,} bad lines (not JSON, not UTF-8, or without a string {field!r}); the first: "
            f"{next(r[4] for r in results if r[4])}")
    meta = {"vocab": tokenizer.get_vocab_size(), "token_dtype": dtype, "tokens": sum(r[1] for r in results),
            "documents": sum(r[2] for r in results), "end_of_text": eos, "shards": len(shards),
            "bad_lines_skipped": bad, "text_bytes": sum(r[5] for r in results),
            "tokenizer_sha256": sha256(targets[0]), "text_field": field}
    with open(targets[2], "w") as f:
        json.dump(meta, f, indent=1)
    return meta
