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
that it was written with this exact config (a changed config uses the checkpoint), and places its
shards with `make_array_from_callback` (no collective).

After a shrink (or a grow) the files of the previous process count are a source too
(`_reshard`): a step counts when every old process's file is held somewhere; the processes agree
on which shards each old file holds (the shard table in each file's meta), each reads — from its
host or fetched from a peer's — only the old files that cover its new shards, and cuts each new
shard out of the old pieces that overlap it. Only a change of `peer_copy.RESHARDABLE` (mesh.dp,
parallel.microbatches, mesh.cpu_devices) is resharded: none changes the state's shapes or its
stored order. The old files go once the new layout has written its second snapshot. A second
round agrees that every process succeeded; otherwise that step is given up — one warning, a bad
own file removed — and the next source is tried: an older step every process holds, then the
checkpoint. Two hosts lost with each other's copies leave a process with no file: the checkpoint. The state is the stored
(pipeline-ordered) one, not the canonical: it is only ever restored into the same config, up to
the data-parallel shape.

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
        self._old_layout = False  # restored from another process count's files: remove them once replaced
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
            own = sorted(self._own_steps())
            self._remove(lambda s: s < own[-KEEP:][0])
            if self._old_layout and len(own) >= 2:
                # This layout's second snapshot: every process has written its first one (each
                # step's collectives keep them in step), so the previous layout's files, restored
                # from at the start, are no longer anyone's newest source: their RAM goes back.
                self._remove(lambda s: True, own=False, other_counts=True)
                self._old_layout = False
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

    def _remove(self, which: Callable[[int], bool], copies: bool = False, own: bool = True,
                other_counts: bool = False) -> None:
        """This process's files (and leftover .tmp) of the steps `which` picks (unless not `own`),
        with `copies` also the peer copies this host holds, with `copies` or `other_counts` every
        file this host holds of a job of another process count (before a shrink or a grow); a
        step directory goes when its last file does."""
        for s in snapshot_steps(self.root):
            if not which(s):
                continue
            folder = os.path.join(self.root, str(s))
            names = os.listdir(folder)
            held = [os.path.join(folder, name) for name in names if name.startswith("peer_")] if copies else []
            if other_counts or copies:
                held += [os.path.join(folder, name) for name in names
                         if (m := run_dirs.SNAPSHOT_FILE.match(name.removesuffix(peer_copy.RECORD)))
                         and int(m.group(2)) != self.processes]
            for name in ((self._file(s), self._file(s) + ".tmp") if own else ()) + tuple(held):
                try:
                    os.remove(name)
                except FileNotFoundError:
                    pass
            try:
                os.rmdir(folder)
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
        """(state, {"step", "data_state"}) of the newest snapshot of which every process of one
        job (this one's, or the previous process count's after a shrink or a grow) has a file
        somewhere — its host's or a peer's copy — newer than step `newer_than`; None when there is
        none, or every such step failed somewhere (then the caller uses the checkpoint)."""
        given_up: set[tuple[int, int]] = set()  # (process count, step) that failed on some process: all skip it
        while True:
            mine = {count: {owner: [s for s in steps if s > newer_than and (up_to is None or s <= up_to)]
                            for owner, steps in owners.items()}
                    for count, owners in peer_copy.inventory_by_count(self.root).items()}
            try:
                reports = [{int(c): {int(p): steps for p, steps in owners.items()} for c, owners in json.loads(r).items()}
                           for r in self._agree(json.dumps(mine))]
            except peer_copy.Refused as e:  # every process reads the same forged record: all take the checkpoint
                self.warn(f"warning: memory snapshots not used: {e}; the checkpoint is")
                return None
            found = newest_source(reports, self.processes, given_up)
            if found is None:
                return None
            count, step = found
            source, problem = "its own file", ""
            try:
                if count == self.processes:
                    holder = next((q for q, r in enumerate(reports)
                                   if q != self.process and step in r.get(count, {}).get(self.process, [])), None)
                    if not os.path.exists(self._file(step)):
                        source = self._fetch(step, holder)
                    state, meta = self._load(step, abstract_state)
                else:
                    state, meta, source = self._reshard(count, step, reports, abstract_state)
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
                self._old_layout = count != self.processes
                return state, {"step": step, "data_state": {"next_index": meta["next_index"]}}
            given_up.add((count, step))
            if problem:
                self.warn(f"warning: {problem}; removed, trying the next source (an older snapshot, then the checkpoint)"
                          if count == self.processes else
                          f"warning: {problem}; trying the next source (an older snapshot, then the checkpoint)")
                if count == self.processes and os.path.exists(self._file(step)):
                    os.remove(self._file(step))

    def _reshard(self, count: int, step: int, reports: list[dict], abstract_state) -> tuple[Any, dict, str]:
        """This process's shards of `abstract_state` assembled from the snapshot files of step
        `step` written by a job of `count` processes (before a shrink or a grow): the processes
        first agree on which shards each old file holds (each lists the files its host has),
        then each reads — from its host, or fetched from a peer's host — only the old files that
        cover its new shards, and cuts each new shard out of the old ones that overlap it."""
        here = self._old_files(count, step)
        catalog: dict[int, list[dict]] = {}
        for owner, path in here.items():
            with contextlib.suppress(OSError, ValueError, KeyError, zipfile.BadZipFile):
                with np.load(path, allow_pickle=False) as f:
                    catalog[owner] = [{"leaf": e["leaf"], "index": e["index"]} for e in json.loads(str(f["meta"]))["shards"]]
        listed: dict[int, list[dict]] = {}
        for value in self._agree(json.dumps(catalog)):
            for owner, entries in json.loads(value).items():
                listed.setdefault(int(owner), entries)
        missing = [o for o in range(count) if o not in listed]
        if missing:
            raise ValueError(f"no readable file of the {count}-process job's process(es) {missing} at step {step}")
        wanted = {(jax.tree_util.keystr(path), _index(index, leaf.shape))
                  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]
                  for index in leaf.sharding.addressable_devices_indices_map(leaf.shape).values()}
        owners = covering_owners(wanted, listed, prefer=set(here))
        fetched_dir = os.path.join(self.root, f".reshard-{step}-of-{count}")
        sources, pieces, meta = [], {}, None
        try:
            for owner in owners:
                path = here.get(owner)
                if path is None:
                    holder = next((q for q, r in enumerate(reports)
                                   if q != self.process and step in r.get(count, {}).get(owner, [])), None)
                    if self.link is None or holder is None:
                        raise peer_copy.Refused(f"no peer holds process {owner} of {count}'s file")
                    os.makedirs(fetched_dir, exist_ok=True)
                    path = os.path.join(fetched_dir, f"process_{owner}-of-{count}.npz")
                    self.link.fetch(holder, owner, step, path, processes=count)
                    sources.append(f"process {owner}'s via process {holder}")
                with np.load(path, allow_pickle=False) as f:
                    meta = json.loads(str(f["meta"]))
                    peer_copy.check_meta(meta, step, self.cfg.to_dict(), reshard=True)
                    for i, entry in enumerate(meta["shards"]):
                        key = entry["leaf"], entry["index"]
                        if key not in pieces and any(_overlap(key, w) for w in wanted):
                            pieces[key] = f[f"shard_{i}"].view(jnp.dtype(entry["dtype"])).reshape(_extent(entry["index"]))
        finally:
            shutil.rmtree(fetched_dir, ignore_errors=True)

        def place(path, abstract):
            leaf = jax.tree_util.keystr(path)
            mine = [(index, data) for (name, index), data in pieces.items() if name == leaf]

            def shard(index):
                return _cut(_index(index, abstract.shape), mine, abstract.dtype)
            return jax.make_array_from_callback(abstract.shape, abstract.sharding, shard)

        state = jax.tree_util.tree_map_with_path(place, abstract_state)
        return state, meta, (f"the {count}-process job's files, resharded"
                             + (f" ({', '.join(sources)})" if sources else ""))

    def _old_files(self, count: int, step: int) -> dict[int, str]:
        """{owner: path} of the files of step `step` of a `count`-process job on this host."""
        folder, found = os.path.join(self.root, str(step)), {}
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            match = run_dirs.SNAPSHOT_FILE.match(name)
            if match and int(match.group(2)) == count:
                found.setdefault(int(match.group(1)), os.path.join(folder, name))
        return found

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


def newest_source(reports: list[dict[int, dict[int, list[int]]]], processes: int,
                  skip: set[tuple[int, int]] = frozenset()) -> tuple[int, int] | None:
    """(process count, step) of the newest snapshot every process of one job's count has a file
    of somewhere (each process's {count: {owner: steps}}, in process order), this job's count
    first among equals; None: the checkpoint."""
    counts = {c for r in reports for c in r}
    found = []
    for count in counts:
        step = peer_copy.newest_recoverable([r.get(count, {}) for r in reports], count,
                                            {s for c, s in skip if c == count})
        if step is not None:
            found.append((step, count == processes, count))
    if not found:
        return None
    step, _, count = max(found)
    return count, step


def covering_owners(wanted: set[tuple[str, str]], listed: dict[int, list[dict]], prefer: set[int]) -> list[int]:
    """The old processes whose files together hold every piece of the old layout that overlaps a
    `wanted` (leaf, index) shard: files on this host (`prefer`) first, then the lowest process.
    ValueError when some wanted shard is not covered."""
    holders: dict[tuple[str, str], list[int]] = {}
    for owner in sorted(listed, key=lambda o: (o not in prefer, o)):
        for entry in listed[owner]:
            key = entry["leaf"], entry["index"]
            if any(_overlap(key, w) for w in wanted):
                holders.setdefault(key, []).append(owner)
    chosen: list[int] = []
    for key, owners in sorted(holders.items()):
        if not any(o in chosen for o in owners):
            chosen.append(owners[0])
    for leaf, index in wanted:  # every element of each wanted shard in some old piece
        volume = sum(_volume(_intersect(index, k[1])) for k in holders if k[0] == leaf and _overlap(k, (leaf, index)))
        if volume != _volume(_ranges(index)):
            raise ValueError(f"the old layout's files do not cover {leaf}[{index}]: another state shape")
    return chosen


def _ranges(index: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in part.split(":")) for part in index.split(",")] if index else []


def _extent(index: str) -> list[int]:
    return [stop - start for start, stop in _ranges(index)]


def _intersect(a: str, b: str) -> list[tuple[int, int]] | None:
    out = [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(_ranges(a), _ranges(b))]
    return out if all(lo < hi for lo, hi in out) or not out else None


def _volume(ranges) -> int:
    return 0 if ranges is None else int(np.prod([hi - lo for lo, hi in ranges]))


def _overlap(a: tuple[str, str], b: tuple[str, str]) -> bool:
    return a[0] == b[0] and len(_ranges(a[1])) == len(_ranges(b[1])) and _intersect(a[1], b[1]) is not None


def _cut(index: str, pieces: list[tuple[str, np.ndarray]], dtype) -> np.ndarray:
    """The block `index` of a leaf, copied out of the old layout's `pieces` that overlap it."""
    lows = [lo for lo, _ in _ranges(index)]
    out = np.empty(_extent(index), dtype)
    for old, data in pieces:
        common = _intersect(index, old)
        if common is None:
            continue
        old_lows = [lo for lo, _ in _ranges(old)]
        out[tuple(slice(lo - base, hi - base) for (lo, hi), base in zip(common, lows))] = \
            data[tuple(slice(lo - base, hi - base) for (lo, hi), base in zip(common, old_lows))]
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
