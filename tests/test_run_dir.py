"""One live run per run directory (`megascale_jax/run_dir.py`), on real processes.

The holder of a lock is another process here, never this one: flock locks belong to an open
file, so only a second process shows what a second `train` would see.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megascale_jax import run_dir

HOLD = """
import sys, time
from megascale_jax import run_dir
lock = run_dir.RunDirLock(sys.argv[1]).acquire()  # kept: a collected lock closes its file
print("held", flush=True)
time.sleep(600)
"""


def holder(path) -> subprocess.Popen:
    """A process that takes the lock of `path` and sleeps; returns once it holds it."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_live_holder_is_named_and_a_dead_ones_lock_is_taken_over_with_a_notice(tmp_path):
    p = holder(tmp_path)
    try:
        with pytest.raises(run_dir.RunDirInUse) as e:
            run_dir.RunDirLock(str(tmp_path)).acquire()
        message = str(e.value)
        assert f"pid {p.pid} on host {socket.gethostname()}" in message and "--run-dir" in message
        assert "\n" not in message
    finally:
        p.kill()  # SIGKILL: no release, its record stays in the file
        p.wait()
    notes = []
    lock = run_dir.RunDirLock(str(tmp_path)).acquire(warn=notes.append)
    assert len(notes) == 1 and f"left by pid {p.pid}" in notes[0] and "no longer running" in notes[0], notes
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    # A clean release leaves nothing to take over: no notice the next time.
    notes.clear()
    run_dir.RunDirLock(str(tmp_path)).acquire(warn=notes.append).release()
    assert notes == [] and (tmp_path / ".lock").read_text() == ""


def test_workers_of_the_launcher_holding_the_lock_run_under_it(tmp_path, monkeypatch):
    p = holder(tmp_path)
    try:
        monkeypatch.setenv(run_dir.HOLDER_ENV, str(p.pid))
        assert run_dir.held_for_us(str(tmp_path))
        monkeypatch.setenv(run_dir.HOLDER_ENV, str(p.pid + 1))  # another launcher's workers
        assert not run_dir.held_for_us(str(tmp_path))
        monkeypatch.delenv(run_dir.HOLDER_ENV)
        assert not run_dir.held_for_us(str(tmp_path))
    finally:
        p.kill()
        p.wait()


def test_launch_refuses_a_directory_in_use(tmp_path):
    p = holder(tmp_path)
    try:
        start = time.time()
        r = subprocess.run([sys.executable, "-m", "megascale_jax.launch", "--nprocs", "1", "--run-dir", str(tmp_path),
                            "train.steps=2"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.strip().splitlines() == [r.stderr.strip()] and f"pid {p.pid}" in r.stderr
        assert not (tmp_path / "logs").exists() and not (tmp_path / "redis").exists()  # nothing started
        assert time.time() - start < 60
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait()


def test_jsonl_appends_whole_lines_and_reads_past_a_torn_one(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    run_dir.append_jsonl(path, [{"step": 1, "loss": 5.5}, {"step": 2, "loss": 5.25}])
    run_dir.append_jsonl(path, [])
    run_dir.append_jsonl(path, [{"step": 3, "loss": 5.0}])
    with open(path, "a") as f:
        f.write('{"step": 4, "lo')  # a kill mid-line
    assert run_dir.read_jsonl(path) == [{"step": 1, "loss": 5.5}, {"step": 2, "loss": 5.25}, {"step": 3, "loss": 5.0}]
    assert run_dir.read_jsonl(str(tmp_path / "absent.jsonl")) == []
    # Resuming from step 2 keeps records up to it, byte for byte, and drops the torn line.
    before = open(path).read().splitlines(keepends=True)
    run_dir.keep_records_up_to(path, 2)
    assert open(path).read().splitlines(keepends=True) == before[:2]


def test_append_new_lines_writes_each_line_once_across_processes(tmp_path):
    """Pods that find the same faulty node at once (preflight) list it once."""
    import subprocess
    import sys

    path = tmp_path / "excluded_hosts.txt"
    path.write_text("node7\n")
    code = ("import sys; from megascale_jax import run_dir; "
            "print(run_dir.append_new_lines(sys.argv[1], ['node1', 'node7', 'node2', 'node1']))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert sorted(path.read_text().splitlines()) == ["node1", "node2", "node7"]
    assert sorted(outs) == ["['node1', 'node2']"] + ["[]"] * 5  # exactly one process appended them


def test_a_snapshot_counts_as_recoverable_only_where_the_next_attempts_hosts_hold_it(tmp_path):
    """The supervisor's count of restorable memory snapshots: with `hosts`, only those hosts'
    directories. A 2-process job's step 6 is whole across slot0 and slot1; once both are excluded,
    the shrunk job on slot2 cannot reach it (it once claimed step 6, and the worker fell back)."""
    from megascale_jax import run_dir as run_dirs

    for host, owner, steps in (("h/slot0", 0, (4, 6)), ("h/slot1", 1, (4, 6)), ("h/slot2", 1, (4,)), ("h/slot2", 0, (4,))):
        for step in steps:
            where = os.path.join(run_dirs.host_snapshot_dir(str(tmp_path), host), str(step))
            os.makedirs(where, exist_ok=True)
            open(os.path.join(where, f"process_{owner}-of-2.npz"), "w").close()
    assert run_dirs.recoverable_snapshot_steps(str(tmp_path)) == [4, 6]
    assert run_dirs.recoverable_snapshot_steps(str(tmp_path), hosts=["h/slot0", "h/slot1"]) == [4, 6]
    assert run_dirs.recoverable_snapshot_steps(str(tmp_path), hosts=["h/slot2"]) == [4]
    assert run_dirs.recoverable_snapshot_steps(str(tmp_path), hosts=["h/slot0"]) == []
