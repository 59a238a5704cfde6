"""The run directory: every path in it, its JSON-lines files, and one live run per directory.

What a run directory holds (every module asks here, none joins its own paths): `config.yaml`,
`metrics.jsonl` (one record per step), `checkpoints/` (or `checkpoint.dir`), `checkpoints.jsonl`
(one record per save), `events.jsonl` (the supervisor's and the straggler check's events),
`timings/`, `tensorboard/`, `profiles/`, `logs/`, `redis/`, `report/`, `compile_cache/`,
`snapshots.jsonl` (one record per memory snapshot), `.lock`. The memory snapshots themselves live
in RAM, outside it (`snapshot_dir`). JSON-lines files are appended whole lines at a time and read
tolerantly: a last line cut by a kill is skipped.

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

import datetime
import errno
import fcntl
import getpass
import hashlib
import json
import os
import re
import socket
import sys
import tempfile
import time

from megascale_jax.config import Config

LOCK_FILE = ".lock"
HOLDER_ENV = "MEGASCALE_RUN_DIR_LOCK_HOLDER"  # the pid of the launcher that holds the lock for its workers


# ---------------------------------------------------------------------------- paths


def default_run_dir(config_path: str | None) -> str:
    """runs/<config name>-<local time>: where a run goes without --run-dir."""
    name = os.path.splitext(os.path.basename(config_path or "tiny_cpu"))[0]
    return os.path.join("runs", f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


def config_path(run_dir: str) -> str:
    return os.path.join(run_dir, "config.yaml")


def metrics_path(run_dir: str) -> str:
    return os.path.join(run_dir, "metrics.jsonl")


def saves_path(run_dir: str) -> str:
    """checkpoints.jsonl: blocking and total seconds of each save."""
    return os.path.join(run_dir, "checkpoints.jsonl")


def events_path(run_dir: str) -> str:
    return os.path.join(run_dir, "events.jsonl")


def timings_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "timings")


def tensorboard_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "tensorboard")


def profiles_dir(run_dir: str, process: int) -> str:
    return os.path.join(run_dir, "profiles", f"process-{process}")


def logs_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "logs")


def excluded_hosts_path(run_dir: str) -> str:
    """Hosts the supervisor excluded for the rest of the job, one per line (for the scheduler)."""
    return os.path.join(run_dir, "excluded_hosts.txt")


def returned_hosts_path(run_dir: str) -> str:
    """Excluded hosts given back to the job (repaired or replaced), one per line: the supervisor
    takes each back as a spare, and a shrunk job grows back onto them (supervise/placement.py)."""
    return os.path.join(run_dir, "returned_hosts.txt")


def redis_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "redis")


def compile_cache_dir(run_dir: str) -> str:
    """JAX's persistent compilation cache of this run (training/compile_cache.py)."""
    return os.path.join(run_dir, "compile_cache")


def tokenizer_dir(run_dir: str) -> str:
    """The tokenizer a run on a token file read (its tokenizer.json and tokens.json)."""
    return os.path.join(run_dir, "tokenizer")


def report_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "report")


def checkpoint_dir(cfg: Config, run_dir: str) -> str:
    return os.path.abspath(cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints"))


def snapshot_dir(cfg: Config, run_dir: str) -> str:
    """Where this run's memory snapshots go (training/snapshot.py): `checkpoint.memory_dir`, or a
    directory in RAM (/dev/shm, else the temporary directory) named by the run directory's path."""
    if cfg.checkpoint.memory_dir:
        return os.path.abspath(cfg.checkpoint.memory_dir)
    ram = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    run = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:16]
    return os.path.join(ram, f"megascale_jax-{getpass.getuser()}", run)


# A memory snapshot file, its own process's or a peer's copy (training/peer_copy.py): owner, processes
SNAPSHOT_FILE = re.compile(r"^(?:peer_)?process_(\d+)-of-(\d+)\.npz$")
HOST_ENV = "MEGASCALE_HOST"  # the host a worker stands for: the local launcher's slot, `<hostname>/slot<k>`


def host_snapshot_dir(root: str, host: str | None) -> str:
    """A host's memory snapshot directory under `root`: per simulated host (`MEGASCALE_HOST`), so
    that a host's loss can take exactly its files; `root` itself on a real machine."""
    return os.path.join(root, re.sub(r"[^\w.-]", "_", host)) if host else root


def recoverable_snapshot_steps(directory: str, processes: int | None = None,
                               hosts: list[str] | None = None) -> list[int]:
    """Steps for which each of `processes` processes has a memory snapshot file — its own or a
    peer copy (training/peer_copy.py) — in `directory` or in a simulated host's directory below
    it; `processes` None: of any one process count (after a shrink or a grow, the previous count's
    files are resharded onto the new mesh). `hosts`: only those hosts' directories — the ones the
    next attempt runs on; an excluded host's RAM is out of its reach (no process of it serves them)."""
    owners: dict[tuple[int, int], set[int]] = {}  # (process count, step) -> owners found
    if hosts is None:
        dirs = [directory] + [os.path.join(directory, d) for d in _listdir(directory) if not d.isdigit()]
    else:
        dirs = [host_snapshot_dir(directory, host) for host in hosts]
    for host in dirs:
        for step in committed_steps(host):
            for name in _listdir(os.path.join(host, str(step))):
                match = SNAPSHOT_FILE.match(name)
                if match and processes in (None, int(match.group(2))):
                    owners.setdefault((int(match.group(2)), step), set()).add(int(match.group(1)))
    return sorted({step for (count, step), found in owners.items() if len(found) == count})


def _listdir(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


def snapshot_steps(directory: str, processes: int | None = None) -> list[int]:
    """Steps with a memory snapshot directory, oldest first; with `processes`, only those where
    each of that many processes has its file (whether the files are good is the restore's
    question)."""
    steps = committed_steps(directory)
    if processes is None:
        return steps
    return [s for s in steps if all(os.path.exists(os.path.join(directory, str(s), f"process_{p}-of-{processes}.npz"))
                                    for p in range(processes))]


def snapshots_path(run_dir: str) -> str:
    """snapshots.jsonl: the blocking seconds of each memory snapshot."""
    return os.path.join(run_dir, "snapshots.jsonl")


def committed_steps(directory: str) -> list[int]:
    """Steps with a committed checkpoint, oldest first (no JAX needed: commit = a rename to `<step>`)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


# ---------------------------------------------------------------------------- JSON lines


def disk_error(e: OSError) -> str:
    """Why a write failed, in words (a full disk, a size limit, a quota), else the OS's words."""
    return {errno.ENOSPC: "no space left on its disk", errno.EFBIG: "the file is at its size limit",
            errno.EDQUOT: "the disk quota is used up"}.get(e.errno, e.strerror or str(e))


def human_bytes(n: float) -> str:
    """A size as people read it: 512 B, 3.4 KiB, 1.2 MiB, 75.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class WarnOnce:
    """A file that stops taking writes (a full disk) is said once, with what goes on without it,
    and said again only after it took a write in between: a run on a full disk logs one line,
    not one a step."""

    def __init__(self, warn, path: str, meanwhile: str):
        self.warn, self.path, self.meanwhile, self.failing = warn, path, meanwhile, False

    def failed(self, e: OSError) -> None:
        if not self.failing:
            self.failing = True
            self.warn(f"warning: cannot write {self.path}: {disk_error(e)}; {self.meanwhile}")

    def wrote(self) -> None:
        self.failing = False


_UNWRITABLE: set[str] = set()  # record files `append_jsonl` has warned about (until they take a write again)


def append_jsonl(path: str, records: list[dict], warn=None) -> None:
    """Append `records`, one line each, in one write, flushed (a reader or a kill sees whole lines,
    except at worst the last). With `warn`, a file that cannot take them (a full disk, a file-size
    limit) is one warning line, said again only after it took a write, and the run goes on:
    a record file is not worth a run."""
    if not records:
        return
    try:
        with open(path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
    except OSError as e:
        if warn is None:
            raise
        if path not in _UNWRITABLE:
            _UNWRITABLE.add(path)
            warn(f"warning: cannot append to {path}: {disk_error(e)}; training goes on, and its log keeps the progress")
    else:
        _UNWRITABLE.discard(path)


def append_lines(path: str, lines: list[str]) -> None:
    """Append `lines` in one write, flushed."""
    if lines:
        with open(path, "a") as f:
            f.write("".join(line + "\n" for line in lines))


def remove_lines(path: str, lines: list[str]) -> None:
    """Drop every line equal to one of `lines` from the file (absent: nothing to do)."""
    try:
        with open(path) as f:
            kept = [line for line in f.read().splitlines() if line not in lines]
    except FileNotFoundError:
        return
    with open(path + ".tmp", "w") as f:
        f.write("".join(line + "\n" for line in kept))
    os.replace(path + ".tmp", path)


def append_new_lines(path: str, lines: list[str]) -> list[str]:
    """Append the `lines` the file does not hold yet, under an exclusive lock, so that processes
    appending the same line at once write it once; returns the lines appended."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released on close
        f.seek(0)
        held = {line.strip() for line in f}
        new = [line for line in dict.fromkeys(lines) if line not in held]
        f.write("".join(line + "\n" for line in new))
    return new


def read_lines(path: str) -> list[str]:
    """The non-empty lines of a text file such as excluded_hosts.txt, stripped ([] if there is none)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file ([] if there is none); a line that does not parse (the
    last one, cut by a kill) is skipped, as training skips it on resume."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
    return out


def unused_name(path: str) -> str:
    """`path`, or `path-2`, `path-3`, ... : the first that does not exist."""
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


def keep_records_up_to(path: str, step: int) -> None:
    """Drop metric records after `step` (left by an interrupted run that is now resumed from
    `step`), so every step appears once. Written to a temporary file and renamed: a crash here
    leaves the old file, never a half-written one."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    # A line cut short by a kill is not JSON; it is after the checkpoint step in any case.
    kept = [line for line in lines if (at := _record_step(line)) is not None and at <= step]
    if kept != lines:
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


def _record_step(line: str) -> int | None:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------- the lock


class RunDirInUse(RuntimeError):
    """Another live process holds the run directory."""


class RunDirLock:
    """The exclusive lock of one run directory; `release()` (or process exit) lets it go."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.file = None

    def acquire(self, warn=lambda line: print(line, file=sys.stderr, flush=True)) -> "RunDirLock":
        """Take the lock or raise RunDirInUse naming its holder. Creates the directory."""
        # what this acquire makes, for `release(undo=True)` to take away again after a refusal
        self.made = [p for p in (self.path, os.path.dirname(self.path) or ".") if not os.path.exists(p)]
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

    def release(self, undo: bool = False) -> None:
        """Empty the holder record (a clean exit leaves nothing to take over), then unlock. With
        `undo` (a refused run) also remove the lock file and the directory if `acquire` made
        them, so that a refusal leaves no trace."""
        if self.file is None:
            return
        self.file.seek(0)
        self.file.truncate()
        self.file.flush()
        if undo:
            for path in getattr(self, "made", []):  # the file, then its directory (if now empty)
                try:
                    os.remove(path) if path == self.path else os.rmdir(path)
                except OSError:
                    pass
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
