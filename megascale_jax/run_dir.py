"""The run directory: where checkpoints go, and one live run per directory (`RUN_DIR/.lock`).

Two runs on one directory would interleave their metrics, timings, checkpoints.jsonl and
TensorBoard files and trim each other's records on resume, so the second is refused before it
writes anything. The lock is `fcntl.flock` on `RUN_DIR/.lock`: the kernel releases it when the
holder dies, however it dies (SIGKILL, OOM killer), so a crashed run never blocks the next one.
The file's content names the holder (host, pid, start time) for the refusal message; a content
left behind by a holder that died without releasing is how a takeover is noticed and announced.

Who holds it: `train` (process 0) when it runs alone; `launch` for the whole supervised job,
and then its workers — children of the launcher, restarted many times — are told so through
`MEGASCALE_RUN_DIR_LOCK_HOLDER` (the launcher's pid) and do not take it themselves. flock works
on local disks and NFSv4 (emulated with POSIX locks); on a file system without working locks
two runs on different hosts are not kept apart.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time

from megascale_jax.config import Config

LOCK_FILE = ".lock"
HOLDER_ENV = "MEGASCALE_RUN_DIR_LOCK_HOLDER"  # the pid of the launcher that holds the lock for its workers


def checkpoint_dir(cfg: Config, run_dir: str) -> str:
    return os.path.abspath(cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints"))


def committed_steps(directory: str) -> list[int]:
    """Steps with a committed checkpoint, oldest first (no JAX needed: commit = a rename to `<step>`)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


class RunDirInUse(RuntimeError):
    """Another live process holds the run directory."""


class RunDirLock:
    """The exclusive lock of one run directory; `release()` (or process exit) lets it go."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.file = None

    def acquire(self, warn=lambda line: print(line, file=sys.stderr, flush=True)) -> "RunDirLock":
        """Take the lock or raise RunDirInUse naming its holder. Creates the directory."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(f)
            f.close()
            raise RunDirInUse(f"run directory {os.path.dirname(self.path) or '.'!r} is in use by "
                              f"{_describe(holder)}; wait for that run to end (or stop it) or pass "
                              "another --run-dir") from None
        stale = _read_holder(f)
        if stale:  # its holder died without releasing (SIGKILL, a crash): the kernel freed the flock
            warn(f"note: taking over the lock of run directory {os.path.dirname(self.path) or '.'!r} "
                 f"left by {_describe(stale)}, which is no longer running")
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
                            "argv": sys.argv}) + "\n")
        f.flush()
        self.file = f
        return self

    def release(self) -> None:
        """Empty the holder record (a clean exit leaves nothing to take over), then unlock."""
        if self.file is None:
            return
        self.file.seek(0)
        self.file.truncate()
        self.file.flush()
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()
        self.file = None


def held_for_us(run_dir: str) -> bool:
    """True when the launcher that started this process holds `run_dir`'s lock for it."""
    holder = os.environ.get(HOLDER_ENV)
    if not holder:
        return False
    try:
        with open(os.path.join(run_dir, LOCK_FILE)) as f:
            record = _read_holder(f)
    except OSError:
        return False
    return bool(record) and str(record.get("pid")) == holder and record.get("host") == socket.gethostname()


def _read_holder(f) -> dict:
    f.seek(0)
    text = f.read().strip()
    try:
        record = json.loads(text) if text else {}
    except ValueError:
        return {"unreadable": text[:80]}
    return record if isinstance(record, dict) else {}


def _describe(holder: dict) -> str:
    if not holder:
        return "another process (it has not written its name yet)"
    if "unreadable" in holder:
        return "an unknown process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')} (since {since})"
