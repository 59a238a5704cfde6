"""``python -m megascale_jax.report RUN_DIR``: the run's timings as pictures, one trace and a verdict.

Writes ``RUN_DIR/report/``:

* ``heatmap.png`` — ranks × steps: arrival lateness (% of the median step time) and step time;
  ``heatmap.csv`` holds the lateness matrix behind it.
* ``trace.json`` — Chrome/Perfetto trace of every process on process 0's clock (offsets
  estimated from the step ends): pid = rank, one track per phase, loop states as instants.
* ``parallel_view.txt`` / ``parallel_view.png`` — the (dp, pp, tp) mesh per step window, each
  device marked ok / slow / hung / waiting with its rank and host.
* ``throughput.png`` — tokens/s and, where the device's peak is known, MFU over steps (from metrics.jsonl).
* ``loss.png`` — the training loss over steps and the validation loss at the steps that evaluated
  (from metrics.jsonl), faults and restarts marked.
* ``device_heatmap.png`` / ``.csv`` — devices × profiled steps: compute and collective seconds
  (runs with ``observe.profile_every``); slow devices are named in the summary.
* ``summary.txt`` — stragglers, hung ranks, clock offsets; also printed.

Flagged stragglers are appended to ``RUN_DIR/events.jsonl`` (kind "straggler") for the supervisor.
"""

from __future__ import annotations

import json
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from megascale_jax import cli, run_dir as run_dirs  # noqa: E402
from megascale_jax.config import ObserveConfig, from_dict  # noqa: E402
from megascale_jax.run_dir import read_jsonl  # noqa: E402
from megascale_jax.observe.hangs import RankState, describe_exit, rank_states  # noqa: E402
from megascale_jax.observe.stragglers import (append_events, arrival_lateness, clock_offsets,  # noqa: E402
                                      flag_stragglers, slow_devices, window_lateness)
from megascale_jax.observe.timings import (AXIS_COLUMNS, STATE_PREFIX, Timings, coordinate, device_label,  # noqa: E402
                                           read_timings)

STATUSES = ("ok", "slow", "waiting", "hung", "stopped", "exited")
STATUS_COLOURS = ("#7fbf7f", "#f0a030", "#9fb7d9", "#d62728", "#bbbbbb", "#888888")
MAX_VIEW_WINDOWS = 6  # the PNG shows the most recent windows; the text shows all



class NoTimings(Exception):
    """The run directory has no timings to report on."""

# ============================================================================ pictures


def save_figure(fig: Figure, out: str, name: str) -> None:
    """Every PNG is written here (the tests wrap it to inspect the figures)."""
    fig.savefig(os.path.join(out, name), dpi=100)
    plt.close(fig)


def integer_steps(ax) -> None:
    """Steps are whole numbers; left to itself matplotlib ticks a short run at 1.5, 2.5, ..."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def heatmap_figure(t: Timings, fraction: np.ndarray, steps: np.ndarray, durations: np.ndarray,
                   duration_steps: np.ndarray) -> Figure:
    panels = [(100 * fraction, steps, "arrival lateness vs the other ranks", "lateness, % of step", "RdBu_r"),
              (durations, duration_steps, "step time", "step time, s", "viridis")]
    # Only panels with data: one rank has no peers to be late against; a run may have no finished step.
    panels = [p for p in panels if not np.isnan(p[0]).all()]
    if not panels:
        raise ValueError("no arrivals or step times to draw")
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1 + len(panels) * (1 + 0.25 * len(t.processes))),
                             sharex=True, squeeze=False, layout="constrained")
    fig.suptitle(f"ranks × steps ({len(t.processes)} ranks)")
    for ax, (matrix, xs, title, label, cmap) in zip(axes[:, 0], panels):
        # A robust colour range: the first steps after compiling can be seconds apart.
        high = 2 * np.nanpercentile(np.abs(matrix), 75)
        image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap=cmap,
                          vmin=-high if cmap == "RdBu_r" else None, vmax=high,
                          extent=(xs[0] - 0.5, xs[-1] + 0.5, len(t.processes) - 0.5, -0.5))
        ax.set_yticks(range(len(t.processes)), [f"rank {p}" for p in t.processes])
        ax.set_title(title)
        ax.set_ylabel("rank")
        fig.colorbar(image, ax=ax, label=label)  # the colour key: a heat map's legend
    integer_steps(axes[-1, 0])  # the panels share their step axis
    axes[-1, 0].set_xlabel("step")
    return fig


def write_heatmap(t: Timings, offsets: np.ndarray, out: str) -> None:
    lateness, steps = arrival_lateness(t, offsets)
    durations, duration_steps = t.matrix("step", t.duration)
    fraction = lateness / np.nanmedian(durations) if durations.size else lateness
    np.savetxt(os.path.join(out, "heatmap.csv"), fraction, delimiter=",", fmt="%.5f",
               header="arrival lateness / median step time; rows = ranks "
                      f"{t.processes}; columns = steps {steps.min(initial=0)}..{steps.max(initial=0)}")
    save_figure(heatmap_figure(t, fraction, steps, durations, duration_steps), out, "heatmap.png")


def device_labels(t: Timings, devices: np.ndarray) -> list[str]:
    with_cp = t.has_cp()  # once, not per device
    coords = {int(d["device"]): device_label(d, with_cp) for d in t.devices}
    return [f"device {d} ({coords.get(int(d), '?')})" for d in devices]


def device_heatmap_figure(t: Timings, compute: np.ndarray, collective: np.ndarray, devices: np.ndarray,
                          steps: np.ndarray) -> Figure:
    panels = [(compute, "compute", "compute, s"), (collective, "collectives (transfer + waiting)", "collectives, s")]
    # A single device runs no collectives: no panel for them then.
    panels = [p for p in panels if p[0].size and not np.isnan(p[0]).all()]
    fig, axes = plt.subplots(1, len(panels), figsize=(10, 1.5 + 0.35 * len(devices)), sharey=True, squeeze=False,
                             layout="constrained")
    fig.suptitle("device time per profiled step (observe.profile_every)")
    for ax, (matrix, title, label) in zip(axes[0], panels):
        image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis")
        # One column per profiled step, labelled with its (integer) step: profiled steps are sparse.
        ax.set_xticks(range(len(steps)), [str(x) for x in steps])
        ax.set_xlabel("profiled step")
        ax.set_title(title)
        fig.colorbar(image, ax=ax, label=label)  # the colour key: a heat map's legend
    axes[0, 0].set_yticks(range(len(devices)), device_labels(t, devices))
    axes[0, 0].set_ylabel("device")
    return fig


def write_device_heatmap(t: Timings, out: str) -> bool:
    """devices × profiled steps: compute and collective seconds (`observe.profile_every`)."""
    compute, devices, steps = t.device_matrix("device_compute")
    if not devices.size:
        return False
    collective, _, _ = t.device_matrix("device_collective")
    np.savetxt(os.path.join(out, "device_heatmap.csv"), compute, delimiter=",", fmt="%.6f",
               header=f"device compute seconds; rows = devices {devices.tolist()}; columns = steps {steps.tolist()}")
    save_figure(device_heatmap_figure(t, compute, collective, devices, steps), out, "device_heatmap.png")
    return True


# The supervisor's events that change a run's course (listed in summary.txt), and all of its
# events the report shows (markers in trace.json and throughput.png); stragglers are reported apart.
RUN_COURSE = ("fault", "restart", "resumed", "give_up", "interrupted")
SUPERVISOR_KINDS = RUN_COURSE + ("done", "drill")


def supervisor_events(run_dir: str) -> list[dict]:
    """events.jsonl's supervisor events (`SUPERVISOR_KINDS`) that carry a time."""
    return [e for e in read_jsonl(run_dirs.events_path(run_dir))
            if e.get("kind") in SUPERVISOR_KINDS and "time" in e]


def mark_events(axes: list, events: list[dict]) -> None:
    """A fault at the step it was detected, a restart at the step it resumes from; one legend
    entry per kind."""
    for e in events:
        step = e.get("step") if e["kind"] == "fault" else e.get("resume_step") if e["kind"] == "restart" else None
        if step is None:
            continue
        colour = "#d62728" if e["kind"] == "fault" else "#1f77b4"
        for ax in axes:
            labelled = e["kind"] in ax.get_legend_handles_labels()[1]
            ax.axvline(step, color=colour, linestyle="--", linewidth=1, label="_nolegend_" if labelled else e["kind"])
        axes[0].text(step, 0.98, f" {e['kind']}: {e.get('cause', '')}", rotation=90, va="top", fontsize=7,
                     color=colour, transform=axes[0].get_xaxis_transform())


def throughput_figure(records: list[dict], events: list[dict] = ()) -> Figure:
    steps = [r["step"] for r in records]
    mfu = [r.get("mfu") for r in records]
    # MFU is null in every record where the device's peak FLOP/s is unknown (CPU): an MFU panel
    # would be empty, so then only tokens/s is drawn.
    has_mfu = any(m is not None for m in mfu)
    fig, axes = plt.subplots(1 + has_mfu, 1, figsize=(8, 5 if has_mfu else 3), sharex=True, squeeze=False,
                             layout="constrained")
    axes = list(axes[:, 0])
    fig.suptitle("throughput" + (" (faults and restarts marked)" if events else ""))
    axes[0].plot(steps, [r.get("tokens_per_s", np.nan) for r in records], label="tokens/s")
    axes[0].set_title("tokens per second")
    axes[0].set_ylabel("tokens/s")
    if has_mfu:
        axes[1].plot(steps, [100 * m if m is not None else np.nan for m in mfu], label="MFU")
        axes[1].set_title("model FLOPs utilisation")
        axes[1].set_ylabel("MFU, %")
    mark_events(axes, events)
    for ax in axes:
        ax.legend(loc="lower right", fontsize=7)
    integer_steps(axes[-1])  # the panels share their step axis
    axes[-1].set_xlabel("step")
    return fig


def loss_figure(records: list[dict], events: list[dict] = ()) -> Figure:
    fig, ax = plt.subplots(figsize=(8, 3), layout="constrained")
    fig.suptitle("loss" + (" (faults and restarts marked)" if events else ""))
    ax.plot([r["step"] for r in records], [r.get("loss", np.nan) for r in records], label="train loss")
    evaluated = [r for r in records if r.get("val_loss") is not None]
    if evaluated:
        ax.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], "o-", label="validation loss")
    ax.set_title("loss per step (nats per token)")
    ax.set_ylabel("loss")
    mark_events([ax], events)
    ax.legend(loc="upper right", fontsize=7)
    integer_steps(ax)
    ax.set_xlabel("step")
    return fig


def downstream_figure(records: list[dict], events: list[dict] = ()) -> Figure:
    """Each downstream task's scores (train.eval_tasks) against the step, one panel a task, with
    their standard errors where the metric has one."""
    scored = [r for r in records if "downstream" in r]
    names = sorted({k for r in scored for k in r["downstream"] if k != "seconds" and not k.endswith("_stderr")})
    tasks = sorted({name.split("/")[0] for name in names})
    fig, axes = plt.subplots(len(tasks), 1, figsize=(8, 2.4 * len(tasks)), layout="constrained", squeeze=False)
    fig.suptitle("downstream tasks (lm-evaluation-harness's metrics)")
    for ax, task in zip(axes[:, 0], tasks):
        for name in [n for n in names if n.split("/")[0] == task]:
            have = [r for r in scored if name in r["downstream"]]
            steps = [r["step"] for r in have]
            values = np.array([r["downstream"][name] for r in have])
            errors = np.array([r["downstream"].get(name + "_stderr", np.nan) for r in have])
            ax.errorbar(steps, values, yerr=None if np.isnan(errors).all() else errors, fmt="o-", capsize=2,
                        label=name.split("/", 1)[1])
        ax.set_title(task)
        ax.legend(loc="best", fontsize=7)
        mark_events([ax], events)
        integer_steps(ax)
    axes[-1, 0].set_xlabel("step")
    return fig


def write_throughput(run_dir: str, out: str, events: list[dict] = ()) -> bool:
    records = [r for r in read_jsonl(run_dirs.metrics_path(run_dir)) if "step" in r]
    if not records:
        return False
    save_figure(throughput_figure(records, events), out, "throughput.png")
    save_figure(loss_figure(records, events), out, "loss.png")
    if any("downstream" in r for r in records):
        save_figure(downstream_figure(records, events), out, "downstream.png")
    return True


# ============================================================================ trace


def chrome_trace(t: Timings, offsets: np.ndarray, supervisor: list[dict] = ()) -> dict:
    """Every row as a trace event in µs since the first one, on process 0's clock; supervisor
    events (faults, restarts) as global instant markers at their wall time (the driver's clock,
    on the same host as rank 0 locally)."""
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
    markers = [{"ph": "i", "s": "g", "name": f"{e['kind']}: {e.get('summary', '')}"[:200], "pid": t.processes[0],
                "tid": tracks.index("state"), "ts": round((e["time"] - origin) * 1e6, 1),
                "args": {k: v for k, v in e.items() if k in ("kind", "cause", "rank", "step", "exit_code", "error")}}
               for e in supervisor] if t.processes else []
    return {"traceEvents": events + timed + markers, "displayTimeUnit": "ms"}


# ============================================================================ 3D-parallel view


def view_statuses(windows: list[dict], t: Timings, states: list[RankState], threshold: float) -> list[dict[int, str]]:
    """Per window, each rank's status: slow when flagged there; in the last window of a run that
    did not finish, hung, waiting, stopped or exited."""
    ended = ("hung", "waiting", "stopped", "exited")
    out = [{p: "slow" if late >= threshold else "ok" for p, late in zip(t.processes, w["lateness"])}
           for w in windows]
    if out and any(s.status in ended for s in states):
        out[-1].update({s.rank: s.status for s in states if s.status in ended})
    return out


def mesh_grid(t: Timings) -> np.ndarray:
    """(dp, pp, cp, tp) array of the rank holding each mesh device (-1 where unknown)."""
    coords = np.array([[coordinate(d, k) for k in (*AXIS_COLUMNS, "process")] for d in t.devices]).reshape(-1, 5)
    grid = np.full(tuple(coords[:, :4].max(axis=0, initial=0) + 1), -1)
    grid[tuple(coords[:, :4].T)] = coords[:, 4]
    return grid


def view_columns(grid: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """The 4-D grid as the views draw it: (dp, pp, columns), a column per (cp, tp) pair, cp outer
    (as in the mesh), and the columns' labels ("tp1", or "cp2 tp1" on a mesh with cp)."""
    dp, pp, cp, tp = grid.shape
    labels = [f"cp{c} tp{j}" if cp > 1 else f"tp{j}" for c in range(cp) for j in range(tp)]
    return grid.reshape(dp, pp, cp * tp), labels


def mesh_title(grid: np.ndarray) -> str:
    dp, pp, cp, tp = grid.shape
    return f"dp={dp} pp={pp}" + (f" cp={cp}" if cp > 1 else "") + f" tp={tp}"


def parallel_view_text(windows: list[dict], statuses: list[dict[int, str]], grid: np.ndarray,
                       hosts: dict[int, str]) -> str:
    title, (columns, labels) = mesh_title(grid), view_columns(grid)
    dp, pp, _ = columns.shape
    width = max(12, 2 + max(len(label) for label in labels))
    lines = [f"mesh {title}; cell = rank:status", ""]
    for w, status in zip(windows, statuses):
        lines.append(f"steps {w['first_step']}-{w['last_step']} (median step {w['step_time_s']:.3f} s)")
        for stage in range(pp):
            lines.append(f"  pp={stage}  " + "".join(f"{label:>{width}}" for label in labels))
            for i in range(dp):
                cells = [f"r{r}:{status.get(r, '?')}" if r >= 0 else "-" for r in columns[i, stage]]
                lines.append(f"  dp={i:<4}" + "".join(f"{c:>{width}}" for c in cells))
        lines.append("")
    lines += [f"rank {r}: host {h}" for r, h in sorted(hosts.items())]
    return "\n".join(lines) + "\n"


def shown_windows_text(windows: list[dict], shown: int) -> str:
    """Which step windows the picture shows, e.g. "steps 41-60 of 1-60 (the 6 most recent of 9 windows)"."""
    steps = f"steps {windows[-shown]['first_step']}-{windows[-1]['last_step']}"
    if shown == len(windows):
        return f"{steps} (all {len(windows)} window{'s' if len(windows) > 1 else ''})"
    return (f"{steps} of {windows[0]['first_step']}-{windows[-1]['last_step']} "
            f"(the {shown} most recent of {len(windows)} windows)")


def parallel_view_figure(windows: list[dict], statuses: list[dict[int, str]], grid: np.ndarray) -> Figure:
    if not windows:
        raise ValueError("no step windows to draw")
    shown = list(zip(windows, statuses))[-MAX_VIEW_WINDOWS:]
    title, (columns, labels) = mesh_title(grid), view_columns(grid)
    dp, pp, tp = columns.shape  # tp: a column per (cp, tp) pair
    # At least 5 inches wide, so that the title and the status key fit beside a small mesh.
    fig, axes = plt.subplots(len(shown), pp, figsize=(max(5, 1 + 2.5 * pp * max(1, tp / 4)), 1.6 + 1.8 * len(shown)),
                             squeeze=False, layout="constrained")
    fig.suptitle(f"rank status per step window, mesh {title}\n"
                 f"{shown_windows_text(windows, len(shown))}", fontsize=9)
    cmap = ListedColormap(STATUS_COLOURS)
    for row, (w, status) in enumerate(shown):
        for stage in range(pp):
            ax = axes[row, stage]
            ranks = columns[:, stage, :]
            codes = np.vectorize(lambda r: STATUSES.index(status.get(r, "ok")))(ranks)
            ax.imshow(codes, cmap=cmap, vmin=-0.5, vmax=len(STATUSES) - 0.5, aspect="auto")
            if ranks.size <= 256:
                for (i, j), r in np.ndenumerate(ranks):
                    ax.text(j, i, f"r{r}\n{status.get(r, 'ok')}", ha="center", va="center", fontsize=7)
            ax.set_title(f"steps {w['first_step']}-{w['last_step']}, pp={stage}", fontsize=8)
            ax.set_xticks(range(tp), labels, fontsize=7)
            ax.set_yticks(range(dp), [f"dp{i}" for i in range(dp)], fontsize=7)
            ax.set_xlabel("cp, tp" if grid.shape[2] > 1 else "tp", fontsize=7)
            ax.set_ylabel("dp", fontsize=7)
    # One key for every panel: the colour of each status.
    fig.legend(handles=[Patch(color=c, label=s) for s, c in zip(STATUSES, STATUS_COLOURS)],
               loc="outside lower center", ncols=3, fontsize=7)
    return fig


def write_parallel_view_png(windows: list[dict], statuses: list[dict[int, str]], grid: np.ndarray, out: str) -> None:
    save_figure(parallel_view_figure(windows, statuses, grid), out, "parallel_view.png")


# ============================================================================ summary and CLI


def apply_exits(states: list[RankState], events: list[dict]) -> None:
    """Ranks that the supervisor saw exit (a `fault` event with an exit code after the run's last
    timings row, or the final fault before a give-up) are "exited", not hung or waiting."""
    faults = [e for e in events if e["kind"] == "fault" and e.get("exit_code") is not None]
    if not faults or not any(s.status in ("hung", "waiting", "stopped") for s in states):
        return
    last = faults[-1]
    for s in states:
        if s.status in ("hung", "waiting", "stopped"):
            s.status = "exited"
            s.exit_note = describe_exit(int(last["exit_code"])) if s.rank == last.get("rank") else \
                "stopped by the supervisor after rank {} exited".format(last.get("rank"))


def events_text(events: list[dict]) -> list[str]:
    lines = []
    for e in events:
        if e["kind"] in RUN_COURSE:
            lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['kind']}: {e.get('summary', '')}")
    return lines


def summary_text(run_dir, t, offsets, stragglers, states, threshold, window, events=(), problems=()) -> str:
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
    exited = [s for s in states if s.status == "exited"]
    restarts = [e for e in events if e["kind"] == "restart"]
    faults = [e for e in events if e["kind"] == "fault"]
    verdict = ("finished" if all(s.status == "done" for s in states) else
               "EXITED: " + "; ".join(f"rank {s.rank} {s.exit_note}" for s in exited) if exited else
               f"HUNG: rank(s) {[s.rank for s in hung]} never arrived; the others wait for them" if hung else
               "ENDED WITHOUT FINISHING: every rank stopped at the same point with no done/failed mark — "
               "killed or crashed (a hang inside the step looks the same; run under launch for exit codes)"
               if any(s.status == "stopped" for s in states) else
               "failed" if any(s.status == "failed" for s in states) else
               "INTERRUPTED (SIGINT/SIGTERM) after a checkpoint of its last step; the same command resumes it"
               if any(s.status == "interrupted" for s in states) else "running")
    if faults:
        verdict += f" after {len(faults)} fault(s) and {len(restarts)} restart(s)"
        if any(e["kind"] == "give_up" for e in events):
            verdict += "; the supervisor gave up"
    lines += ["", f"run state: {verdict}"] + [f"  {s.describe()}" for s in states]
    if faults or restarts:
        lines += ["", "faults and restarts (events.jsonl):"] + events_text(events)
    if problems:
        lines += ["", "report sections not written:"] + [f"  {p}" for p in problems]
    return "\n".join(lines) + "\n"


def observe_settings(run_dir: str) -> ObserveConfig:
    """The run's observe.* settings (defaults for runs without them)."""
    path = run_dirs.config_path(run_dir)
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
        raise NoTimings(f"no timings under {run_dirs.timings_dir(run_dir)}; run with observe.timings=true")
    out = run_dirs.report_dir(run_dir)
    os.makedirs(out, exist_ok=True)
    offsets = clock_offsets(t)
    durations = t.duration[t.select("step")]
    if hang_after is None:  # silent for this long = stalled; generous, as a checkpoint may run long
        hang_after = max(60.0, 20 * float(np.median(durations))) if durations.size else 60.0
    states = rank_states(t, time.time(), hang_after)
    windows = window_lateness(t, offsets, window)
    stragglers = flag_stragglers(t, windows, threshold)
    append_events(run_dir, stragglers)
    events = supervisor_events(run_dir)
    apply_exits(states, events)

    problems = []

    def section(name, write):
        """Every section is attempted: one that fails is named in summary.txt, the rest still land."""
        try:
            write()
        except Exception as e:  # noqa: BLE001 — a report of a broken run must still finish
            text = str(e).strip().splitlines()
            problems.append(f"{name}: {type(e).__name__}: {text[0][:200] if text else ''}")

    def trace():
        with open(os.path.join(out, "trace.json"), "w") as f:
            json.dump(chrome_trace(t, offsets, events), f)

    statuses = view_statuses(windows, t, states, threshold)

    def view_text():
        with open(os.path.join(out, "parallel_view.txt"), "w") as f:
            f.write(parallel_view_text(windows, statuses, mesh_grid(t), t.hosts()))

    def throughput():
        if not write_throughput(run_dir, out, events):
            raise ValueError("no metrics.jsonl records")

    section("heatmap.png", lambda: write_heatmap(t, offsets, out))
    section("device_heatmap.png", lambda: write_device_heatmap(t, out))
    section("trace.json", trace)
    section("parallel_view.txt", view_text)
    section("parallel_view.png", lambda: write_parallel_view_png(windows, statuses, mesh_grid(t), out))
    section("throughput.png and loss.png", throughput)
    summary = summary_text(run_dir, t, offsets, stragglers, states, threshold, window, events, problems)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(summary)
    return summary


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m megascale_jax.report", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--threshold", type=float, help="straggler lateness, fraction of the step (default: observe.straggler_threshold)")
    parser.add_argument("--window", type=int, help="steps per window (default: observe.straggler_window)")
    parser.add_argument("--hang-after", type=float, help="seconds without any row before a run counts as stalled "
                                                         "(default: max(60, 20 median steps))")
    args = cli.parse(parser, argv)
    if not os.path.isdir(args.run_dir):
        return cli.user_error(f"run directory {args.run_dir} does not exist; pass the --run-dir of a run")
    try:
        print(write_report(args.run_dir, args.threshold, args.window, args.hang_after), end="")
    except NoTimings as e:
        return cli.user_error(e)
    return 0
