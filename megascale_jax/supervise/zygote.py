"""`python -m megascale_jax.supervise.zygote MODULE FD`: one process that imports MODULE once and
forks a warm standby (cluster/standby.py) on request, so that refilling a `StandbyPool` costs a
fork instead of a fresh interpreter importing jax, flax, optax and orbax.

Why: a cold standby costs 1.37 s of CPU to import `megascale_jax.train` (2026-11-29, this 2-core
VM: `python -m bench.resilience.standby_refill`, bench/results/standby_refill_cpu.json). After
each restart of the 4-process ETTR drill the pools refill 8 of them (4 workers, 4 diagnostics):
10.9 s of CPU, taken from the steps that follow the restart (1.5-2x slower for ~10 steps). A fork
of the zygote costs 4 ms; its memory is shared with the zygote's until written (`gc.freeze()`
keeps the collector from writing to every object).

How: FD is one end of a Unix socket pair. Each request is a module's name (the one preloaded,
or another whose imports are a subset: the diagnostics') with one file descriptor attached
(SCM_RIGHTS): the read end of the pipe the new standby reads its command line from
(cluster/standby.py's protocol, unchanged). The zygote forks a child that forks the standby and
exits: the standby is orphaned and adopted by the nearest *subreaper*, the pool's own process
(`become_subreaper`), which can then wait for it and read its exit code like any child's — the
supervisor judges faults by exit codes. The zygote waits for that child, so that the standby has
been adopted before its pid is sent back (a line of ASCII digits). End of the socket ends the
zygote; the standbys it forked live on (they are the pool's). `ps` shows them with the zygote's
command line.

Fork safety: the zygote has imported, not started, JAX (no backend, no client, no thread pool of
XLA's); its only other thread is numpy's OpenBLAS pool, which OpenBLAS re-creates after a fork
(its pthread_atfork handlers), as every `multiprocessing` fork of a numpy process relies on. A
failed import is not the zygote's failure: each standby it forks writes the traceback into its
worker's log and exits 1 once given a command line, as a cold standby does.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import socket
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Make this process the one that adopts its descendants' orphans (Linux); False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def serve(sock: socket.socket) -> tuple[int, str] | None:
    """Fork a standby per request; returns in the standby only (the fd of its command pipe and
    the module it is to run), and None in the zygote when the socket closes."""
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 256, 1)
        except OSError:
            return None
        if not message:
            return None
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            sock.sendall(b"-1\n")
            continue
        said, say = os.pipe()
        middle = os.fork()
        if middle == 0:  # the child: fork the standby, tell its pid, exit (the standby is orphaned)
            os.close(said)
            standby = os.fork()
            if standby == 0:
                os.close(say)
                sock.close()
                return fds[0], message.decode()
            os.write(say, b"%d\n" % standby)
            os._exit(0)
        os.close(say)
        os.close(fds[0])
        with os.fdopen(said, "rb") as pipe:
            pid = pipe.readline()
        os.waitpid(middle, 0)  # the standby is adopted by now: the pool may wait for it
        sock.sendall(pid or b"-1\n")


def main() -> int:
    from megascale_jax.cluster import standby

    name, fd = sys.argv[1], int(sys.argv[2])
    loaded = standby.load(name)  # what every standby would import, done once here
    gc.collect()
    gc.freeze()  # the objects so far are shared with every standby: the collector must not touch them
    request = serve(socket.socket(fileno=fd))
    if request is None:
        return 0
    command_fd, wanted = request
    # The standby: its own session (the launcher passes signals on, it does not share them), its
    # command pipe as stdin, then what a cold standby does once it has imported.
    os.setsid()
    os.dup2(command_fd, 0)
    os.close(command_fd)  # the imports stay frozen: a full collection would copy every page they are on
    # Another module than the one preloaded (the diagnostics' from the workers' zygote) imports
    # what it adds to it: little, as the heavy imports are shared.
    return standby.serve(*(loaded if wanted == name else standby.load(wanted)))


# ============================================================================ the pool's side


class Forked:
    """A standby forked by a zygote and adopted by this process: what the pool and WorkerGroup use
    of a subprocess.Popen (pid, stdin, poll, wait, kill)."""

    def __init__(self, pid: int, stdin):
        self.pid, self.stdin, self.returncode = pid, stdin, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not ours after all (adopted elsewhere): gone, code unknown
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"standby {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class Zygote:
    """A zygote process that imports `module` (and what it imports: the diagnostics' module too
    is little more), started with `env` (what JAX reads at import is the workers' environment).
    `fork(module)` is None once it is gone (the pool then starts cold standbys), and where this
    process cannot adopt orphans (not Linux)."""

    def __init__(self, module: str, env: dict, timeout_s: float = 120.0):
        self.sock, self.process = None, None
        if not become_subreaper():
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, module, str(theirs.fileno())], env=env, pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        ours.settimeout(timeout_s)  # its imports come first: the first fork waits for them
        self.sock, self.replies = ours, ours.makefile("rb")

    def fork(self, module: str) -> Forked | None:
        """A new standby of `module` (its command pipe's write end as its stdin), or None."""
        if self.sock is None:
            return None
        read, write = os.pipe()
        try:
            socket.send_fds(self.sock, [module.encode()], [read])
            pid = int(self.replies.readline() or -1)
        except (OSError, ValueError):
            pid = -1
        finally:
            os.close(read)
        if pid <= 0:
            os.close(write)
            self.close()
            return None
        return Forked(pid, os.fdopen(write, "wb"))

    def close(self) -> None:
        if self.sock is not None:
            self.replies.close()
            self.sock.close()
            self.sock = None
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


if __name__ == "__main__":
    sys.exit(main())
