"""Checkpoints, exact resume, resume on another mesh, faults, and the prefetching data pipeline.

* In-process: checksums, corrupt-checkpoint fallback, prefetch order and latency hiding, and the
  orbax-only restore snippet of docs/checkpoints.md (run in a subprocess that never imports megascale_jax).
* Real processes (the CLI): a reference run; a run SIGKILLed while its step-15 checkpoint is
  still being written, then resumed (bitwise identical steps 11-20); resumes of a dp=8
  checkpoint on other meshes (rel <= 1e-5); a run whose files are capped by RLIMIT_FSIZE, so its
  saves fail, which keeps training and keeps the last good checkpoint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from megascale_jax import cli, run_dir as run_dirs
from megascale_jax.training import checkpoint, checkpoint_damage, data
from megascale_jax.config import load_config
from megascale_jax.parallel.mesh import make_mesh

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
TINY = ["train.sample_at_end=0", "model.layers=2", "model.d_model=64", "model.heads=4", "model.kv_heads=4", "model.seq_len=32", "train.global_batch=8", "train.steps=20",
        "train.eval_every=0", "checkpoint.every=5", "checkpoint.keep=5"]
DP8 = ["mesh.dp=8", "mesh.tp=1"]

# Runs the CLI, SIGKILLing itself right after the blocking part of the save of step KILL_STEP
# returned, once the background write of that step has written its files: it is held just before
# its commit (rename), so the kill always lands mid-write.
KILL_DRIVER = textwrap.dedent("""
    import os, signal, sys, threading, time
    from megascale_jax.training import checkpoint
    from megascale_jax import train
    KILL_STEP = int(os.environ["KILL_STEP"])
    on_commit, save = checkpoint.Checkpointer._on_commit, checkpoint.Checkpointer.save
    written = threading.Event()
    def held_commit(self):
        if self._pending and self._pending["step"] == KILL_STEP:
            written.set()
            time.sleep(600)
        on_commit(self)
    def save_then_die(self, step, state, data_state, *rest):
        out = save(self, step, state, data_state, *rest)
        if step == KILL_STEP:
            written.wait(120)  # the background thread wrote the data files and holds the commit
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    checkpoint.Checkpointer._on_commit, checkpoint.Checkpointer.save = held_commit, save_then_die
    sys.exit(train.main(sys.argv[1:]))
""")


def run_cli(run_dir: Path, overrides: list[str], driver: str | None = None, env: dict | None = None,
            preexec_fn=None) -> subprocess.CompletedProcess:
    entry = ["-c", driver] if driver else ["-m", "megascale_jax.train"]
    cmd = [sys.executable, *entry, "--run-dir", str(run_dir), *overrides]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
                          capture_output=True, text=True, timeout=TIMEOUT_S, preexec_fn=preexec_fn)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def warnings_in(stderr: str) -> list[str]:
    """Our one-line warnings (orbax logs its own traceback of a failed write besides)."""
    return [line for line in stderr.splitlines() if line.startswith("warning: checkpoint")]


# ============================================================================ in-process


def tiny_cfg(*extra):
    return load_config(None, [*TINY, *DP8, *extra])


def tiny_state(mesh, seed):
    keys = jax.random.split(jax.random.key(seed), 2)
    return {"w": jax.device_put(jax.random.normal(keys[0], (64, 32)), NamedSharding(mesh, P("dp", None))),
            "b": jax.device_put(jax.random.normal(keys[1], (32,)), NamedSharding(mesh, P())),
            "step": jax.device_put(jnp.int32(seed), NamedSharding(mesh, P()))}


def saved_checkpoints(directory: Path, steps) -> tuple:
    """(cfg, mesh) after saving tiny_state(mesh, step) as checkpoint `step` for each of `steps`."""
    cfg = tiny_cfg()
    mesh = make_mesh(cfg.mesh)
    ckpt = checkpoint.Checkpointer(cfg, str(directory), warn=print)
    for step in steps:
        ckpt.save(step, tiny_state(mesh, step), {"next_index": step})
    ckpt.close()
    return cfg, mesh


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def test_checksums_are_sharding_independent_and_catch_a_bit_flip():
    cfg = tiny_cfg()
    mesh = make_mesh(cfg.mesh)
    x = np.random.default_rng(0).normal(size=(64, 32)).astype(np.float32)
    a = checkpoint.checksums(jax.device_put(x, NamedSharding(mesh, P("dp", None))))
    b = checkpoint.checksums(jax.device_put(x, NamedSharding(mesh, P(None, "dp"))))
    assert int(a) == int(b)
    flipped = x.copy()
    flipped.view(np.uint32)[17, 5] ^= 1  # lowest mantissa bit
    assert int(checkpoint.checksums(jnp.asarray(flipped))) != int(a)
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert int(checkpoint.checksums(jnp.asarray(swapped))) != int(a)


def _numpy_checksum(x: np.ndarray) -> int:
    """The checksum's definition in float64-free NumPy: sum of (raw bits x (2i+1)) mod 2**32."""
    bits = np.ascontiguousarray(x).view(f"uint{8 * x.dtype.itemsize}").astype(np.uint64).ravel()
    weights = np.arange(bits.size, dtype=np.uint64) * 2 + 1
    return int(np.sum((bits & 0xFFFFFFFF) * weights % 2**32) % 2**32)


def test_checksums_are_kept_in_meta_one_per_array(tmp_path):
    """meta.json holds each array's checksum by its path, equal to NumPy's; there is no separate
    checksums item (it cost a third of a save's blocking time)."""
    cfg = tiny_cfg()
    mesh = make_mesh(cfg.mesh)
    ckpt = checkpoint.Checkpointer(cfg, str(tmp_path), warn=print)
    state = tiny_state(mesh, 7)
    ckpt.save(7, state, {"next_index": 7})
    ckpt.close()
    assert sorted(p.name for p in (tmp_path / "7").iterdir() if p.is_dir()) == ["data", "meta", "state"]
    meta = json.loads((tmp_path / "7" / "meta" / "metadata").read_text())
    expected = {f"['{k}']": _numpy_checksum(np.asarray(v)) for k, v in state.items()}
    assert meta["checksums"] == expected
    # the config it was written with, read without restoring (what train checks before it writes)
    assert checkpoint.saved_config(str(tmp_path), 7) == json.loads(json.dumps(cfg.to_dict()))
    assert checkpoint.saved_config(str(tmp_path), 8) is None


def test_orbax_waits_at_the_coordination_service_not_in_a_collective(tmp_path, monkeypatch):
    """orbax reads its barrier choice from an absl flag this program never parses: a Checkpointer
    sets it so that orbax's own read sees it (unset, orbax's barrier is an all-gather compiled
    over every device, ~12 ms each, ~8 per save, in the train step's collectives)."""
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost

    monkeypatch.setattr(flags.FLAGS["experimental_orbax_use_distributed_barrier"], "present", 0)
    monkeypatch.setattr(flags.FLAGS["experimental_orbax_use_distributed_barrier"], "value", False)
    try:
        before = multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.value
    except flags.UnparsedFlagAccessError:  # what orbax meets unparsed: it falls back to its default
        before = None
    assert not before
    checkpoint.Checkpointer(tiny_cfg(), str(tmp_path), warn=print).close()
    assert multihost.EXPERIMENTAL_ORBAX_USE_DISTRIBUTED_BARRIER.value is True


def test_a_checkpoint_with_the_older_checksums_item_restores_and_is_verified(tmp_path):
    """Written as before 2026-11-24 (checksums as an orbax item, none in meta): it restores, and a
    flipped bit in it is still caught (the previous checkpoint is restored instead)."""
    cfg = tiny_cfg()
    mesh = make_mesh(cfg.mesh)
    manager = ocp.CheckpointManager(str(tmp_path))
    for step in (1, 2):
        state = tiny_state(mesh, step)
        manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), checksums=ocp.args.StandardSave(checkpoint.checksums(state)),
            meta=ocp.args.JsonSave({"step": step, "data_step": step, "seed": 0, "config": cfg.to_dict()})))
    manager.wait_until_finished()
    manager.close()
    ckpt = checkpoint.Checkpointer(cfg, str(tmp_path), warn=print)
    restored, meta = ckpt.restore_latest(abstract(tiny_state(mesh, 0)))
    assert meta["step"] == 2 and "checksums" not in meta
    assert all(np.array_equal(restored[k], tiny_state(mesh, 2)[k]) for k in ("w", "b", "step"))

    _flip_one_bit(tmp_path / "2")
    warnings = []
    ckpt = checkpoint.Checkpointer(cfg, str(tmp_path), warn=warnings.append)
    restored, meta = ckpt.restore_latest(abstract(tiny_state(mesh, 0)))
    assert meta["step"] == 1 and len(warnings) == 1, warnings
    assert all(np.array_equal(restored[k], tiny_state(mesh, 1)[k]) for k in ("w", "b", "step"))


def _biggest_data_file(step_dir: Path) -> Path:
    # state/d holds the merged OCDBT data that restore reads (ocdbt.process_*/d are per-process
    # write-side copies).
    return max((step_dir / "state" / "d").iterdir(), key=os.path.getsize)


def _flip_one_bit(step_dir: Path):
    path = _biggest_data_file(step_dir)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))


def _truncate(step_dir: Path):
    path = _biggest_data_file(step_dir)
    os.truncate(path, os.path.getsize(path) // 2)


def _delete_data_file(step_dir: Path):
    _biggest_data_file(step_dir).unlink()


def _garble_manifest(step_dir: Path):
    path = step_dir / "state" / "manifest.ocdbt"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", [_flip_one_bit, _truncate, _delete_data_file, _garble_manifest],
                         ids=["bit-flip", "truncated", "deleted", "garbled-manifest"])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    cfg = tiny_cfg()
    mesh = make_mesh(cfg.mesh)
    warnings = []
    ckpt = checkpoint.Checkpointer(cfg, str(tmp_path), warn=warnings.append)
    ckpt.compile(abstract(tiny_state(mesh, 1)))
    for step in (1, 2):
        ckpt.save(step, tiny_state(mesh, step), {"next_index": step})
    assert [r["step"] for r in ckpt.close()] == [2] and not warnings
    damage(tmp_path / "2")

    ckpt = checkpoint.Checkpointer(cfg, str(tmp_path), warn=warnings.append)
    state, meta = ckpt.restore_latest(abstract(tiny_state(mesh, 0)))
    assert meta["step"] == 1 and meta["data_state"] == {"next_index": 1}
    expected = tiny_state(mesh, 1)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected)))
    assert len(warnings) == 1 and "\n" not in warnings[0] and str(tmp_path / "2") in warnings[0], warnings
    # Names the bad file, briefly (the length leaves out the temporary directory's own length).
    assert "state/" in warnings[0] and len(warnings[0].replace(str(tmp_path), "")) < 300, warnings
    # Kept for inspection, out of resume's way, and a new save of step 2 works.
    assert (tmp_path / "2.corrupt").is_dir() and run_dirs.committed_steps(str(tmp_path)) == [1]
    ckpt.save(2, tiny_state(mesh, 2), {"next_index": 2})
    assert "error" not in ckpt.close()[0]


@pytest.mark.parametrize("error", [TypeError, AttributeError])
@pytest.mark.parametrize("reader", ["Checkpointer._saved_checksums", "_IteratorState.set_state"])
def test_a_programming_error_in_restore_propagates_and_moves_nothing_aside(tmp_path, monkeypatch, error, reader):
    """A bug in the code that reads a checkpoint is not damage to the files: before, it was taken
    for corruption and every good checkpoint was moved aside, one restart after another."""
    cfg, mesh = saved_checkpoints(tmp_path, (1, 2))

    def bug(*args, **kwargs):
        raise error("a bug, not damage")
    monkeypatch.setattr(getattr(checkpoint, reader.split(".")[0]), reader.split(".")[1], bug)
    warnings = []
    ckpt = checkpoint.Checkpointer(cfg, str(tmp_path), warn=warnings.append)
    with pytest.raises(error, match="a bug, not damage"):
        ckpt.restore_latest(abstract(tiny_state(mesh, 0)))
    assert not warnings and sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]
    assert run_dirs.committed_steps(str(tmp_path)) == [1, 2]


def test_data_iterator_state_is_saved_by_grain_and_checked_against_meta(tmp_path):
    """grain's orbax handler writes one file per process; a state that disagrees with the
    checkpoint's step is corruption (falls back), and a checkpoint without this process's file
    (saved with another process count) resumes the data from meta.data_step."""
    cfg, mesh = saved_checkpoints(tmp_path, (4, 6))
    own = tmp_path / "6" / "data" / "process_0-of-1.json"
    assert json.loads(own.read_text()) == {"next_index": 6}

    own.write_text(json.dumps({"next_index": 5}))
    warnings = []
    ckpt = checkpoint.Checkpointer(cfg, str(tmp_path), warn=warnings.append)
    _, meta = ckpt.restore_latest(abstract(tiny_state(mesh, 0)))
    assert meta["step"] == 4 and meta["data_state"] == {"next_index": 4}
    assert len(warnings) == 1 and "data iterator" in warnings[0], warnings

    (tmp_path / "4" / "data" / "process_0-of-1.json").rename(tmp_path / "4" / "data" / "process_0-of-2.json")
    _, meta = ckpt.restore_latest(abstract(tiny_state(mesh, 0)))
    assert meta["data_state"] == {"next_index": 4}
    ckpt.close()


def test_interop_snippet_restores_with_orbax_alone(tmp_path):
    """The docs/checkpoints.md snippet: no megascale_jax import, arrays come back as plain numpy/jax arrays."""
    cfg = tiny_cfg()
    mesh = make_mesh(cfg.mesh)
    ckpt = checkpoint.Checkpointer(cfg, str(tmp_path), warn=print)
    ckpt.compile(abstract(tiny_state(mesh, 3)))
    ckpt.save(3, tiny_state(mesh, 3), {"next_index": 3})
    ckpt.close()
    snippet = textwrap.dedent(f"""
        import sys
        import jax
        import numpy as np
        import orbax.checkpoint as ocp

        manager = ocp.CheckpointManager({str(tmp_path)!r}, item_handlers={{
            "state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}})
        step = manager.latest_step()
        # The arrays were saved sharded over the training mesh; say where they go here.
        shapes = manager.item_metadata(step)["state"]
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), shapes)
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        state, meta = restored["state"], restored["meta"]
        assert "megascale_jax" not in sys.modules
        np.save(sys.argv[1], np.asarray(state["w"]))
        print(step, meta["data_step"], meta["config"]["model"]["d_model"])
    """)
    out = subprocess.run([sys.executable, "-c", snippet, str(tmp_path / "w.npy")], env={**os.environ, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["3", "3", "64"]
    np.testing.assert_array_equal(np.load(tmp_path / "w.npy"), np.asarray(tiny_state(mesh, 3)["w"]))


# ============================================================================ data prefetch


def _batches(cfg):
    return data.SequenceBatches.from_config(cfg, np.random.default_rng(1).integers(0, 256, 50_000, dtype=np.uint16),
                                            "train")


@pytest.mark.parametrize("depth", [1, 3])
def test_prefetch_order_equals_the_synchronous_order(depth):
    cfg = tiny_cfg()
    mesh = make_mesh(cfg.mesh)
    sharding = NamedSharding(mesh, P("dp", None))
    batches = _batches(cfg)
    prefetcher = data.Prefetcher(batches, sharding, start=7, depth=depth)
    try:
        got = [np.asarray(prefetcher.get()) for _ in range(40)]  # crosses an epoch boundary
    finally:
        prefetcher.close()
    reference = _batches(cfg)
    for i, batch in enumerate(got):
        np.testing.assert_array_equal(batch, np.asarray(data.make_global_batch(reference, 7 + i, sharding)))


def test_prefetch_hides_a_slow_source(monkeypatch):
    """Rows take 50 ms per step; a 'step' of 80 ms between gets leaves the consumer no wait."""
    cfg = tiny_cfg()
    sharding = NamedSharding(make_mesh(cfg.mesh), P("dp", None))
    rows = data.SequenceBatches.rows

    def slow_rows(self, step, start, stop):
        time.sleep(0.05)
        return rows(self, step, start, stop)

    monkeypatch.setattr(data.SequenceBatches, "rows", slow_rows)
    prefetcher = data.Prefetcher(_batches(cfg), sharding, start=0, depth=2)
    waits = []
    try:
        time.sleep(0.3)  # the queue fills
        for _ in range(12):
            t = time.perf_counter()
            prefetcher.get()
            waits.append(time.perf_counter() - t)
            time.sleep(0.08)  # the train step
    finally:
        prefetcher.close()
    assert max(waits) < 0.02, waits
    sync = data.Prefetcher(_batches(cfg), sharding, start=0, depth=0)
    t = time.perf_counter()
    sync.get()
    assert time.perf_counter() - t >= 0.05  # the source really is slow


def test_the_background_copy_lands_in_pinned_host_memory_sharded_as_on_the_device():
    """save_copy.to_pinned_host: every array in the devices' pinned host memory (what the GPU's
    copy engines write at full rate), same sharding otherwise, same values bitwise."""
    mesh = make_mesh(tiny_cfg().mesh)
    state = tiny_state(mesh, 3)
    on_host = checkpoint.to_pinned_host(state)
    for key, x in state.items():
        assert on_host[key].sharding.memory_kind == "pinned_host"
        assert on_host[key].sharding.spec == x.sharding.spec and on_host[key].sharding.mesh == x.sharding.mesh
        np.testing.assert_array_equal(np.asarray(on_host[key]), np.asarray(x))


@pytest.mark.parametrize("cap", [None, 32 * 4 + 4], ids=["whole", "capped"])
def test_background_host_copy_saves_the_state_as_it_was_while_training_donates_it(tmp_path, monkeypatch, cap):
    """checkpoint.background_host_copy: save() returns after a copy on the device; orbax's save()
    (the host copy) runs on our thread while the caller keeps updating the state with donated
    buffers. The checkpoint holds the state as it was at save(), bitwise, with NumPy's checksums.
    (Without the device copy orbax would read buffers the updates deleted.) Capped to 132 bytes a
    device (save_copy.SaveCopy, what trainer.device_copy_cap gives where the copy would not fit
    beside the step), "b" and "step" are copied on the device and "w" into pinned host memory
    before save() returns: the same checkpoint."""
    cfg = tiny_cfg("checkpoint.background_host_copy=true")
    mesh = make_mesh(cfg.mesh)
    state = tiny_state(mesh, 7)
    want = {k: np.asarray(v).copy() for k, v in state.items()}
    threads = []
    save = ocp.CheckpointManager.save

    def save_slowly(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        time.sleep(0.5)  # the updates below all run while this save has not read the state yet
        return save(self, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save_slowly)
    ckpt = checkpoint.Checkpointer(cfg, str(tmp_path), warn=print)
    ckpt.compile(abstract(state))
    if cap is not None:
        ckpt.device_copy.compile(abstract(state), cap)
        assert (ckpt.device_copy.on_device_bytes, ckpt.device_copy.to_host_bytes) == (cap, 64 * 32 * 4 // cfg.mesh.dp)
    assert ckpt.save(7, state, {"next_index": 7}) == []
    copy = ckpt.take_copy()
    kinds = {k: v.sharding.memory_kind for k, v in copy.items()}
    on_device = state["w"].sharding.memory_kind
    assert kinds == ({"b": on_device, "step": on_device, "w": "pinned_host"} if cap else dict.fromkeys(copy, on_device))
    del copy
    update = jax.jit(lambda t: jax.tree.map(lambda x: x * 3 + 1, t), donate_argnums=0)
    saved = state["w"]
    for _ in range(3):
        state = update(state)
    jax.block_until_ready(state)
    assert saved.is_deleted()  # donated: its buffer is the first update's now
    assert ckpt.poll() == []  # still saving: nothing to report yet
    records = ckpt.close()
    assert threads == ["checkpoint-7"]
    assert [r["step"] for r in records] == [7] and "error" not in records[0], records
    assert records[0]["background_parts_s"]["orbax_save"] >= 0.5 > records[0]["block_s"], records
    assert abs(sum(records[0]["block_parts_s"].values()) - records[0]["block_s"]) < 1e-3, records
    restored, data_state = checkpoint.Checkpointer(cfg, str(tmp_path), warn=print).restore_latest(abstract(state))
    for k in want:
        np.testing.assert_array_equal(np.asarray(restored[k]), want[k])
    meta = json.loads((tmp_path / "7" / "meta" / "metadata").read_text())
    assert meta["checksums"] == {f"['{k}']": _numpy_checksum(v) for k, v in want.items()}


def test_a_background_save_that_fails_warns_once_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    cfg = tiny_cfg("checkpoint.background_host_copy=true")
    mesh = make_mesh(cfg.mesh)
    warned = []
    ckpt = checkpoint.Checkpointer(cfg, str(tmp_path), warn=warned.append)
    ckpt.save(5, tiny_state(mesh, 5), {"next_index": 5})
    assert [r["step"] for r in ckpt.poll(wait=True)] == [5]

    def no_space(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", no_space)
    ckpt.save(10, tiny_state(mesh, 10), {"next_index": 10})
    records = ckpt.poll(wait=True)
    assert [r["step"] for r in records] == [10] and records[0]["error"].startswith("no space left on the disk of"), records
    assert len(warned) == 1 and "checkpoint at step 10 not saved" in warned[0], warned
    assert "last good checkpoint: step 5" in warned[0]
    assert ckpt.poll(wait=True) == [] and ckpt.close() == []
    assert run_dirs.committed_steps(str(tmp_path)) == [5]


# ============================================================================ real processes


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """20 uninterrupted steps on dp=8, checkpoints every 5."""
    run_dir = tmp_path_factory.mktemp("ckpt") / "reference"
    result = run_cli(run_dir, [*TINY, *DP8])
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _file_checksums(directory: Path) -> dict[str, str]:
    import hashlib
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint-reference")
def test_a_refused_resume_leaves_the_run_directory_as_it_was(reference, tmp_path, run_main):
    """A config the newest checkpoint cannot continue (another model width) is refused in one line
    before anything is written: config.yaml and every other file byte for byte as they were, so
    `sample` and `export_hf` still read the run's own shape (issue 59). Refused before JAX starts,
    so run in this process."""
    from megascale_jax import train

    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = _file_checksums(run_dir)
    code, _, err = run_main(train.main, ["--run-dir", str(run_dir), *TINY, *DP8, "model.d_model=128",
                                         "train.steps=30"], REPO)
    assert code == 2, err[-2000:]
    assert "was written with model.d_model=64 but the config has 128" in err
    assert _file_checksums(run_dir) == before


@pytest.mark.xdist_group("checkpoint-reference")
def test_saves_record_blocking_and_total_time(reference):
    saves = [json.loads(line) for line in (reference / "checkpoints.jsonl").read_text().splitlines()]
    assert [s["step"] for s in saves] == [5, 10, 15, 20]
    assert all(0 < s["block_s"] <= s["total_s"] for s in saves), saves
    # The blocking time's parts add up to it (rounded to 0.1 ms each) and are all measured.
    for s in saves:
        parts = s["block_parts_s"]
        assert set(parts) == {"previous_save", "checksums", "orbax"} and all(v >= 0 for v in parts.values())
        assert abs(sum(parts.values()) - s["block_s"]) < 1e-3 and parts["orbax"] > 0, s
    assert run_dirs.committed_steps(str(reference / "checkpoints")) == [5, 10, 15, 20]


# Runs the CLI with the blocking part of the first save (orbax's) held SLOW_SAVE_S longer (the
# later ones as they are: the step after the first is the one measured).
SLOW_SAVE_DRIVER = textwrap.dedent("""
    import os, sys, time
    from megascale_jax.training import checkpoint
    from megascale_jax import train
    save, held = checkpoint.ocp.CheckpointManager.save, []
    def slow_save(self, *args, **kwargs):
        if not held:
            held.append(True)
            time.sleep(float(os.environ["SLOW_SAVE_S"]))
        return save(self, *args, **kwargs)
    checkpoint.ocp.CheckpointManager.save = slow_save
    sys.exit(train.main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_a_saves_blocking_is_not_counted_in_the_next_steps_time(tmp_path):
    """A step's time (and so tokens/s, MFU and bench/resilience/ettr.py's productive time) is training only:
    the blocking of a save before it is overhead, recorded in checkpoints.jsonl."""
    held = 4.0  # far above a TINY step (~0.05 s), so the assertion is about structure, not speed
    run_dir = tmp_path / "slow-saves"
    result = run_cli(run_dir, [*TINY, *DP8, "train.steps=10"], driver=SLOW_SAVE_DRIVER,
                     env={"SLOW_SAVE_S": str(held)})
    assert result.returncode == 0, result.stderr[-3000:]
    saves = [json.loads(line) for line in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
    assert [s["step"] for s in saves] == [5, 10] and saves[0]["block_s"] >= held, saves
    assert saves[0]["block_parts_s"]["orbax"] >= held, saves  # attributed to orbax's part
    after_save = records(run_dir)[5]
    assert after_save["step"] == 6 and after_save["step_time_s"] < held, after_save


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint-reference")
def test_a_run_with_background_host_copies_trains_and_saves_what_the_reference_does(reference, tmp_path):
    """The CLI with checkpoint.background_host_copy=true: the same losses as the reference, bitwise,
    and checkpoints with the same checksums (so the same arrays); the host copy ran on the thread.
    The device copy capped at 10 KiB a device (checkpoint.device_copy_gib; on a GPU the cap is what
    fits beside the step): the rest of the state goes to host memory before the step, said once."""
    run_dir = tmp_path / "background"
    result = run_cli(run_dir, [*TINY, *DP8, "checkpoint.background_host_copy=true", "checkpoint.memory_every=3",
                               f"checkpoint.device_copy_gib={10 * 2**10 / 2**30}"])
    assert result.returncode == 0, result.stderr[-3000:]
    capped = [line for line in (result.stdout + result.stderr).splitlines() if "note: a save copies" in line]
    assert len(capped) == 1 and "per device on the device" in capped[0], result.stderr[-3000:]
    # Memory snapshots take the same path (a device copy, the host copy on their writer thread):
    # every 3rd step, the checkpoints' (15) included.
    snapshots = run_dirs.read_jsonl(run_dirs.snapshots_path(str(run_dir)))
    assert [s["step"] for s in snapshots] == [3, 6, 9, 12, 15, 18], snapshots
    assert [(r["loss"], r["grad_norm"]) for r in records(run_dir)] == \
        [(r["loss"], r["grad_norm"]) for r in records(reference)]
    saves = [json.loads(line) for line in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
    assert [s["step"] for s in saves] == [5, 10, 15, 20] and all("error" not in s for s in saves), saves
    assert all(set(s["block_parts_s"]) == {"previous_save", "dispatch"} for s in saves), saves
    assert all(set(s["background_parts_s"]) == {"device_copy", "device_to_host", "orbax_save"} for s in saves), saves
    assert all(s["background_parts_s"]["device_to_host"] > 0 and s["background_parts_s"]["orbax_save"] > 0
               for s in saves), saves

    def sums(directory, step):
        return json.loads((directory / "checkpoints" / str(step) / "meta" / "metadata").read_text())["checksums"]

    for step in (5, 10, 15, 20):
        assert sums(run_dir, step) == sums(reference, step), step


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint-reference")
def test_kill_during_background_write_then_resume_is_bitwise_exact(reference, tmp_path, run_main):
    run_dir = tmp_path / "killed"
    killed = run_cli(run_dir, [*TINY, *DP8], driver=KILL_DRIVER, env={"KILL_STEP": "15"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    ckpt_dir = run_dir / "checkpoints"
    # The step-15 write never committed: only its tmp directory exists, which resume ignores.
    assert run_dirs.committed_steps(str(ckpt_dir)) == [5, 10]
    assert any(p.name.startswith("15.") and "tmp" in p.name for p in ckpt_dir.iterdir()), list(ckpt_dir.iterdir())
    assert [r["step"] for r in records(run_dir)] == list(range(1, 16))

    resumed = run_cli(run_dir, [*TINY, *DP8])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint step 10" in resumed.stdout + resumed.stderr
    # SIGKILL left the run directory's lock record behind: taken over, with one notice.
    notes = [line for line in resumed.stderr.splitlines() if "taking over the lock" in line]
    assert len(notes) == 1 and notes[0].startswith("note: ") and "no longer running" in notes[0], resumed.stderr
    got, want = records(run_dir), records(reference)
    assert [r["step"] for r in got] == list(range(1, 21))  # 11-15 of the killed run were dropped
    for g, w in zip(got, want):
        assert (g["loss"], g["grad_norm"], g["lr"]) == (w["loss"], w["grad_norm"], w["lr"]), (g, w)
    assert run_dirs.committed_steps(str(ckpt_dir)) == [5, 10, 15, 20]
    # A finished run is not resumed again: refused before JAX starts, so checked in this process.
    from megascale_jax import train

    code, _, err = run_main(train.main, ["--run-dir", str(run_dir), *TINY, *DP8], REPO)
    assert code == 2 and "finished run" in err, err


# dp=8 onto tp (no dp2-tp4 layout: dp4-zero1 reshards onto tp, dp and the ZeRO-1 moments' slices
# together, the same restore path with one more axis changed), and onto pipeline stages.
OTHER_MESHES = {
    "dp4-zero1": ["mesh.dp=4", "mesh.tp=2", "parallel.zero1=true"],
    "pp2": ["mesh.dp=4", "mesh.pp=2", "mesh.tp=1", "parallel.microbatches=2"],
}


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint-reference")
def test_dp8_checkpoint_resumes_on_other_meshes(reference, tmp_path):
    def one(name):
        run_dir = tmp_path / name
        (run_dir / "checkpoints").mkdir(parents=True)
        shutil.copytree(reference / "checkpoints" / "10", run_dir / "checkpoints" / "10")
        shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")  # 11-20 are dropped on resume
        return name, run_cli(run_dir, [*TINY, *OTHER_MESHES[name]]), run_dir

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, OTHER_MESHES))
    want = records(reference)
    for name, result, run_dir in results:
        assert result.returncode == 0, (name, result.stderr[-3000:])
        got = records(run_dir)
        assert [r["step"] for r in got] == list(range(1, 21)), name
        # The state restores exactly; only the layout's fp32 reduction order differs (parity contract).
        np.testing.assert_allclose([r["loss"] for r in got[10:]], [r["loss"] for r in want[10:]], rtol=1e-5,
                                   err_msg=name)


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint-reference")
def test_failing_saves_keep_training_and_the_last_good_checkpoint(reference, tmp_path):
    """RLIMIT_FSIZE makes every checkpoint data file too large to write (EFBIG, as on a full disk):
    training goes on to its last step, and since that step's checkpoint failed too the run ends
    with exit 5 and one line naming the newest good checkpoint (tests/training/test_full_disk.py:
    a real full disk)."""
    run_dir = tmp_path / "full"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "10", run_dir / "checkpoints" / "10")
    shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")
    before = sorted((p.relative_to(run_dir), p.read_bytes()) for p in (run_dir / "checkpoints").rglob("*") if p.is_file())

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))

    result = run_cli(run_dir, [*TINY, *DP8], preexec_fn=small_files)
    assert result.returncode == cli.EXIT_NOT_SAVED, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the final checkpoint (step 20) was not saved: a file too large") and \
        "the newest saved state is the checkpoint of step 10 in" in last, last
    assert [r["step"] for r in records(run_dir)] == list(range(1, 21))
    warnings = warnings_in(result.stderr + result.stdout)
    assert warnings and all("last good checkpoint: step 10" in w for w in warnings), warnings
    saves = [json.loads(line) for line in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
    assert [s["step"] for s in saves] == [15, 20] and all("error" in s for s in saves), saves
    assert run_dirs.committed_steps(str(run_dir / "checkpoints")) == [10]
    after = sorted((p.relative_to(run_dir), p.read_bytes()) for p in (run_dir / "checkpoints" / "10").rglob("*")
                   if p.is_file())
    assert after == before


# ============================================================================ single-replica restore


def test_single_replica_restore_equals_the_ordinary_restore(tmp_path):
    """Replicated leaves come through orbax's broadcast, dp-sharded ones through the ordinary
    read; both verify against the saved checksums and equal what was saved."""
    cfg = tiny_cfg("mesh.dp=2", "mesh.tp=4", "checkpoint.single_replica_restore=true")
    mesh = make_mesh(cfg.mesh)
    saved = tiny_state(mesh, 5)  # w sharded over dp (like ZeRO-1 moments), b and step replicated
    ckpt = checkpoint.Checkpointer(cfg, str(tmp_path), warn=print)
    ckpt.save(5, saved, {"next_index": 5})
    ckpt.close()
    target = abstract(saved)
    target["b"] = jax.ShapeDtypeStruct(target["b"].shape, target["b"].dtype, sharding=NamedSharding(mesh, P("tp")))
    state, meta = checkpoint.Checkpointer(cfg, str(tmp_path), warn=print).restore_latest(target)
    assert meta["step"] == 5
    for name in saved:
        np.testing.assert_array_equal(np.asarray(state[name]), np.asarray(saved[name]))
        assert state[name].sharding == target[name].sharding


@pytest.mark.slow
def test_single_replica_restore_reads_on_one_replica_only(tmp_path):
    """Two processes, one dp replica each, ZeRO-1 off so every array is replicated over dp: with
    single-replica restore process 1 reads almost nothing (metadata, checksums) while process 0
    reads the state; the restore verifies every array's checksum on both processes and training
    continues. (With ZeRO-1 each process also reads its own slice of the moments.)"""
    from megascale_jax.cluster.rendezvous import free_port

    def run_two(steps, *extra):
        address = f"127.0.0.1:{free_port()}"
        procs = [subprocess.Popen(
            [sys.executable, "-m", "megascale_jax.train", "--run-dir", str(tmp_path / "run"),
             "--coordinator", address, "--num-processes", "2", "--process-id", str(i), *TINY,
             "mesh.dp=2", "mesh.tp=4", "mesh.cpu_devices=4", "model.d_model=128", "parallel.zero1=false",
             f"train.steps={steps}",
             "checkpoint.every=2", *extra],
            cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True) for i in range(2)]
        outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
        return [o[1] for o in outs]

    run_two(2)
    errs = run_two(4, "checkpoint.single_replica_restore=true")
    read = []
    for i, err in enumerate(errs):
        line = next(x for x in err.splitlines() if x.startswith(f"process {i}: restored checkpoint step 2"))
        read.append(float(line.split(" reading ")[1].split()[0]) * 1e6)
    params_bytes = 4 * sum(np.prod(s) for s in [(256, 128), (2, 128, 3 * 128 + 512), (2, 128 + 512, 128)])
    assert read[0] > params_bytes, read
    assert read[1] < 0.2 * read[0], read
    assert len(records(tmp_path / "run")) == 4


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint-reference")
def test_damaged_checkpoints_give_one_warning_line_each_then_resume_from_the_good_one(reference, tmp_path):
    """Two damaged checkpoints (a truncated data file, a deleted one; the in-process test above
    covers more kinds of damage) in the real CLI: TensorStore's errors and the asyncio tracebacks of its reads still in flight
    (~300 lines before) become one line per checkpoint naming its step and the bad array/file, and
    training resumes from step 5, bitwise equal to the uninterrupted run."""
    run_dir = tmp_path / "damaged"
    for step in (5, 10, 15):  # not 20: a checkpoint at train.steps is a finished run
        shutil.copytree(reference / "checkpoints" / str(step), run_dir / "checkpoints" / str(step))
    shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")
    for step, damage in ((15, _truncate), (10, _delete_data_file)):
        damage(run_dir / "checkpoints" / str(step))
    result = run_cli(run_dir, [*TINY, *DP8])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "warning" in line.lower() or "Traceback" in line
             or "Error" in line]
    assert len(lines) == 2, result.stderr[-5000:]
    for line, step, bad in zip(lines, (15, 10), ("state/d/", "state/d/")):
        assert line.startswith(f"warning: checkpoint step {step} ") and bad in line, line
    assert "array " in lines[0] and "OUT_OF_RANGE" in lines[0] and "NOT_FOUND" in lines[1], lines
    assert "resumed from checkpoint step 5" in result.stderr + result.stdout
    got, want = records(run_dir), records(reference)
    assert [r["step"] for r in got] == list(range(1, 21))
    assert [(g["loss"], g["grad_norm"]) for g in got] == [(w["loss"], w["grad_norm"]) for w in want]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".corrupt")) == \
        ["10.corrupt", "15.corrupt"]


# Runs the CLI with the batch of step HOLD_STEP held back until the file GO exists (writing HELD
# when it starts waiting): the run is live, mid-way, for as long as the test needs. With
# HOLD_SAVE set, the checkpoint of the interrupt is held instead (to send a second signal).
HOLD_DRIVER = textwrap.dedent("""
    import os, sys, time
    from megascale_jax.training import checkpoint, data
    from megascale_jax import train
    HOLD_STEP, FLAGS = int(os.environ["HOLD_STEP"]), os.environ["FLAGS"]
    get, save, calls = data.Prefetcher.get, checkpoint.Checkpointer.save, [0]
    def held_get(self):
        calls[0] += 1
        if calls[0] == HOLD_STEP:  # call n returns the batch of step n (step 1's is fetched first)
            open(os.path.join(FLAGS, "HELD"), "w").close()
            while not os.path.exists(os.path.join(FLAGS, "GO")):
                time.sleep(0.05)
        return get(self)
    def held_save(self, step, state, data_state, *rest):
        if os.environ.get("HOLD_SAVE") and step == HOLD_STEP:
            open(os.path.join(FLAGS, "SAVING"), "w").close()
            for _ in range(6000):  # short sleeps: the signal handler runs between them, wherever
                time.sleep(0.1)    # the kernel delivered the signal (main thread or another)
        return save(self, step, state, data_state, *rest)
    data.Prefetcher.get, checkpoint.Checkpointer.save = held_get, held_save
    sys.exit(train.main(sys.argv[1:]))
""")


def start_held_run(run_dir: Path, flags: Path, hold_step: int, hold_save: bool = False) -> subprocess.Popen:
    flags.mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HOLD_STEP": str(hold_step), "FLAGS": str(flags),
           **({"HOLD_SAVE": "1"} if hold_save else {})}
    p = subprocess.Popen([sys.executable, "-c", HOLD_DRIVER, "--run-dir", str(run_dir), *TINY, *DP8], cwd=REPO,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + TIMEOUT_S
    while not (flags / "HELD").exists():
        assert p.poll() is None and time.time() < deadline, p.communicate()[1][-3000:]
        time.sleep(0.1)
    return p


@pytest.mark.slow
@pytest.mark.xdist_group("checkpoint-reference")
def test_a_second_run_is_refused_and_sigterm_saves_the_step_in_flight_then_resume_is_bitwise(reference, tmp_path):
    """A live run is held before step 9 (checkpoints every 5). A second `train` on its directory
    exits 2 naming the holder and touches nothing. SIGTERM then lets the first finish step 9,
    commit a checkpoint of it and exit 143 with the resume hint; the same command again resumes
    from step 9 and ends bitwise equal to the uninterrupted run."""
    run_dir, flags = tmp_path / "run", tmp_path / "flags"
    first = start_held_run(run_dir, flags, hold_step=9)
    try:
        # TensorBoard's writer flushes on its own timer, so its file is the live run's, not ours; the
        # live run's checkpoints are not walked at all: orbax renames its temporary directories as
        # it commits (a walk that entered one saw it vanish: FileNotFoundError, CI on 2026-11-27).
        before = {p: p.read_bytes() for p in files_outside(run_dir, {"checkpoints", "tensorboard"})}
        second = run_cli(run_dir, [*TINY, *DP8])
        assert second.returncode == 2, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"in use by pid {first.pid} on host " in errors[0], second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        after = {p: p.read_bytes() for p in before}
        assert after == before  # config.yaml, metrics, timings, the lock: untouched
        first.send_signal(signal.SIGTERM)
        (flags / "GO").touch()
        out, err = first.communicate(timeout=TIMEOUT_S)
    finally:
        first.kill()
    assert first.returncode == 143, err[-3000:]
    assert "interrupted at step 9; checkpoint saved — re-run the same command to resume" in err.splitlines(), err[-2000:]
    assert "Traceback" not in err
    assert run_dirs.committed_steps(str(run_dir / "checkpoints")) == [5, 9]
    assert [r["step"] for r in records(run_dir)] == list(range(1, 10))
    assert (run_dir / ".lock").read_text() == ""  # released on the way out

    resumed = run_cli(run_dir, [*TINY, *DP8])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint step 9" in resumed.stdout + resumed.stderr
    assert "taking over" not in resumed.stderr  # the interrupted run released its lock
    got, want = records(run_dir), records(reference)
    assert [r["step"] for r in got] == list(range(1, 21))
    assert [(g["loss"], g["grad_norm"], g["lr"]) for g in got] == [(w["loss"], w["grad_norm"], w["lr"]) for w in want]
    done = [line for line in resumed.stdout.splitlines() if line.startswith("done: ")]
    assert len(done) == 1 and done[0].startswith("done: steps 10-20 in ") and \
        f"final loss {want[-1]['loss']:.4f}, val_loss {want[-1]['val_loss']:.4f}" in done[0], resumed.stdout


def files_outside(root, skipped: set[str]) -> list:
    """The files under `root`, not descending into directories named in `skipped`."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skipped]
        found += [Path(folder) / f for f in files]
    return found


@pytest.mark.slow
def test_a_second_signal_exits_at_once(tmp_path):
    """SIGINT asks for a checkpoint of the step in flight; a second SIGINT while that save is
    (held) in progress exits 130 at once, leaving the committed checkpoints as they were."""
    run_dir, flags = tmp_path / "run", tmp_path / "flags"
    p = start_held_run(run_dir, flags, hold_step=7, hold_save=True)
    try:
        p.send_signal(signal.SIGINT)
        (flags / "GO").touch()
        deadline = time.time() + TIMEOUT_S
        while not (flags / "SAVING").exists():
            assert p.poll() is None and time.time() < deadline
            time.sleep(0.05)
        start = time.time()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        assert time.time() - start < 10
    finally:
        p.kill()
    assert p.returncode == 130, err[-3000:]
    assert "second signal (SIGINT): exiting now" in err and "Traceback" not in err, err[-3000:]
    # Nothing of step 7 was committed; step 5's background write may or may not have finished
    # before the exit (an exit "at once" does not wait for it), never half of it.
    assert run_dirs.committed_steps(str(run_dir / "checkpoints")) in ([], [5])


def test_only_unawaited_tensorstore_read_errors_are_dropped_from_asyncio_logs(caplog):
    """asyncio reports the failed reads of an aborted restore at garbage collection ("Future
    exception was never retrieved" + TensorStore's JSON spec): dropped, since the restore's one
    warning line names the error. Any other asyncio error is still logged."""
    checkpoint_damage.quiet_late_tensorstore_callbacks()
    log = logging.getLogger("asyncio")
    spec_error = ValueError('NOT_FOUND: Error reading "params.embed/.zarray" [tensorstore_spec=\'{"driver":"zarr"}\']')
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        log.error("Future exception was never retrieved\nfuture: <Future finished>", exc_info=(ValueError, spec_error, None))
        assert caplog.records == []
        log.error("Future exception was never retrieved\nfuture: <Future finished>",
                  exc_info=(ValueError, ValueError("something else"), None))
        log.error("Task was destroyed but it is pending!")
    assert [r.getMessage().splitlines()[0] for r in caplog.records] == [
        "Future exception was never retrieved", "Task was destroyed but it is pending!"]


@pytest.mark.slow
def test_an_unawaited_failed_restore_task_is_dropped_from_asyncio_logs(caplog):
    """orbax's async_deserialize runs as Tasks: a failed one nobody awaited is reported as "Task
    exception was never retrieved" when collected, which once made a CI run print 5 lines where
    the damaged-checkpoint test expects 2. A real Task, collected for real."""
    checkpoint_damage.quiet_late_tensorstore_callbacks()

    async def failed_read(message):
        raise ValueError(message)

    def leave_unawaited(message):
        # What this process already holds is frozen out of the collection (in a suite worker,
        # full collections of its heap took seconds); the task and anything it is part of are not.
        gc.freeze()
        try:
            loop = asyncio.new_event_loop()
            task = loop.create_task(failed_read(message))
            loop.run_until_complete(asyncio.sleep(0))  # the task runs and fails; nobody asks
            loop.close()
            del task
            gc.collect()
        finally:
            gc.unfreeze()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        leave_unawaited('OUT_OF_RANGE: Error reading [tensorstore_spec=\'{"driver":"zarr"}\']')
        assert caplog.records == []
        leave_unawaited("something else")
    assert [r.getMessage().splitlines()[0] for r in caplog.records] == ["Task exception was never retrieved"]


INTERLEAVED = ["model.layers=4", "model.d_model=32", "model.heads=4", "model.kv_heads=4", "model.seq_len=32",
               "train.global_batch=4", "train.steps=4", "train.eval_every=0", "checkpoint.every=2",
               "mesh.dp=1", "mesh.tp=1", "mesh.pp=2", "parallel.pp_schedule=interleaved_1f1b",
               "parallel.pp_virtual=2", "parallel.microbatches=2"]


@pytest.mark.slow
def test_interleaved_checkpoints_hold_network_order_and_resume_bitwise(tmp_path):
    """pp=2 × v=2 keeps its layers stage-major (stage 0 holds layers 0 and 2). Its checkpoints hold
    the network order: resumed from step 2 on one device, steps 3-4 give the interleaved run's
    losses (rel 1e-5; a stage-major file would swap layers 1 and 2 there); resumed with the same
    layout they are bitwise equal to the uninterrupted run."""
    whole = tmp_path / "whole"
    result = run_cli(whole, INTERLEAVED)
    assert result.returncode == 0, result.stderr[-3000:]

    def resume(name, extra):
        run_dir = tmp_path / name
        (run_dir / "checkpoints").mkdir(parents=True)
        shutil.copytree(whole / "checkpoints" / "2", run_dir / "checkpoints" / "2")
        shutil.copy(whole / "metrics.jsonl", run_dir / "metrics.jsonl")
        return run_cli(run_dir, [*INTERLEAVED, *extra]), run_dir

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        same, one = pool.map(lambda a: resume(*a), [("same", []), ("one", ["mesh.pp=1", "mesh.cpu_devices=1", "parallel.pp_virtual=1", "parallel.pp_schedule=1f1b"])])
    want = records(whole)
    for result, _ in (same, one):
        assert result.returncode == 0, result.stderr[-3000:]
    assert [(r["loss"], r["grad_norm"]) for r in records(same[1])[2:]] == [(r["loss"], r["grad_norm"]) for r in want[2:]]
    np.testing.assert_allclose([r["loss"] for r in records(one[1])[2:]], [r["loss"] for r in want[2:]], rtol=1e-5)


def test_a_read_error_wrapped_by_orbax_is_described_from_tensorstores_cause():
    """Orbax wraps TensorStore's error in one whose first line ends in "TensorStore({" (the warning
    was once cut there): the description comes from the cause, naming array, file and reason."""
    from megascale_jax.training.checkpoint_damage import describe_read_error as _describe_read_error

    cause = ValueError('OUT_OF_RANGE: Error reading "params.embed/0.0" in OCDBT database at local file '
                       '"/r/10/state/": Requested byte range [123070, 183779) is not valid for value of size 100')
    try:
        try:
            raise cause
        except ValueError as inner:
            raise Exception("Encountered error while reading array index: (slice(0, 4, 1),). See full TensorStore "
                            "details: <bound method spec of TensorStore({\n  'base': {\n    'driver': 'zarr',\n"
                            ) from inner
    except Exception as wrapped:  # noqa: BLE001 — orbax raises a bare Exception
        described = _describe_read_error(wrapped, "/r/10")
    assert described == ("array params.embed, file state: OUT_OF_RANGE; Requested byte range [123070, 183779) is "
                         "not valid for value of size 100")
    assert _describe_read_error(Exception("Encountered error. See full TensorStore details: <bound method"), "/r") == \
        "Exception: Encountered error."


def test_the_background_host_copy_is_the_gpu_default_and_an_explicit_setting_stays():
    """checkpoint.background_host_copy=null (the default) is decided by the devices: on for GPUs
    (an H200's 16 GB save blocked 0.17% of its time with it, 21% without), off elsewhere; a value
    the user set is kept on any device. Only a run that saves holds the device copy."""
    from megascale_jax.config import with_device_defaults
    from megascale_jax.training.trainer import saves_state

    cfg = tiny_cfg()
    assert cfg.checkpoint.background_host_copy is None
    assert with_device_defaults(cfg, "gpu").checkpoint.background_host_copy is True
    assert with_device_defaults(cfg, "cpu").checkpoint.background_host_copy is False
    assert with_device_defaults(cfg, "gpu").model == cfg.model
    for setting in (True, False):
        chosen = tiny_cfg(f"checkpoint.background_host_copy={str(setting).lower()}")
        assert with_device_defaults(chosen, "gpu").checkpoint.background_host_copy is setting
        assert with_device_defaults(chosen, "cpu").checkpoint.background_host_copy is setting
    assert saves_state(tiny_cfg("checkpoint.every=5"))
    assert saves_state(tiny_cfg("checkpoint.every=0", "checkpoint.memory_every=2"))
    assert not saves_state(tiny_cfg("checkpoint.every=0", "checkpoint.memory_every=0"))
