"""Every test process simulates 8 XLA CPU devices, set before the JAX backend starts, and compiles
for compile time rather than run time; no test module leaves a process behind; and the one way
tests run an entry point's `main` in this process.

Processes left behind. Every process a test starts inherits `MEGASCALE_TEST_OWNER` (this pytest
process's pid) in its environment, also one that started a session of its own or was orphaned when
its parent died (a launcher's workers, an embedded Redis), which a walk of the process tree would
miss. At the end of each test module, such processes that were not there at its start get 10 s to
exit; those still alive are killed and the module errors, naming them.

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
and says so in pytest's header. The README's first command runs without them (tests/test_readme.py), as a user types it;
the other documented commands keep them.
"""

import atexit
import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile

import psutil

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


OWNER = "MEGASCALE_TEST_OWNER"
os.environ[OWNER] = str(os.getpid())


def started_here() -> dict[int, str]:
    """pid -> command line of every live process started from this pytest process, at any depth."""
    found = {}
    for process in psutil.process_iter():
        try:
            if (process.pid != os.getpid() and process.status() != psutil.STATUS_ZOMBIE
                    and process.environ().get(OWNER) == os.environ[OWNER]):
                found[process.pid] = " ".join(process.cmdline())[:200]
        except psutil.Error:  # it exited meanwhile, or is not ours to read
            pass
    return found


def end_left_behind(before: set[int], grace_s: float = 10.0) -> dict[int, str]:
    """Processes started here since `before` that are still alive after `grace_s`: killed, and
    returned (pid -> command line)."""
    left = {pid: command for pid, command in started_here().items() if pid not in before}
    processes = []
    for pid in left:
        with contextlib.suppress(psutil.Error):
            processes.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return {p.pid: left[p.pid] for p in alive}


@pytest.fixture(scope="module", autouse=True)
def no_process_left_behind():
    before = set(started_here())
    yield
    left = end_left_behind(before)
    if left:
        pytest.fail(f"{len(left)} process(es) left running by this module, now killed: "
                    + "; ".join(f"pid {pid}: {command}" for pid, command in left.items()), pytrace=False)


def pytest_configure(config):
    """One JAX compilation cache for the trainings each test process starts, where a run of a
    program an earlier run compiled loads it (training/compile_cache.py): set after JAX read its
    settings, so the test process's own compilations do not use it, and not in xdist's controller,
    whose environment its workers inherit before they import JAX (they make their own, and no two
    processes share one). tests/supervise/test_compile_cache.py takes it out of the runs whose own
    directory it counts."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="megascale-tests-jax-cache-")
        atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An embedded Redis (with its own password) for one test module (the supervise tests)."""
    from megascale_jax.supervise.redis_server import EmbeddedRedis

    s = EmbeddedRedis(str(tmp_path_factory.mktemp("redis")))
    yield s
    s.stop()
