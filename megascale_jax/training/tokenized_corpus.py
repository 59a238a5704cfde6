"""`data.source=jsonl|parquet`: a corpus's shards, tokenized with `data.tokenizer` once, then
memory-mapped by every run that reads them.

    data.source=jsonl data.path='shards/*.jsonl.gz' data.tokenizer=path/to/tokenizer.json

The first run over a corpus encodes every shard with the model's own tokenizer
(`pretrained_tokenizer.tokenize_corpus`, the path `python -m megascale_jax.tokenize --tokenizer`
takes: one worker process a core, each document's ids followed by the end-of-document token)
into a token file under `data.cache_dir` (default ~/.cache/megascale_jax/tokenized), in a
directory named by a key of everything the ids depend on: the tokenizer file's bytes, the text
field, the end-of-document token, and each shard's real path, size and modification time. Every
later run over the same corpus (another mesh or process count, a resume) maps that file: no
second tokenization, and the same ids in the same order, so resume is as exact as for
`data.source=tokens`. A changed shard or tokenizer is a new key, tokenized again.

Memory does not grow with the corpus: a worker holds one batch of documents and its ids, the
parts are joined on disk, and training reads the token file through a read-only memory map.
The cache directory is written under a temporary name and renamed into place, so processes
that tokenize at once (one per host without a shared disk, or several on one) each end with the
same complete file and never read a half-written one.

Checked before anything is tokenized: the shards exist and are of the source's format, the
tokenizer loads, and its vocabulary fits `model.vocab`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import numpy as np

from megascale_jax import cli
from megascale_jax.training import documents, pretrained_tokenizer
from megascale_jax.training.tokenizer import META_FILE, TOKENS_FILE, TokenizerError, sha256

logger = cli.get_logger("data")

DEFAULT_CACHE = os.path.join("~", ".cache", "megascale_jax", "tokenized")
KEY_VERSION = 1  # bump when the token file a key names would be written differently


class CorpusError(ValueError):
    """A corpus or tokenizer the run cannot use: one line naming the key and the fix."""


# The readers' messages name `python -m megascale_jax.tokenize`'s options; a run names its keys.
OPTION_KEYS = {"--input": "data.path", "--text-field": "data.text_field", "--tokenizer": "data.tokenizer",
               "--eos": "data.eos", "--stop-at-bad-line": "data.stop_at_bad_line=true"}


def in_config_keys(error: Exception) -> str:
    message = str(error)
    for option, key in OPTION_KEYS.items():
        message = message.replace(option, key)
    return message


def shards(d) -> list[str]:
    """The shards `data.path` names, each of `data.source`'s format."""
    try:
        paths = documents.shard_paths(d.path)
    except documents.DocumentError as e:
        raise CorpusError(f"data.path={d.path!r}: {e}") from None
    other = [p for p in paths if documents.shard_format(p) != d.source]
    if other:
        raise CorpusError(f"data.path={d.path!r} matches {other[0]}, which is not {d.source}; narrow the glob, or "
                          f"set data.source={documents.shard_format(other[0])}")
    return paths


def key(d, paths: list[str], eos: int) -> str:
    """The cache key of the ids this corpus and tokenizer give (module docstring)."""
    described = {"version": KEY_VERSION, "tokenizer_sha256": sha256(pretrained_tokenizer.tokenizer_file(d.tokenizer)),
                 "text_field": d.text_field, "eos": eos,
                 "shards": [(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths]}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


def checked(cfg) -> tuple[list[str], object, int]:
    """(the shards, the tokenizer, its end-of-document token), each checked: one line where not."""
    d = cfg.data
    paths = shards(d)
    try:
        tokenizer = pretrained_tokenizer.load(d.tokenizer)
        eos = pretrained_tokenizer.end_of_document(d.tokenizer, tokenizer, d.eos)
    except TokenizerError as e:
        raise CorpusError(in_config_keys(e)) from None
    vocab = tokenizer.get_vocab_size()
    if vocab > cfg.model.vocab:
        raise CorpusError(f"data.tokenizer={d.tokenizer!r} has {vocab:,} tokens but model.vocab={cfg.model.vocab:,}; "
                          f"set model.vocab={vocab} or more (a multiple of 128 is faster on GPUs)")
    return paths, tokenizer, eos


def token_file(cfg) -> tuple[str, dict]:
    """(the token file, its tokens.json) of the run's corpus, tokenizing it first if no run has."""
    d = cfg.data
    paths, _, eos = checked(cfg)
    root = os.path.expanduser(d.cache_dir or DEFAULT_CACHE)
    directory = os.path.join(root, key(d, paths, eos))
    if not os.path.isfile(os.path.join(directory, META_FILE)):
        _tokenize(d, paths, root, directory)
    with open(os.path.join(directory, META_FILE)) as f:
        return os.path.join(directory, TOKENS_FILE), json.load(f)


def _tokenize(d, paths: list[str], root: str, directory: str) -> None:
    workers = d.tokenize_workers or max(1, min(len(paths), os.cpu_count() or 1))
    logger.info(f"data: tokenizing {len(paths):,} {d.source} shards with {d.tokenizer} ({workers} workers) into "
                f"{directory} (once: later runs map it)")
    os.makedirs(root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".tokenizing-", dir=root)
    try:
        try:
            pretrained_tokenizer.tokenize_corpus(d.tokenizer, d.path, scratch, d.text_field, workers, d.eos,
                                                 d.stop_at_bad_line, overwrite=True, log=logger.warning)
        except (TokenizerError, documents.DocumentError) as e:
            raise CorpusError(in_config_keys(e)) from None
        try:
            os.replace(scratch, directory)
        except OSError:  # another process renamed its identical copy into place first
            if not os.path.isfile(os.path.join(directory, META_FILE)):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load(cfg) -> tuple[np.ndarray, str, str, int]:
    """(tokens as a read-only memory map, what was read, the token file, the end-of-document token)
    for `data.source=jsonl|parquet`."""
    path, meta = token_file(cfg)
    tokens = np.memmap(path, dtype=meta["token_dtype"], mode="r")
    description = (f"{meta['shards']:,} {cfg.data.source} shards, {meta['documents']:,} documents, "
                   f"{len(tokens):,} tokens (tokenized with {cfg.data.tokenizer}"
                   + (f"; {meta['bad_lines_skipped']:,} bad lines skipped" if meta["bad_lines_skipped"] else "") + ")")
    return tokens, description, path, meta["end_of_text"]
