"""Per-process phase timings in the run directory, and TensorBoard scalars.

Schema (one CSV per process, appended and line-flushed, so a hung or killed run keeps every row
it wrote):

``RUN_DIR/timings/process-<i>.csv``: ``step,process,device,dp,pp,tp,phase,start,duration``

* ``phase``: ``data_wait`` (waiting for the batch), ``dispatch`` (enqueuing the compiled step;
  its ``start`` is the moment the process *arrived* at the step; a zero-duration row is written
  as the dispatch starts and the full row when it returns, so a dispatch blocked behind a hung
  peer still shows the arrival), ``step`` (finish-to-finish time
  of the compiled forward+backward+optimizer step), ``checkpoint`` (blocking part of a save),
  ``eval``, and ``state:<name>`` (zero-duration marks where the loop entered a state:
  initialising, compiling, training, checkpointing, evaluating, done, failed).
* ``start`` is this process's wall clock (``time.time()``, seconds); clocks of different hosts
  differ, so readers estimate per-process offsets (`megascale_jax.observe.stragglers.clock_offsets`).
* The host loop measures phases per process, not per device: such rows carry
  ``device=dp=pp=tp=-1``, meaning "every mesh device of this process". Which devices those
  are is in ``RUN_DIR/timings/devices-<i>.csv``: ``process,host,device,dp,pp,tp`` (global
  device id and its mesh coordinates).
* Rows with ``device>=0`` come from profiled steps (``observe.profile_every``): per device
  ``device_compute`` (union of its compute ops), ``device_collective`` (union of its
  collectives: transfer plus waiting for peers) and ``device_span`` (first op to last), with the
  device's own ``dp,pp,tp``.

Rows are appended in the order they happen; a resumed run appends to the same file and a
later row of the same (process, step, phase) replaces an earlier one when read.
"""

from __future__ import annotations

import csv
import errno
import glob
import os
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np

from megascale_jax.run_dir import WarnOnce, tensorboard_dir, timings_dir
from megascale_jax.training.observers import LoopObserver

COLUMNS = ("step", "process", "device", "dp", "pp", "cp", "tp", "phase", "start", "duration")
DEVICE_COLUMNS = ("process", "host", "device", "dp", "pp", "cp", "tp")
# The mesh coordinates the tables carry, in the mesh's order. Tables written before the cp axis
# have no cp column: readers take cp 0 there (`coordinate`).
AXIS_COLUMNS = ("dp", "pp", "cp", "tp")
STATE_PREFIX = "state:"


# ============================================================================ writing


class TimingsWriter(LoopObserver):
    """Appends this process's phase rows to its CSV, one unbuffered write per row (a kill loses
    at most the row being written). A disk that stops taking rows (full) is one warning line;
    rows are dropped meanwhile, training goes on, and rows resume on a fresh line once it has room."""

    def __init__(self, run_dir: str, mesh, process: int, warn=print):
        from megascale_jax.parallel.mesh import process_device_coords  # the writer runs in a jax process

        self.process = process
        os.makedirs(timings_dir(run_dir), exist_ok=True)
        path = os.path.join(timings_dir(run_dir), f"process-{process}.csv")
        self.failures = WarnOnce(warn, path, "training goes on without its phase timings (the report and the "
                                             "straggler check miss those steps) until the disk has room")
        self.coords = {device: tuple(c[axis] for axis in AXIS_COLUMNS)
                       for device, c in process_device_coords(mesh, process)}
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.torn = False  # a row cut short by a full disk: the next row starts on a new line
        if os.fstat(self.fd).st_size == 0:
            self._write(",".join(COLUMNS) + "\n")
        try:
            write_device_table(run_dir, mesh, process)
        except OSError as e:
            self.failures.failed(e)

    def _write(self, row: str) -> None:
        data = (("\n" if self.torn else "") + row).encode()
        try:
            written = os.write(self.fd, data)
        except OSError as e:
            self.failures.failed(e)
            return
        self.torn = written < len(data)
        if self.torn:
            self.failures.failed(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        else:
            self.failures.wrote()

    def phase(self, step, name, start, duration):
        self._write(f"{step},{self.process},-1,-1,-1,-1,-1,{name},{start:.6f},{duration:.6f}\n")

    def device_phase(self, step, device, name, start, duration):
        coords = ",".join(map(str, self.coords.get(device, (-1,) * len(AXIS_COLUMNS))))
        self._write(f"{step},{self.process},{device},{coords},{name},{start:.6f},{duration:.6f}\n")

    def state(self, state, step, error=""):
        self.phase(step, STATE_PREFIX + state, time.time(), 0.0)

    def close(self):
        os.close(self.fd)


def coordinate(row: dict, axis: str) -> int:
    """A device row's coordinate on `axis` (0 for cp in a table written before the cp axis)."""
    return int(row.get(axis, 0 if axis == "cp" else -1))


def device_label(row: dict, with_cp: bool) -> str:
    """A device's mesh coordinates, e.g. "dp1 pp0 tp1" ("dp1 pp0 cp2 tp1" on a mesh with cp)."""
    return " ".join(f"{axis}{coordinate(row, axis)}" for axis in AXIS_COLUMNS if axis != "cp" or with_cp)


def write_device_table(run_dir: str, mesh, process: int) -> None:
    """This process's mesh devices with their (dp, pp, cp, tp) coordinates and host name."""
    from megascale_jax.parallel.mesh import process_device_coords

    host = socket.gethostname()
    with open(os.path.join(timings_dir(run_dir), f"devices-{process}.csv"), "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(DEVICE_COLUMNS)
        for device, coords in process_device_coords(mesh, process):
            out.writerow([process, host, device, *(coords[axis] for axis in AXIS_COLUMNS)])


class TensorBoardScalars(LoopObserver):
    """Loss, learning rate, grad norm, MFU, tokens/s and step time as TensorBoard scalars, and the
    downstream tasks' scores (`downstream/<task>/<metric>`) on the steps that have them.

    Written on the loop's thread with tensorboardX's synchronous `EventsWriter`, not its
    `SummaryWriter`: that one writes from a thread which dies on a full disk, after which its
    10-event queue fills and the next scalar blocks the loop for ever. A handful of small records
    per logged step costs microseconds here; the file is flushed every `FLUSH_S` seconds (a
    killed run keeps the scalars up to then) and on close. A disk that stops taking them is one
    warning line; scalars are dropped meanwhile and a new event file is tried every `RETRY_S`
    (the old one may end in a torn record, which TensorBoard's reader stops at)."""

    TAGS = ("loss", "val_loss", "lr", "grad_norm", "mfu", "tokens_per_s", "step_time_s", "data_wait_s")
    FLUSH_S = 10.0
    RETRY_S = 30.0

    def __init__(self, run_dir: str, warn=print):
        self.directory = tensorboard_dir(run_dir)
        self.failures = WarnOnce(warn, self.directory, "training goes on without its TensorBoard scalars until "
                                                       "the disk has room")
        self.events, self.scalar = tensorboard_writing()
        self.writer, self.opened = None, 0
        self.flushed_at = self.failed_at = -float("inf")
        self._open()

    def _open(self) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            # A name of this process's own: tensorboardX names files by the second and host only, and
            # a file reopened (a retry, a restart within the second) would truncate the one before.
            self.opened += 1
            self.writer = self.events.EventsWriter(os.path.join(self.directory, "events"),
                                                   filename_suffix=f".{os.getpid()}.{self.opened}")
        except OSError as e:
            self._failed(e)

    def _failed(self, e: OSError) -> None:
        self.failures.failed(e)
        self.failed_at = time.monotonic()
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer._py_recordio_writer._writer.close()  # what it holds is lost; close() would flush again
            except OSError:
                pass

    def record(self, record):
        now = time.monotonic()
        if self.writer is None and now - self.failed_at >= self.RETRY_S:
            self._open()
        if self.writer is None:
            return
        try:
            scalars = {f"train/{tag}": record[tag] for tag in self.TAGS
                       if record.get(tag) is not None}  # mfu is None where the peak FLOP/s is unknown (CPU)
            scalars.update({f"downstream/{key}": value for key, value in (record.get("downstream") or {}).items()})
            for tag, value in scalars.items():
                self.writer.write_event(self.events.event_pb2.Event(
                    wall_time=time.time(), step=record["step"], summary=self.scalar(tag, value)))
            if now - self.flushed_at >= self.FLUSH_S:
                self.writer.flush()
                self.flushed_at = now
                self.failures.wrote()
        except OSError as e:
            self._failed(e)

    def close(self):
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError as e:
                self._failed(e)


def tensorboard_writing():
    """tensorboardX's event-file module and its scalar summary, imported without torch.
    tensorboardX imports torch whenever it is installed, only to accept torch tensors: 4-5 s of
    CPU that rank 0 would pay on every start and restart. We log Python floats, so torch is
    hidden from that one import."""
    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles
    try:
        from tensorboardX import event_file_writer
        from tensorboardX.summary import scalar
    finally:
        if hidden:
            del sys.modules["torch"]
    return event_file_writer, scalar


def observers(cfg, run_dir: str, mesh, warn=print) -> list[LoopObserver]:
    """The timing and TensorBoard observers `cfg.observe` asks for on this process."""
    import jax  # here, so that reading timings (the report) never starts a JAX backend

    process = jax.process_index()
    found: list[LoopObserver] = []
    if cfg.observe.timings:
        found.append(TimingsWriter(run_dir, mesh, process, warn))
    if cfg.observe.tensorboard and process == 0:
        found.append(TensorBoardScalars(run_dir, warn))
    return found


# ============================================================================ reading


@dataclass
class Timings:
    """All processes' rows of one run, as column arrays, plus the device table."""

    step: np.ndarray
    process: np.ndarray
    device: np.ndarray  # -1 for host rows (every device of the process)
    phase: np.ndarray  # str
    start: np.ndarray
    duration: np.ndarray
    devices: list[dict]  # rows of devices-<i>.csv
    processes: list[int]

    def select(self, phase: str) -> np.ndarray:
        return self.phase == phase

    def device_matrix(self, phase: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Durations of a device phase as a (device, step) matrix (NaN where missing), its device
        ids and its steps."""
        mask = self.select(phase) & (self.device >= 0)
        devices, steps = np.unique(self.device[mask]), np.unique(self.step[mask])
        out = np.full((len(devices), len(steps)), np.nan)
        out[np.searchsorted(devices, self.device[mask]), np.searchsorted(steps, self.step[mask])] = self.duration[mask]
        return out, devices, steps

    def matrix(self, phase: str, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`values` of `phase` rows as a (process, step) matrix (NaN where missing) and its steps."""
        mask = self.select(phase)
        steps = np.unique(self.step[mask])
        out = np.full((len(self.processes), len(steps)), np.nan)
        rows = np.searchsorted(self.processes, self.process[mask])
        out[rows, np.searchsorted(steps, self.step[mask])] = values[mask]
        return out, steps

    def hosts(self) -> dict[int, str]:
        return {int(d["process"]): d["host"] for d in self.devices}

    def has_cp(self) -> bool:
        """Whether the mesh splits sequences over cp (a device beyond cp 0): labels then name it."""
        return any(coordinate(d, "cp") > 0 for d in self.devices)


def read_timings(run_dir: str, since: float = 0.0) -> Timings:
    """Read every process's CSV; a torn last line (killed mid-write) is skipped. With `since`,
    only rows that started at or after that wall time (the supervisor: this attempt's own rows;
    after a restart, process numbers and replayed steps would mix attempts)."""
    latest: dict[tuple, tuple] = {}
    for path in sorted(glob.glob(os.path.join(timings_dir(run_dir), "process-*.csv"))):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                try:
                    key = (int(row["step"]), int(row["process"]), int(row["device"]), row["phase"])
                    value = (float(row["start"]), float(row["duration"]))
                except (TypeError, ValueError):
                    continue
                if value[0] >= since:
                    latest[key] = value
    devices = []
    for path in sorted(glob.glob(os.path.join(timings_dir(run_dir), "devices-*.csv"))):
        with open(path, newline="") as f:
            devices += list(csv.DictReader(f))  # rewritten by every attempt: this attempt's
    keys = list(latest)
    values = np.array(list(latest.values()), dtype=float).reshape(-1, 2)
    process = np.array([k[1] for k in keys], dtype=int)
    return Timings(step=np.array([k[0] for k in keys], dtype=int), process=process,
                   device=np.array([k[2] for k in keys], dtype=int),
                   phase=np.array([k[3] for k in keys], dtype=object), start=values[:, 0],
                   duration=values[:, 1], devices=devices,
                   processes=sorted(set(process.tolist()) | {int(d["process"]) for d in devices}))
