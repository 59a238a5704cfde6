"""Memory snapshots (training/snapshot.py): each process's shards in a RAM file every few steps.

* In-process: save then restore is bitwise and keeps every leaf's sharding and dtype (bf16, int,
  sharded over dp and tp, replicated); the newest three steps are kept; a flipped byte, another
  config or a snapshot not newer than the checkpoint is not used; the processes agree on the
  newest step all of them hold, and fall back together when one cannot read its file.
* Real processes: a run SIGKILLed right after its step-13 snapshot resumes from it (not from the
  step-10 checkpoint) and its steps equal an uninterrupted run without snapshots bitwise; the
  finished run leaves no snapshot in RAM.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from megascale_jax import run_dir as run_dirs
from megascale_jax.config import ConfigError, load_config
from megascale_jax.parallel.mesh import make_mesh
from megascale_jax.training import compile_cache, peer_copy, snapshot

REPO = Path(__file__).resolve().parents[2]
TINY = ["train.sample_at_end=0", "model.layers=2", "model.d_model=64", "model.heads=4", "model.kv_heads=4", "model.seq_len=32",
        "train.global_batch=8", "train.steps=20", "train.eval_every=0", "checkpoint.every=5", "checkpoint.keep=5",
        "mesh.dp=4", "mesh.tp=2"]


def cfg_with(*extra):
    return load_config(None, ["mesh.dp=4", "mesh.tp=2", "checkpoint.memory_every=1", *extra])


def random_state(mesh, seed: int) -> dict:
    keys = jax.random.split(jax.random.key(seed), 3)
    return {"w": jax.device_put(jax.random.normal(keys[0], (64, 32)), NamedSharding(mesh, P("dp", "tp"))),
            "b": jax.device_put(jax.random.normal(keys[1], (32,)).astype(jnp.bfloat16), NamedSharding(mesh, P())),
            "m": jax.device_put(jax.random.normal(keys[2], (16, 8)), NamedSharding(mesh, P(None, "tp"))),
            "step": jax.device_put(jnp.int32(seed), NamedSharding(mesh, P()))}


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def host_copy(tree) -> dict:
    return {k: np.asarray(jax.device_get(v)) for k, v in tree.items()}


def saved(root: Path, steps, *extra) -> tuple:
    """(snapshots, mesh, {step: host copy of its state}) after snapshotting random_state(step)."""
    cfg = cfg_with(*extra)
    mesh = make_mesh(cfg.mesh)
    snaps = snapshot.Snapshots(cfg, str(root), warn=print)
    states = {}
    for step in steps:
        state = random_state(mesh, step)
        states[step] = host_copy(state)
        snaps.save(step, state, next_index=100 + step)
    snaps.wait()
    return snaps, mesh, states


def test_restore_is_bitwise_with_the_same_shardings_and_keeps_the_newest_three(tmp_path):
    snaps, mesh, states = saved(tmp_path, [1, 2, 3, 4, 5])
    assert run_dirs.snapshot_steps(str(tmp_path)) == [3, 4, 5]
    assert run_dirs.snapshot_steps(str(tmp_path), processes=1) == [3, 4, 5]
    like = abstract(random_state(mesh, 0))
    state, meta = snaps.restore(like, newer_than=2)
    assert meta == {"step": 5, "data_state": {"next_index": 105}}
    for name, want in states[5].items():
        assert state[name].sharding == like[name].sharding and state[name].dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(state[name]), want)
    assert snaps.restore(like, newer_than=5) is None  # the checkpoint is as new: it is used
    snaps.discard_after(4)  # resumed from step 4 (e.g. a checkpoint): step 5 is another timeline's
    assert run_dirs.snapshot_steps(str(tmp_path)) == [3, 4]
    snaps.remove_all()
    assert not tmp_path.exists()


def test_a_background_host_copy_snapshots_the_state_as_it_was_while_training_donates_it(tmp_path, monkeypatch):
    """checkpoint.background_host_copy: save() blocks for a copy on the device only; the writer
    thread copies it to the host while the caller's updates donate the state's buffers. The
    snapshot restores to the state as it was at save(), bitwise."""
    cfg = cfg_with("checkpoint.background_host_copy=true")
    mesh = make_mesh(cfg.mesh)
    snaps = snapshot.Snapshots(cfg, str(tmp_path), warn=print)
    state = random_state(mesh, 7)
    want = host_copy(state)
    threads = []
    host_copy_of = snapshot.Snapshots._host_copy

    def host_copy_slowly(self, *args):
        threads.append(threading.current_thread().name)
        time.sleep(0.5)  # the updates below all run before this copy reads anything
        return host_copy_of(self, *args)

    monkeypatch.setattr(snapshot.Snapshots, "_host_copy", host_copy_slowly)
    snaps.save(7, state, next_index=107)
    update = jax.jit(lambda t: jax.tree.map(lambda x: x * 3 + 1, t), donate_argnums=0)
    saved_w = state["w"]
    for _ in range(3):
        state = update(state)
    jax.block_until_ready(state)
    assert saved_w.is_deleted()  # donated
    snaps.wait()
    assert threads == ["snapshot-writer"]
    restored, meta = snaps.restore(abstract(state), newer_than=0)
    assert meta == {"step": 7, "data_state": {"next_index": 107}}
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(jax.device_get(restored[name])), value)


def test_a_flipped_byte_is_one_warning_and_the_file_goes(tmp_path, capsys):
    snaps, mesh, _ = saved(tmp_path, [4])
    path = tmp_path / "4" / "process_0-of-1.npz"
    data = bytearray(path.read_bytes())
    with np.load(path) as f:  # a byte inside the first shard's data, found by its value
        raw = f["shard_0"].tobytes()
    at = bytes(data).index(raw[:64]) + 7
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    assert snaps.restore(abstract(random_state(mesh, 0)), newer_than=0) is None
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "memory snapshot at step 4" in lines[0], lines
    assert "Bad CRC-32 for file 'shard_0.npy'" in lines[0], lines
    assert not path.exists()


def test_a_snapshot_of_another_config_is_not_used(tmp_path, capsys):
    saved(tmp_path, [4])
    other = snapshot.Snapshots(cfg_with("optim.lr=0.5"), str(tmp_path), warn=print)
    mesh = make_mesh(cfg_with().mesh)
    assert other.restore(abstract(random_state(mesh, 0)), newer_than=0) is None
    assert "written with another config" in capsys.readouterr().out


def split_among(root: Path, step: int, owners: int) -> None:
    """Rewrite the one-process file of `step` as the files of an `owners`-process job: the
    distinct shards dealt out in turn, a shard held by every device (replicated) in each file."""
    path = root / str(step) / "process_0-of-1.npz"
    with np.load(path) as f:
        meta, arrays = json.loads(str(f["meta"])), {k: f[k] for k in f.files if k != "meta"}
    files = [[] for _ in range(owners)]
    counts: dict[str, int] = {}
    for i, entry in enumerate(meta["shards"]):
        counts[entry["leaf"]] = counts.get(entry["leaf"], 0) + 1
    dealt: dict[str, int] = {}
    for i, entry in enumerate(meta["shards"]):
        if counts[entry["leaf"]] == 1:
            targets = range(owners)
        else:
            targets = [dealt.get(entry["leaf"], 0) % owners]
            dealt[entry["leaf"]] = dealt.get(entry["leaf"], 0) + 1
        for t in targets:
            files[t].append((entry, arrays[f"shard_{i}"]))
    for owner, held in enumerate(files):
        with open(root / str(step) / f"process_{owner}-of-{owners}.npz", "wb") as f:
            np.savez(f, meta=np.array(json.dumps({**meta, "shards": [e for e, _ in held]})),
                     **{f"shard_{i}": a for i, (_, a) in enumerate(held)})
    path.unlink()


def test_after_a_shrink_the_previous_jobs_snapshot_is_resharded_onto_the_smaller_mesh_bitwise(tmp_path, capsys):
    """Issue 64 item 3. A 2-process job at dp=4 x tp=2 snapshotted steps 3 and 4 (each file a
    share of w's eight distinct shards, the replicated leaves in both); the job shrinks to one
    process at dp=2 x tp=2 with 2 microbatches: it restores step 4 from those files, every leaf
    equal to the saved state bitwise and laid out as the new mesh asks; the old files are removed
    once the new layout has written its second snapshot. A config that differs beyond dp and
    microbatches (another learning rate) is not resharded: one warning, the checkpoint."""
    _, _, states = saved(tmp_path, [3, 4])
    for step in (3, 4):
        split_among(tmp_path, step, 2)
    assert run_dirs.recoverable_snapshot_steps(str(tmp_path)) == [3, 4]  # the supervisor's count, any layout
    assert run_dirs.recoverable_snapshot_steps(str(tmp_path), 1) == []
    smaller = cfg_with("mesh.dp=2", "parallel.microbatches=2")
    mesh = make_mesh(smaller.mesh, devices=jax.devices()[:4])
    like = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("dp", "tp"))),
            "b": jax.ShapeDtypeStruct((32,), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
            "m": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(mesh, P("tp", None))),
            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))}
    other = snapshot.Snapshots(cfg_with("mesh.dp=2", "parallel.microbatches=2", "optim.lr=0.5"), str(tmp_path), warn=print)
    assert other.restore(like, newer_than=0) is None
    out = capsys.readouterr().out
    assert out.count("warning:") == 2 and "beyond mesh.dp and parallel.microbatches" in out, out  # steps 4, then 3
    snaps = snapshot.Snapshots(smaller, str(tmp_path), warn=print)
    state, meta = snaps.restore(like, newer_than=0)
    assert meta == {"step": 4, "data_state": {"next_index": 104}}
    for name, want in states[4].items():
        assert state[name].sharding == like[name].sharding and state[name].dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(state[name]), want)
    for step in (5, 6):
        snaps.save(step, random_state(mesh, step), next_index=100 + step)
        snaps.wait()
    left = sorted(p.name for p in tmp_path.rglob("*.npz"))
    assert left == ["process_0-of-1.npz"] * 2, left  # steps 5 and 6 of the new layout only


def test_a_reshard_refuses_files_that_do_not_cover_a_shard():
    wanted = {("['w']", "0:32,0:16")}
    listed = {0: [{"leaf": "['w']", "index": "0:16,0:16"}], 1: [{"leaf": "['w']", "index": "0:16,16:32"}]}
    with pytest.raises(ValueError, match=r"do not cover \['w'\]\[0:32,0:16\]"):
        snapshot.covering_owners(wanted, listed, prefer=set())
    listed[2] = [{"leaf": "['w']", "index": "16:32,0:16"}, {"leaf": "['w']", "index": "16:32,16:32"}]
    listed[3] = [{"leaf": "['w']", "index": "0:16,0:16"}]  # the same piece as process 0's
    assert snapshot.covering_owners(wanted, listed, prefer=set()) == [0, 2]
    assert snapshot.covering_owners(wanted, listed, prefer={3}) == [3, 2]  # a file on this host first


class KeyValueStore:
    """The coordination service's key-value store as snapshot uses it, in one process; the other
    process's answers are set beforehand."""

    def __init__(self, values: dict):
        self.values = dict(values)

    def key_value_set(self, key, value):
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_in_ms):
        return self.values[key]


@pytest.mark.parametrize("peer_fails", [False, True])
def test_processes_agree_on_the_newest_step_all_hold(tmp_path, monkeypatch, peer_fails):
    """This process holds 3-5, its peer 2-4 (one write behind): both use 4. When the peer cannot
    read its file of 4, that step is given up and both use the next source, the older step 3."""
    snaps, mesh, states = saved(tmp_path, [1, 2, 3, 4, 5])
    for step in (3, 4, 5):  # as process 0 of 2
        os.replace(tmp_path / str(step) / "process_0-of-1.npz", tmp_path / str(step) / "process_0-of-2.npz")
    snaps.processes = 2
    rounds = snapshot._rounds[0]
    inventory, fine = json.dumps({"2": {"1": [2, 3, 4]}}), json.dumps(["", "its own file"])
    peer = {f"megascale_jax/snapshot/{rounds + 1}/1": inventory,
            f"megascale_jax/snapshot/{rounds + 2}/1": json.dumps(["unreadable", "its own file"]) if peer_fails else fine,
            f"megascale_jax/snapshot/{rounds + 3}/1": inventory, f"megascale_jax/snapshot/{rounds + 4}/1": fine}
    store = KeyValueStore(peer)
    monkeypatch.setattr(compile_cache, "coordination_client", lambda: store)
    restored = snaps.restore(abstract(random_state(mesh, 0)), newer_than=1)
    assert store.values[f"megascale_jax/snapshot/{rounds + 1}/0"] == json.dumps({"2": {"0": [3, 4, 5]}})
    step = 3 if peer_fails else 4
    assert restored[1]["step"] == step
    np.testing.assert_array_equal(np.asarray(restored[0]["w"]), states[step]["w"])
    assert (tmp_path / "4" / "process_0-of-2.npz").exists()  # its own file was good: kept


@pytest.mark.parametrize("record", ["signed", "unsigned", "another round's"])
def test_with_the_jobs_key_only_signed_records_of_the_other_processes_are_believed(tmp_path, monkeypatch, capsys,
                                                                                     record):
    """What the processes agree on through jax.distributed's store (which anyone who reaches it can
    write) is signed with the job's key and its slot: process 1's signed inventory is used; an
    unsigned one, or a signed one replayed from another round, makes every process take the
    checkpoint (one warning), not a forged step."""
    from megascale_jax import job_key
    snaps, mesh, states = saved(tmp_path, [3, 4])
    for step in (3, 4):
        os.replace(tmp_path / str(step) / "process_0-of-1.npz", tmp_path / str(step) / "process_0-of-2.npz")
    snaps.processes, snaps.key = 2, b"k" * 32
    rounds = snapshot._rounds[0]

    def peer(round_, value):
        slot = f"megascale_jax/snapshot/{round_}/1"
        if record == "unsigned":
            return value
        signed_slot = slot if record == "signed" else f"megascale_jax/snapshot/{round_ + 7}/1"
        return json.dumps(job_key.signed(snaps.key, {"slot": signed_slot, "value": value}))

    store = KeyValueStore({f"megascale_jax/snapshot/{rounds + 1}/1": peer(rounds + 1, json.dumps({"2": {"1": [3, 4]}})),
                           f"megascale_jax/snapshot/{rounds + 2}/1": peer(rounds + 2, json.dumps(["", "its own file"]))})
    monkeypatch.setattr(compile_cache, "coordination_client", lambda: store)
    restored = snaps.restore(abstract(random_state(mesh, 0)), newer_than=1)
    mine = json.loads(store.values[f"megascale_jax/snapshot/{rounds + 1}/0"])
    assert job_key.authentic(snaps.key, mine) and mine["value"] == json.dumps({"2": {"0": [3, 4]}})  # its own, signed
    if record == "signed":
        assert restored[1]["step"] == 4
        np.testing.assert_array_equal(np.asarray(restored[0]["w"]), states[4]["w"])
    else:
        assert restored is None
        warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1 and "not signed with the job's key" in warnings[0], warnings


def test_memory_every_must_not_be_negative():
    from megascale_jax.config import ConfigError
    with pytest.raises(ConfigError, match="checkpoint.memory_every=-1 must be >= 0"):
        cfg_with("checkpoint.memory_every=-1")


# ============================================================================ real processes

# Runs the CLI, SIGKILLing itself once the snapshot of step KILL_STEP is written.
KILL_AFTER_SNAPSHOT = textwrap.dedent("""
    import os, signal, sys
    from megascale_jax import train
    from megascale_jax.training import snapshot
    save = snapshot.Snapshots.save
    def save_then_die(self, step, state, next_index, *rest):
        blocked = save(self, step, state, next_index, *rest)
        if step == int(os.environ["KILL_STEP"]):
            self.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return blocked
    snapshot.Snapshots.save = save_then_die
    sys.exit(train.main(sys.argv[1:]))
""")


def run_cli(run_dir: Path, overrides: list[str], driver: str | None = None, env: dict | None = None):
    entry = ["-c", driver] if driver else ["-m", "megascale_jax.train"]
    return subprocess.run([sys.executable, *entry, "--run-dir", str(run_dir), *overrides], cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
                          capture_output=True, text=True, timeout=300)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_newest_snapshot_bitwise(tmp_path):
    reference = tmp_path / "reference"
    done = run_cli(reference, TINY)  # no snapshots
    assert done.returncode == 0, done.stderr[-3000:]

    run_dir = tmp_path / "killed"
    with_snapshots = [*TINY, "checkpoint.memory_every=2"]
    killed = run_cli(run_dir, with_snapshots, driver=KILL_AFTER_SNAPSHOT, env={"KILL_STEP": "14"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    cfg = load_config(None, with_snapshots)
    ram = Path(run_dirs.snapshot_dir(cfg, str(run_dir)))
    assert str(ram).startswith("/dev/shm/") or not os.path.isdir("/dev/shm")
    # Snapshots at the checkpoint's step too (10): a restart then reads RAM, not the disk.
    assert run_dirs.snapshot_steps(str(ram), processes=1) == [10, 12, 14]
    # Step 10's checkpoint may still be in its background write when the kill comes: either way
    # the snapshot of step 14 is the newer.
    assert run_dirs.committed_steps(str(run_dir / "checkpoints")) in ([5], [5, 10])
    blocks = [json.loads(line) for line in (run_dir / "snapshots.jsonl").read_text().splitlines()]
    # Step 14's line is not written: the process was killed inside that snapshot.
    assert [b["step"] for b in blocks] == [2, 4, 6, 8, 10, 12] and all(b["block_s"] >= 0 for b in blocks)

    resumed = run_cli(run_dir, with_snapshots)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from memory snapshot step 14" in resumed.stdout + resumed.stderr
    got, want = records(run_dir), records(reference)
    assert [r["step"] for r in got] == list(range(1, 21))
    for g, w in zip(got, want):
        assert (g["loss"], g["grad_norm"], g["lr"]) == (w["loss"], w["grad_norm"], w["lr"]), (g, w)
    assert not ram.exists()  # a finished run gives the RAM back


def test_the_ram_snapshots_take_is_stated_and_checked_before_the_first_step(tmp_path, monkeypatch):
    """One process holds every shard once: a snapshot file holds the state's bytes (numpy's count),
    and three steps of them must fit in the snapshot filesystem, or the run stops in one line."""
    snaps, mesh, states = saved(tmp_path, [1])
    like = abstract(random_state(mesh, 0))
    one = sum(x.nbytes for x in host_copy(random_state(mesh, 0)).values())
    assert snapshot.state_bytes(like) == one
    assert snaps.check_room(like) == snapshot.KEEP * one  # no peer copies in a one-process run
    usage = shutil.disk_usage
    monkeypatch.setattr(snapshot.shutil, "disk_usage", lambda path: usage(path)._replace(free=100))
    held = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())  # reused, so counted as free
    assert held + 100 < snapshot.KEEP * one
    with pytest.raises(ConfigError, match=r"memory snapshots need .* in .*checkpoint.memory_dir") as e:
        snaps.check_room(like)
    assert "\n" not in str(e.value)


class RefusingLink:
    """A peer link whose every copy fails verification, as a damaged one would."""

    def peers(self):
        return [("host_a", ""), ("host_b", "")]

    def fetch(self, source, owner, step, target):
        raise peer_copy.Refused("its SHA-256 does not match the one recorded when it was sent")


def test_a_refused_peer_copy_is_one_warning_and_the_next_source_is_used(tmp_path, monkeypatch, capsys):
    """This process (0 of 2) lost its file of step 5 (its host was replaced); process 1 holds a copy
    of it, which fails its checksum: one warning, step 5 given up, and both use step 4, which this
    process still holds itself."""
    snaps, mesh, states = saved(tmp_path, [3, 4, 5])
    for step in (3, 4, 5):
        os.replace(tmp_path / str(step) / "process_0-of-1.npz", tmp_path / str(step) / "process_0-of-2.npz")
    os.remove(tmp_path / "5" / "process_0-of-2.npz")
    snaps.processes, snaps.link = 2, RefusingLink()
    rounds = snapshot._rounds[0]
    inventory, fine = json.dumps({"2": {"0": [5], "1": [4, 5]}}), json.dumps(["", "its own file"])
    store = KeyValueStore({f"megascale_jax/snapshot/{rounds + 1}/1": inventory, f"megascale_jax/snapshot/{rounds + 2}/1": fine,
                           f"megascale_jax/snapshot/{rounds + 3}/1": inventory, f"megascale_jax/snapshot/{rounds + 4}/1": fine})
    monkeypatch.setattr(compile_cache, "coordination_client", lambda: store)
    restored = snaps.restore(abstract(random_state(mesh, 0)), newer_than=1)
    assert restored[1]["step"] == 4
    np.testing.assert_array_equal(np.asarray(restored[0]["w"]), states[4]["w"])
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "SHA-256" in warnings[0] and "the copy held by process 1" in warnings[0], warnings


def test_a_snapshot_at_a_checkpoints_step_reuses_its_device_copy(tmp_path):
    """background_host_copy with a checkpoint and a snapshot at step 4: one device copy is made,
    not two (only when a snapshot is due and no layer permutation tells the two states apart),
    and the snapshot still holds the state as it was, bitwise, after updates donated it."""
    from megascale_jax.training import saving
    from megascale_jax.training.metrics import FiniteSteps
    from megascale_jax.training.observers import LoopObserver
    from megascale_jax.training.progress import StartupClock

    cfg = cfg_with("checkpoint.background_host_copy=true", "checkpoint.every=2", "checkpoint.memory_every=4",
                   f"checkpoint.dir={tmp_path / 'ckpt'}", f"checkpoint.memory_dir={tmp_path / 'ram'}")
    mesh = make_mesh(cfg.mesh)
    state = random_state(mesh, 4)
    want = host_copy(state)

    class Recorder:
        def __init__(self): self.finite = FiniteSteps()
        def flush(self, params=None): pass
        def restart_clock(self): pass

    saves = saving.Saves(cfg, str(tmp_path), lambda s: s, abstract(state), print, StartupClock())
    copies = []  # every device copy, the checkpoint's and the snapshots' own
    copy = saves.ckpt.device_copy
    saves.ckpt.device_copy = saves.snapshots._device_copy = lambda s: copies.append(1) or copy(s)
    recorder = Recorder()
    saves.begin(0, 100, 0, recorder, LoopObserver())
    recorder.finite.recorded(4)  # the loop saw steps 2 and 4 finite
    saves.checkpoint(2, random_state(mesh, 2))  # no snapshot due at step 2: its copy is not kept
    assert saves.checkpoint_copy is None and len(copies) == 1
    saves.checkpoint(4, state)
    saves.snapshot(4, state)
    assert len(copies) == 2 and saves.checkpoint_copy is None  # the snapshot took the checkpoint's
    update = jax.jit(lambda t: jax.tree.map(lambda x: x * 3 + 1, t), donate_argnums=0)
    for _ in range(2):
        state = update(state)
    saves.snapshots.wait()
    saves.close()
    restored, meta = saves.snapshots.restore(abstract(state), newer_than=0)
    assert meta["step"] == 4
    for k in want:
        np.testing.assert_array_equal(host_copy(restored)[k], want[k])


def test_background_saves_wait_for_their_steps_record_not_the_loop(tmp_path, capsys):
    """background_host_copy: the checkpoint and snapshot hooks do not wait for their step (no
    flush: the devices run on, and the step's clock with them), their writers commit once the loop
    recorded the step finite, a step found non-finite is never saved (the loop replays it), and
    the last step is recorded before its save, as every step once was."""
    from megascale_jax.training import saving
    from megascale_jax.training.metrics import FiniteSteps
    from megascale_jax.training.observers import LoopObserver
    from megascale_jax.training.progress import StartupClock

    cfg = cfg_with("checkpoint.background_host_copy=true", "checkpoint.every=2", "checkpoint.memory_every=2",
                   f"checkpoint.dir={tmp_path / 'ckpt'}", f"checkpoint.memory_dir={tmp_path / 'ram'}")
    mesh = make_mesh(cfg.mesh)

    class Recorder:
        def __init__(self): self.finite, self.flushed, self.clock_restarts = FiniteSteps(), [], []
        def flush(self, params=None): self.flushed.append(True)
        def restart_clock(self): self.clock_restarts.append(True)

    recorder = Recorder()
    saves = saving.Saves(cfg, str(tmp_path), lambda s: s, abstract(random_state(mesh, 0)), print, StartupClock())
    saves.begin(0, 6, 0, recorder, LoopObserver())

    def committed():
        return run_dirs.committed_steps(saves.ckpt.directory), sorted(saves.snapshots._own_steps())

    def save(step):
        saves.checkpoint(step, random_state(mesh, step))
        saves.snapshot(step, random_state(mesh, step))

    save(2)
    assert recorder.flushed == [] and committed() == ([], [])  # the writers wait for step 2's record
    recorder.finite.recorded(2)
    saves.ckpt.poll(wait=True)
    saves.snapshots.wait()
    assert committed() == ([2], [2])
    save(4)
    recorder.finite.not_finite(4)
    saves.ckpt.poll(wait=True)
    saves.snapshots.wait()
    assert committed() == ([2], [2])
    assert "checkpoint at step 4 not saved: abandoned: step 4 was not recorded finite" in capsys.readouterr().out
    saves.checkpoint(6, random_state(mesh, 6))  # the last step: recorded first, no ticket
    saves.close()
    assert recorder.flushed == [True] and recorder.clock_restarts == [True] and committed()[0] == [2, 6]


def test_a_full_ram_disk_is_said_once_a_streak_and_leaves_no_part_written_file(tmp_path, monkeypatch, capsys):
    """A snapshot the RAM disk cannot take (ENOSPC half-way through the file): one warning for a
    run of failures, none of the part-written files left behind (they would hold the room the
    next one needs), and the snapshot written in between restores."""
    cfg = cfg_with()
    mesh = make_mesh(cfg.mesh)
    snaps = snapshot.Snapshots(cfg, str(tmp_path), warn=print)
    savez = np.savez
    full = {1, 2, 3, 5}

    def savez_on_a_small_disk(f, *args, **kwargs):
        if snaps_step[0] in full:
            f.write(b"PK\x03\x04" + bytes(100))  # part of the zip made it to the disk
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return savez(f, *args, **kwargs)

    monkeypatch.setattr(snapshot.np, "savez", savez_on_a_small_disk)
    snaps_step = [0]
    states = {}
    for step in range(1, 7):
        snaps_step[0] = step
        state = random_state(mesh, step)
        states[step] = host_copy(state)
        snaps.save(step, state, next_index=step)
        snaps.wait()
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert [w.split(" (")[0] for w in warnings] == ["warning: memory snapshots not written from step 1",
                                                    "warning: memory snapshots not written from step 5"], warnings
    assert all("no space left on its disk; training continues on checkpoints" in w for w in warnings)
    assert not list(tmp_path.rglob("*.tmp"))
    assert run_dirs.snapshot_steps(str(tmp_path)) == [4, 6]
    restored, meta = snaps.restore(abstract(random_state(mesh, 0)), newer_than=0, up_to=4)
    assert meta["step"] == 4
    for name, value in states[4].items():
        np.testing.assert_array_equal(np.asarray(jax.device_get(restored[name])), value)
