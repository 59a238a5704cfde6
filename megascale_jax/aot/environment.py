"""Find the compile-only environment and compile a config's step in it (`plan --compile`).

The environment is a separate Python (3.12, the GPU machines' jax with its CUDA plugin) made by
`configs/aot/setup_env.sh`; the project's own environment may run another jax, whose XLA would
give other numbers (jax 0.10.2 compiles the `gpt_1b` step to 80.70 GiB where 0.11.2 gives 74.98,
and 0.11.2 is what ran on the H200). So the compile always runs there, in a child process, and
hands back its report as JSON. jax-free.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETUP = "configs/aot/setup_env.sh"
STAMP = ".megascale_aot_0.11.2"  # what setup_env.sh leaves in a finished environment


class MissingEnvironment(RuntimeError):
    pass


def python() -> str:
    """The compile-only environment's Python: $MEGASCALE_AOT_VENV's, else the default place's;
    MissingEnvironment (one line, naming the script) where it was never set up."""
    venv = os.environ.get("MEGASCALE_AOT_VENV") or os.path.expanduser("~/.cache/megascale_jax/aot-venv")
    if not os.path.exists(os.path.join(venv, STAMP)):
        raise MissingEnvironment(f"no compile-only GPU environment at {venv}; make it with 'bash {SETUP}' "
                                 "(about 2.3 GB, once per machine; MEGASCALE_AOT_VENV chooses another place)")
    return os.path.join(venv, "bin", "python")


def compile_report(gpu: str, topology: str, config: str | None, overrides: list[str],
                   xla_options: list[str] = (), dump: str | None = None, timeout_s: float = 1800) -> dict:
    """The compile's report (`aot.compile_step.compile_report`); a RuntimeError with the child's
    last lines if it failed (a kernel that does not lower for sm_90, XLA running out of memory)."""
    with tempfile.TemporaryDirectory(prefix="aot-") as scratch:
        out = os.path.join(scratch, "report.json")
        command = [python(), "-m", "megascale_jax.aot.compile_step", "--gpu", gpu, "--topology", topology,
                   "--out", out, *(["--config", config] if config else []),
                   *[f"--xla-option={o}" for o in xla_options], *(["--dump", os.path.abspath(dump)] if dump else []),
                   *overrides]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("XLA_FLAGS", None)  # the CPU mesh's simulated-device flags mean nothing to this compile
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(_failure(done.stderr))
        with open(out) as f:
            return json.load(f)


def _failure(stderr: str) -> str:
    """The child's error as one line: its last exception line, the tail where there is none."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith(" ") and ("Error" in line or "error:" in line)]
    return (errors[-1] if errors else " | ".join(lines[-3:]))[:600]

