"""Token data: load a corpus, pack it into fixed-length sequences, hand each process its rows.

Design:
* One flat 1-D token array per run. `data.source=stdlib` (default) is this Python's own
  standard-library `.py` sources as bytes — real text on every machine, no download;
  `files` is a glob of text files, also byte-level; `tokens` is a flat uint16/uint32 file,
  memory-mapped so a huge corpus is never read whole; `jsonl`/`parquet` are a corpus's shards,
  tokenized with `data.tokenizer` once into a cached token file, then mapped as `tokens`
  (`tokenized_corpus`).
* Packing: sequence i is the window `tokens[i*L : i*L + L + 1]` (inputs = first L tokens,
  targets = last L). Windows do not overlap except for that one shared boundary token.
* Split: the last ceil(val_fraction * n) sequences are validation, the rest train — two
  contiguous blocks, so no validation text hides inside a training sequence.
* Order depends on the seed alone, never on the mesh: training walks an endless stream of
  per-epoch permutations, step k takes stream positions [k*B, (k+1)*B); validation walks its
  sequences in order, cycling. A batch is a list of global sequence indices.
* Each process materialises only the rows its devices hold and assembles the global
  `jax.Array` with `jax.make_array_from_process_local_data`.
* `Prefetcher` is a grain pipeline that builds the next `data.prefetch` batches on a
  background thread while the step runs; its iterator state is checkpointed with the model.
  `Feed` hands the loop each step's batch, and a replayed step's batch again.
* User mistakes (missing/empty inputs, tokens >= vocab, too little data) raise `DataError`:
  one line naming the key or file and the fix. A `files` glob is read as a user means it: each
  file once however many symlinks lead to it, and files that are not text (a NUL byte or invalid
  UTF-8 in the first KiB: compressed, binary) skipped with one warning that counts them — an
  error if nothing is left. `Corpus.description` says what was read (files and bytes, or tokens).
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import math
import os
import sysconfig
import time
from typing import Literal

import grain
import jax
import numpy as np

from megascale_jax import cli
from megascale_jax.config import Config
from megascale_jax.training import documents, tokenized_corpus

logger = cli.get_logger("data")

_SCAN_CHUNK = 1 << 24  # tokens checked against the vocabulary at a time (bounded memory)


class DataError(ValueError):
    """A user-facing data mistake; the message is one line naming the key/file and the fix."""


# ----------------------------------------------------------------------------- loading


@dataclasses.dataclass(frozen=True)
class Corpus:
    tokens: np.ndarray | None  # 1-D, all of it (a read-only memmap for data.source=tokens|jsonl|parquet); None: streamed
    description: str  # what was read: "12 files, 1,234,567 bytes" or "1,234,567 tokens"
    # jsonl/parquet: the cached token file (its tokenizer.json beside it; streamed: only its directory exists)
    token_file: str | None = None
    end_of_document: int | None = None  # jsonl/parquet: the token the tokenizer ends each document with


def load_tokens(cfg: Config) -> np.ndarray:
    """The whole corpus as a 1-D token array (a read-only memmap for `data.source=tokens`)."""
    return load_corpus(cfg).tokens


def load_corpus(cfg: Config) -> Corpus:
    d = cfg.data
    if d.source == "stdlib":
        stdlib = sysconfig.get_paths()["stdlib"]
        paths = sorted(glob.glob(os.path.join(stdlib, "*.py")))
        where = f"data.source=stdlib ({stdlib})"
        tokens = _read_bytes(paths, where)
        description = f"{len(paths):,} files, {len(tokens):,} bytes"
    elif d.source == "files":
        if d.path is None:
            raise DataError("data.source=files needs data.path=GLOB (e.g. 'corpus/*.txt')")
        # Each file once: two symlinks (or a link and its target) to one file are one file.
        paths = documents.matching_files(d.path)
        where = f"data.path={d.path!r}"
        tokens, used = _read_text_files(paths, where)
        description = f"{used:,} files, {len(tokens):,} bytes"
    elif d.source in ("jsonl", "parquet"):
        try:
            tokens, description, token_file, eos = tokenized_corpus.load(cfg)
        except tokenized_corpus.CorpusError as e:
            raise DataError(str(e)) from None
        return Corpus(tokens, description, token_file, eos)  # the tokenizer's ids: checked against model.vocab
    else:
        tokens = _map_token_file(d.path, d.token_dtype)
        where = f"data.path={d.path!r}"
        description = f"{len(tokens):,} tokens"
    _check_vocab(tokens, cfg.model.vocab, where)
    return Corpus(tokens, description)


def _is_text(head: bytes) -> bool:
    """No NUL byte and valid UTF-8 (a character cut at the end of `head` allowed)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return b"\0" not in head


def _read_text_files(paths: list[str], where: str) -> tuple[np.ndarray, int]:
    """`_read_bytes` of the files that are text, and how many those are; the others are skipped
    with one warning, or refused with one line when nothing is left."""
    if not paths:
        raise DataError(f"{where} matches no files; pass a glob of readable text files")
    text, skipped = [], []
    for path in paths:
        try:
            with open(path, "rb") as f:
                (text if _is_text(f.read(1024)) else skipped).append(path)
        except OSError as e:
            raise DataError(f"{where}: cannot read {path!r} ({e.strerror}); pass readable text files")
    if not text:
        raise DataError(f"{where}: none of the {len(paths):,} matched files is text (a NUL byte or invalid UTF-8 "
                        f"in the first KiB, e.g. {skipped[0]!r}); pass a glob of text files")
    if skipped:
        logger.warning(f"{where}: skipped {len(skipped):,} of {len(paths):,} files that are not text (a NUL byte "
                       f"or invalid UTF-8 in the first KiB), e.g. {skipped[0]!r}")
    return _read_bytes(text, where), len(text)


def _read_bytes(paths: list[str], where: str) -> np.ndarray:
    """Byte-level tokens: the files' bytes joined by b"\\n", as uint16."""
    if not paths:
        raise DataError(f"{where} matches no files; pass a glob of readable text files")
    contents = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                contents.append(f.read())
        except OSError as e:
            raise DataError(f"{where}: cannot read {path!r} ({e.strerror}); pass readable text files")
    data = b"\n".join(contents)
    if not any(contents):
        raise DataError(f"{where}: all {len(paths)} matched files are empty; pass non-empty text files")
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def _map_token_file(path: str | None, dtype: str) -> np.ndarray:
    """Memory-map a flat binary token file without reading it."""
    if path is None:
        raise DataError("data.source=tokens needs data.path=FILE (a flat uint16/uint32 token file)")
    if not os.path.isfile(path):
        raise DataError(f"data.path={path!r} is not a file; pass a flat {dtype} token file")
    size, itemsize = os.path.getsize(path), np.dtype(dtype).itemsize
    if size == 0:
        raise DataError(f"data.path={path!r} is empty; pass a non-empty flat {dtype} token file")
    if size % itemsize:
        raise DataError(f"data.path={path!r} has {size} bytes, not a multiple of {itemsize}; "
                        f"is data.token_dtype={dtype} the dtype it was written with?")
    return np.memmap(path, dtype=dtype, mode="r")


def _check_vocab(tokens: np.ndarray, vocab: int, where: str) -> None:
    """Every token must be < model.vocab; scanned in chunks so a memmap is never loaded whole."""
    top = max(int(tokens[i:i + _SCAN_CHUNK].max()) for i in range(0, len(tokens), _SCAN_CHUNK))
    if top >= vocab:
        raise DataError(f"{where} contains token {top} but model.vocab={vocab}; "
                        f"set model.vocab>={top + 1} or re-tokenize the data")


# ----------------------------------------------------------------------------- packing and order


def with_documents_apart(cfg: Config, corpus: Corpus) -> Config:
    """`cfg` with model.document_eos the corpus's end-of-document token, where the source has one
    (jsonl/parquet), data.keep_documents_apart is on and the config names none itself."""
    if corpus.end_of_document is None or not cfg.data.keep_documents_apart or cfg.model.document_eos is not None:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, document_eos=corpus.end_of_document))


def split_sizes(n_sequences: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) sequence counts: the last ceil(val_fraction * n) sequences are validation."""
    n_val = math.ceil(round(val_fraction * n_sequences, 9))  # round: 0.1 * 30 is 3.0000000000000004
    return n_sequences - n_val, n_val


class SequenceBatches:
    """Global batches of packed sequences for one split; a pure function of (seed, step)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, split: Literal["train", "val"],
                 val_fraction: float, seed: int, global_batch: int):
        if seed < 0:
            raise DataError(f"train.seed={seed} must be >= 0")
        self.tokens, self.seq_len, self.split = tokens, seq_len, split
        self.seed, self.global_batch = seed, global_batch
        self._orders: dict[int, np.ndarray] = {}
        n = max(len(tokens) - 1, 0) // seq_len
        self.n_train, self.n_val = split_sizes(n, val_fraction)
        if self.n_train < global_batch or (self.n_val < 1 and val_fraction > 0):  # 0: a run without validation
            raise DataError(
                f"{len(tokens)} tokens pack into {n} sequences of model.seq_len={seq_len} "
                f"({self.n_train} train, {self.n_val} validation) but train.global_batch={global_batch} "
                f"needs at least {_tokens_needed(seq_len, global_batch, val_fraction)} tokens; "
                "lower model.seq_len or train.global_batch, or add data")

    @classmethod
    def from_config(cls, cfg: Config, tokens: np.ndarray, split: Literal["train", "val"]) -> SequenceBatches:
        return cls(tokens, cfg.model.seq_len, split, cfg.data.val_fraction, cfg.train.seed,
                   cfg.train.global_batch)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """Training order of one epoch; the previous epoch's is kept, as a batch may span both."""
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_train)
        return self._orders[epoch]

    def indices_at(self, positions: np.ndarray) -> np.ndarray:
        """Sequence indices (into the whole packed corpus) at these positions of the split's
        stream (ascending: a stream position's epoch order is built once)."""
        if self.split == "val":
            return self.n_train + positions % self.n_val
        epochs, offsets = np.divmod(positions, self.n_train)
        out = np.empty(len(positions), dtype=np.int64)
        for e in np.unique(epochs):
            out[epochs == e] = self._epoch_order(int(e))[offsets[epochs == e]]
        return out

    def global_indices(self, step: int) -> np.ndarray:
        """Sequence indices (into the whole packed corpus) of step `step`'s global batch."""
        return self.indices_at(np.arange(step * self.global_batch, (step + 1) * self.global_batch))

    def rows_at(self, positions: np.ndarray) -> np.ndarray:
        """The sequences at these stream positions: int32, shape (len(positions), seq_len+1)."""
        first = self.indices_at(positions) * self.seq_len
        return np.asarray(self.tokens[first[:, None] + np.arange(self.seq_len + 1)], dtype=np.int32)

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of step `step`'s global batch: int32, shape (stop-start, seq_len+1)."""
        return self.rows_at(np.arange(step * self.global_batch + start, step * self.global_batch + stop))

    def record_fields(self, steps: int) -> dict:
        """What a metrics record says of the data after `steps` steps (a mixture's proportions)."""
        return {}


def _tokens_needed(seq_len: int, global_batch: int, val_fraction: float) -> int:
    """Fewest tokens giving `global_batch` train sequences and at least one validation sequence."""
    n = global_batch + 1
    while split_sizes(n, val_fraction)[0] < global_batch:
        n += 1
    return n * seq_len + 1


# ----------------------------------------------------------------------------- device placement


def process_row_range(sharding: jax.sharding.Sharding, global_shape: tuple[int, int]) -> tuple[int, int]:
    """[start, stop) of the batch rows held by this process's devices (one contiguous block)."""
    batch, width = global_shape
    covered = set()
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        rows, cols = index
        if cols.indices(width) != (0, width, 1):
            raise ValueError(f"batch sharding must not split the sequence dimension, got {sharding}")
        covered.update(range(*rows.indices(batch)))
    start, stop = min(covered), max(covered) + 1
    if len(covered) != stop - start:
        raise ValueError(f"this process's batch rows {sorted(covered)} are not contiguous under {sharding}; "
                         "order mesh devices so each process holds one block of dp")
    return start, stop


def make_global_batch(batches: SequenceBatches, step: int, sharding: jax.sharding.Sharding) -> jax.Array:
    """Step `step`'s (global_batch, seq_len+1) int32 batch, built from this process's rows only."""
    global_shape = (batches.global_batch, batches.seq_len + 1)
    start, stop = process_row_range(sharding, global_shape)
    local = batches.rows(step, start, stop)
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


class Prefetcher:
    """Global batches of steps start, start+1, ... from a grain pipeline, `depth` of them prepared
    ahead on grain's prefetch thread while the step runs.

    The pipeline is a `grain.MapDataset` over step indices mapped to `make_global_batch`, so one
    loader per process reads just its rows and places them on all of its devices, and the order
    is exactly the synchronous one. Its iterator state (`{"next_index": steps consumed}`) is
    checkpointed beside the model with grain's orbax handler (see checkpoint.py)."""

    def __init__(self, batches: SequenceBatches, sharding: jax.sharding.Sharding, start: int, depth: int):
        steps = grain.MapDataset.range(0, _ENDLESS).map(lambda step: make_global_batch(batches, step, sharding))
        iterable = steps.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        if depth > 0:
            iterable = grain.experimental.ThreadPrefetchIterDataset(iterable, prefetch_buffer_size=depth)
        self._iterator = iter(iterable)
        self._iterator.set_state({"next_index": start})  # before the first get: nothing prefetched yet
        if depth > 0:
            self._iterator.start_prefetch()  # fill the queue now, not at the first get

    def get(self) -> jax.Array:
        """The next step's batch (blocks only if the background thread is behind)."""
        return next(self._iterator)

    def get_state(self) -> dict:
        """`{"next_index": n}`: n batches consumed; what grain's orbax handler saves."""
        return self._iterator.get_state()

    def close(self) -> None:
        close = getattr(self._iterator, "close", None)
        if close:
            close()


_ENDLESS = 1 << 62  # steps in the (lazy) dataset: more than any run takes


class Feed:
    """The batch of each step the loop runs, in order — and the same batch again for a step that
    is replayed (training/triage.py): batches are kept until their step is recorded, because the
    loop learns that a step was not finite one step late."""

    def __init__(self, prefetcher: Prefetcher, start: int, watch):
        self.prefetcher, self.watch = prefetcher, watch
        self.first = prefetcher.get()  # fetched before compiling: the step is lowered for its shape
        self.kept = {start + 1: self.first}
        self.wait_s = 0.0  # how long the last `batch` waited for the prefetcher

    def batch(self, step: int) -> jax.Array:
        t_data, wall_data = time.perf_counter(), time.time()
        batch = self.kept[step] if step in self.kept else self.prefetcher.get()
        self.kept[step] = batch
        self.wait_s = time.perf_counter() - t_data
        self.watch.phase(step, "data_wait", wall_data, self.wait_s)
        return batch

    def recorded_before(self, step: int) -> None:
        """Steps before `step` are recorded (finite): their batches will not run again."""
        self.kept = {s: b for s, b in self.kept.items() if s >= step}

    def close(self) -> None:
        self.prefetcher.close()
