"""Run one piece of the GPU campaign in a fresh process, with a time limit, and say in one line
why it failed.

Every campaign section, and every MFU-ladder row inside one, runs in its own process: an XLA
abort (an unknown flag, a CHECK failure), a segfault in a kernel or an out-of-memory death then
ends that piece only, a GPU is handed back whole to the next piece, and XLA_FLAGS can differ
between pieces (XLA reads them once, when the backend starts). The process gets its own
process group, so a piece that runs out of time is killed together with the processes it
started. Its output is echoed live with a prefix, and the last lines are kept to find the line
that names the failure (the supervisor's `last_error_line`: glog's fatal line, else the Python
exception, else our own `error:` line). Every piece gets this checkout on its PYTHONPATH, so
`python -m bench....` starts in the user's cwd, wherever that is (`common.with_repo_on_path`).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import subprocess
import threading

from bench.common import python_module, with_repo_on_path
from megascale_jax.observe.hangs import describe_exit
from megascale_jax.supervise.workers import last_error_line

TAIL_LINES = 400  # enough to reach back past a native crash's stack frames to its fatal line


@dataclasses.dataclass
class Finished:
    code: int  # exit status; negative: killed by that signal
    timed_out: bool
    tail: list[str]  # its last output lines

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.timed_out

    def failure(self, limit_s: float) -> str:
        """One line: why it failed ('' if it did not)."""
        if self.timed_out:
            return f"timed out after {limit_s:.0f} s"
        if self.code == 0:
            return ""
        cause = last_error_line(self.tail) or next((line.strip() for line in reversed(self.tail) if line.strip()), "")
        return f"{describe_exit(self.code)}: {cause}" if cause else describe_exit(self.code)


def run(command: list[str], *, env: dict, limit_s: float, prefix: str) -> Finished:
    """Run `command` (output echoed as `prefix line`) until it exits or `limit_s` passes."""
    proc = subprocess.Popen(command, env={**with_repo_on_path(env), "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    timed_out = threading.Event()

    def kill_group():
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own group: the piece and what it started
        except ProcessLookupError:
            pass

    timer = threading.Timer(limit_s, kill_group)
    timer.start()
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        for line in proc.stdout:  # ends when every process holding the pipe has exited
            tail.append(line.rstrip("\n"))
            print(f"{prefix} {line}", end="", flush=True)
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # interrupted (Ctrl-C): leave nothing of ours running
            kill_group()
            proc.wait()
    return Finished(code, timed_out.is_set(), list(tail))


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message. A first line that
    only introduces what follows (Triton's "at 21:12:", then source, then the cause) is joined
    to the message's last line, where such errors name their cause."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    text = lines[0] if not lines[0].endswith(":") or len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(error).__name__}: {text[:300]}"


def python(module: str, *args: str) -> list[str]:
    """The command line that runs `python -m module` (e.g. bench.campaign.worker) with this interpreter."""
    return python_module(module, *args)
