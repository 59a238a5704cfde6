"""Heartbeats to the supervisor: a thread in every worker writes, every `supervisor.heartbeat_s`,
one JSON record to Redis with a TTL (MegaScale's per-executor daemon).

The record says who (host, pid, rank, the mesh coordinates of this process's devices), where
the loop is (state, step, last step time) and how the machine looks (the tail of this process's
log, memory, devices). A record that stops changing means the process is gone or hung — the
driver decides which (supervise/detect.py, supervise/policy.py). The thread never raises into
the training loop: while Redis is unreachable it keeps trying, and training goes on.

Active when the worker joined through Redis (`train.py --redis`, which sets the two variables
below); otherwise `observers()` returns nothing.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from typing import TYPE_CHECKING

import jax
import psutil

from megascale_jax.cli import get_logger
from megascale_jax.parallel.mesh import process_device_coords
from megascale_jax.training.observers import LoopObserver
from megascale_jax.cluster.rendezvous import connect, heartbeat_key

if TYPE_CHECKING:  # redis is imported where it is used: a trainer without --redis never loads it
    import redis

log = get_logger("heartbeat")
LOG_TAIL_BYTES = 2048
class Heartbeat(LoopObserver):
    def __init__(self, client: redis.Redis, job: str, rank: int, interval_s: float, ttl_s: float,
                 mesh_coords: list[dict]):
        self.client, self.key, self.interval_s, self.ttl_s = client, heartbeat_key(job, rank), interval_s, ttl_s
        self.identity = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "mesh_coords": mesh_coords}
        self.loop = {"state": "initialising", "step": 0, "last_step_time_s": None}
        self.seq = 0
        self.unreachable_since: float | None = None
        self.process = psutil.Process()
        self.wake, self.stopping = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ loop hooks (train thread)

    def state(self, state, step, error=""):
        # "failed"/"diverged"/"unreadable_checkpoint" come with step -1 (unknown): keep the last step known.
        self.loop.update(state=state, step=step if step >= 0 else self.loop["step"])
        if error:  # the driver's error line for the fault, even before this process's exit prints it
            self.loop["error"] = error
        self.wake.set()  # a state change is news: send it now, not at the next tick

    def phase(self, step, name, start, duration):
        if name == "step":
            self.loop.update(step=step, last_step_time_s=duration)
        elif name == "dispatch":  # arrived at `step`: in a stuck collective, who never arrived
            self.loop.update(arrived_step=step)

    def record(self, record):
        # The driver prints rank 0's progress on its console (launch): loss and throughput.
        self.loop.update(loss=record["loss"], tokens_per_s=record["tokens_per_s"])

    def event(self, kind, **fields):
        # Every event of this process so far, numbered: the driver logs those it has not seen
        # (a beat can be missed, a list cannot). A run has a handful, never a stream.
        events = self.loop.get("events", [])
        self.loop["events"] = [*events, {"id": len(events), "kind": kind, **fields}]
        self.wake.set()

    def close(self):
        self.stopping.set()
        self.wake.set()
        self.thread.join(timeout=5 * self.interval_s)

    # ------------------------------------------------------------------ the heartbeat thread

    def _run(self):
        while True:
            self._beat()
            if self.stopping.is_set():
                return
            self.wake.wait(self.interval_s)
            self.wake.clear()

    def _beat(self):
        import redis

        self.seq += 1
        try:
            self.client.set(self.key, json.dumps(self.snapshot()), px=int(self.ttl_s * 1000))
            if self.unreachable_since is not None:
                log.warning(f"heartbeat: Redis reachable again after {time.time() - self.unreachable_since:.1f}s")
                self.unreachable_since = None
        except redis.RedisError as e:
            if self.unreachable_since is None:  # one line per outage, not one per beat
                log.warning(f"heartbeat: Redis unreachable ({e}); training continues, retrying every "
                            f"{self.interval_s}s")
                self.unreachable_since = time.time()

    def snapshot(self) -> dict:
        memory = psutil.virtual_memory()
        return {**self.identity, **self.loop, "seq": self.seq, "time": time.time(),
                "log_tail": _log_tail(),
                "memory": {"rss_bytes": self.process.memory_info().rss, "host_used_percent": memory.percent,
                           "host_available_bytes": memory.available},
                "cpu_percent": self.process.cpu_percent(),
                "devices": [_device_info(d) for d in jax.local_devices()]}


def _device_info(device) -> dict:
    stats = device.memory_stats() or {}  # None on the CPU
    return {"id": device.id, "kind": device.device_kind,
            **{k: stats[k] for k in ("bytes_in_use", "bytes_limit", "peak_bytes_in_use") if k in stats}}


def _log_tail() -> list[str]:
    """The last lines of this process's stdout when it is a file (the launcher's and SLURM's
    per-worker logs); progress-bar redraws (carriage returns) keep only their last state."""
    path = "/proc/self/fd/1"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return []
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    lines = [line.rsplit("\r", 1)[-1].strip() for line in text.splitlines()]
    return [line for line in lines if line][-5:]


def mesh_coords(mesh) -> list[dict]:
    """(dp, pp, tp) of every device of this process in `mesh`."""
    return [{"device": device, **coords} for device, coords in process_device_coords(mesh, jax.process_index())]


def observers(cfg, mesh, url: str | None, job: str | None) -> list[LoopObserver]:
    """The heartbeat of this process, when it joined job `job` of a supervised launch through the
    Redis server at `url` (`train --redis URL --job JOB`)."""
    if not (url and job):
        return []
    sv = cfg.supervisor
    # Short timeouts: a dead Redis must cost the heartbeat thread a beat, not a minute.
    client = connect(url, timeout_s=max(0.5, sv.heartbeat_s))
    return [Heartbeat(client, job, jax.process_index(), sv.heartbeat_s, sv.hang_timeout_s, mesh_coords(mesh))]
