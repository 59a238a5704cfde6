"""SIGINT/SIGTERM end a run cleanly: finish the step in flight, checkpoint it, exit 130/143.

Ctrl-C at a terminal sends SIGINT; a cluster's preemption or `scancel` sends SIGTERM. Either
way the work since the last periodic checkpoint would be lost by dying on the spot, so the first
signal only asks the loop to stop; the loop finishes the step it dispatched, saves a checkpoint
of it and waits until that is committed. A second signal means "now": the process exits at
once (committed checkpoints are safe: they commit by an atomic rename).

With several processes every one must stop after the *same* step, or those that went on would
wait forever in the next step's collectives for those that stopped. Signals reach processes at
different moments, so each step every process contributes its own flag to a tiny all-reduce
(max over processes), dispatched right after the train step and read one step later, when it
has long finished: every process reads the same value at the same step, and the host never
waits on the devices for it. A single process needs no agreement and stops after the step in
flight.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _line_break() -> str:
    """A line break first on a terminal, where the progress bar holds the current line."""
    return "\n" if sys.stderr.isatty() else ""


class Interrupted(Exception):
    """The loop stopped on a signal after `step` (checkpoint saved when `saved`)."""

    def __init__(self, step: int, signum: int, saved: bool):
        super().__init__(f"interrupted at step {step}")
        self.step, self.signum, self.saved = step, signum, saved

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class StopRequest:
    """Installs the handlers (main thread only) and answers, once per step, "stop after this step?"."""

    def __init__(self, mesh: Mesh):
        self.signum = 0  # the first signal received, 0 while none
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        self.multi = jax.process_count() > 1
        if self.multi:
            devices = mesh.devices.flatten()
            flat = Mesh(devices, ("all",))
            self.sharding = NamedSharding(flat, P("all"))
            self.local = len([d for d in devices if d.process_index == jax.process_index()])
            self.shape = (len(devices),)
            # Compiled here, before the loop: the loop's first step must not time a compilation.
            self.agree = jax.jit(jnp.max, out_shardings=NamedSharding(flat, P())).lower(
                jax.ShapeDtypeStruct(self.shape, np.int32, sharding=self.sharding)).compile()
        self.in_flight = None  # the all-reduce dispatched at the previous step

    def _handle(self, signum, frame):
        if self.signum:
            print(f"{_line_break()}second signal ({signal.Signals(signum).name}): exiting now, without a checkpoint of the "
                  "step in flight", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        print(f"{_line_break()}{signal.Signals(signum).name} received: finishing the step in flight and saving a "
              "checkpoint (send it again to exit at once)", file=sys.stderr, flush=True)

    def after_dispatch(self) -> int:
        """Called once per step, right after it was dispatched, by every process: the signal to
        stop on after this step (agreed by all processes), or 0 to go on."""
        if not self.multi:
            return self.signum
        flags = np.full((self.local,), self.signum, np.int32)
        mine = self.agree(jax.make_array_from_process_local_data(self.sharding, flags, self.shape))
        agreed, self.in_flight = self.in_flight, mine
        return 0 if agreed is None else int(agreed)

    def close(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}
