"""In-memory snapshots between checkpoints: a restart redoes the steps since the last snapshot,
not since the last checkpoint.

Why: in the ETTR drill (bench/results/ettr_cpu.json, 2026-11-23) the steps redone after each
restart were 2.5% of the wall and checkpoint blocking 1.8%. An orbax save blocks ~0.2 s whatever
the state's size (barriers, directories, a thread); saving more often trades one for the other.
A snapshot costs one device->host copy of this process's shards: every `checkpoint.memory_every`
steps each process copies its own shards of the state (each distinct index once, replicas on its
devices skipped) and a background thread writes them to one file in RAM (`/dev/shm`, a tmpfs),
written to `.tmp` and renamed. With `checkpoint.background_host_copy` the blocking copy is one on
the device (save_copy.SaveCopy) and the host copy runs on the writer thread too. The file outlives the process (kill -9, a hang the supervisor
killed, a crash) but not the machine; so with `checkpoint.peer_copy` the writer also sends it to
a process on another host, which holds it in its RAM (training/peer_copy.py): a lost machine's
processes, restarted on a spare, restore from that peer, not from disk.

Layout: `<root>/<step>/process_<i>-of-<n>.npz` (and the copies held for peers,
`peer_process_<j>-of-<n>.npz`), `<root>` = `checkpoint.memory_dir` or
/dev/shm/megascale_jax-<user>/<hash of the run directory> (run_dir.snapshot_dir), plus the host's
name when the launcher simulates hosts (`MEGASCALE_HOST`: each slot its own directory). Each file is a
zip (numpy's .npz, each member with its CRC-32) of the shards as raw bytes and a JSON `meta`:
step, data position, the config, each shard's leaf path, index and dtype. The newest three steps
are kept per process: a process can be one snapshot ahead of a peer whose write is still in
flight, so the newest step every process holds is at worst the third newest of the fastest.

Restore (`restore`, before the checkpoint's): each process lists every file its host holds
(its own and peer copies), newer than the newest committed checkpoint; the processes agree
through the coordination service's key-value store on the newest step for which a file of every
process exists somewhere; each reads its own file — or, where its host lost it, fetches the copy
from the peer that holds it (the log names the peer) — checks the CRCs (the zip's), the step and
that it was written with this exact config (a changed config, or a shrunk mesh, uses the
checkpoint), and places its shards with `make_array_from_callback` (no collective). A second
round agrees that every process succeeded; otherwise that step is given up — one warning, a bad
own file removed — and the next source is tried: an older step every process holds, then the
checkpoint. Two hosts lost with each other's copies leave a process with no file: the checkpoint. The state is the stored
(pipeline-ordered) one, not the canonical: it is only ever restored into the same config.

Whatever it resumes from, a run first removes its snapshots past that step: they belong to a
timeline whose metrics it dropped. A finished (or interrupted and checkpointed) run removes its
snapshots: RAM is not kept past the run. A crashed run's snapshots stay until the run resumes,
which overwrites them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading
import time
import zipfile
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from megascale_jax import cli
from megascale_jax import run_dir as run_dirs
from megascale_jax import job_key
from megascale_jax.config import Config, ConfigError
from megascale_jax.run_dir import snapshot_steps
from megascale_jax.training import compile_cache, peer_copy, save_copy

logger = cli.get_logger("snapshot")
KEEP = 3
AGREE_TIMEOUT_MS = 30 * 60 * 1000  # peers reach the restore within their start-up skew
_rounds = [0]  # agreements this process has run: keys stay distinct within one coordination service


class Snapshots:
    """One process's memory snapshots of a run: `save` on the loop's cadence, `restore` at start."""

    def __init__(self, cfg: Config, root: str, warn: Callable[[str], None],
                 device_copy: Callable = save_copy.device_copy):
        """`device_copy`: with background_host_copy, the blocking copy on the device; the run
        passes the checkpointer's, compiled once for both."""
        self.cfg, self.warn, self._device_copy = cfg, warn, device_copy
        self.root = run_dirs.host_snapshot_dir(root, os.environ.get(run_dirs.HOST_ENV))
        self.process, self.processes = jax.process_index(), jax.process_count()
        self._writer: threading.Thread | None = None
        self._error: str | None = None
        self._failing = False  # the last write failed and was said: the next failure is not said again
        self.link = None
        try:  # what the processes agree on through jax.distributed's store is signed with it
            self.key = job_key.job_key() if self.processes > 1 else None
        except job_key.JobKeyError as e:
            raise ConfigError(str(e)) from None
        if cfg.checkpoint.peer_copy and self.processes > 1:
            if self.key is None:  # nothing to prove the job's processes to each other with
                warn(f"warning: no peer copies of memory snapshots: they need the job's key; {job_key.HOW}")
            else:
                self.link = peer_copy.PeerLink(self.root, self.process, self.processes, KEEP, self.key)
                try:
                    self.link.join(self._agree(self.link.record))
                except peer_copy.Refused as e:  # where the others' servers are, forged: send them nothing
                    warn(f"warning: no peer copies of memory snapshots: {e}")
                    self.link.close()
                    self.link = None

    def check_room(self, abstract_state) -> int:
        """The RAM this host's snapshots take, checked against what its snapshot filesystem has
        free before the first step (ConfigError, one line, naming the fix); returns the bytes.
        Per process: `KEEP` snapshots of its own shards and, with peer copies, `KEEP` of the
        process it holds for — the same size at pp = tp = 1, about the same elsewhere."""
        one = state_bytes(abstract_state)
        hosts = [host for host, _ in self.link.peers()] if self.link else []
        here = hosts.count(hosts[self.process]) if hosts else 1  # the processes on this host
        copies = 2 if self.link and self.link.holder() is not None else 1
        need = KEEP * copies * one * here
        held = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(self.root) for f in files)
        os.makedirs(self.root, exist_ok=True)
        free = shutil.disk_usage(self.root).free + held  # what this run holds already is reused
        if need > free:
            raise ConfigError(
                f"memory snapshots need {run_dirs.human_bytes(need)} in {self.root} on this host ({KEEP} steps x "
                f"{run_dirs.human_bytes(one)} per process x {here} process(es)"
                + (" x 2 with peer copies" if copies == 2 else "")
                + f"), {run_dirs.human_bytes(free)} free; set checkpoint.memory_dir to a larger RAM disk, or "
                "checkpoint.peer_copy=false, or checkpoint.memory_every=0")
        return need

    def _file(self, step: int) -> str:
        return os.path.join(self.root, str(step), f"process_{self.process}-of-{self.processes}.npz")

    # ------------------------------------------------------------------ save

    def save(self, step: int, state, next_index: int, device_copy=None,
             commit_when: Callable[[], bool] | None = None) -> float:
        """Copy this process's shards of `state` (after step `step`) to host memory and hand them
        to the writer; returns the seconds it blocked (the previous write, the copy). With
        background_host_copy the copy is on the device and the writer copies it to the host;
        `device_copy`, a copy of `state` already made (the checkpoint's of the same step), is
        used instead of making another; `commit_when` is asked before the write, which is
        abandoned when it says False (the step turned out non-finite, or the loop ended)."""
        start = time.perf_counter()
        self.wait()
        if self.cfg.checkpoint.background_host_copy:
            # dispatched: the next step may donate `state`, not `copy`
            copy = self._device_copy(state) if device_copy is None else device_copy
            target, args = self._copy_and_write, (step, copy, next_index, commit_when)
        else:
            target, args = self._write, (step, *self._host_copy(step, state, next_index))
        self._writer = threading.Thread(target=target, args=args, daemon=True, name="snapshot-writer")
        self._writer.start()
        return time.perf_counter() - start

    def _copy_and_write(self, step: int, copy, next_index: int, commit_when: Callable[[], bool] | None) -> None:
        shards, meta = self._host_copy(step, copy, next_index)
        if commit_when is None or commit_when():
            self._write(step, shards, meta)

    def _host_copy(self, step: int, state, next_index: int) -> tuple[list[np.ndarray], dict]:
        """This process's distinct shards of `state` in host memory, and the file's meta."""
        shards, entries = [], []
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            seen = set()
            for shard in leaf.addressable_shards:
                index = _index(shard.index, leaf.shape)
                if index in seen:
                    continue
                seen.add(index)
                # A copy: the next step donates the state's buffers, which a view would alias.
                data = np.array(shard.data, copy=True)
                shards.append(data)
                entries.append({"leaf": jax.tree_util.keystr(path), "index": index, "dtype": str(data.dtype)})
        return shards, {"step": step, "next_index": next_index, "config": self.cfg.to_dict(), "shards": entries}

    def _write(self, step: int, shards: list[np.ndarray], meta: dict) -> None:
        path = self._file(step)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            arrays = {f"shard_{i}": _raw(data) for i, data in enumerate(shards)}
            with open(path + ".tmp", "wb") as f:  # a zip: each member's CRC-32 is checked on reading
                np.savez(f, meta=np.array(json.dumps(meta)), **arrays)
            os.replace(path + ".tmp", path)
            oldest_kept = sorted(self._own_steps())[-KEEP:][0]
            self._remove(lambda s: s < oldest_kept)
        except OSError as e:  # RAM disk full or not writable: training goes on, on checkpoints
            with contextlib.suppress(OSError):
                os.remove(path + ".tmp")  # a part-written file would hold the room the next one needs
                os.rmdir(os.path.dirname(path))  # and an empty step directory would list a step not held
            reason = run_dirs.disk_error(e) if e.errno in (errno.ENOSPC, errno.EDQUOT) else cli.one_line(e)
            self._error = f"memory snapshots not written from step {step} ({path}): {reason}"
            return
        self._failing = False
        if self.link:
            try:
                self.link.send(step, path)
            except OSError as e:  # the peer is gone or full: this host's copy still stands
                self._error = f"memory snapshot at step {step} not copied to its peer: {cli.one_line(e)}"

    def wait(self) -> None:
        """Until the write in flight is on disk; a failed write is one warning."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error:
            if not self._failing:  # said once a streak: a full RAM disk is not a line every snapshot
                self.warn(f"warning: {self._error}; training continues on checkpoints (said again only after a "
                          "snapshot was written)")
            self._failing, self._error = True, None

    def _own_steps(self) -> list[int]:
        return [s for s in snapshot_steps(self.root) if os.path.exists(self._file(s))]

    def _remove(self, which: Callable[[int], bool], copies: bool = False) -> None:
        """This process's files (and leftover .tmp) of the steps `which` picks, with `copies` also
        the peer copies this host holds; a step directory goes when its last file does."""
        for s in snapshot_steps(self.root):
            if not which(s):
                continue
            held = [os.path.join(self.root, str(s), name) for name in os.listdir(os.path.join(self.root, str(s)))
                    if name.startswith("peer_")] if copies else []
            for name in (self._file(s), self._file(s) + ".tmp", *held):
                try:
                    os.remove(name)
                except FileNotFoundError:
                    pass
            try:
                os.rmdir(os.path.dirname(self._file(s)))
            except OSError:
                pass  # a peer's file is still there

    def discard_after(self, step: int) -> None:
        """Training resumes from `step`: a snapshot past it is of a timeline this run no longer
        continues (its metrics after `step` were dropped), and must never be resumed from."""
        self._remove(lambda s: s > step, copies=True)

    def remove_all(self) -> None:
        """The run is over (or safely checkpointed): give the RAM back."""
        self.wait()
        self._remove(lambda s: True, copies=True)
        parent = os.path.dirname(self.root)
        for directory in (self.root, parent, os.path.dirname(parent)):  # by the last process out
            try:
                os.rmdir(directory)
            except OSError:
                return

    # ------------------------------------------------------------------ restore

    def restore(self, abstract_state, newer_than: int, up_to: int | None = None) -> tuple[Any, dict] | None:
        """(state, {"step", "data_state"}) of the newest snapshot of which every process can read
        its own file or a peer's copy, newer than step `newer_than`; None when there is none, or
        every such step failed somewhere (then the caller uses the checkpoint)."""
        given_up: set[int] = set()  # steps that failed on some process: every process skips them
        while True:
            mine = {p: [s for s in steps if s > newer_than and (up_to is None or s <= up_to)]
                    for p, steps in peer_copy.inventory(self.root, self.processes).items()}
            try:
                reports = [{int(p): steps for p, steps in json.loads(r).items()} for r in self._agree(json.dumps(mine))]
            except peer_copy.Refused as e:  # every process reads the same forged record: all take the checkpoint
                self.warn(f"warning: memory snapshots not used: {e}; the checkpoint is")
                return None
            step = peer_copy.newest_recoverable(reports, self.processes, given_up)
            if step is None:
                return None
            holder = next((q for q, r in enumerate(reports) if q != self.process and step in r.get(self.process, [])), None)
            source, problem = "its own file", ""
            try:
                if not os.path.exists(self._file(step)):
                    source = self._fetch(step, holder)
                state, meta = self._load(step, abstract_state)
            except (OSError, ValueError, KeyError, zipfile.BadZipFile, peer_copy.Refused) as e:
                problem = f"memory snapshot at step {step} ({source}) unusable: {cli.one_line(e)}"
            try:
                verdicts = [json.loads(v) for v in self._agree(json.dumps([problem, source]))]
            except peer_copy.Refused as e:
                self.warn(f"warning: memory snapshots not used: {e}; the checkpoint is")
                return None
            if not any(problem for problem, _ in verdicts):
                for process, (_, where) in enumerate(verdicts):  # said once, by the process that logs
                    if where != "its own file" and self.process == 0:
                        logger.info(f"process {process} restored its memory snapshot of step {step} from {where}")
                return state, {"step": step, "data_state": {"next_index": meta["next_index"]}}
            given_up.add(step)
            if problem:
                self.warn(f"warning: {problem}; removed, trying the next source (an older snapshot, then the checkpoint)")
                if os.path.exists(self._file(step)):
                    os.remove(self._file(step))

    def _fetch(self, step: int, holder: int | None) -> str:
        """This process's file of `step`, fetched from the peer `holder` that holds a copy; which
        peer. Refused names the peer too."""
        if self.link is None or holder is None:
            raise peer_copy.Refused("no peer holds a copy")
        source = f"the copy held by process {holder} ({self.link.peers()[holder][0]})"
        os.makedirs(os.path.dirname(self._file(step)), exist_ok=True)
        try:
            self.link.fetch(holder, self.process, step, self._file(step))
        except (OSError, peer_copy.Refused) as e:
            raise peer_copy.Refused(f"{source}: {cli.one_line(e)}") from None
        return source

    def _load(self, step: int, abstract_state):
        with np.load(self._file(step), allow_pickle=False) as f:
            meta = json.loads(str(f["meta"]))
            peer_copy.check_meta(meta, step, self.cfg.to_dict())
            shards: dict[tuple[str, str], np.ndarray] = {}
            for i, entry in enumerate(meta["shards"]):
                shards[entry["leaf"], entry["index"]] = f[f"shard_{i}"].view(jnp.dtype(entry["dtype"]))

        def place(path, abstract):
            leaf = jax.tree_util.keystr(path)

            def shard(index):
                return shards[leaf, _index(index, abstract.shape)].reshape(
                    [len(range(*s.indices(n))) for s, n in zip(index, abstract.shape)])
            return jax.make_array_from_callback(abstract.shape, abstract.sharding, shard)

        return jax.tree_util.tree_map_with_path(place, abstract_state), meta

    def _agree(self, mine: str) -> list[str]:
        """Every process's `mine`, in process order (the key-value store of jax.distributed). With
        the job's key each value is signed with its slot: Refused when one is not (forged, or
        replayed from another round)."""
        if self.processes == 1:
            return [mine]
        _rounds[0] += 1
        client = compile_cache.coordination_client()
        prefix = f"megascale_jax/snapshot/{_rounds[0]}"
        slot = f"{prefix}/{self.process}"
        client.key_value_set(slot, json.dumps(job_key.signed(self.key, {"slot": slot, "value": mine}))
                             if self.key else mine)
        values = [client.blocking_key_value_get(f"{prefix}/{p}", AGREE_TIMEOUT_MS) for p in range(self.processes)]
        if not self.key:
            return values
        out = []
        for p, value in enumerate(values):
            try:
                record = json.loads(value)
            except ValueError:
                record = None
            if not (isinstance(record, dict) and job_key.authentic(self.key, record)
                    and record.get("slot") == f"{prefix}/{p}"):
                raise peer_copy.Refused(f"process {p}'s record in jax.distributed's key-value store is not signed "
                                        "with the job's key")
            out.append(record["value"])
        return out


def state_bytes(abstract_state) -> int:
    """Bytes of this process's distinct shards of a state (what one snapshot file holds)."""
    total = 0
    for leaf in jax.tree.leaves(abstract_state):
        indices = {_index(index, leaf.shape) for index in leaf.sharding.addressable_devices_indices_map(leaf.shape).values()}
        total += len(indices) * leaf.dtype.itemsize * int(np.prod(leaf.sharding.shard_shape(leaf.shape)))
    return total


def _index(index: tuple, shape: tuple) -> str:
    """A shard's index as 'start:stop,...' (slice(None) and slice(0, n) are the same shard)."""
    return ",".join("%d:%d" % s.indices(n)[:2] for s, n in zip(index, shape))


def _raw(data: np.ndarray) -> np.ndarray:
    """The bytes of `data` as unsigned integers of its width: npz keeps no bfloat16."""
    return np.ascontiguousarray(data).view(np.dtype(f"uint{8 * data.dtype.itemsize}"))
