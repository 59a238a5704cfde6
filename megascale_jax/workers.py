"""A group of local worker processes (training or diagnostics), one log file each.

Stopping is forceful on purpose: a worker may be stopped (SIGSTOP) or blocked in a collective
whose peer is gone, so it is continued (SIGCONT) and killed (SIGKILL) rather than asked. Nothing
is lost by that: checkpoints commit by an atomic rename and metrics.jsonl is trimmed on resume.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from megascale_jax.config import Config, ConfigError


def per_process_overrides(cfg: Config, overrides: list[str], nprocs: int) -> list[str]:
    """A launched job's `mesh.cpu_devices` (default: the mesh size) is the total; each of the `nprocs`
    workers simulates its share."""
    total = cfg.mesh.cpu_devices if cfg.mesh.cpu_devices is not None else cfg.mesh.size
    if total % nprocs:
        name = "mesh.cpu_devices" if cfg.mesh.cpu_devices is not None else "mesh dp*pp*tp"
        raise ConfigError(f"{name}={total} (devices of the whole job) must be divisible by --nprocs={nprocs}")
    return [*overrides, f"mesh.cpu_devices={total // nprocs}"]


def worker_env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # log tails in heartbeats are current
    env.setdefault("JAX_PLATFORMS", "cpu")  # the local launcher simulates devices on the CPU
    return env


class WorkerGroup:
    """`python -m <module> <args> --process-id i` for i in 0..n-1, logging to `<log_dir>/<name><i>.log`."""

    def __init__(self, module: str, args: list[str], nprocs: int, env: dict, log_dir: str, name: str,
                 header: str = ""):
        os.makedirs(log_dir, exist_ok=True)
        self.log_paths = [os.path.join(log_dir, f"{name}{i}.log") for i in range(nprocs)]
        self.processes = []
        for i, path in enumerate(self.log_paths):
            with open(path, "a") as log:
                if header:
                    log.write(f"===== {header} =====\n")
                    log.flush()
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", module, *args, "--process-id", str(i)], env=env,
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

    def log_tail(self, rank: int, lines: int = 5) -> list[str]:
        with open(self.log_paths[rank], errors="replace") as f:
            text = f.read()[-4096:]
        return [line.rsplit("\r", 1)[-1] for line in text.splitlines() if line.strip()][-lines:]


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
