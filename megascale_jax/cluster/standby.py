"""`python -m megascale_jax.cluster.standby MODULE`: a warm worker that waits for its command line.

A restart or a spare's promotion should not pay for Python importing jax, flax, optax and orbax
again (seconds of CPU per process). So the launcher keeps processes that have already imported
`MODULE` (megascale_jax.train) and run its `warm_up()` if it has one — JAX's backend not yet
started, so the device count is still free — each waiting on its stdin for one JSON line:

    {"argv": [...], "log": "RUN_DIR/logs/worker3.log", "env": {...}}

It then appends its output to `log`, takes `env` and runs `MODULE.main(argv)`; had the import
failed, the traceback goes to `log` instead and it exits 1, so the supervisor reports the error
line like any worker's. End of input (the launcher released it, or died) ends it quietly. A pipe rather than Redis on purpose: a spare must
outlive a killed Redis server, and the launcher that spawned it is the only one to command it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from types import ModuleType


def load(name: str) -> tuple[ModuleType | None, str | None]:
    """Import `name` and run its `warm_up()`: (the module, None), or (None, the traceback)."""
    try:
        module = importlib.import_module(name)  # the expensive part, done while standing by
        getattr(module, "warm_up", lambda: None)()
        return module, None
    except Exception:  # noqa: BLE001 — reported where the supervisor looks: the worker's log, once assigned
        return None, traceback.format_exc()


def serve(module: ModuleType | None, failed: str | None) -> int:
    """Wait for the command line on stdin, then run it (module docstring). Also the body of a
    standby forked from a zygote (supervise/zygote.py), which imported `module` once for all."""
    line = sys.stdin.readline()
    if not line:
        return 0
    job = json.loads(line)
    log = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    if failed:
        print(failed, file=sys.stderr, flush=True)
        return 1
    os.environ.update(job["env"])
    sys.argv = [module.__file__, *job["argv"]]
    return module.main(job["argv"])


def main() -> int:
    return serve(*load(sys.argv[1]))


if __name__ == "__main__":
    sys.exit(main())
