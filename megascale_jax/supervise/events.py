"""The record of a supervised run: `RUN_DIR/events.jsonl`, one JSON line per event (a fault, a
restart, a drill, a diagnosis...), each also printed as one `[supervisor] kind: summary` line.

The driver's modules (supervisor, detect, transport) and preflight write through it; `report`
and the tests read the file back, so an event's kind and fields are part of the interface.
"""

from __future__ import annotations

import time

from megascale_jax import run_dir as run_dirs
from megascale_jax.cli import get_logger

log = get_logger("supervise", tag="[supervisor] ")


class EventLog:
    """RUN_DIR/events.jsonl plus one printed line per event."""

    def __init__(self, run_dir: str):
        self.path = run_dirs.events_path(run_dir)

    def log(self, kind: str, summary: str, **fields) -> dict:
        record = {"time": time.time(), "kind": kind, **fields, "summary": summary}
        run_dirs.append_jsonl(self.path, [record], log.warning)  # a full disk does not stop the supervisor
        log.info(f"{kind}: {summary}")
        return record
