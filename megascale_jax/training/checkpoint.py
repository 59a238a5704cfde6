"""Two-stage checkpoints (MegaScale §4): a short blocking copy, then a background write.

An orbax `CheckpointManager` does both stages: `save()` returns once the state is copied to
host memory, a background thread serialises it into `<dir>/<step>.orbax-checkpoint-tmp` and
renames that to `<dir>/<step>` on commit, so a process killed mid-write leaves only a tmp
directory, which resume ignores. Old checkpoints are deleted only after the new one commits.
With `checkpoint.background_host_copy` the blocking stage is a copy of the state on the device
instead (the next step donates the state's buffers, so orbax cannot read them later), and a
thread of ours runs orbax's `save()`, host copy included, while training goes on.

Each checkpoint is an ordinary orbax composite with three items:
* `state`     — the TrainState (step, params, opt_state), restorable into any mesh's shardings;
* `data`      — each process's grain iterator state (`process_<i>-of-<n>.json`, grain's own
  orbax handler): resume continues with exactly the next batch;
* `meta`      — JSON: step, the data position, the config it was written with, and one uint32
  checksum per array (by its path in the state), computed on device at save time: orbax does not
  notice a flipped bit in a data file, so restore recomputes them and rejects a mismatch. Batches
  are a pure function of (seed, step), so a checkpoint restored on another number of processes
  (no `data` file for this process) resumes the data from `meta.data_step`.
The checksums were a fourth item, a tree of scalar arrays, until 2026-11-24: one small
tensorstore write (and read) per array, which lengthened every save's blocking part; checkpoints
written that way still restore.
With `checkpoint.single_replica_restore=true` only the processes of dp replica 0 read arrays
that are replicated over dp and broadcast them to the other replicas (orbax's
`SingleReplicaArrayHandler`, replica axis = dp), so N replicas do not read N copies from
storage; arrays sharded over dp (ZeRO-1 moments) are read once anyway, each replica its slice.
Every process reports the bytes it read (`/proc/self/io` rchar) in one line.

A newest checkpoint that fails to restore or verify is reported in one line, moved aside to
`<step>.corrupt` (kept for inspection, never deleted) and the previous one is tried. A bug in
the reading code (PROGRAMMING_ERRORS) is not damage: it propagates and nothing is moved
(`checkpoint_damage` tells the two apart and describes the damage).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import grain
import orbax.checkpoint as ocp
from absl import flags as absl_flags

from megascale_jax import cli
from megascale_jax.config import Config, ConfigError
from megascale_jax.training import compile_cache
from megascale_jax.training.save_copy import SaveCopy, to_pinned_host
from megascale_jax.training.checkpoint_damage import (ChecksumMismatch, CorruptCheckpoint, damage_is_corruption,
                                                      describe_read_error, quiet_late_tensorstore_callbacks)
from megascale_jax.run_dir import committed_steps

# Config sections that fix the state's shapes: a checkpoint restores only into the same ones.
_SHAPE_SECTIONS = ("model",)
_SHAPE_KEYS = {"optim": ("name",)}


@jax.jit
def checksums(tree):
    """A uint32 per array: sum of (raw bits x odd position weight) mod 2**32.

    Integer sums are exact in any order, so the value is the same under every sharding; an odd
    weight makes every single-bit flip change the sum, and distinct weights catch swapped values."""
    def one(x):
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
        weights = jax.lax.iota(jnp.uint32, x.size).reshape(x.shape) * 2 + 1
        return jnp.sum(bits * weights, dtype=jnp.uint32)
    return jax.tree.map(one, tree)


def _write_arrays_whole() -> None:
    """Replica-parallel saving slices replicated arrays across their replicas with one small
    compiled op per shape: ~10 s of compilation inside the first blocking save, for no gain
    within one process. Each array's replica 0 writes it whole instead."""
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(handler, "_use_replica_parallel", True):
        absl_logger = logging.getLogger("absl")
        level = absl_logger.level
        absl_logger.setLevel(logging.ERROR)  # orbax warns about the (intended) override
        try:
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
        finally:
            absl_logger.setLevel(level)


def _barriers_through_coordination_service() -> None:
    """orbax's barriers (~8 per save, in its blocking part) default to a compiled all-gather over
    every device (`sync_global_devices`): ~12 ms each on this 2-core machine's gloo, in the same
    collectives as the train step, and with no timeout. Its documented alternative waits at a
    barrier of the job's coordination service (`jax.distributed`): ~7 ms each, with a timeout.
    An absl flag of orbax's; this program parses no absl flags, so it is set, not parsed. An orbax
    without the flag keeps its own barriers."""
    name = "experimental_orbax_use_distributed_barrier"
    if name in absl_flags.FLAGS:
        flag = absl_flags.FLAGS[name]
        flag.value, flag.present = True, 1


class OrbaxErrors(logging.Filter):
    """orbax's own error logs (through absl's logger) about a save, kept as one line and not printed:
    a full disk printed ~200 lines of tracebacks from its background threads. The run's warning
    (`Checkpointer.poll`, "checkpoint at step N failed ...") names the error instead."""

    def __init__(self):
        super().__init__()
        self.last: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        # orbax's own logs, and asyncio's "Task exception was never retrieved" for orbax's write
        # tasks that a full disk failed (logged when they are collected, even after the run's last line)
        if record.levelno < logging.ERROR or ("orbax" not in record.pathname and "orbax" not in record.getMessage()):
            return True
        cause = record.exc_info[1] if record.exc_info else None
        # kept whole: a full disk's own words can come after 300 characters of paths (Checkpointer.plain_words)
        self.last = f"{type(cause).__name__}: {cause}" if cause is not None else record.getMessage()
        return False


_ORBAX_ERRORS = OrbaxErrors()


def _quiet_orbax_errors() -> OrbaxErrors:
    # and the write coroutines such a failure leaves unawaited, which Python names at exit
    warnings.filterwarnings("ignore", message="coroutine 'async_serialize_from_host", category=RuntimeWarning)
    for name in ("absl", "asyncio"):
        if _ORBAX_ERRORS not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_ORBAX_ERRORS)
    return _ORBAX_ERRORS


class CheckpointUnreadable(Exception):
    """A multi-process restore could not read a checkpoint on this process: it was moved aside, and
    this attempt ends, since the processes cannot agree in-process on falling back (see
    restore_latest). Wrong values read without an error fall back in-process (ChecksumMismatch)."""


class Checkpointer:
    """Saves the steps it is given (the loop's checkpoint hook: every `checkpoint.every` steps and
    the last); restores the newest good one."""

    def __init__(self, cfg: Config, directory: str, warn: Callable[[str], None]):
        self.cfg, self.directory, self.warn = cfg, directory, warn
        self.damaged: list[dict] = []  # {"step", "error"} of each checkpoint restore_latest moved aside and went past
        self._lock = threading.Lock()
        self._commit_times: dict[int, float] = {}  # step -> time the background write finished
        self._pending: dict | None = None  # the save in flight: {"step", "start", "block_s"}
        self._saver: threading.Thread | None = None  # with background_host_copy: runs orbax's save()
        self._copy = None  # with background_host_copy: the last save's device copy, until taken
        # With background_host_copy: the blocking copy (save_copy.SaveCopy), compiled in compile();
        # memory snapshots use it too.
        self._checksums, self.device_copy = checksums, SaveCopy(cfg.to_dict())
        c = cfg.checkpoint
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create checkpoint.dir {directory!r}: {e.strerror}; "
                              "pass a writable checkpoint.dir") from None
        _write_arrays_whole()
        _barriers_through_coordination_service()
        self._orbax_errors = _quiet_orbax_errors()
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=c.async_, max_to_keep=c.keep, save_interval_steps=max(c.every, 1),
            async_options=ocp.AsyncOptions(post_finalization_callback=self._on_commit))
        self.manager = ocp.CheckpointManager(directory, options=options)

    # ------------------------------------------------------------------ save

    def check_room(self, abstract_state) -> None:
        """Before the first step: the disk under checkpoint.dir holds the checkpoints the run keeps
        (checkpoint.keep, and the one orbax writes before it deletes the oldest), counted as the
        state's bytes each (orbax's metadata aside), beside what the directory holds already.
        ConfigError (one line, naming the fixes) if not: a full disk found at the first save would
        have cost the steps before it."""
        one = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract_state))
        keep = self.cfg.checkpoint.keep
        held = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(self.directory) for f in files)
        free = shutil.disk_usage(self.directory).free + held
        need = (keep + 1) * one
        if need > free:
            raise ConfigError(
                f"checkpoint.dir {self.directory!r} has {free / 2**20:,.1f} MiB free (its own checkpoints counted) but "
                f"the run keeps checkpoint.keep={keep} checkpoints of {one / 2**20:,.1f} MiB and writes one more before "
                f"deleting the oldest ({need / 2**20:,.1f} MiB); lower checkpoint.keep, or set checkpoint.dir on a "
                "larger disk")

    def compile(self, abstract_state) -> None:
        """Compile the checksum up front, so that neither the restore's verification nor the first
        save's blocking time holds a compilation; through the run's compilation cache, so that a
        restart loads it without tracing (in every process: see compile_cache.load_or_compile;
        tracing both over the state's tree took ~0.3 s of each restart in the ETTR drill)."""
        config = self.cfg.to_dict()
        self._checksums = compile_cache.load_or_compile(
            "checkpoint_checksums", lambda: checksums.lower(abstract_state), config, (abstract_state,))
        if self.cfg.checkpoint.background_host_copy:
            self.device_copy.compile(abstract_state)

    def save(self, step: int, state, data_state: dict, commit_when: Callable[[], bool] | None = None) -> list[dict]:
        """Stage 1: blocks for the device->host copy (and for the previous save, if still writing);
        with `checkpoint.background_host_copy`, for a copy on the device only.

        `data_state` is the data iterator's state after step `step`'s batch. `commit_when` (with
        background_host_copy): the background writer calls it before it writes, and abandons the
        save when it says False (the step turned out non-finite, or the loop ended first).
        Returns the records of earlier saves that finished meanwhile (see `poll`)."""
        start = time.perf_counter()
        finished = self.poll(wait=True)  # orbax would wait for it inside save() anyway
        waited = time.perf_counter()
        meta = {"step": step, "data_step": data_state["next_index"], "seed": self.cfg.train.seed,
                "config": self.cfg.to_dict()}
        if self.cfg.checkpoint.background_host_copy:
            sums, copy = self._checksums(state), self.device_copy(state)  # dispatched, not waited for
            self._copy = copy  # for a memory snapshot of the same step (`take_copy`); never donated
            end = time.perf_counter()
            self._pending = {"step": step, "start": start, "block_s": end - start, "dispatched": end,
                             "block_parts_s": {"previous_save": round(waited - start, 4),
                                               "dispatch": round(end - waited, 4)}}
            self._saver = threading.Thread(target=self._save_in_background,
                                           args=(step, copy, sums, meta, data_state, commit_when),
                                           name=f"checkpoint-{step}", daemon=True)
            self._saver.start()
            return finished
        meta["checksums"] = _flat(jax.device_get(self._checksums(state)))
        summed = time.perf_counter()
        try:
            self._orbax_save(step, state, meta, data_state)
        except Exception as e:  # e.g. the directory cannot be written
            self._warn_not_saved(step, self.save_error(e))
            return finished + [{"step": step, "block_s": time.perf_counter() - start, "error": self.save_error(e)}]
        end = time.perf_counter()
        # Where the blocking went: the previous save's write, the checksums (which also wait for
        # the step that produced `state`), orbax's own part (host copy, directories, barriers).
        parts = {"previous_save": waited - start, "checksums": summed - waited, "orbax": end - summed}
        self._pending = {"step": step, "start": start, "block_s": end - start,
                         "block_parts_s": {k: round(v, 4) for k, v in parts.items()}}
        return finished

    def take_copy(self):
        """The device copy of the state the last save made (background_host_copy), or None; given
        once, so that no device memory stays held for it."""
        copy, self._copy = self._copy, None
        return copy

    def _orbax_save(self, step: int, state, meta: dict, data_state: dict) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=grain.checkpoint.CheckpointSave(_IteratorState(data_state)),
                                  meta=ocp.args.JsonSave(meta))
        # force: the cadence (incl. the last step) is the loop's checkpoint hook's.
        self.manager.save(step, args=args, force=True)

    def _save_in_background(self, step: int, copy, sums, meta: dict, data_state: dict,
                            commit_when: Callable[[], bool] | None) -> None:
        """The blocking stage's work, on a thread: `copy` (which nothing donates) goes to pinned
        host memory, and orbax saves that. Records `background_parts_s`: until the device copy was
        ready (an upper bound on its device time: it includes finishing the step that produced the
        state), the device-to-host copy, and orbax's save() of the host arrays."""
        pending = self._pending
        try:
            jax.block_until_ready(copy)
            copied = time.perf_counter()
            on_host = to_pinned_host(copy)
            landed = time.perf_counter()
            meta["checksums"] = _flat(jax.device_get(sums))
            if commit_when is not None and not commit_when():
                pending["error"] = f"abandoned: step {step} was not recorded finite"
                return
            self._orbax_save(step, on_host, meta, data_state)
            pending["background_parts_s"] = {"device_copy": round(copied - pending["dispatched"], 4),
                                             "device_to_host": round(landed - copied, 4),
                                             "orbax_save": round(time.perf_counter() - landed, 4)}
        except Exception as e:  # noqa: BLE001 — reported by poll(), like a failed background write
            pending["error"] = self.save_error(e)

    def _warn_not_saved(self, step: int, error: str) -> None:
        self.warn(f"warning: checkpoint at step {step} not saved: {error}; training continues, "
                  f"last good checkpoint: step {self._last_committed()}")

    def save_error(self, e: BaseException) -> str:
        """A failed save's exception as one line (`plain_words` where it has them)."""
        return self.plain_words(str(e)) or cli.one_line(e)

    def plain_words(self, error: str) -> str | None:
        """A full disk or a file-size limit said as the user needs it, None for any other error.
        Read from the whole message: orbax's and tensorstore's own wording of it can come after
        300 characters of paths."""
        if "No space left on device" in error or "ENOSPC" in error:
            return f"no space left on the disk of {self.directory}"
        if "File too large" in error or "EFBIG" in error:
            return f"a file too large for the disk of {self.directory} or this process's file-size limit (EFBIG)"
        return None

    def _on_commit(self) -> None:
        # Runs on orbax's background thread once the write is finalised (just before the rename).
        with self._lock:
            if self._pending:
                self._commit_times[self._pending["step"]] = time.perf_counter()

    def poll(self, wait: bool = False) -> list[dict]:
        """Records of saves that finished since the last call: {step, block_s, block_parts_s,
        total_s}, or with `error` instead of total_s."""
        pending = self._pending
        if pending is None:
            return []
        if self._saver is not None:
            if self._saver.is_alive() and not wait:
                return []
            self._saver.join()
            self._saver = None
        if "error" in pending:  # orbax's save() raised on the background thread: nothing was written
            self._pending = None
            self._warn_not_saved(pending["step"], pending["error"])
            return [{"step": pending["step"], "block_s": pending["block_s"], "block_parts_s": pending["block_parts_s"],
                     "error": pending["error"]}]
        if wait:
            try:
                self.manager.wait_until_finished()
            except Exception:
                pass  # reported below
        elif self.manager.is_saving_in_progress():
            return []
        self._pending = None
        step = pending["step"]
        record = {"step": step, "block_s": pending["block_s"], "block_parts_s": pending["block_parts_s"]}
        if "background_parts_s" in pending:
            record["background_parts_s"] = pending["background_parts_s"]
        # orbax logs a background write error but does not always re-raise it, so success is
        # judged by the commit itself: the rename to <dir>/<step>.
        cause = self._orbax_errors.last or "orbax gave no cause"
        error = self.plain_words(cause) or f"not committed ({cause.splitlines()[0][:300]})"
        try:
            self.manager.check_for_errors()
        except Exception as e:
            error = self.save_error(e)
        with self._lock:
            done = self._commit_times.pop(step, None)
        if step not in committed_steps(self.directory):
            self.warn(f"warning: checkpoint at step {step} failed in the background: {error}; "
                      f"training continues, last good checkpoint: step {self._last_committed()}")
            return [{**record, "error": error}]
        return [{**record, "total_s": (done or time.perf_counter()) - pending["start"]}]

    def close(self) -> list[dict]:
        records = self.poll(wait=True)
        try:
            self.manager.close()  # waits for orbax's own metadata writes, which a full disk fails too
        except OSError as e:  # a full disk was said with the save that met it
            if self.plain_words(str(e)) is None:
                self.warn(f"warning: closing the checkpoints in {self.directory}: {cli.one_line(e)}")
        return records

    def _last_committed(self):
        steps = committed_steps(self.directory)
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ restore

    def restore_latest(self, abstract_state, up_to: int | None = None) -> tuple[Any, dict] | None:
        """(state, meta) of the newest checkpoint (not after step `up_to`) that verifies, placed
        per `abstract_state`'s shardings; None when there is none. Bad ones are reported and moved
        aside, and the previous one is tried. With several processes that holds for wrong values
        (ChecksumMismatch: every process finds them, together); a read that fails on one process
        ends the attempt instead (CheckpointUnreadable), so that all of them fall back together on
        the restart: its peers may be waiting for it inside orbax's restore."""
        quiet_late_tensorstore_callbacks()
        for step in reversed([s for s in committed_steps(self.directory) if up_to is None or s <= up_to]):
            try:
                return self.restore(step, abstract_state)
            except CorruptCheckpoint as e:
                where = os.path.join(self.directory, str(step))
                aside = where + ".corrupt"
                try:  # by whichever process found it: the damage may be in this process's files only
                    os.rename(where, aside)
                except FileNotFoundError:
                    pass  # a peer moved it first
                if jax.process_count() > 1 and not isinstance(e, ChecksumMismatch):
                    # The peers may have read their part and be waiting in orbax's barrier for this
                    # process, which must not go on to another step's reads alone.
                    raise CheckpointUnreadable(
                        f"checkpoint step {step} ({where}) is unreadable on process {jax.process_index()}: {e}; "
                        f"moved to {aside}: restart, and every process resumes from the previous one") from None
                self.warn(f"warning: checkpoint step {step} ({where}) is unreadable: {e}; moved to {aside}, "
                          "trying the previous one")
                self.damaged.append({"step": step, "error": str(e)})
        self.manager.reload()  # forget the steps moved aside
        return None

    def restore(self, step: int, abstract_state) -> tuple[Any, dict]:
        """(state, meta); meta["data_state"] is the data iterator state to continue from."""
        with damage_is_corruption(lambda e: f"meta: {cli.one_line(e)}"):
            meta = self._meta(step)
        self._check_compatible(step, meta)
        meta["data_state"] = self._restore_data_state(step, meta)
        read_before, start = _bytes_read(), time.perf_counter()
        with damage_is_corruption(lambda e: describe_read_error(e, os.path.join(self.directory, str(step)))):
            expected = self._saved_checksums(step, meta, abstract_state)
            if self.cfg.checkpoint.single_replica_restore:
                state = self._restore_single_replica(step, abstract_state)
            else:
                state = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state)))["state"]
        if self.cfg.checkpoint.single_replica_restore or jax.process_count() > 1:
            mode = "single-replica" if self.cfg.checkpoint.single_replica_restore else "every-replica"
            # Every process reports its own read (print: logging is quiet on ranks > 0).
            print(f"process {jax.process_index()}: restored checkpoint step {step} ({mode}) reading "
                  f"{(_bytes_read() - read_before) / 1e6:.2f} MB in {time.perf_counter() - start:.2f}s",
                  file=sys.stderr, flush=True)
        _verify(self._checksums(state), expected)
        self.manager.reload()
        return state, meta

    def restore_params(self, step: int, abstract_state):
        """Only the parameters of checkpoint `step` (the optimizer state is not read), placed per
        `abstract_state.params`' shardings and verified against their checksums."""
        quiet_late_tensorstore_callbacks()
        path = os.path.join(self.directory, str(step))
        item = abstract_state.replace(step=ocp.PLACEHOLDER, opt_state=jax.tree.map(lambda _: ocp.PLACEHOLDER,
                                                                                   abstract_state.opt_state))
        restore_args = jax.tree.map(lambda a: a if a is ocp.PLACEHOLDER else ocp.ArrayRestoreArgs(sharding=a.sharding),
                                    item)
        with damage_is_corruption(lambda e: describe_read_error(e, path)):
            meta = self._meta(step)
            with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
                params = reader.restore(os.path.join(path, "state"), args=ocp.args.PyTreeRestore(
                    item=item, restore_args=restore_args)).params
            expected = self._saved_checksums(step, meta, abstract_state)
        _verify(checksums(params), expected, prefix=".params")
        return params

    def _meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def _saved_checksums(self, step: int, meta: dict, abstract_state) -> dict[str, int]:
        """{path: checksum} as saved: in `meta` (since 2026-11-24), or the `checksums` item of
        checkpoints written before."""
        if "checksums" in meta:
            return meta["checksums"]
        replicated = jax.sharding.NamedSharding(jax.tree.leaves(abstract_state)[0].sharding.mesh,
                                                jax.sharding.PartitionSpec())
        abstract_sums = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
                                     jax.eval_shape(checksums, abstract_state))
        return _flat(jax.device_get(self.manager.restore(step, args=ocp.args.Composite(
            checksums=ocp.args.StandardRestore(abstract_sums)))["checksums"]))

    def _restore_single_replica(self, step: int, abstract_state):
        """Leaves replicated over dp: replica 0 reads, orbax broadcasts. Leaves sharded over dp:
        the ordinary read (each replica its own slice). Two passes, each skipping the other's
        leaves with orbax's PLACEHOLDER."""
        def over_dp(leaf) -> bool:
            return "dp" in jax.tree.leaves(tuple(leaf.sharding.spec))

        def part(keep, restore_args):
            item = jax.tree.map(lambda a: a if keep(a) else ocp.PLACEHOLDER, abstract_state)
            args = jax.tree.map(lambda a: restore_args(a) if keep(a) else ocp.PLACEHOLDER, abstract_state)
            return ocp.args.PyTreeRestore(item=item, restore_args=args)

        path = os.path.join(self.directory, str(step), "state")
        single_replica = ocp.type_handlers.create_type_handler_registry(
            (jax.Array, ocp.type_handlers.SingleReplicaArrayHandler(replica_axis_index=0)))
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=single_replica)) as reader:
            broadcast = reader.restore(path, args=part(lambda a: not over_dp(a), lambda a: (
                ocp.type_handlers.SingleReplicaArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape,
                                                                dtype=a.dtype))))
        if not any(over_dp(a) for a in jax.tree.leaves(abstract_state)):
            return broadcast
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
            sliced = reader.restore(path, args=part(over_dp, lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding)))
        return jax.tree.map(lambda b, s: s if b is ocp.PLACEHOLDER else b, broadcast, sliced)

    def _restore_data_state(self, step: int, meta: dict) -> dict:
        """This process's saved grain iterator state; from `meta.data_step` if it has none (saved
        with another number of processes: the position is the same on every process)."""
        own = os.path.join(self.directory, str(step), "data",
                           f"process_{jax.process_index()}-of-{jax.process_count()}.json")
        if not os.path.exists(own):
            return {"next_index": meta["data_step"]}
        holder = _IteratorState()
        with damage_is_corruption(lambda e: f"data iterator: {cli.one_line(e)}"):
            self.manager.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(holder)))
        if holder.state.get("next_index") != meta["data_step"]:
            raise CorruptCheckpoint(f"data iterator at {holder.state} but meta.data_step={meta['data_step']}")
        return holder.state

    def _check_compatible(self, step: int, meta: dict) -> None:
        check_compatible(meta.get("config", {}), self.cfg, step, self.directory)


def check_compatible(saved: dict, cfg, step: int, directory: str) -> None:
    """A different model shape is a user mistake, not corruption: say which key differs (a
    ConfigError). `saved`: the config checkpoint `step` in `directory` was written with."""
    now = cfg.to_dict()
    keys = [(s, k) for s in _SHAPE_SECTIONS for k in now[s]] + \
           [(s, k) for s, ks in _SHAPE_KEYS.items() for k in ks]
    for section, key in keys:
        if key not in saved.get(section, {}) or now[section][key] == saved[section][key]:
            continue
        if section == "model" and key in ("attention", "dtype", "window", "init_from"):
            continue  # computation choices, or where the weights first came from: the parameters are the same
        raise ConfigError(
            f"checkpoint step {step} in {directory} was written with {section}.{key}="
            f"{saved[section][key]} but the config has {now[section][key]}; set it back or pass a new --run-dir")


def saved_config(directory: str, step: int) -> dict | None:
    """The config checkpoint `step` in `directory` was written with, read from its `meta` item
    (orbax's JSON, `<step>/meta/metadata`) without restoring anything; None where it cannot be
    read (the restore then says why, or falls back to an older checkpoint)."""
    try:
        with open(os.path.join(directory, str(step), "meta", "metadata")) as f:
            config = json.load(f).get("config")
    except (OSError, ValueError, AttributeError):
        return None
    return config if isinstance(config, dict) else None


def _flat(sums) -> dict[str, int]:
    """{path: checksum} of a tree of checksums, as JSON keeps them."""
    return {jax.tree_util.keystr(path): int(v) for path, v in jax.tree_util.tree_leaves_with_path(sums)}


def _verify(sums, expected: dict[str, int], prefix: str = "") -> None:
    """Raise CorruptCheckpoint unless the checksums `sums` of a restored tree (at `prefix` in the
    state) are the saved ones."""
    actual = _flat(jax.device_get(sums))
    bad = [prefix + path for path, value in actual.items() if expected.get(prefix + path) != value]
    if bad:
        raise ChecksumMismatch(f"checksum mismatch in {len(bad)} arrays, e.g. {bad[0]}")


class _IteratorState:
    """A data iterator's state as grain's orbax handler saves and restores it, frozen at the
    blocking part of the save: the live iterator moves on while the background write runs."""

    def __init__(self, state: dict | None = None):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()

    def set_state(self, state: bytes) -> None:
        self.state = json.loads(state)

    def start_prefetch(self) -> None:
        pass  # grain's handler calls this after set_state; there is nothing to start


def _bytes_read() -> int:
    """Bytes this process has read through read() system calls, page cache included (Linux)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar"))
    except OSError:
        return 0
