"""The driver's link to Redis while a job runs: the client its heartbeat monitors read with, and
the embedded server (redis_server.py) kept alive under them.

The workers only ever know the URL, so a server that died is restarted on the same port and
their next heartbeats land in it (nothing is persisted: heartbeats carry a TTL and rendezvous
keys are per attempt). Meanwhile silence proves nothing: the monitor's clocks restart
(`HeartbeatMonitor.grace`), and one `heartbeats_resumed` event says when every running rank
was heard from again. With an external Redis (`launch --redis`) there is no server to restart.
A restarted server keeps its port and password (supervise/redis_server.py): neither the workers
nor this client need to hear of it.
"""

from __future__ import annotations

import time

from megascale_jax.cluster.rendezvous import connect
from megascale_jax.supervise.detect import HeartbeatMonitor
from megascale_jax.supervise.events import EventLog


class RedisLink:
    """The URL the workers are given, a client on it, and the embedded server if there is one."""

    def __init__(self, url: str, events: EventLog, server=None):
        self.url, self.server, self.events = url, server, events  # server: a redis_server.EmbeddedRedis
        self.client = connect(url, timeout_s=1.0)  # with the job's password (cluster/redis_auth.py)
        self.restarted_at: float | None = None  # until every heartbeat reached the new server

    def keep_alive(self, monitor: HeartbeatMonitor, now: float, died_at: float) -> None:
        """Restart the embedded server if it died (`died_at`: a drill's kill, else now); the
        workers' next heartbeats land in the new one."""
        if self.server is None or self.server.alive():
            return
        self.server.start()
        self.restarted_at = time.time()
        monitor.grace(self.restarted_at)
        self.events.log("redis_restart", f"embedded Redis died; restarted in {time.time() - died_at:.2f}s",
                        latency_s=now - died_at, restart_s=time.time() - died_at, verdict="Redis lost")

    def note_heartbeats_back(self, monitor: HeartbeatMonitor, running: set[int], now: float) -> None:
        """After a restart: one event once every running rank's heartbeat reached the new server."""
        if self.restarted_at and all(monitor.arrived.get(r, 0) > self.restarted_at for r in running):
            self.events.log("heartbeats_resumed", f"all heartbeats back {now - self.restarted_at:.2f}s "
                            "after the Redis restart", since_restart_s=now - self.restarted_at)
            self.restarted_at = None
