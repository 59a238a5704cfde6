"""A group of local worker processes (training or diagnostics), one log file each.

Stopping is forceful on purpose: a worker may be stopped (SIGSTOP) or blocked in a collective
whose peer is gone, so it is continued (SIGCONT) and killed (SIGKILL) rather than asked. Nothing
is lost by that: checkpoints commit by an atomic rename and metrics.jsonl is trimmed on resume.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

from megascale_jax import run_dir as run_dirs
from megascale_jax.config import Config, ConfigError
from megascale_jax.supervise.zygote import Forked, Zygote


def per_process_overrides(cfg: Config, overrides: list[str], nprocs: int) -> list[str]:
    """A launched job's `mesh.cpu_devices` (default: the mesh size) is the total; each of the `nprocs`
    workers simulates its share."""
    total = cfg.mesh.cpu_devices if cfg.mesh.cpu_devices is not None else cfg.mesh.size
    if total % nprocs:
        product = "mesh dp*pp*cp*tp" if cfg.mesh.cp > 1 else "mesh dp*pp*tp"
        name = "mesh.cpu_devices" if cfg.mesh.cpu_devices is not None else product
        raise ConfigError(f"{name}={total} (devices of the whole job) must be divisible by --nprocs={nprocs}")
    return [*overrides, f"mesh.cpu_devices={total // nprocs}"]


def worker_env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # log tails in heartbeats are current
    env.setdefault("JAX_PLATFORMS", "cpu")  # the local launcher simulates devices on the CPU
    return env


class StandbyPool:
    """One warm process per slot (`python -m megascale_jax.cluster.standby MODULE`: imports done,
    waiting for its command line), so that starting a worker there costs no Python imports.
    With a `zygote` (supervise/zygote.py) a warm process is a fork of one that imported
    everything once: milliseconds of CPU instead of ~1 s (a fresh interpreter's imports).

    A slot taken is refilled only when `refill` is called — by the supervisor once the workers
    are training again — not at once: on a small host, N processes importing jax would take the
    CPU from the N workers that are restoring and compiling, and slow the very restart the pool
    is there to speed up. A slot started before its refill gets a cold process (it imports, then
    runs)."""

    def __init__(self, module: str, env: dict, slots: int, zygote: Zygote | None = None):
        self.module, self.env, self.zygote = module, env, zygote
        self.warm: dict[int, subprocess.Popen | Forked] = {}
        for slot in range(slots):
            self.warm[slot] = self._spawn()

    def _spawn(self) -> subprocess.Popen | Forked:
        forked = self.zygote.fork(self.module) if self.zygote is not None else None
        return forked or subprocess.Popen(
            [sys.executable, "-m", "megascale_jax.cluster.standby", self.module], env=self.env,
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def start(self, slot: int, args: list[str], log_path: str, env: dict) -> subprocess.Popen:
        """`MODULE.main(args)` in `slot`'s warm process (a fresh one if it has none, or it died),
        logging to `log_path`."""
        line = json.dumps({"argv": args, "log": os.path.abspath(log_path), "env": env}).encode() + b"\n"
        process = self.warm.pop(slot, None) or self._spawn()
        try:
            process.stdin.write(line)
            process.stdin.close()
        except BrokenPipeError:  # it died while standing by (killed, out of memory): a fresh one
            process = self._spawn()
            process.stdin.write(line)
            process.stdin.close()
        return process

    def refill(self, slots: list[int]) -> None:
        """A warm process for each of `slots` that has none."""
        for slot in slots:
            if slot not in self.warm:
                self.warm[slot] = self._spawn()

    def close(self) -> None:
        """End the warm processes: killed, all at once, since they hold nothing but imports.
        Ending them by end of input, one after another, waited for each interpreter to tear jax
        down: 2.1 s for 7 warm processes on the 2-core VM, 0.05 s killed (of the 2.7 s the ETTR
        drill's launcher took to exit after the job was done)."""
        processes = list(self.warm.values())
        self.warm.clear()
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()
            process.stdin.close()


class WorkerGroup:
    """`python -m <module> <args> --process-id i` for i in 0..n-1, logging to `<log_dir>/<name><i>.log`;
    with a `pool`, rank i runs in the warm process of slot `slots[i]`; with `hosts`, rank i is told
    it stands for host `hosts[i]` (run_dir.HOST_ENV)."""

    def __init__(self, module: str, args: list[str], nprocs: int, env: dict, log_dir: str, name: str,
                 header: str = "", pool: StandbyPool | None = None, slots: list[int] | None = None,
                 hosts: list[str] | None = None):
        os.makedirs(log_dir, exist_ok=True)
        self.log_paths = [os.path.join(log_dir, f"{name}{i}.log") for i in range(nprocs)]
        self.processes = []
        for i, path in enumerate(self.log_paths):
            with open(path, "a") as log:
                if header:
                    log.write(f"===== {header} =====\n")
                    log.flush()
                argv = [*args, "--process-id", str(i)]
                # the host rank i stands for: where its memory snapshots live (run_dir.HOST_ENV)
                rank_env = {**env, run_dirs.HOST_ENV: hosts[i]} if hosts else env
                if pool is not None:
                    self.processes.append(pool.start(slots[i], argv, path, rank_env))
                else:
                    self.processes.append(subprocess.Popen(
                        [sys.executable, "-m", module, *argv], env=rank_env,
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def exit_codes(self) -> dict[int, int]:
        """Exit codes of the workers that ended so far, by rank."""
        return {rank: code for rank, p in enumerate(self.processes) if (code := p.poll()) is not None}

    def signal(self, rank: int, sig: int) -> None:
        if self.processes[rank].poll() is None:
            os.kill(self.processes[rank].pid, sig)

    def stop(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(p.pid, sig)
                    except ProcessLookupError:
                        pass
        for p in self.processes:
            p.wait()

    def _attempt_lines(self, rank: int) -> list[str]:
        """This attempt's log lines (after the last header), tqdm redraws reduced to the last."""
        with open(self.log_paths[rank], errors="replace") as f:
            text = f.read()[-256 * 1024:]
        text = text.rsplit("\n===== ", 1)[-1]
        return [line.rsplit("\r", 1)[-1] for line in text.splitlines()]  # _meaningful splits glued lines

    def log_tail(self, rank: int, lines: int = 5) -> list[str]:
        """The last `lines` meaningful lines (no native stack frames, progress bars or blanks)."""
        return _meaningful(self._attempt_lines(rank))[-lines:]

    def last_error(self, rank: int) -> str:
        return last_error_line(self._attempt_lines(rank))


# A native crash prints glog's fatal line, then ~30 lines of `@ 0x...` frames, Python's
# faulthandler dump (`Fatal Python error: Aborted`, `Current thread ...` or, for one thread,
# `Stack (most recent call first):`, `File "...", line N in f`) and the list of
# extension modules: none of that names the problem. tqdm bars are progress, not errors.
_NOISE = re.compile(r"""^\s*(@\s+0x|PC:\s+@|\*\*\*\s|File\s"|Fatal\sPython\serror|Current\sthread|Thread\s0x|Stack\s\(most
                     |Extension\smodules:|Traceback\s\(most|\.\.\.|\^+$|-+$|=+$|<no\sPython\sframe>)
                     |\d+%\|.*\|.*(it|step)/s""", re.X)
_GLOG = r"[FEWI]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] "
_GLOG_FATAL = re.compile(r"^[FE]\d{4} ")
_PY_ERROR = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)|jaxlib\.\S+|KeyboardInterrupt)(:|$)")


def _is_noise(line: str) -> bool:
    return not line.strip() or bool(_NOISE.search(line))


def _meaningful(lines: list[str]) -> list[str]:
    """`lines` without noise. stderr is shared, so a glog line can follow a progress bar's last
    redraw on the same line: it is split off first."""
    split = [part for line in lines for part in re.split(f"(?={_GLOG})", line)]
    return [line.strip() for line in split if not _is_noise(line)]


def last_error_line(lines: list[str]) -> str:
    """The line of a worker's log that names why it died, '' if none does.

    In order of preference: the last glog fatal/error line (`F1122 17:01:02.1 123 file.cc:1615]
    ...`: what XLA or TensorStore says before an abort), the last Python exception line
    (`XxxError: ...`, the end of a traceback), the last line starting with `error:` (our own user
    errors). Native stack frames and progress bars are skipped."""
    candidates = _meaningful(lines)
    for pattern in (_GLOG_FATAL, _PY_ERROR, re.compile(r"^(error|fatal)\b", re.I)):
        found = [line for line in candidates if pattern.search(line)]
        if found:
            return found[-1][:500]
    return ""


def error_key(line: str) -> str:
    """`line` without what differs between two runs of the same crash (glog's time, thread id,
    addresses, pids), so a deterministic crash compares equal to itself."""
    line = re.sub(r"^[FEWI]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ ", "", line)
    return re.sub(r"0x[0-9a-fA-F]+|\bpid \d+", "#", line)

