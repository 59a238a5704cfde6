"""Test and drill support: make one process a straggler or make it hang, from the environment.

* ``MEGASCALE_FAULT_SLOW="<process>:<fraction>"`` — that process sleeps, right before it
  dispatches each step, `fraction` times its recent step time: it arrives late at every step,
  like a host with a slow CPU or data loader.
  ``MEGASCALE_FAULT_SLOW="usr2:<fraction>"``: every process, once it receives SIGUSR2.
* ``MEGASCALE_FAULT_STOP="<process>:<step>"`` — that process finishes the steps it has in flight,
  then sends itself SIGSTOP right before dispatching `step`: a host that hung between steps; its
  peers finish the earlier steps and block in `step`'s collectives.
* ``MEGASCALE_FAULT_ABORT="<process>:<step>"`` — that process prints a glog-style fatal line and
  aborts (SIGABRT) right before dispatching `step`, every time it gets there: a native crash
  that repeats deterministically, like an XLA check failure.
* ``MEGASCALE_FAULT_WEDGE="<process>:<step>"`` — that process's training loop deadlocks right
  before it dispatches `step` (its main thread waits on a lock it holds), while all its other
  threads go on: its heartbeats to Redis and to JAX's coordination service keep beating, only the
  step stops. Its peers block in `step`'s collectives, their threads alive too: a hang that no
  heartbeat's silence shows, only the steps' (supervise/detect.py's stall; under SLURM,
  supervise/watch.py). ``MEGASCALE_FAULT_WEDGE="usr1"``: every process, before its next step
  after a SIGUSR1 (a wedge at a moment, once: a restarted process is not wedged again; not
  together with ``MEGASCALE_FAULT_NAN="usr1"``, which takes the same signal).

* ``MEGASCALE_FAULT_HOLD="<process>:<step>"`` — that process waits, up to `HOLD_LIMIT_S`, right
  before it dispatches `step`: armed by the driver for a drill that fires when the heartbeats
  report `step - 2` (a step is reported once its record is made, one step late), so the drill's
  kill lands there and not steps later on a loaded machine, where the driver's poll lags a fast run.

* ``MEGASCALE_FAULT_NAN="<process>:<step>"`` — that process corrupts one token of its share of
  `step`'s batch, the first time the step runs: an id past the vocabulary, whose embedding
  lookup is NaN (`jnp.take` fills out-of-range rows with NaN), like a flipped bit in one device's
  activations. The replay of the step (training/triage.py) runs on the clean batch.
  ``MEGASCALE_FAULT_NAN="usr1"``: every process corrupts its next batch after each SIGUSR1.

Nothing here runs unless the variables are set; never set them in production.
"""

from __future__ import annotations

import os
import signal
import time

from megascale_jax.training.observers import LoopObserver


class SlowProcess(LoopObserver):
    """Sleeps `fraction` × the median of the last few step times before each dispatch (when
    `on_signal`, only after a SIGUSR2)."""

    def __init__(self, fraction: float, on_signal: bool = False):
        self.fraction, self.active = fraction, not on_signal
        self.recent: list[float] = []
        if on_signal:
            signal.signal(signal.SIGUSR2, self.activate)

    def activate(self, *_):
        self.active = True

    def phase(self, step, name, start, duration):
        if name == "step":
            self.recent = (self.recent + [duration])[-5:]

    def before_step(self, step):
        if self.recent and self.active:
            time.sleep(self.fraction * sorted(self.recent)[len(self.recent) // 2])


class StopProcess(LoopObserver):
    """Stops the process once every step it dispatched has finished. Stopping it mid-step instead
    could freeze a collective half-sent, and where its peers then block would depend on timing
    (the test of the hang report needs one place: the peers wait in `step`, not before it)."""

    def __init__(self, step: int):
        self.step = step

    def before_step(self, step):
        if step == self.step:
            import jax

            jax.block_until_ready(jax.live_arrays())
            os.kill(os.getpid(), signal.SIGSTOP)


class WedgeProcess(LoopObserver):
    """Deadlocks the training loop before dispatching `step` (step None: before the next step
    after a SIGUSR1). A lock acquired twice, as a Python deadlock in the step would: the wait
    releases the GIL, so the heartbeat threads and JAX's own go on, and a signal's handler runs and
    returns to the wait (SIGTERM's stop request is never acted on: only SIGKILL ends it)."""

    def __init__(self, step: int | None):
        self.step, self.armed = step, False
        if step is None:
            signal.signal(signal.SIGUSR1, self.arm)

    def arm(self, *_):
        self.armed = True

    def before_step(self, step):
        if self.armed if self.step is None else step == self.step:
            import sys
            import threading

            print(f"wedged before step {step} (MEGASCALE_FAULT_WEDGE): the training loop waits forever, its threads "
                  "go on", file=sys.stderr, flush=True)
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()


HOLD_LIMIT_S = 60.0


class HoldProcess(LoopObserver):
    """Waits before dispatching `step` (the driver's drill ends it meanwhile), then goes on."""

    def __init__(self, step: int, limit_s: float = HOLD_LIMIT_S, sleep=time.sleep):
        self.step, self.limit_s, self.sleep = step, limit_s, sleep

    def before_step(self, step):
        if step == self.step:
            self.sleep(self.limit_s)


class AbortProcess(LoopObserver):
    def __init__(self, step: int):
        self.step = step

    def before_step(self, step):
        if step == self.step:
            import sys
            import faulthandler
            import time as _time

            # glog's format (severity+date, time, thread, file:line), as XLA's check failures print it.
            now = _time.time()
            stamp = _time.strftime("%m%d %H:%M:%S", _time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
            print(f"F{stamp} {os.getpid():7d} faults.py:1] injected abort before step {step} "
                  "(MEGASCALE_FAULT_ABORT)", file=sys.stderr, flush=True)
            print("*** Check failure stack trace: ***\n    @     0x7f0000001234  abort\n"
                  "    @     0x7f0000005678  (unknown)", file=sys.stderr, flush=True)
            # The Python stack dump a real abort prints after the frames. This thread's only:
            # walking the other threads' frames while XLA's threads run can itself segfault, and
            # the process then dies by SIGSEGV instead of the SIGABRT being injected (a flaky
            # test_a_deterministic_native_crash_is_given_up_after_the_second_time saw -11 once).
            faulthandler.enable(all_threads=False)
            os.abort()


class NanBatch:
    """At `step` once, or (step None) at the next step after each SIGUSR1."""

    def __init__(self, step: int | None, vocab: int):
        self.step, self.vocab, self.fired, self.armed = step, vocab, False, False
        if step is None:
            signal.signal(signal.SIGUSR1, self.arm)

    def arm(self, *_):
        self.armed = True

    def __call__(self, step: int, batch):
        if not (self.armed if self.step is None else step == self.step and not self.fired):
            return batch
        import jax
        import numpy as np

        self.fired, self.armed = True, False
        shards = [s.data for s in batch.addressable_shards]
        bad = np.array(shards[0])
        bad.flat[0] = self.vocab
        shards[0] = jax.device_put(bad, shards[0].devices().pop())  # one device only: a local fault
        return jax.make_array_from_single_device_arrays(batch.shape, batch.sharding, shards)


def _target(variable: str, process: int) -> str | None:
    """The value after "<process>:" in `variable` when it names this process."""
    spec = os.environ.get(variable)
    if not spec:
        return None
    target, _, value = spec.partition(":")
    return value if int(target) == process else None


def from_env() -> list[LoopObserver]:
    """The faults the environment asks this process to inject (usually none)."""
    import jax

    process = jax.process_index()
    found: list[LoopObserver] = []
    if (spec := os.environ.get("MEGASCALE_FAULT_SLOW", "")).startswith("usr2:"):
        found.append(SlowProcess(float(spec[5:]), on_signal=True))
    elif (fraction := _target("MEGASCALE_FAULT_SLOW", process)) is not None:
        found.append(SlowProcess(float(fraction)))
    if (step := _target("MEGASCALE_FAULT_STOP", process)) is not None:
        found.append(StopProcess(int(step)))
    if (step := _target("MEGASCALE_FAULT_ABORT", process)) is not None:
        found.append(AbortProcess(int(step)))
    if (step := _target("MEGASCALE_FAULT_HOLD", process)) is not None:
        found.append(HoldProcess(int(step)))
    if os.environ.get("MEGASCALE_FAULT_WEDGE") == "usr1":
        found.append(WedgeProcess(None))
    elif (step := _target("MEGASCALE_FAULT_WEDGE", process)) is not None:
        found.append(WedgeProcess(int(step)))
    return found


def batch_fault_from_env(vocab: int):
    """(step, batch) -> the batch to dispatch: `MEGASCALE_FAULT_NAN`'s corruption, else the batch."""
    import jax

    if os.environ.get("MEGASCALE_FAULT_NAN") == "usr1":
        return NanBatch(None, vocab)
    if (step := _target("MEGASCALE_FAULT_NAN", jax.process_index())) is not None:
        return NanBatch(int(step), vocab)
    return lambda step, batch: batch
