"""Every test process simulates 8 XLA CPU devices, set before the JAX backend starts, and compiles
for compile time rather than run time; and the one way tests run an entry point's `main` in this
process.

Why the XLA flags. Compilation is most of the suite's time: tests/parallel/test_pipeline.py takes
130 s on 2 workers cold and 22 s with every executable already in a persistent cache (a cache
shared by both workers but empty at the start, as on a clean clone, saves nothing: 129 s, the
programs tests compile are all different). XLA:CPU spends
it in LLVM: `--xla_backend_optimization_level=0` (no LLVM optimisation of the generated code) and
`--xla_cpu_use_fusion_emitters=false` (the older loop emitters, less IR per fusion) take one
pipeline test from 24 s to 10 s and the whole suite from 18:44 to 9:40 (jaxlib 0.10.2, 2 cores).
The code they make runs slower (tiny_cpu's step 2.8x), but the suite compiles far more than it
runs: at `--xla_backend_optimization_level=1`, whose code runs at full speed, it took 11:55. They
change how fast the compiled code runs, not what it computes: the HLO passes (sharding,
fusion decisions, collectives) are the same, and every numerical test passes unchanged. The
flags travel to the subprocesses tests start. An unknown flag aborts every process that reads it,
so a child process tries them first; a jaxlib that no longer knows one runs the suite without them
and says so in pytest's header. The README's commands run without them (tests/test_readme.py), as
a user types them.
"""

import contextlib
import io
import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(flags: str) -> bool:
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, timeout=120,
                           env={**os.environ, "XLA_FLAGS": flags})
    return probe.returncode == 0


_FLAGS = " ".join([os.environ.get("XLA_FLAGS", ""), *TEST_XLA_FLAGS]).strip()
FAST_COMPILE = _xla_accepts(_FLAGS)
if FAST_COMPILE:
    os.environ["XLA_FLAGS"] = _FLAGS

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_report_header(config):
    state = "on" if FAST_COMPILE else "OFF (this jaxlib rejects one of them; the suite runs slower)"
    return f"XLA flags for fast compilation {' '.join(TEST_XLA_FLAGS)}: {state}"


@pytest.fixture(scope="session")
def run_main():
    """`run_main(main, argv, cwd) -> (exit code, stdout, stderr)`: an entry point's main() in
    this process (its JAX is already up, so nothing is started twice), from directory `cwd`."""
    def run(main, argv, cwd) -> tuple[int, str, str]:
        out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv)
        finally:
            os.chdir(before)
        return code, out.getvalue(), err.getvalue()

    return run
