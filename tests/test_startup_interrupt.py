"""Ctrl-C at any moment of the train command's start-up, as a terminal sends it (SIGINT to the
process group): during its imports, while it reads its data, while XLA compiles the step — each
ends within seconds with exit 130 and one line, no traceback, no "Exception ignored" (Python drops
a KeyboardInterrupt raised inside a garbage-collection callback: the start-up went on and trained,
once in four tries, before cli.StartupInterrupt's watchdog)."""

import os
import signal
import subprocess
import sys
import time

import pytest

ARGS = ["train.steps=200", "model.layers=2", "train.eval_every=0"]


def interrupt_when(tmp_path, ready) -> tuple[int, str, float]:
    """Start `train`, wait until `ready(output so far)`, SIGINT its process group: (exit code, its
    output, seconds from the signal to its exit)."""
    out_path = tmp_path / "out.txt"
    with open(out_path, "w+") as out:
        p = subprocess.Popen([sys.executable, "-m", "megascale_jax.train", "--run-dir", str(tmp_path / "run"), *ARGS],
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.time() + 120
            while not ready(out_path.read_text()):
                assert p.poll() is None and time.time() < deadline, out_path.read_text()[-3000:]
                time.sleep(0.02)
            sent = time.time()
            os.killpg(p.pid, signal.SIGINT)
            code = p.wait(timeout=30)
            return code, out_path.read_text(), time.time() - sent
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def after_data_line(delay_s: float):
    """Ready `delay_s` after the output first shows the data line (compiling follows it)."""
    seen = {}

    def ready(text: str) -> bool:
        if "data:" in text:
            seen.setdefault("at", time.time())
        return "at" in seen and time.time() - seen["at"] >= delay_s
    return ready


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["importing", "reading data", "compiling"])
def test_ctrl_c_during_start_up_is_one_line_and_exit_130_at_once(tmp_path, moment):
    started = time.time()
    ready = {"importing": lambda text: time.time() - started > 0.3,  # python and jax's imports: ~2 s
             "reading data": after_data_line(0.0),
             "compiling": after_data_line(0.8)}[moment]  # the train step compiles for ~3 s after it
    code, out, seconds = interrupt_when(tmp_path, ready)
    assert code == 130, out[-3000:]
    assert seconds < 2 + 3, (seconds, out[-3000:])  # the watchdog's grace, and the process's own exit
    assert "Traceback" not in out and "Exception ignored" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if "interrupted during start-up" in line]
    assert len(lines) == 1, out[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran


def test_an_interrupt_python_could_not_raise_is_left_to_the_watchdog_not_printed(monkeypatch):
    """Python prints a KeyboardInterrupt raised inside a weakref or gc callback as "Exception
    ignored ... Traceback" (sys.unraisablehook) and goes on (seen in CI); once Ctrl-C was pressed
    that is dropped, the watchdog ending the start-up; any other unraisable is printed as before."""
    from types import SimpleNamespace

    from megascale_jax import cli

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # this test process keeps its own handler
    guard = cli.StartupInterrupt("interrupted")
    guard.install()
    try:
        interrupt, other = SimpleNamespace(exc_type=KeyboardInterrupt), SimpleNamespace(exc_type=ValueError)
        sys.unraisablehook(interrupt)  # before Ctrl-C: not ours to drop
        guard._armed = True  # Ctrl-C pressed
        sys.unraisablehook(interrupt)
        sys.unraisablehook(other)
    finally:
        sys.unraisablehook = guard._unraisable
    assert seen == [interrupt, other]
