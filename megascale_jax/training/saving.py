"""A run's saved states: orbax checkpoints on disk (`checkpoint.every`) and memory snapshots
(`checkpoint.memory_every`) — what a start restores from, the hooks that save on their cadence,
and the save an interrupt asks for.

Three rules tie them to the loop:
* nothing is saved before the step's metrics are recorded: a checkpoint is never newer than the
  metrics on disk, and a snapshot is never of a step whose loss was not seen finite. A save that
  copies on the device (`checkpoint.background_host_copy`) dispatches the copy and lets the loop
  go on; its background writer waits for the record (`recorder.finite`) before it commits, and
  gives up if the step was not finite. Waiting for the step in the loop instead (`recorder.flush`,
  as host-copying saves and the last step's do) drained the devices at every save: with a save
  every 5 steps, ~9 s of the ETTR drill's 37 min (its budget's "other", 11.5 s before, 0.3 s
  after, 2.1 s of that the launcher's exit: `bench/results/ettr_cpu_30min.json` at 1ccce19, f0f76b2);
* a save's blocking is not the next step's time (`recorder.restart_clock` after a save that
  recorded its step first): tokens/s and MFU stay the training's, and ETTR (the ETTR bench)
  counts the blocking as the overhead it is. A save in the background blocks while its step still
  runs on the devices: that is inside the step's time, and the clock goes on;
* the data position saved is the step's, counted from the start (`data_state`), never the
  prefetcher's, which runs ahead (and a replayed step fetched ahead again).
Checkpoints hold the canonical layer order (`to_canonical`), snapshots the stored one.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax

from megascale_jax import run_dir as run_dirs
from megascale_jax.config import Config
from megascale_jax.model import flops
from megascale_jax.parallel import layout
from megascale_jax.training import checkpoint, compile_cache, save_copy, snapshot
from megascale_jax.training.hooks import Hooks


class FinalSaveFailed(RuntimeError):
    """The run trained to its last step but that step's checkpoint was not written: one line saying
    what was lost and where the newest good state is (train exits cli.EXIT_NOT_SAVED)."""


class Saves:
    def __init__(self, cfg: Config, run_dir: str, to_canonical: Callable, abstract_state: Any,
                 warn: Callable[[str], None], clock):
        """Opens the checkpointer and the snapshot store `cfg` asks for, compiled for
        `abstract_state` before anything is restored (the restore's verification runs it)."""
        self.run_dir, self.is_main, self.warn = run_dir, jax.process_index() == 0, warn
        self.ckpt = checkpoint.Checkpointer(cfg, run_dirs.checkpoint_dir(cfg, run_dir), warn=warn) \
            if cfg.checkpoint.every else None
        self.to_canonical, self.permutes = to_canonical, layout.permutes(cfg)
        self.checkpoint_copy: tuple | None = None  # (step, the checkpoint's device copy) for its snapshot
        if self.ckpt:
            self.ckpt.check_room(abstract_state)
            self.ckpt.compile(abstract_state)
            if self.permutes:  # compiled now: the first save's blocking time holds no compilation
                self.to_canonical = compile_cache.compile(to_canonical.lower(abstract_state), "to_canonical")
            clock.lap("checkpoint_compile")
        # With background_host_copy, snapshots copy on the device with the checkpointer's compiled
        # program (without checkpoints, the first snapshot compiles it).
        self.snapshots = snapshot.Snapshots(
            cfg, run_dirs.snapshot_dir(cfg, run_dir), warn=warn,
            device_copy=self.ckpt.device_copy if self.ckpt else save_copy.SaveCopy(cfg.to_dict())) \
            if cfg.checkpoint.memory_every else None
        if self.snapshots:
            self.snapshot_bytes = self.snapshots.check_room(abstract_state)
        self.every, self.memory_every = cfg.checkpoint.every, cfg.checkpoint.memory_every
        self.in_background = cfg.checkpoint.background_host_copy
        self.saved_step: int | None = None
        self.final_error: str | None = None  # why the last step's checkpoint was not written
        self.start = self.data_position = 0  # the step and data index this run started from
        self.last: int | None = None

    def cap_device_copy(self, cap_bytes: int | None, abstract_state: Any) -> None:
        """With checkpoint.background_host_copy: copy at most `cap_bytes` of the state per device
        on the device at each save (`trainer.device_copy_cap`; None: all of it), the rest into
        host memory while the step waits; said in one line when it caps."""
        copier = self.ckpt.device_copy if self.ckpt else self.snapshots._device_copy if self.snapshots else None
        if cap_bytes is None or copier is None:
            return
        copier.compile(abstract_state, cap_bytes)
        size = flops.format_bytes
        self.warn(f"note: a save copies {size(copier.on_device_bytes)} of the state's "
                  f"{size(copier.on_device_bytes + copier.to_host_bytes)} per device on the device (what fits beside "
                  f"the compiled step, or checkpoint.device_copy_gib); the other {size(copier.to_host_bytes)} go to "
                  "host memory while the step waits")

    # ---- the start
    def restore(self, abstract_state: Any, clock, up_to: int | None = None) -> tuple[Any, int, int, str] | None:
        """The newest saved state, as `(state in stored order?, step, data index, source)`, or None.
        A memory snapshot is used when at least as new as the newest checkpoint (RAM, or a peer's
        copy, rather than a disk read); snapshots after the step restored are dropped (a later run
        would otherwise find them)."""
        restored, source = None, None
        if self.snapshots:
            committed = [s for s in run_dirs.committed_steps(self.ckpt.directory) if up_to is None or s <= up_to] \
                if self.ckpt else []
            restored = self.snapshots.restore(abstract_state, newer_than=committed[-1] - 1 if committed else 0,
                                              up_to=up_to)
            source = "memory snapshot" if restored is not None else None
            clock.lap("snapshot_restore")
        if self.ckpt and not restored:
            restored = self.ckpt.restore_latest(abstract_state, up_to)
            source = "checkpoint" if restored else None
            clock.lap("restore")
        step = restored[1]["step"] if restored else 0
        if self.snapshots:
            self.snapshots.discard_after(step)
        if not restored:
            return None
        return restored[0], step, restored[1]["data_state"]["next_index"], source

    def damaged_checkpoints(self) -> list[dict]:
        """{"step", "error"} of each checkpoint the restore moved aside and went past."""
        return self.ckpt.damaged if self.ckpt else []

    def begin(self, start: int, last: int, data_position: int, recorder, watch) -> None:
        """Training starts after step `start`, at data index `data_position`, and ends at `last`."""
        self.start, self.last, self.data_position = start, last, data_position
        self.recorder, self.watch = recorder, watch

    def data_state(self, step: int) -> dict:
        return {"next_index": self.data_position + step - self.start}

    # ---- on a cadence
    def add_hooks(self, hooks: Hooks) -> None:
        if self.ckpt:
            hooks.add("checkpoint", self.every, self.checkpoint)
        if self.snapshots:
            hooks.add("memory snapshot", self.memory_every, self.snapshot, at_last=False)

    def checkpoint(self, step: int, state) -> None:
        commit_when = self._before_save(step)
        self.watch.state("checkpointing", step)
        t_save = time.time()
        self._log_saves(self.ckpt.save(step, self.to_canonical(state), self.data_state(step), commit_when))
        # A snapshot of the same step (it follows) reuses the checkpoint's device copy: one copy,
        # not two. Only when both hold the same layout (no layer permutation) and a snapshot is due.
        copy = self.ckpt.take_copy()
        if copy is not None and self.snapshots and not self.permutes and step % self.memory_every == 0:
            self.checkpoint_copy = (step, copy)
        self.watch.phase(step, "checkpoint", t_save, time.time() - t_save)
        self.watch.state("training", step)
        self.saved_step = step
        if commit_when is None:
            self.recorder.restart_clock()

    def snapshot(self, step: int, state) -> None:
        # Also at a checkpoint's step: a restart then reads RAM (or a peer's copy), not the disk.
        commit_when = self._before_save(step)
        wall = time.time()
        copy, self.checkpoint_copy = self.checkpoint_copy, None
        block_s = self.snapshots.save(step, state, self.data_state(step)["next_index"],
                                      copy[1] if copy and copy[0] == step else None, commit_when)
        self.watch.phase(step, "snapshot", wall, block_s)
        if self.is_main:
            run_dirs.append_jsonl(run_dirs.snapshots_path(self.run_dir), [{"step": step, "block_s": round(block_s, 4)}],
                                  self.warn)
        if commit_when is None:
            self.recorder.restart_clock()

    def _before_save(self, step: int):
        """What a save of `step` waits on before it commits (see the module's first rule): a
        ticket for its background writer, or None once the step is recorded here."""
        if self.in_background and step < self.last:
            return self.recorder.finite.ticket(step)
        self.recorder.flush()
        return None

    def poll(self) -> None:
        """Logs the background saves that finished since the last poll."""
        if self.ckpt:
            self._log_saves(self.ckpt.poll())

    # ---- stopping
    def for_interrupt(self, step: int, state) -> bool:
        """Checkpoints step `step` (if its hook did not) and waits until it is committed, as the
        interrupt's message promises; True if it is on disk. Snapshots then have nothing to add."""
        saved = False
        if self.ckpt:
            if self.saved_step != step:
                self.checkpoint(step, state)
            self._log_saves(self.ckpt.poll(wait=True))
            saved = step in run_dirs.committed_steps(self.ckpt.directory)
        if saved and self.snapshots:
            self.snapshots.remove_all()
        return saved

    def close(self) -> None:
        """Waits for the saves in flight (the loop ended, normally or not); those still waiting
        for their step's record are abandoned (it never came: the loop raised)."""
        self.recorder.finite.close()
        if self.ckpt:
            self._log_saves(self.ckpt.close())

    def finished(self) -> None:
        """The run reached its last step: the final state is in the last checkpoint, or nowhere by
        request; FinalSaveFailed if that checkpoint was asked for and could not be written (the
        memory snapshots are then kept: they may hold a newer state than the disk)."""
        if self.final_error is not None:
            good = run_dirs.committed_steps(self.ckpt.directory)
            where = (f"the newest saved state is the checkpoint of step {good[-1]} in {self.ckpt.directory}" if good
                     else "no checkpoint of this run was saved")
            raise FinalSaveFailed(f"the final checkpoint (step {self.last}) was not saved: "
                                  f"{self.final_error}; {where}; "
                                  "free space there and run the same command again to resume")
        if self.snapshots:
            self.snapshots.remove_all()

    def _log_saves(self, saves: list[dict]) -> None:
        """One line per finished save in checkpoints.jsonl: blocking vs total (until committed)
        seconds. Notes a failed save of the last step (`finished` reports it)."""
        for save in saves:
            if save["step"] == self.last and "error" in save:
                self.final_error = save["error"]
        if self.is_main and saves:
            run_dirs.append_jsonl(run_dirs.saves_path(self.run_dir), saves, self.warn)
