"""A checkpoint that does not read back, seen from the reading side: what counts as damage, and
how it is told to the user in one line.

* `CorruptCheckpoint`: the files of a committed checkpoint cannot be read back or fail
  verification; `Checkpointer.restore_latest` then moves it aside and tries the previous one.
* `damage_is_corruption`: turns an error raised while reading into a CorruptCheckpoint — except
  `PROGRAMMING_ERRORS`, which mean the reading code is wrong, not the files, and propagate.
* `describe_read_error`: the array, file and reason of a failed TensorStore read, from the
  exception's cause chain (orbax's own message is several hundred characters of spec).
* `quiet_late_tensorstore_callbacks`: after one array of a restore fails, TensorStore's reads
  still in flight report into a closed event loop, and asyncio reports the failed reads nobody
  awaited; both are dropped, nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from typing import Callable

from megascale_jax import cli


class CorruptCheckpoint(Exception):
    """A committed checkpoint whose contents cannot be read back or fail verification."""


class ChecksumMismatch(CorruptCheckpoint):
    """Every array was read, and some differ from the checksums saved with them. The checksums of
    what was read are one compiled program over the global state whose results every process holds
    alike (integer sums, the same in any order), compared with the same saved meta: every process
    of the job reaches this verdict together, so all of them can fall back in-process."""


# Exceptions that mean the code reading a checkpoint is wrong (ours, or orbax as we call it), not
# the files: taken for corruption, they would move every good checkpoint aside one restart after
# another. They propagate as they are; damaged files raise OSError, ValueError or tensorstore's
# errors (checked by the damage tests).
PROGRAMMING_ERRORS = (TypeError, AttributeError, NameError, ImportError, AssertionError, NotImplementedError)


@contextlib.contextmanager
def damage_is_corruption(describe: Callable[[Exception], str]):
    """An error reading a checkpoint's files becomes CorruptCheckpoint(describe(error)), one line;
    a PROGRAMMING_ERRORS one propagates as it is."""
    try:
        yield
    except PROGRAMMING_ERRORS:
        raise
    except Exception as e:
        raise CorruptCheckpoint(describe(e)) from None


def describe_read_error(e: BaseException, step_dir: str) -> str:
    """The array and the file a failed read names, from TensorStore's nested message.

    TensorStore reports e.g. `OUT_OF_RANGE: Error opening "cast" driver: ... Error reading
    "opt_state.4.count/.zarray" in OCDBT database at local file ".../10/state/": Error reading
    Byte range [0, 29537) of local file ".../10/state/d/5f1...": Requested byte range ... is not
    valid [tensorstore_spec=...]` (several hundred characters): the user needs the array, the
    innermost file (relative to the checkpoint) and the innermost reason. Orbax may wrap it
    ("Encountered error while reading array index: ... See full TensorStore details: <bound method
    ... TensorStore({" and the spec over many lines) with TensorStore's error as the cause: the
    chain is searched for the first message that names an array or a file."""
    chain, seen = [], e
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    e = next((x for x in chain if re.search(r'(?:Error reading|Metadata at) "|file "', str(x))), e)
    text = str(e).strip().replace("\n", " ")
    code = re.match(r"([A-Z][A-Z_]+): ", text)
    text = re.split(r"\s*\[tensorstore_spec", text)[0]
    # The array: its zarr metadata (`params.embed/.zarray`) or one of its chunks (`params.embed/0.0`).
    array = re.search(r'(?:Error reading|Metadata at) "([^"]+?)/(?:\.z(?:array|attrs|group)|[0-9.]+)"', text)
    files = list(re.finditer(r'file "([^"]+)"', text))
    if not (array or files):
        return cli.one_line(e).split(" See full TensorStore details")[0]
    parts = []
    if array:
        parts.append(f"array {array.group(1)}")
    reason = ""
    if files:
        path = files[-1].group(1).rstrip("/")
        parts.append(f"file {os.path.relpath(path, step_dir) if path.startswith(step_dir) else path}")
        reason = text[files[-1].end():].lstrip(": ").strip()  # what the innermost error says of that file
    detail = "; ".join(x for x in ((code.group(1) if code else ""), reason[:120]) if x)
    return f"{', '.join(parts)}: {detail}" if detail else ", ".join(parts)


_FILTER_INSTALLED = False


def quiet_late_tensorstore_callbacks() -> None:
    """Drop two known-harmless tracebacks, keep every other unraisable exception and log record.

    When one array of a restore fails, orbax's asyncio.gather raises and its event loop closes
    while TensorStore still has the other reads in flight; as each completes, TensorStore calls
    `loop.call_soon_threadsafe` on the closed loop and reports the RuntimeError through
    sys.unraisablehook, from its own threads and possibly after restore returned: one 6-line
    traceback per pending read (~300 lines for a real model) after our one warning line. Reads
    that failed too but whose futures the aborted gather never awaited are reported by asyncio,
    when garbage-collected, as "Future exception was never retrieved" (or "Task exception ...",
    for orbax's own async_deserialize tasks) with TensorStore's whole JSON spec (logger
    "asyncio"); when the collector runs decides whether they appear at all. The read's own
    error is what we report, so both are noise.
    Installed once, process-wide."""
    global _FILTER_INSTALLED
    if _FILTER_INSTALLED:
        return
    _FILTER_INSTALLED = True
    previous = sys.unraisablehook

    def hook(unraisable):
        exc, tb = unraisable.exc_value, unraisable.exc_traceback
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and "call_soon_threadsafe" in frames:
            return
        previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_unretrieved_tensorstore_error)


def _unretrieved_tensorstore_error(record: logging.LogRecord) -> bool:
    """False (drop) for asyncio's report of a TensorStore read error nobody awaited."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (str(record.msg).startswith(("Future exception was never retrieved",
                                            "Task exception was never retrieved"))
                and isinstance(exc, ValueError) and "tensorstore_spec" in str(exc))
