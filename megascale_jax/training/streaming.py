"""`data.stream=true`: a corpus's JSONL/Parquet shards tokenized while the run trains, not into a
cache file before its first step — and a batch still a pure function of (seed, step), so there is
nothing more to checkpoint and a resume on any mesh or process count is exact.

    data.source=jsonl data.path='shards/*.jsonl.zst' data.tokenizer=tok.json data.stream=true

Readers. The corpus is read by R virtual readers (`data.readers`, fixed for the run: chosen at its
first start — the largest divisor of train.global_batch that the process count divides, at most
max(8, processes) and the shard count — and kept in its config.yaml, which a resume reads). Shard
s (in name order) belongs to reader s mod R. Reader j's token stream is its shards in a seeded
order per epoch (`np.random.default_rng([seed, epoch, j])`), each shard's training documents in
file order, each document's ids followed by the end-of-document token, concatenated over shards and
epochs; its sequence q is the window `tokens[q*L : q*L + L + 1]` (SequenceBatches' packing).

Closed-form positions. Row r of step k is served by reader j = r // (B/R) at its position
p = k*(B/R) + r % (B/R); a reader shuffles within windows of W sequences (`data.shuffle_window`):
position p of window w = p // W holds sequence w*W + perm_w[p % W], perm_w seeded by (seed, j, w).
So `rows(step, start, stop)` — what `make_global_batch` and the Prefetcher call — is a pure function
of (seed, step), and a process reads only the readers of its rows: with P processes and P | R each
owns R/P whole readers, so shards and rows are divided among processes without overlap.

On the fly. Each process tokenizes its readers' shards in background worker processes
(`shard_cache`), each reader's in the order it reads them, into a per-shard cache keyed by what the
ids depend on (not the seed, R or the mesh); a position is a read of that cache, and one not yet
tokenized waits (`data_wait_s`). Later epochs read the cached shards again in their new order: each
shard is tokenized once. A resume, or a new owner of a reader after a change of process count, whose
cache lacks the reader's shards tokenizes them again from the epoch's first (the reader's stream up
to the position: at most 1/R of the corpus each) — exact either way, as the ids are the same.

Validation. Documents whose hash of (shard file name, index in the shard) falls under
data.val_fraction form each reader's validation stream (shard_cache.is_validation), read in the
reader's first-epoch shard order, cycling, not shuffled: no pass over the corpus first.

What this gives up against the cached mode (data.stream=false, the default): the order is shuffled
within a reader's windows and across its shards, not over the whole corpus; the corpus's size is not
known at the start (too little data, or a reader with no validation document, is found when reached).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile

import numpy as np
import yaml

from megascale_jax import run_dir as run_dirs
from megascale_jax.config import Config
from megascale_jax.training import data, pretrained_tokenizer, tokenized_corpus
from megascale_jax.training.shard_cache import ShardCache, ShardError, shard_key
from megascale_jax.training.tokenizer import META_FILE, TOKENIZER_FILE, TOKENS_FILE, sha256, token_dtype

WINDOW_SEED = 0x77696E  # the windows' shuffles: a stream of their own beside the shard orders
DEFAULT_READERS_AT_MOST = 8  # readers chosen at a run's first start: resumable on 1, 2, 4 or 8 processes


class ReaderStream:
    """Reader `reader`'s endless token stream of one split, read at any position."""

    def __init__(self, cache: ShardCache, shards: list[int], split: str, seed: int, reader: int):
        self.cache, self.shards, self.split, self.seed, self.reader = cache, np.asarray(shards), split, seed, reader
        self.first = self.order(0)
        self._known: list[int] = []  # lengths of the complete shards leading the first epoch's order
        self._starts = np.zeros(1, np.int64)  # their starts, and the end of the last
        self._layouts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def order(self, epoch: int) -> np.ndarray:
        """The reader's shards in epoch `epoch`'s order (validation: always the first epoch's)."""
        epoch = 0 if self.split == "val" else epoch
        return self.shards[np.random.default_rng([self.seed, epoch, self.reader]).permutation(len(self.shards))]

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the stream, waiting for the workers where needed."""
        pieces, tries = [], 0
        while count > 0:
            piece = self._piece(start, count)
            if len(piece):
                pieces.append(piece)
                start, count, tries = start + len(piece), count - len(piece), 0
            else:
                self.cache.wait(tries)
                tries += 1
        return np.concatenate(pieces)

    def _total(self) -> int | None:
        """Tokens in one epoch of the reader, once all its shards are tokenized."""
        while len(self._known) < len(self.first) and (n := self.cache.length(int(self.first[len(self._known)]),
                                                                              self.split)) is not None:
            self._known.append(n)
            self._starts = np.append(self._starts, self._starts[-1] + n)
        if len(self._known) < len(self.first):
            return None
        total = int(self._starts[-1])
        if total == 0:
            held = "validation" if self.split == "val" else "training"
            fix = "raise data.val_fraction or lower data.readers" if self.split == "val" else "fix the shards"
            first = self.cache.shards[int(self.shards[0])] + (", ..." if len(self.shards) > 1 else "")
            raise ShardError(f"reader {self.reader} finds no {held} document in its {len(self.shards)} shard(s) "
                             f"({first}); {fix}")
        return total

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(the epoch's shard order, each shard's start in it and the end): all shards complete."""
        if epoch not in self._layouts:
            order = self.order(epoch)
            lengths = [self.cache.length(int(s), self.split) for s in order]
            self._layouts = {e: v for e, v in self._layouts.items() if e == epoch - 1}  # a sequence spans two at most
            self._layouts[epoch] = order, np.concatenate([[0], np.cumsum(lengths)])
        return self._layouts[epoch]

    def _piece(self, position: int, count: int) -> np.ndarray:
        """What can be read now from `position` (up to `count` tokens, within one shard)."""
        total = self._total()
        if total is None:  # the first epoch, still being tokenized
            order, starts, offset = self.first, self._starts, position
            if offset >= starts[-1]:  # inside the shard being tokenized
                return self.cache.read(int(order[len(self._known)]), self.split, offset - int(starts[-1]), count)
        else:
            epoch, offset = (0, position % total) if self.split == "val" else divmod(position, total)
            order, starts = self._layout(epoch)
        i = int(np.searchsorted(starts, offset, side="right")) - 1
        within = offset - int(starts[i])
        return self.cache.read(int(order[i]), self.split, within, min(count, int(starts[i + 1]) - within))


class StreamBatches:
    """Global batches of one split of a streamed corpus; the interface of `data.SequenceBatches`
    the loop uses (`rows`, `global_batch`, `seq_len`, `record_fields`)."""

    def __init__(self, cache: ShardCache, reader_shards: list[list[int]], seq_len: int, split: str, seed: int,
                 global_batch: int, window: int):
        self.cache, self.reader_shards, self.seq_len, self.split = cache, reader_shards, seq_len, split
        self.seed, self.global_batch = seed, global_batch
        self.per_reader = global_batch // len(reader_shards)
        self.window = window if split == "train" else 1
        self._streams: dict[int, ReaderStream] = {}
        self._windows: dict[tuple[int, int], np.ndarray] = {}

    def streams(self, readers) -> list[ReaderStream]:
        """The readers' streams; their shards' tokenizing starts with the first batch that asks for
        them, all at once (the workers share them out)."""
        new = [j for j in readers if j not in self._streams]
        for j in new:
            self._streams[j] = ReaderStream(self.cache, self.reader_shards[j], self.split, self.seed, j)
        if new:
            self.cache.start({j: [int(s) for s in self._streams[j].first] for j in new})
        return [self._streams[j] for j in readers]

    def sequence(self, reader: int, position: int) -> int:
        """The sequence of the reader's stream at `position`: shuffled within its window."""
        if self.window == 1:
            return position
        w, i = divmod(position, self.window)
        if (reader, w) not in self._windows:
            if len(self._windows) > 2 * len(self.reader_shards):
                self._windows.clear()
            self._windows[reader, w] = np.random.default_rng([self.seed, WINDOW_SEED, reader, w]).permutation(
                self.window)
        return w * self.window + int(self._windows[reader, w][i])

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of step `step`'s global batch: int32, shape (stop-start, seq_len+1)."""
        readers, positions = np.divmod(np.arange(start, stop), self.per_reader)
        streams = dict(zip(mine := np.unique(readers).tolist(), self.streams(mine)))
        out = np.empty((stop - start, self.seq_len + 1), dtype=np.int32)
        try:
            for i, (j, p) in enumerate(zip(readers.tolist(), (positions + step * self.per_reader).tolist())):
                q = self.sequence(j, p)
                out[i] = streams[j].read(q * self.seq_len, self.seq_len + 1)
        except ShardError as e:
            raise data.DataError(tokenized_corpus.in_config_keys(e)) from None
        return out

    def record_fields(self, steps: int) -> dict:
        return {}

    def close(self) -> None:
        self.cache.close()


# ----------------------------------------------------------------------------- the run's readers


def default_readers(global_batch: int, processes: int, shards: int) -> int | None:
    """The most readers, at most max(8, processes) and `shards`, dividing the batch and divided by
    the process count (None where none is)."""
    fits = [r for r in range(processes, min(shards, max(DEFAULT_READERS_AT_MOST, processes)) + 1, processes)
            if global_batch % r == 0]
    return fits[-1] if fits else None


def recorded(cfg: Config, run_dir: str | None) -> dict | None:
    """The data section a run being resumed (one with a committed checkpoint) started with."""
    if not run_dir or not run_dirs.committed_steps(run_dirs.checkpoint_dir(cfg, run_dir)):
        return None
    try:
        with open(run_dirs.config_path(run_dir)) as f:
            return (yaml.safe_load(f) or {}).get("data")
    except (OSError, yaml.YAMLError):
        return None


def readers_for(cfg: Config, run_dir: str | None, processes: int, shards: int) -> int:
    """The run's reader count: the one it started with, on a resume; else data.readers or the
    default. One line (DataError) where the processes or the batch cannot share it."""
    d, batch = cfg.data, cfg.train.global_batch
    saved, where = recorded(cfg, run_dir), "data.readers"
    if saved is not None:
        path = run_dirs.config_path(run_dir)
        for key, now in (("stream", d.stream), ("readers", d.readers), ("shuffle_window", d.shuffle_window)):
            if now is not None and saved.get(key) != now:
                raise data.DataError(f"data.{key}={now}, but the run being resumed started with data.{key}="
                                     f"{saved.get(key)} ({path}): its data order depends on it; set it back or pass "
                                     "a new --run-dir")
        readers, where = saved["readers"], f"the run's data.readers (recorded in {path})"
    else:
        readers = d.readers or default_readers(batch, processes, shards)
        if readers is None:
            raise data.DataError(f"data.stream=true: {shards} shards cannot be shared by {processes} processes with "
                                 f"train.global_batch={batch}; set data.readers to a multiple of {processes} that "
                                 f"divides {batch}, with at least that many shards")
    if readers > shards:
        raise data.DataError(f"data.readers={readers} is more than the {shards} shards data.path matches (each reader "
                             f"reads its own shards); lower data.readers to {shards} or fewer, or split the shards")
    if batch % readers:
        raise data.DataError(f"{where}={readers} does not divide train.global_batch={batch}; choose a batch it divides")
    if readers % processes:
        raise data.DataError(f"{where}={readers} cannot be divided among {processes} processes (each owns whole "
                             f"readers); run on a process count that divides {readers}")
    return readers


# ----------------------------------------------------------------------------- loading


@dataclasses.dataclass(frozen=True)
class Stream:
    cfg: Config  # with data.readers resolved: what the run's config.yaml records
    corpus: data.Corpus  # no tokens; its token_file names the directory holding the tokenizer
    train: StreamBatches
    val: StreamBatches
    description: str


def load(cfg: Config, run_dir: str | None, processes: int) -> Stream:
    """The streamed corpus of `cfg` (data.stream=true): checked, nothing tokenized yet (workers
    start with the first batch asked for)."""
    d = cfg.data
    try:
        paths, tokenizer, eos = tokenized_corpus.checked(cfg)
    except tokenized_corpus.CorpusError as e:
        raise data.DataError(str(e)) from None
    readers = readers_for(cfg, run_dir, processes, len(paths))
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(d, readers=readers))
    root = os.path.join(os.path.expanduser(d.cache_dir or tokenized_corpus.DEFAULT_CACHE), "stream")
    source = pretrained_tokenizer.tokenizer_file(d.tokenizer)
    keys = [shard_key(sha256(source), d.text_field, eos, d.val_fraction, p) for p in paths]
    dtype = token_dtype(tokenizer.get_vocab_size())
    job = {"tokenizer": d.tokenizer, "eos": eos, "dtype": dtype, "text_field": d.text_field,
           "val_fraction": d.val_fraction, "stop_at_bad_line": d.stop_at_bad_line}
    cache = ShardCache(root, paths, keys, job, d.tokenize_workers, data.logger.warning)
    reader_shards = [list(range(j, len(paths), readers)) for j in range(readers)]
    batches = {split: StreamBatches(cache, reader_shards, cfg.model.seq_len, split, cfg.train.seed,
                                    cfg.train.global_batch, d.shuffle_window) for split in ("train", "val")}
    described = _describe(root, keys, source, {"vocab": tokenizer.get_vocab_size(), "token_dtype": dtype,
                                               "end_of_text": eos, "shards": len(paths), "text_field": d.text_field,
                                               "tokenizer_sha256": sha256(source), "streamed": True})
    description = (f"{len(paths):,} {d.source} shards streamed, tokenized with {d.tokenizer} while training "
                   f"({cache.already_tokenized():,} already in the cache); {readers} readers "
                   f"({readers // processes} a process), each shuffled within windows of {d.shuffle_window:,} "
                   f"sequences of {cfg.model.seq_len} tokens")
    return Stream(cfg, data.Corpus(None, description, os.path.join(described, TOKENS_FILE), eos), batches["train"],
                  batches["val"], description)


def _describe(root: str, keys: list[str], tokenizer_file: str, meta: dict) -> str:
    """A directory with the tokenizer and a tokens.json saying what the ids are (no tokens.bin:
    what a run records in RUN_DIR/tokenizer/), named by the shards' keys."""
    directory = os.path.join(root, "corpus-" + hashlib.sha256("\n".join(keys).encode()).hexdigest()[:24])
    if not os.path.isfile(os.path.join(directory, META_FILE)):
        os.makedirs(directory, exist_ok=True)
        with open(tokenizer_file, "rb") as f:
            files = ((TOKENIZER_FILE, f.read()), (META_FILE, json.dumps(meta, indent=1).encode()))
        for name, content in files:  # processes that write at once each write a whole file
            with tempfile.NamedTemporaryFile(dir=directory, suffix=".tmp", delete=False) as f:
                f.write(content)
            os.replace(f.name, os.path.join(directory, name))
    return directory
