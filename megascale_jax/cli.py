"""What every `python -m megascale_jax.<cmd>` shares: its command line, its one way of reporting a
user's mistake, and its logging.

* `parse`: options and `section.key=value` overrides in any order (`parse_intermixed_args`:
  argparse's plain `parse_args` rejects a positional after an option); `ArgumentParser`, whose
  errors are one line like the rest.
* `user_error`: one line on stderr, `error: <what is wrong and how to fix it>`, exit code 2 —
  never a traceback for a user mistake.
* `setup_logging`: progress and notices go through the `megascale_jax` logger: INFO to stdout,
  warnings and errors to stderr. In a job of several processes every line carries `[rank N]`,
  so merged logs (SLURM's, a terminal running several workers) say who wrote what; a single
  process prints bare lines. Lines are written through `tqdm.write`, so they never tear a
  progress bar on a terminal. A program's own results (flops' table, the report's summary) are
  its output, printed, not logged.

jax-free: the driver uses it too.
"""

from __future__ import annotations

import argparse
import os
import shlex
import logging
import signal
import sys
import threading
import time

LOGGER = "megascale_jax"
# Exit codes besides 0, read by the supervisor (supervise/detect.py).
EXIT_CONFIG_ERROR = 2  # bad input: every CLI's user_error
EXIT_DIVERGED = 3  # a non-finite loss, again when the step was replayed
EXIT_UNREADABLE_CHECKPOINT = 4  # one of several processes cannot read the newest checkpoint: a restart falls back
EXIT_NOT_SAVED = 5  # the run's final checkpoint could not be written (a full disk): a person frees space


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, but a mistake on the command line is one line and exit 2, like every other
    user error (argparse prints its usage first: up to a dozen lines before the one that matters)."""

    def error(self, message: str):
        print(error_line(f"{message} ({self.prog} --help lists the options)"), file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG_ERROR)


class StartupInterrupt:
    """Ctrl-C before a command's own handler is in place (its imports, JAX's start, compiling):
    one line and exit 130, at once. During the imports the process ends there and then; once the
    command's main() runs, the first SIGINT raises KeyboardInterrupt where Python can (the
    command's `except KeyboardInterrupt` says `line` and calls `reported`); a watchdog ends the
    process `GRACE_S` later if it is still starting: Python drops an exception raised inside a
    garbage-collection callback (JAX's `_xla_gc_callback`: "Exception ignored in ...", and start-up
    went on), and a compilation in XLA's C++ does not come back to Python for seconds. A second
    Ctrl-C ends the process at once."""

    GRACE_S = 2.0

    def __init__(self, line: str):
        self.line, self._reported, self._armed, self._raising = line, False, False, False

    def install(self) -> None:
        """From here a SIGINT ends the process at once (during imports no `except` could catch it)."""
        signal.signal(signal.SIGINT, self._on_sigint)
        self._unraisable = sys.unraisablehook
        sys.unraisablehook = self._drop_interrupt

    def _drop_interrupt(self, unraisable) -> None:
        """A KeyboardInterrupt Python could not raise (inside a weakref or gc callback) is not
        printed as "Exception ignored ... Traceback": the watchdog ends the start-up instead."""
        if not (self._armed and unraisable.exc_type is KeyboardInterrupt):
            self._unraisable(unraisable)

    def raise_from_here(self) -> None:
        """From here a SIGINT raises KeyboardInterrupt, for the command to say and to return 130."""
        self._raising = True

    def reported(self) -> None:
        """The command said the line itself: the watchdog, if armed, only ends the process."""
        self._reported = True

    def _on_sigint(self, signum, frame):
        if self._armed or not self._raising:
            self._end()
        self._armed = True
        threading.Thread(target=self._watch, daemon=True, name="startup-interrupt").start()
        raise KeyboardInterrupt

    def _watch(self) -> None:
        time.sleep(self.GRACE_S)
        self._end()

    def _end(self) -> None:
        if not self._reported:
            print(self.line, file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGINT)


def parse(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    return parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)


def user_error(message, code: int = EXIT_CONFIG_ERROR) -> int:
    """Report what the user must fix as one line; returns the exit code (2: bad input; the train
    CLI also uses EXIT_DIVERGED and EXIT_UNREADABLE_CHECKPOINT)."""
    print(error_line(message), file=sys.stderr, flush=True)
    return code


def error_line(message) -> str:
    """The line `user_error` prints for `message` (an exception or a string)."""
    return f"error: {message}"


def one_line(e: BaseException) -> str:
    """An exception as one line for a warning or a record: its type and first line."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def resume_command(module: str, argv: list[str], run_dir: str | None, default_run_dir: str) -> str | None:
    """The command that continues a run: None when the user named its `--run-dir` (their own
    command does), else their command with the run directory chosen for them added, since the same
    command would start a new `runs/<config>-<time>/`."""
    if run_dir is not None:
        return None
    return shlex.join(["python", "-m", module, *argv, "--run-dir", default_run_dir])


def interrupted(step: int | None, resume: str | None = None) -> str:
    """The last line of a run stopped by SIGINT/SIGTERM (`train` and `launch` both print it):
    `step` is the checkpoint it saved, None when none was saved; `resume` the command that
    continues the run where it is not the same command (`resume_command`)."""
    again = f"resume with: {resume}" if resume else "re-run the same command to resume"
    if step is None:
        return ("interrupted; no checkpoint saved (checkpoint.every=0, or the save failed: see above) — "
                + (f"{again} (from the newest older checkpoint, if any)" if resume
                   else "a re-run starts from the newest older checkpoint, if any"))
    return f"interrupted at step {step}; checkpoint saved — {again}"


class _TqdmHandler(logging.StreamHandler):
    """A stream handler that writes around any live tqdm progress bar."""

    def emit(self, record):
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # noqa: BLE001 — logging must never raise into the program
            self.handleError(record)


def setup_logging(rank: int = 0, processes: int = 1, quiet: bool = False) -> logging.Logger:
    """The `megascale_jax` logger, configured once per process (calling again reconfigures it).

    quiet: only warnings and errors (processes other than 0 of a training job, whose progress
    lines would repeat rank 0's)."""
    logger = logging.getLogger(LOGGER)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    tag = f"[rank {rank}] " if processes > 1 else ""
    formatter = logging.Formatter(tag.replace("%", "%%") + "%(message)s")
    out, err = _TqdmHandler(sys.stdout), _TqdmHandler(sys.stderr)
    out.addFilter(lambda r: r.levelno < logging.WARNING)
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    logger.propagate = False
    return logger


class _Tagged(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"{self.extra['tag']}{msg}", kwargs


def get_logger(name: str, tag: str = "") -> logging.LoggerAdapter:
    """A child of the `megascale_jax` logger (configured by `setup_logging`) whose lines start
    with `tag`, e.g. the driver's "[supervisor] "."""
    return _Tagged(logging.getLogger(f"{LOGGER}.{name}"), {"tag": tag})
