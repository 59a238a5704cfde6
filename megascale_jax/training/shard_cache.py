"""The shards of a streamed corpus (`data.stream=true`, training/streaming.py), tokenized while the
run trains: one cache directory per shard, written by background worker processes and read by the
loader while it grows.

    <data.cache_dir>/stream/<shard key>/train.bin   the shard's training documents' ids, each ended by EOS
                                       /val.bin     its validation documents' ids
                                       /meta.json   written last: the shard is complete (its counts)

A shard's key is everything its ids depend on: the tokenizer file's bytes, the text field, the
end-of-document token, data.val_fraction, and the shard's real path, size and modification time.
Not the run's seed, reader count or mesh: a later run over the same corpus (another seed, another
process count, a resume) reads what an earlier one tokenized, and only a shard never tokenized
costs tokenizing. The ids are exactly `pretrained_tokenizer`'s (the cached mode's and `python -m
megascale_jax.tokenize`'s): each document as the tokenizer encodes it, then the end-of-document token.

Workers. A process starts at most `workers` worker processes (`python -m
megascale_jax.training.shard_cache`, no JAX in them), its readers shared out among them; a worker
tokenizes its readers' shards, each reader's in the order that reader reads them, one batch of
documents (256, or 1 MiB of text) of each reader in turn — so the readers advance together, and the
first step waits for the first windows of every reader, not for whole shards. Each batch's ids are
appended to `train.<job>.part` / `val.<job>.part` and flushed, so the loader reads a shard while it
is being tokenized; at the shard's end the parts are renamed into place, then meta.json is written.
Parts are named by the job that writes them: two processes that tokenize one shard at once (two
runs on one corpus) never write one file, and as a shard's ids are the same whoever tokenizes it,
either copy is right. A worker holds the tokenizer and, per reader, one batch of documents and its
ids: memory does not grow with the corpus. It stops when its parent dies (a killed run leaves no
worker behind).

Validation documents: a document is held out when a hash of (its shard's file name, its index
among the shard's documents) falls under data.val_fraction; decided as the document is read, so no
pass over the corpus comes first, and the same documents whatever the seed, readers or mesh.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from megascale_jax.training import documents, pretrained_tokenizer
from megascale_jax.training.tokenizer import TokenizerError

KEY_VERSION = 1  # bump when a shard key's files would be written differently
SPLITS = ("train", "val")
META = "meta.json"
_POLL_S = (0.002, 0.05)  # the loader's wait for a worker: first and longest sleep between looks


class ShardError(ValueError):
    """A shard or tokenizer a worker could not use: one line (the cached mode's messages)."""


def is_validation(name: str, index: int, val_fraction: float) -> bool:
    """Whether document `index` (0-based, among its shard's documents) of the shard named `name`
    (its file name) is held out: its hash, a 64-bit fraction, falls under `val_fraction`."""
    if val_fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{name}\n{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < val_fraction * 2.0 ** 64


def shard_key(tokenizer_sha256: str, text_field: str, eos: int, val_fraction: float, path: str) -> str:
    stat = os.stat(path)
    described = {"version": KEY_VERSION, "tokenizer_sha256": tokenizer_sha256, "text_field": text_field, "eos": eos,
                 "val_fraction": val_fraction, "shard": (path, stat.st_size, stat.st_mtime_ns)}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


# ----------------------------------------------------------------------------- the worker process


def tokenize_readers(job: dict) -> None:
    """A worker's job: the shards of `job["readers"]` (one list of [shard, directory] a reader, in
    its reading order), one batch of documents of each reader in turn."""
    os.environ["RAYON_NUM_THREADS"] = "1"  # one core a worker, before tokenizers starts its threads
    tokenizer = pretrained_tokenizer.load(job["tokenizer"])
    parent = os.getppid()
    running = [_reader_batches(tokenizer, shards, job) for shards in job["readers"]]
    while running:
        for batches in list(running):
            if next(batches, None) is None:
                running.remove(batches)
        if os.getppid() != parent:  # the run is gone: nothing will read these
            return


def _reader_batches(tokenizer, shards: list, job: dict):
    for path, directory in shards:
        if not os.path.isfile(os.path.join(directory, META)):
            yield from _shard_batches(tokenizer, path, directory, job)


def _shard_batches(tokenizer, path: str, directory: str, job: dict):
    """Tokenize one shard into `directory`, yielding (True) after each batch of documents."""
    os.makedirs(directory, exist_ok=True)
    parts = {split: part_path(directory, split, job["part"]) for split in SPLITS}
    bad = documents.BadLines(job["stop_at_bad_line"])
    counts = {"tokens": {s: 0 for s in SPLITS}, "documents": {s: 0 for s in SPLITS}, "text_bytes": 0}
    name, dtype, eos = os.path.basename(path), job["dtype"], job["eos"]
    try:
        with open(parts["train"], "wb") as train, open(parts["val"], "wb") as val:
            out = {"train": train, "val": val}
            for batch, size in pretrained_tokenizer.document_batches(path, job["text_field"], bad):
                first = sum(counts["documents"].values())
                for i, ids in enumerate(pretrained_tokenizer.encode_documents(tokenizer, batch, eos) if batch else []):
                    split = "val" if is_validation(name, first + i, job["val_fraction"]) else "train"
                    out[split].write(np.asarray(ids, dtype=dtype).tobytes())
                    counts["tokens"][split] += len(ids)
                    counts["documents"][split] += 1
                for f in out.values():
                    f.flush()  # the loader reads what is written so far
                counts["text_bytes"] += size
                yield True
    except BaseException:
        for part in parts.values():
            _remove(part)
        raise
    for split in SPLITS:
        try:
            os.replace(parts[split], os.path.join(directory, f"{split}.bin"))
        except FileNotFoundError:  # removed as stale by another process that completed the shard first
            if not os.path.isfile(os.path.join(directory, META)):
                raise
    meta = {"shard": path, **counts, "bad_lines": bad.count, "first_bad_line": bad.first}
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as f:
        json.dump(meta, f)
    os.replace(f.name, os.path.join(directory, META))
    for stale in glob.glob(os.path.join(directory, "*.part")):  # a crashed run's, or a slower copy's
        _remove(stale)
    yield True


def part_path(directory: str, split: str, part: str) -> str:
    return os.path.join(directory, f"{split}.{part}.part")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def main() -> int:
    """`python -m megascale_jax.training.shard_cache ERROR_FILE`, the job as JSON on stdin: exit 2
    with the one-line reason in ERROR_FILE for a shard or tokenizer it cannot use."""
    job = json.load(sys.stdin)
    try:
        tokenize_readers(job)
    except (documents.DocumentError, TokenizerError) as e:
        with open(sys.argv[1], "w") as f:
            f.write(str(e))
        return 2
    return 0


# ----------------------------------------------------------------------------- the loader's side


class ShardCache:
    """One process's view of the shards' cache: which are complete, how much of the others is
    tokenized, reads of their ids, and the workers that tokenize them (started per group of readers
    the first time a batch asks for them)."""

    def __init__(self, root: str, shards: list[str], keys: list[str], job: dict, workers: int, log):
        """`job`: what every worker is told (tokenizer, eos, dtype, text_field, val_fraction,
        stop_at_bad_line); `workers`: most worker processes at once (0: one a core)."""
        self.root, self.shards, self.dirs = root, shards, [os.path.join(root, k) for k in keys]
        self.job = {**job, "part": f"{os.getpid()}-{os.urandom(4).hex()}"}
        self.dtype = np.dtype(job["dtype"])
        self.workers, self.log = workers or (os.cpu_count() or 1), log
        self._complete: dict[int, dict] = {}  # shard -> its meta.json
        self._started: set[int] = set()  # readers whose shards are tokenized (or being)
        self._workers: list[tuple[subprocess.Popen, str]] = []
        self._lock = threading.RLock()  # start() asks meta() under it

    def already_tokenized(self) -> int:
        return sum(self.meta(s) is not None for s in range(len(self.shards)))

    def start(self, readers: dict[int, list[int]]) -> None:
        """Tokenize the shards of `readers` (reader -> its shards in reading order) not yet in the
        cache; readers already started are left alone."""
        with self._lock:
            new = [[[self.shards[s], self.dirs[s]] for s in shards if self.meta(s) is None]
                   for j, shards in sorted(readers.items()) if j not in self._started]
            self._started.update(readers)
            new = [shards for shards in new if shards]
            groups = [new[w::self.workers] for w in range(min(self.workers, len(new)))]
            for group in groups:
                self._spawn({**self.job, "readers": group})

    def _spawn(self, job: dict) -> None:
        error = tempfile.NamedTemporaryFile(prefix="megascale-shard-worker-", suffix=".err", delete=False).name
        worker = subprocess.Popen([sys.executable, "-m", "megascale_jax.training.shard_cache", error],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        worker.stdin.write(json.dumps(job))
        worker.stdin.close()
        self._workers.append((worker, error))

    def meta(self, s: int) -> dict | None:
        """Shard s's meta.json once it is complete (its counts; its bad lines warned of once), else None."""
        if s in self._complete:
            return self._complete[s]
        with self._lock:  # the train batches' thread and the validation's: one warning a shard
            return self._complete.get(s) or self._read_meta(s)

    def _read_meta(self, s: int) -> dict | None:
        try:
            with open(os.path.join(self.dirs[s], META)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return None
        if meta["bad_lines"]:
            self.log(f"data: skipped {meta['bad_lines']:,} bad lines (not JSON, not UTF-8, or without a string "
                     f"{self.job['text_field']!r}) in {self.shards[s]}; the first: {meta['first_bad_line']}")
        if not sum(meta["documents"].values()):
            self.log(f"data: {self.shards[s]} holds no document (empty, or every line bad): skipped")
        self._complete[s] = meta
        return meta

    def length(self, s: int, split: str) -> int | None:
        """Shard s's tokens of `split`, None while it is not complete."""
        meta = self.meta(s)
        return None if meta is None else meta["tokens"][split]

    def read(self, s: int, split: str, start: int, count: int) -> np.ndarray:
        """Up to `count` ids of shard s's `split` from `start`: fewer, or none, where the worker has
        not written them yet."""
        complete = self.meta(s) is not None
        path = os.path.join(self.dirs[s], f"{split}.bin") if complete else part_path(self.dirs[s], split,
                                                                                      self.job["part"])
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # not started, or renamed into place meanwhile: look again
            return np.empty(0, self.dtype)
        try:
            data = os.pread(fd, count * self.dtype.itemsize, start * self.dtype.itemsize)
        finally:
            os.close(fd)
        return np.frombuffer(data[:len(data) - len(data) % self.dtype.itemsize], self.dtype)

    def wait(self, tries: int) -> None:
        """Sleep a little before looking again (longer the longer it waits); a worker that failed
        is raised here (ShardError: one line), one that died otherwise too (RuntimeError)."""
        for worker, error in self._workers:
            code = worker.poll()
            if code == 2:
                with open(error) as f:
                    raise ShardError(f.read().strip())
            if code:
                raise RuntimeError(f"a tokenizing worker (pid {worker.pid}) died with exit code {code}; its shards "
                                   "are not complete (see its output above)")
        time.sleep(min(_POLL_S[0] * 2 ** min(tries, 10), _POLL_S[1]))

    def close(self) -> None:
        """Stop the workers (what they tokenized so far is kept as parts, tokenized again later)."""
        for worker, error in self._workers:
            if worker.poll() is None:
                worker.terminate()
            worker.wait()
            _remove(error)
        self._workers = []


if __name__ == "__main__":
    sys.exit(main())
