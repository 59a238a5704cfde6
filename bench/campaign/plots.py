"""The campaign's PNGs, drawn from its result (so a merged `--only` rerun redraws them all):

    <stem>_kernels.png      attention TFLOP/s per (seq, window), one bar per contender
    <stem>_ladder.png       tokens/s per ladder row (MFU in the label), PyTorch peers beside
    <stem>_checkpoints.png  blocking and total save, and restore seconds per state size

(`profile` copies the report's device heat map to <stem>_device_heatmap.png itself.)
A figure that cannot be drawn is one line in the result's png_problems, never a failed campaign.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.campaign import process  # noqa: E402


def bars(ax, groups: list[str], series: dict[str, list[float]]) -> None:
    """Grouped bars: one group per label in `groups`, one bar per series (NaN: no bar)."""
    width = 0.8 / max(1, len(series))
    x = np.arange(len(groups))
    for i, (label, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=label)
    ax.set_xticks(x, groups, rotation=30, ha="right")
    ax.legend(fontsize="small")


def kernels_figure(section: dict):
    rows = [r for r in section["attention"] if "tflops" in r]
    shapes = sorted({(r["seq"], r["window"]) for r in rows if r["window"] is not None})
    contenders = sorted({r["contender"] for r in rows})
    tflops = {(r["contender"], r["seq"], r["window"]): r["tflops"] for r in rows}
    # The dense causal kernel is measured once per seq: shown in every window's group of that seq.
    series = {c: [tflops.get((c, s, w), tflops.get((c, s, None), np.nan)) for s, w in shapes] for c in contenders}
    fig, ax = plt.subplots(figsize=(10, 4.5), layout="constrained")
    bars(ax, [f"s={s} w={w}" for s, w in shapes], series)
    ax.set_ylabel("TFLOP/s (useful FLOPs of the problem)")
    ax.set_title("attention forward+backward, bf16")
    return fig


def ladder_figure(ladder: dict, torch_peer: dict | None):
    rows = ladder["rows"]
    labels = [r["name"] + (f"\nMFU {r['mfu']:.1%}" if r.get("mfu") is not None else "") for r in rows]
    peers = {p["row"]: p.get("tokens_per_s", np.nan) for p in (torch_peer or {}).get("rows", [])}
    series = {"megascale_jax": [r.get("tokens_per_s", np.nan) for r in rows]}
    if peers:
        series["PyTorch peer"] = [peers.get(r["name"], np.nan) for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.5), layout="constrained")
    bars(ax, labels, series)
    ax.set_ylabel("tokens/s")
    ax.set_title("MFU ladder: one technique added per row")
    return fig


def checkpoints_figure(section: dict):
    rows = [r for r in section["sizes"] if "total_s" in r]
    series = {key: [r[key] for r in rows] for key in ("block_s", "total_s", "restore_s")}
    background = {r["state_gb"]: r for r in section.get("background_sizes", []) if "total_s" in r}
    if all(r["state_gb"] in background for r in rows):
        series["block_s, background host copy"] = [background[r["state_gb"]]["block_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    bars(ax, [f"{r['state_gb']:.2f} GB" for r in rows], series)
    ax.set_ylabel("seconds")
    ax.set_title("checkpoint: blocking vs total save, restore")
    return fig


FIGURES = {  # file suffix -> (the section it needs, the figure from the sections that succeeded)
    "kernels": ("kernels", lambda ok: kernels_figure(ok["kernels"])),
    "ladder": ("mfu_ladder", lambda ok: ladder_figure(ok["mfu_ladder"], ok.get("torch_peer"))),
    "checkpoints": ("checkpoints", lambda ok: checkpoints_figure(ok["checkpoints"])),
}


def draw(sections: dict, stem: str) -> tuple[list[str], list[str]]:
    """Draw every figure whose section succeeded; (paths written, one line per figure that failed)."""
    ok = {name: s for name, s in sections.items() if s["status"] == "ok"}
    paths, problems = [], []
    for suffix, (needs, figure) in FIGURES.items():
        if needs not in ok:
            continue
        try:
            fig = figure(ok)
            fig.savefig(f"{stem}_{suffix}.png", dpi=100)
            plt.close(fig)
            paths.append(f"{stem}_{suffix}.png")
        except Exception as e:  # noqa: BLE001 — a figure is not worth a failed campaign
            problems.append(f"{suffix}.png: {process.one_line(e)}")
    heatmap = f"{stem}_device_heatmap.png"  # drawn by the report, copied by profile
    if "profiled_steps" in ok and os.path.isfile(heatmap):
        paths.append(heatmap)
    return paths, problems
