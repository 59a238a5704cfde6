"""The campaign result's top-level `summary`: the numbers issue 36's claims are checked against,
each read off the sections' own rows, with exactly the keys of `KEYS`. A number a section did not
measure (a dry run, a section that failed, a row that did not fit) is None, never a guess.

* mfu_best, tokens_per_s_best, batch_best: the training row (the MFU ladder's and the levers',
  each lever alone on its base) of highest MFU among those that compute the campaign's window, its FLOPs counted for that window (issue 36, item 1: the dense
  twin, whose MFU counts full attention's FLOPs, is the check beside it, not the claim);
  sequences per step, microbatches included; without MFUs (a CPU dry run) the fastest such row,
  mfu_best None.
* peer_same_work_tokens_per_s, ratio_vs_peer_same_work: the PyTorch peer's sliding-window row,
  and our fastest training row (ladder or levers) doing the same work: the same window, AdamW, one microbatch, the same
  batch (kernels, fusion and XLA flags are ours to choose).
* ratio_vs_peer_dense: the same at window=null, against the faster dense peer row at that batch.
* peak_bytes_ours, peak_bytes_peer: the device's peak memory of the two same-work rows.
* peak_bytes_predicted: our same-work row's peak as compiled without a GPU (`bench.aot.predict_peaks`
  writes it into each row: the compiled step's argument + output - alias + temporaries).
* attention_worst_ratio_vs_cudnn: per measured (seq, window), cuDNN's time over the faster of our
  kernels (the tuned Pallas kernel, tokamax's); the worst such ratio.
* checkpoint_block_fraction_16gb: with checkpoint.background_host_copy, the 16 GB save's blocking
  share of its total time.
* device_to_host_gb_per_s: the background saves' device-to-host copy rate at the largest size
  measured (state bytes / the writer thread's copy into pinned host memory, median seconds).
"""

from __future__ import annotations

import statistics

from bench.campaign.ladder import measured

KEYS = ("device", "mfu_best", "tokens_per_s_best", "batch_best", "peer_same_work_tokens_per_s",
        "ratio_vs_peer_same_work", "ratio_vs_peer_dense", "peak_bytes_ours", "peak_bytes_predicted", "peak_bytes_peer",
        "attention_worst_ratio_vs_cudnn", "checkpoint_block_fraction_16gb", "device_to_host_gb_per_s")
OURS = ("pallas_window", "triton_window", "tokamax_window")  # sliding-window kernels we run (Pallas, our jax-triton kernel, tokamax), against cudnn_window


def summary(device: str, sections: dict) -> dict:
    ok = {name: s for name, s in sections.items() if s.get("status") == "ok"}
    levers = ok.get("levers", {})
    rows = [r for r in [*ok.get("mfu_ladder", {}).get("rows", []), *([levers["base"], *levers["rows"]] if levers else [])]
              if measured(r)]
    peers = [r for r in ok.get("torch_peer", {}).get("rows", []) if measured(r)]
    out = dict.fromkeys(KEYS)
    out["device"] = device
    window = ok["mfu_ladder"]["window"] if "mfu_ladder" in ok else levers.get("config", {}).get("model.window")
    windowed = [r for r in rows if str(r["config"].get("model.window")) == str(window)]
    # highest MFU; where no row has one (a CPU has no peak FLOP/s), the fastest row
    rated = [r for r in windowed if r.get("mfu") is not None]
    best = max(rated, key=lambda r: r["mfu"]) if rated else fastest(windowed)
    if best:
        out.update(mfu_best=best["mfu"], tokens_per_s_best=best["tokens_per_s"],
                   batch_best=best["batch"] * best["microbatches"])
    peer = next((p for p in peers if p["row"] == "sliding_window"), None)
    ours = fastest(same_work(rows, window, peer["batch"])) if peer else None
    if peer:
        out.update(peer_same_work_tokens_per_s=peer["tokens_per_s"], peak_bytes_peer=peer.get("peak_bytes_in_use"))
    if peer and ours:
        out.update(ratio_vs_peer_same_work=ours["tokens_per_s"] / peer["tokens_per_s"],
                   peak_bytes_ours=ours.get("peak_bytes_in_use"), peak_bytes_predicted=ours.get("peak_bytes_predicted"))
    dense_peer = fastest(p for p in peers if p["row"] != "sliding_window")
    dense_ours = fastest(same_work(rows, None, dense_peer["batch"])) if dense_peer else None
    if dense_peer and dense_ours:
        out["ratio_vs_peer_dense"] = dense_ours["tokens_per_s"] / dense_peer["tokens_per_s"]
    out["attention_worst_ratio_vs_cudnn"] = attention_worst_ratio(ok.get("kernels", {}).get("attention", []))
    background = [r for r in ok.get("checkpoints", {}).get("background_sizes", []) if "total_s" in r]
    at_16 = next((r for r in background if r["state_gb"] == 16.0), None)
    out["checkpoint_block_fraction_16gb"] = at_16["block_fraction"] if at_16 else None
    if background:
        out["device_to_host_gb_per_s"] = device_to_host_gb_per_s(max(background, key=lambda r: r["state_gb"]))
    return out


def fastest(rows):
    return max(rows, key=lambda r: r["tokens_per_s"], default=None)


def same_work(ladder: list[dict], window, batch: int) -> list[dict]:
    """Our training rows that do the peer's work: `window` (None: full causal), AdamW, one
    microbatch of `batch` sequences."""
    want = "null" if window is None else str(window)
    return [r for r in ladder if str(r["config"].get("model.window")) == want and r["config"].get("optim.name") == "adamw"
            and r["microbatches"] == 1 and r["batch"] == batch]


def attention_worst_ratio(rows: list[dict]):
    """min over (seq, window) of cuDNN's ms / the faster of ours; None without a cuDNN time."""
    ratios = []
    for cudnn in (r for r in rows if r["contender"] == "cudnn_window" and "ms" in r):
        ours = [r["ms"] for r in rows if r["contender"] in OURS and "ms" in r
                and (r["seq"], r["window"]) == (cudnn["seq"], cudnn["window"])]
        if ours:
            ratios.append(cudnn["ms"] / min(ours))
    return min(ratios) if ratios else None


def device_to_host_gb_per_s(row: dict):
    """The state's GB over the median background device-to-host copy (into pinned host memory)."""
    copies = [s["background_parts_s"]["device_to_host"] for s in row.get("saves", [])
              if s.get("background_parts_s", {}).get("device_to_host")]
    return row["state_gb"] / statistics.median(copies) if copies else None
