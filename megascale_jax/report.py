"""``python -m megascale_jax.report RUN_DIR``: the run's timings as pictures, one trace and a verdict.

Writes ``RUN_DIR/report/``:

* ``heatmap.png`` — ranks × steps: arrival lateness (% of the median step time) and step time;
  ``heatmap.csv`` holds the lateness matrix behind it.
* ``trace.json`` — Chrome/Perfetto trace of every process on process 0's clock (offsets
  estimated from the step ends): pid = rank, one track per phase, loop states as instants.
* ``parallel_view.txt`` / ``parallel_view.png`` — the (dp, pp, tp) mesh per step window, each
  device marked ok / slow / hung / waiting with its rank and host.
* ``throughput.png`` — tokens/s and MFU over steps (from metrics.jsonl).
* ``device_heatmap.png`` / ``.csv`` — devices × profiled steps: compute and collective seconds
  (runs with ``observe.profile_every``); slow devices are named in the summary.
* ``summary.txt`` — stragglers, hung ranks, clock offsets; also printed.

Flagged stragglers are appended to ``RUN_DIR/events.jsonl`` (kind "straggler") for the supervisor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

from megascale_jax.config import ObserveConfig, from_dict  # noqa: E402
from megascale_jax.hangs import RankState, rank_states  # noqa: E402
from megascale_jax.stragglers import (append_events, arrival_lateness, clock_offsets,  # noqa: E402
                                      flag_stragglers, slow_devices, window_lateness)
from megascale_jax.timings import STATE_PREFIX, Timings, read_timings  # noqa: E402

STATUSES = ("ok", "slow", "waiting", "hung")
STATUS_COLOURS = ("#7fbf7f", "#f0a030", "#9fb7d9", "#d62728")
MAX_VIEW_WINDOWS = 6  # the PNG shows the most recent windows; the text shows all


# ============================================================================ pictures


def write_heatmap(t: Timings, offsets: np.ndarray, out: str) -> None:
    lateness, steps = arrival_lateness(t, offsets)
    durations, duration_steps = t.matrix("step", t.duration)
    fraction = lateness / np.nanmedian(durations) if durations.size else lateness
    np.savetxt(os.path.join(out, "heatmap.csv"), fraction, delimiter=",", fmt="%.5f",
               header="arrival lateness / median step time; rows = ranks "
                      f"{t.processes}; columns = steps {steps.min(initial=0)}..{steps.max(initial=0)}")
    fig, axes = plt.subplots(2, 1, figsize=(10, 2 + 0.5 * len(t.processes)), sharex=True, squeeze=True)
    for ax, matrix, xs, label, cmap in ((axes[0], 100 * fraction, steps, "lateness, % of step", "RdBu_r"),
                                        (axes[1], durations, duration_steps, "step time, s", "viridis")):
        if np.isnan(matrix).all():
            continue
        # A robust colour range: the first steps after compiling can be seconds apart.
        high = 2 * np.nanpercentile(np.abs(matrix), 75)
        image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap=cmap,
                          vmin=-high if cmap == "RdBu_r" else None, vmax=high,
                          extent=(xs[0] - 0.5, xs[-1] + 0.5, len(t.processes) - 0.5, -0.5))
        ax.set_yticks(range(len(t.processes)), [f"rank {p}" for p in t.processes])
        fig.colorbar(image, ax=ax, label=label)
    axes[1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "heatmap.png"), dpi=100)
    plt.close(fig)


def device_labels(t: Timings, devices: np.ndarray) -> list[str]:
    coords = {int(d["device"]): f"dp{d['dp']} pp{d['pp']} tp{d['tp']}" for d in t.devices}
    return [f"device {d} ({coords.get(int(d), '?')})" for d in devices]


def write_device_heatmap(t: Timings, out: str) -> bool:
    """devices × profiled steps: compute and collective seconds (`observe.profile_every`)."""
    compute, devices, steps = t.device_matrix("device_compute")
    if not devices.size:
        return False
    collective, _, _ = t.device_matrix("device_collective")
    np.savetxt(os.path.join(out, "device_heatmap.csv"), compute, delimiter=",", fmt="%.6f",
               header=f"device compute seconds; rows = devices {devices.tolist()}; columns = steps {steps.tolist()}")
    fig, axes = plt.subplots(1, 2, figsize=(10, 1.5 + 0.35 * len(devices)), sharey=True, squeeze=True)
    for ax, matrix, label in ((axes[0], compute, "compute, s"), (axes[1], collective, "collectives, s")):
        image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_xticks(range(len(steps)), [str(x) for x in steps])
        ax.set_xlabel("profiled step")
        fig.colorbar(image, ax=ax, label=label)
    axes[0].set_yticks(range(len(devices)), device_labels(t, devices))
    fig.tight_layout()
    fig.savefig(os.path.join(out, "device_heatmap.png"), dpi=100)
    plt.close(fig)
    return True


def write_throughput(run_dir: str, out: str) -> bool:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r["step"] for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    top.plot(steps, [r["tokens_per_s"] for r in records])
    top.set_ylabel("tokens/s")
    mfu = [r.get("mfu") for r in records]
    if any(m is not None for m in mfu):
        bottom.plot(steps, [100 * m if m is not None else np.nan for m in mfu])
    else:
        bottom.text(0.5, 0.5, "MFU unknown (no peak FLOP/s for this device)", ha="center", transform=bottom.transAxes)
    bottom.set_ylabel("MFU, %")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "throughput.png"), dpi=100)
    plt.close(fig)
    return True


# ============================================================================ trace


def chrome_trace(t: Timings, offsets: np.ndarray) -> dict:
    """Every row as a trace event in µs since the first one, on process 0's clock."""
    hosts = t.hosts()
    corrected = t.start - offsets[np.searchsorted(t.processes, t.process)]
    origin = corrected.min() if corrected.size else 0.0
    tracks = sorted({p for p in t.phase if not p.startswith(STATE_PREFIX)}) + ["state"]
    events = []
    for p in t.processes:
        events.append({"ph": "M", "name": "process_name", "pid": p, "args": {"name": f"rank {p} ({hosts.get(p, '?')})"}})
        events += [{"ph": "M", "name": "thread_name", "pid": p, "tid": i, "args": {"name": name}}
                   for i, name in enumerate(tracks)]
    timed = []
    for i in range(len(t.step)):
        ts = round((corrected[i] - origin) * 1e6, 1)
        args = {"step": int(t.step[i])}
        if t.phase[i].startswith(STATE_PREFIX):
            timed.append({"ph": "i", "s": "t", "name": t.phase[i][len(STATE_PREFIX):], "pid": int(t.process[i]),
                          "tid": tracks.index("state"), "ts": ts, "args": args})
        else:
            timed.append({"ph": "X", "name": t.phase[i], "pid": int(t.process[i]), "tid": tracks.index(t.phase[i]),
                          "ts": ts, "dur": round(t.duration[i] * 1e6, 1), "args": args})
    timed.sort(key=lambda e: (e["pid"], e["tid"], e["ts"]))
    return {"traceEvents": events + timed, "displayTimeUnit": "ms"}


# ============================================================================ 3D-parallel view


def view_statuses(windows: list[dict], t: Timings, states: list[RankState], threshold: float) -> list[dict[int, str]]:
    """Per window, each rank's status: slow when flagged there; in the last window of a stalled
    run, hung or waiting."""
    out = [{p: "slow" if late >= threshold else "ok" for p, late in zip(t.processes, w["lateness"])}
           for w in windows]
    if out and any(s.status in ("hung", "waiting") for s in states):
        out[-1].update({s.rank: s.status for s in states if s.status in ("hung", "waiting")})
    return out


def mesh_grid(t: Timings) -> np.ndarray:
    """(dp, pp, tp) array of the rank holding each mesh device (-1 where unknown)."""
    coords = np.array([[int(d[k]) for k in ("dp", "pp", "tp", "process")] for d in t.devices]).reshape(-1, 4)
    grid = np.full(tuple(coords[:, :3].max(axis=0, initial=0) + 1), -1)
    grid[coords[:, 0], coords[:, 1], coords[:, 2]] = coords[:, 3]
    return grid


def parallel_view_text(windows: list[dict], statuses: list[dict[int, str]], grid: np.ndarray,
                       hosts: dict[int, str]) -> str:
    dp, pp, tp = grid.shape
    lines = [f"mesh dp={dp} pp={pp} tp={tp}; cell = rank:status", ""]
    for w, status in zip(windows, statuses):
        lines.append(f"steps {w['first_step']}-{w['last_step']} (median step {w['step_time_s']:.3f} s)")
        for stage in range(pp):
            lines.append(f"  pp={stage}  " + "".join(f"{f'tp={j}':>12}" for j in range(tp)))
            for i in range(dp):
                cells = [f"r{r}:{status.get(r, '?')}" if r >= 0 else "-" for r in grid[i, stage]]
                lines.append(f"  dp={i:<4}" + "".join(f"{c:>12}" for c in cells))
        lines.append("")
    lines += [f"rank {r}: host {h}" for r, h in sorted(hosts.items())]
    return "\n".join(lines) + "\n"


def write_parallel_view_png(windows: list[dict], statuses: list[dict[int, str]], grid: np.ndarray, out: str) -> None:
    shown = list(zip(windows, statuses))[-MAX_VIEW_WINDOWS:]
    dp, pp, tp = grid.shape
    fig, axes = plt.subplots(len(shown), pp, figsize=(1 + 2.5 * pp * max(1, tp / 4), 0.6 + 1.8 * len(shown)),
                             squeeze=False)
    cmap = ListedColormap(STATUS_COLOURS)
    for row, (w, status) in enumerate(shown):
        for stage in range(pp):
            ax = axes[row, stage]
            ranks = grid[:, stage, :]
            codes = np.vectorize(lambda r: STATUSES.index(status.get(r, "ok")))(ranks)
            ax.imshow(codes, cmap=cmap, vmin=-0.5, vmax=len(STATUSES) - 0.5, aspect="auto")
            if ranks.size <= 256:
                for (i, j), r in np.ndenumerate(ranks):
                    ax.text(j, i, f"r{r}\n{status.get(r, 'ok')}", ha="center", va="center", fontsize=7)
            ax.set_title(f"steps {w['first_step']}-{w['last_step']}, pp={stage}", fontsize=8)
            ax.set_xticks(range(tp), [f"tp{j}" for j in range(tp)], fontsize=7)
            ax.set_yticks(range(dp), [f"dp{i}" for i in range(dp)], fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "parallel_view.png"), dpi=100)
    plt.close(fig)


# ============================================================================ summary and CLI


def summary_text(run_dir, t, offsets, stragglers, states, threshold, window) -> str:
    durations = t.duration[t.select("step")]
    steps = t.step[t.select("step")]
    lines = [f"run {run_dir}: {len(t.processes)} process(es) on {sorted(set(t.hosts().values()))}",
             f"steps {steps.min()}-{steps.max()}, median step time {np.median(durations):.4f} s" if steps.size
             else "no finished step",
             "clock offsets vs rank 0 (s): " + ", ".join(f"rank {p}: {o:+.4f}" for p, o in zip(t.processes, offsets)),
             "", f"stragglers (median arrival lateness >= {threshold:.0%} of the step over {window}-step windows):"]
    by_rank: dict[int, list[dict]] = {}
    for s in stragglers:
        by_rank.setdefault(s["rank"], []).append(s)
    for rank, flagged in sorted(by_rank.items()):
        worst = max(s["lateness"] for s in flagged)
        spans = ", ".join(f"{s['first_step']}-{s['last_step']}" for s in flagged)
        lines.append(f"  STRAGGLER rank {rank} on {flagged[0]['host']}: late by up to {worst:.1%} of the step "
                     f"in steps {spans}")
    if not by_rank:
        lines.append("  none")
    compute, devices, profiled = t.device_matrix("device_compute")
    if devices.size:
        slow = slow_devices(t, threshold)
        lines += ["", f"device compute ({len(devices)} devices, profiled steps {profiled.tolist()}; "
                      f"median {np.nanmedian(compute):.4f} s per step):"]
        lines += [f"  SLOW DEVICE {label}: compute {x:+.1%} vs the median device"
                  for label, x in zip(device_labels(t, [d for d, _ in slow]), [x for _, x in slow])] or ["  none slow"]
    hung = [s for s in states if s.status == "hung"]
    waiting = [s for s in states if s.status == "waiting"]
    verdict = ("finished" if all(s.status == "done" for s in states) else
               f"HUNG: rank(s) {[s.rank for s in hung]} never arrived; the others wait for them" if hung else
               "stalled with every rank at the same point (a hang inside the step, on the devices)" if waiting else
               "failed" if any(s.status == "failed" for s in states) else "running")
    lines += ["", f"run state: {verdict}"] + [f"  {s.describe()}" for s in states]
    return "\n".join(lines) + "\n"


def observe_settings(run_dir: str) -> ObserveConfig:
    """The run's observe.* settings (defaults for runs without them)."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return ObserveConfig()
    with open(path) as f:
        return from_dict(yaml.safe_load(f) or {}).observe


def write_report(run_dir: str, threshold: float | None = None, window: int | None = None,
                 hang_after: float | None = None) -> str:
    """Write RUN_DIR/report/ and return the summary text."""
    settings = observe_settings(run_dir)
    threshold = settings.straggler_threshold if threshold is None else threshold
    window = settings.straggler_window if window is None else window
    t = read_timings(run_dir)
    if len(t.step) == 0:
        raise SystemExit(f"error: no timings under {run_dir}/timings; run with observe.timings=true")
    out = os.path.join(run_dir, "report")
    os.makedirs(out, exist_ok=True)
    offsets = clock_offsets(t)
    durations = t.duration[t.select("step")]
    if hang_after is None:  # silent for this long = stalled; generous, as a checkpoint may run long
        hang_after = max(60.0, 20 * float(np.median(durations))) if durations.size else 60.0
    states = rank_states(t, time.time(), hang_after)
    windows = window_lateness(t, offsets, window)
    stragglers = flag_stragglers(t, windows, threshold)
    append_events(run_dir, stragglers)

    write_heatmap(t, offsets, out)
    write_device_heatmap(t, out)
    with open(os.path.join(out, "trace.json"), "w") as f:
        json.dump(chrome_trace(t, offsets), f)
    statuses = view_statuses(windows, t, states, threshold)
    grid = mesh_grid(t)
    with open(os.path.join(out, "parallel_view.txt"), "w") as f:
        f.write(parallel_view_text(windows, statuses, grid, t.hosts()))
    write_parallel_view_png(windows, statuses, grid, out)
    write_throughput(run_dir, out)
    summary = summary_text(run_dir, t, offsets, stragglers, states, threshold, window)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(summary)
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megascale_jax.report", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--threshold", type=float, help="straggler lateness, fraction of the step (default: observe.straggler_threshold)")
    parser.add_argument("--window", type=int, help="steps per window (default: observe.straggler_window)")
    parser.add_argument("--hang-after", type=float, help="seconds without any row before a run counts as stalled "
                                                         "(default: max(60, 20 median steps))")
    args = parser.parse_intermixed_args(argv)
    if not os.path.isdir(args.run_dir):
        print(f"error: run directory {args.run_dir} does not exist", file=sys.stderr)
        return 2
    print(write_report(args.run_dir, args.threshold, args.window, args.hang_after), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
