"""Clock offsets between processes and straggler detection from the phase timings.

SPMD steps run in lockstep: a collective makes every rank wait for the slowest, so a slow rank
does not have a longer step than its peers. What differs is when each process *arrives* at a
step (the start of its ``dispatch`` row): a slow host arrives late and the others wait for it.

* Clock offsets: a step's final collective ends at one moment for every process, and a process
  blocked on it sees its ``step`` row end right then; so, per process, the median over steps of
  (its step end − the median step end of all processes) is its clock offset. A rank that is so
  slow that it never waits sees its steps end when it gets round to fetching them; its offset
  then absorbs part of its lateness (it is still flagged, with a smaller lateness). Processes on
  one host share one clock, so they get their host's median offset — on a single host, none.
* Lateness of rank p at step k: its corrected arrival minus the median arrival of its peers,
  as a fraction of the median step time of the window. A window's statistic is the median over
  its steps — robust to the odd hiccup — and a rank is flagged when it is ≥ `threshold`, i.e.
  it was late by that much at more than half of the window's steps.
* A device that computes slowly but whose host dispatches on time is invisible to lateness; in
  profiled steps (`observe.profile_every`) its compute time shows it (`slow_devices`).
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from megascale_jax import run_dir as run_dirs
from megascale_jax.observe.timings import AXIS_COLUMNS, Timings, coordinate, device_label, read_timings
from megascale_jax.run_dir import append_jsonl, read_jsonl


def clock_offsets(t: Timings) -> np.ndarray:
    """Seconds to subtract from each process's times (in `t.processes` order) to put them on
    process 0's clock. 0 for a process without any finished step."""
    ends, _ = t.matrix("step", t.start + t.duration)
    if ends.size == 0:
        return np.zeros(len(t.processes))
    reference = _nanmedian(ends, axis=0)
    offsets = np.nan_to_num(_nanmedian(ends - reference, axis=1))
    # Processes on one host read one clock: they share their host's (median) offset. Left per
    # process, the estimate would absorb part of a slow process's lateness.
    hosts = t.hosts()
    for host in set(hosts.values()):
        same = [i for i, p in enumerate(t.processes) if hosts.get(p) == host]
        offsets[same] = np.median(offsets[same])
    return offsets - offsets[0]


def arrival_lateness(t: Timings, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(process × step) seconds each process arrived after the median of its peers, and the steps."""
    corrected = t.start - offsets[np.searchsorted(t.processes, t.process)]
    arrivals, steps = t.matrix("dispatch", corrected)
    lateness = np.full_like(arrivals, np.nan)
    for p in range(len(arrivals)):
        if len(arrivals) > 1:
            lateness[p] = arrivals[p] - _nanmedian(np.delete(arrivals, p, axis=0), axis=0)
    return lateness, steps


def step_windows(steps: np.ndarray, window: int) -> list[np.ndarray]:
    """Boolean masks over `steps` of consecutive windows (1..w, w+1..2w, ...); the last may be partial."""
    if len(steps) == 0:
        return []
    index = (steps - 1) // window
    return [index == i for i in np.unique(index)]


def trailing_windows(steps: np.ndarray, window: int) -> list[np.ndarray]:
    """The first window (warm-up, never judged) and the last `window` steps, once they are past it.

    What the supervisor judges: a rank that turns slow is flagged once it was late at most of the
    last `window` steps, wherever the slow-down began. Fixed windows wait for the end of the
    window holding the majority of late steps: on average 10.5 late steps for a window of 10,
    against 6 here."""
    blocks = step_windows(steps, window)
    if not blocks:
        return []
    last = steps > steps.max() - window
    return [blocks[0]] + ([last] if steps[last].min() > steps[blocks[0]].max() else [])


def window_lateness(t: Timings, offsets: np.ndarray, window: int, trailing: bool = False) -> list[dict]:
    """Per step window (consecutive ones; with `trailing`, the first and the last `window` steps):
    its steps, the median step time, and each rank's median lateness fraction."""
    lateness, steps = arrival_lateness(t, offsets)
    durations, duration_steps = t.matrix("step", t.duration)
    out = []
    for mask in (trailing_windows if trailing else step_windows)(steps, window):
        in_window = np.isin(duration_steps, steps[mask])
        step_time = float(_nanmedian(durations[:, in_window], axis=None))
        out.append({"first_step": int(steps[mask][0]), "last_step": int(steps[mask][-1]),
                    "step_time_s": step_time,
                    "lateness": _nanmedian(lateness[:, mask], axis=1) / step_time})
    return out


def find_stragglers(run_dir: str | Timings, threshold: float = 0.05, window: int = 20,
                    trailing: bool = False) -> list[dict]:
    """Ranks (processes) whose median arrival lateness over a step window is ≥ `threshold` of
    the step time: one dict per (rank, window), oldest window first; with `trailing`, over the
    last `window` steps only (the supervisor's live check)."""
    t = read_timings(run_dir) if isinstance(run_dir, str) else run_dir
    return flag_stragglers(t, window_lateness(t, clock_offsets(t), window, trailing), threshold)


def flag_slow_devices(t: Timings, threshold: float) -> list[dict]:
    """`slow_devices` with each device's rank (process), host, mesh coordinates and their label
    (naming cp on a mesh with cp, for every device alike)."""
    table, with_cp = {int(d["device"]): d for d in t.devices}, t.has_cp()
    out = []
    for device, excess in slow_devices(t, threshold):
        row = table.get(device, {})
        out.append({"device": device, "rank": int(row.get("process", -1)), "host": row.get("host", "?"),
                    **{axis: coordinate(row, axis) for axis in AXIS_COLUMNS}, "coords": device_label(row, with_cp),
                    "excess": round(excess, 4), "threshold": threshold})
    return out


def flag_stragglers(t: Timings, windows: list[dict], threshold: float) -> list[dict]:
    """The (rank, window) pairs at or above `threshold`. The run's first window is warm-up (first
    executions, process 0 starting its writers) and is not judged, by the report or the supervisor."""
    hosts = t.hosts()
    return [{"rank": rank, "host": hosts.get(rank, "?"), "first_step": w["first_step"],
             "last_step": w["last_step"], "lateness": round(float(late), 4), "threshold": threshold}
            for w in windows[1:] for rank, late in zip(t.processes, w["lateness"]) if late >= threshold]


def append_events(run_dir: str, stragglers: list[dict]) -> None:
    """Append one ``kind: straggler`` line per flagged (rank, window) to RUN_DIR/events.jsonl for
    the supervisor; windows already recorded there are not repeated."""
    path = run_dirs.events_path(run_dir)
    seen = {(e.get("rank"), e.get("first_step"), e.get("last_step"))
            for e in read_jsonl(path) if e.get("kind") == "straggler"}
    new = [s for s in stragglers if (s["rank"], s["first_step"], s["last_step"]) not in seen]
    append_jsonl(path, [{"time": time.time(), "kind": "straggler", **s} for s in new])


def slow_devices(t: Timings, threshold: float) -> list[tuple[int, float]]:
    """(device id, excess) of devices whose median compute time over the profiled steps exceeds
    the median device's by more than `threshold` (e.g. 0.3 = 30% slower)."""
    compute, devices, _ = t.device_matrix("device_compute")
    if devices.size < 2:
        return []
    per_device = np.nanmedian(compute, axis=1)
    excess = per_device / np.median(per_device) - 1
    return [(int(d), float(x)) for d, x in zip(devices, excess) if x > threshold]


def _nanmedian(a: np.ndarray, axis: int | None) -> np.ndarray:
    """np.nanmedian without the all-NaN warning (such slices stay NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(a, axis=axis)
