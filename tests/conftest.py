"""Every test process simulates 8 XLA CPU devices, set before the JAX backend starts; and the one
way tests run an entry point's `main` in this process."""

import contextlib
import io
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


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
