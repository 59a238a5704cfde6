"""This project's own GPU measurements as planner workloads: the MFU ladder of the GPU campaign
(`python -m bench.campaign`, results in bench/results/gpu_<device>_<date>.json).

Each measured ladder row is the ladder's config file (recorded in the result) with the row's
overrides, batch and microbatches on one GPU. `validation_table(path, gpu_key)` predicts every row's step time and
sets it beside the measured median. The H200 entry of configs/calibration.yaml takes its
elementwise passes from this table (`fit_elementwise_passes`, the `xla_flags` row; the other rows
check it) and, with the H100's, its fused attention from the campaign's kernel bench
(`attention_fit`).
"""

from __future__ import annotations

import json
import os

from megascale_jax.config import load_config
from megascale_jax.planner import calibration, costs
from megascale_jax.planner.predict import predict
from megascale_jax.planner.workload import from_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# What a run's code did by default then that the planner prices apart now: (the change's commit
# time, the overrides that undo it for runs that finished before it). The LM head's backward ran
# in float32 until commit dc3b32a (2026-11-27 11:48 UTC: model.head_grad_float32 and the bf16
# backward), after both H200 runs (their ladders finished 2026-11-23T01:43, 2026-11-27T11:30).
AS_RUN = (("2026-11-27T11:48:53", ("model.head_grad_float32=true",)),)


def finished(result: dict, section: str) -> str:
    """When `section` of a campaign result finished (ISO time), or its day for older results."""
    return result["sections"][section].get("finished", result["date"])


def row_config(config_file: str, row: dict, ran_at: str = "9999"):
    """A ladder row's config: `config_file` (relative to the checkout) with the row's changes, as
    the code it ran at `ran_at` (an ISO time: `finished`) had it (`AS_RUN`)."""
    as_run = [o for change, overrides in AS_RUN if ran_at < change for o in overrides]
    overrides = as_run + [f"{k}={v}" for k, v in row["config"].items()] + [
        f"parallel.microbatches={row['microbatches']}", f"train.global_batch={row['global_batch']}"]
    return load_config(os.path.join(REPO, config_file), overrides, planning=True)


def ladder_workload(result: dict, row: dict):
    """The planner's workload of one MFU ladder row of a campaign result, as its code ran it."""
    ladder = result["sections"]["mfu_ladder"]
    return from_config(row_config(ladder["config"], row, finished(result, "mfu_ladder")), 1)


def relative_lstsq(design, measured):
    """Coefficients c of design @ c ≈ measured, least squares on the relative error (every row
    weighted alike, whatever its size)."""
    import numpy as np

    return np.linalg.lstsq(design / measured[:, None], np.ones(len(measured)), rcond=None)[0]


def validation_table(path: str, gpu_key: str) -> list[dict]:
    """Predicted vs measured step seconds for every ladder row that ran, with relative error."""
    with open(path) as f:
        result = json.load(f)
    gpu = calibration.gpu(gpu_key)
    table = []
    for row in (r for r in result["sections"]["mfu_ladder"]["rows"] if r.get("step_time_s")):
        predicted = predict(ladder_workload(result, row), gpu).iteration_s
        table.append({"row": row["name"], "batch": row["global_batch"], "measured_s": row["step_time_s"],
                      "predicted_s": predicted, "error": predicted / row["step_time_s"] - 1})
    return table


# The op table's parts (bench/campaign/op_table.py) as the planner's kinds of time (`--explain`).
OP_TABLE_KINDS = {"QKV projection": "gemm", "output projection": "gemm", "QKV + MLP-up GEMM": "gemm",
                  "output + MLP-down GEMM": "gemm", "attention": "attention", "MLP": "elementwise",
                  "norms": "elementwise", "copies/transposes": "elementwise", "other": "elementwise",
                  "embedding": "elementwise", "LM head/loss": "lm head", "optimizer": "optimizer",
                  "collectives": "communication"}
PLANNER_KINDS = {"gemm": ("compute gemm", "compute gemm wave quantization"), "attention": ("compute attention",),
                 "elementwise": ("compute elementwise", "compute gradient accumulation"),
                 "lm head": ("compute lm head",), "optimizer": ("optimizer",),
                 "communication": ("tp layers", "tp embedding+head", "pp sends", "dp gradients+parameters")}


def part_table(path: str, gpu_key: str) -> list[dict]:
    """Seconds per step by kind (GEMMs, attention, elementwise, LM head and loss, optimizer): the
    device time a profiled GPU step spent (the result's `profiled_steps` op table, its model parts
    grouped as OP_TABLE_KINDS) beside the planner's prediction of the same configuration and batch."""
    with open(path) as f:
        result = json.load(f)
    section = result["sections"]["profiled_steps"]
    profiled = section["op_table"]
    config_file = result["sections"].get("mfu_ladder", {}).get("config", "configs/gpt_1b.yaml")
    row = {"config": profiled["config"], "microbatches": 1, "global_batch": profiled["batch"]}
    parts = predict(from_config(row_config(config_file, row, finished(result, "profiled_steps")), 1),
                    calibration.gpu(gpu_key)).parts
    measured = dict.fromkeys(PLANNER_KINDS, 0.0)
    for part, seconds in section["by_part"].items():
        if part != "total":
            measured[OP_TABLE_KINDS[part]] += seconds
    return [{"kind": kind, "measured_s": measured[kind], "predicted_s": sum(parts[p] for p in PLANNER_KINDS[kind])}
            for kind in PLANNER_KINDS]


def attention_fit(path: str, gpu_key: str, contender: str = "cudnn_window") -> dict:
    """The fused attention's two constants (`costs.fused_attention_s`) from the kernel bench's
    rows of `contender` in the campaign result at `path` (its `kernels` section: forward +
    backward of one attention call, timed from the host, per (seq, window)):

        t = t_call + F / (P · e_attn) + N_q · c_q

    F the call's FLOPs (`costs.FLASH_FWD_BWD` × 4 · head_dim per visible (query, key) pair and
    head), N_q its query rows (batch × heads × seq), t_call what each timed call pays once (the host's dispatch and
    the kernels' launches: inside a compiled train step it is not paid per layer, so the planner
    drops it). Least squares on the relative error, every measured row weighted alike. Returns
    e_attn, c_q (ns), t_call (µs) and each row's measured and fitted ms; P is `gpu_key`'s peak."""
    import numpy as np

    with open(path) as f:
        kernels = json.load(f)["sections"]["kernels"]
    shape, peak = kernels["settings"], calibration.gpu(gpu_key).peak_flops
    rows = [r for r in kernels["attention"] if r["contender"] == contender and r.get("ms")]
    if len(rows) < 3:
        raise ValueError(f"{path}: {len(rows)} measured {contender} rows; the fit needs 3 or more")
    flops = [costs.FLASH_FWD_BWD * 4 * shape["batch"] * shape["heads"] * shape["head_dim"]
             * costs.visible_pairs(r["seq"], r["window"]) for r in rows]
    queries = [shape["batch"] * shape["heads"] * r["seq"] for r in rows]
    seconds = np.array([r["ms"] * 1e-3 for r in rows])
    design = np.array([[1.0, f / peak, q] for f, q in zip(flops, queries)])
    coef = relative_lstsq(design, seconds)
    fitted = design @ coef
    return {"attention_efficiency": float(1 / coef[1]), "attention_query_ns": float(coef[2] * 1e9),
            "call_us": float(coef[0] * 1e6),
            "rows": [{"seq": r["seq"], "window": r["window"], "measured_ms": r["ms"], "fitted_ms": float(t * 1e3),
                      "error": float(t / (r["ms"] * 1e-3) - 1)} for r, t in zip(rows, fitted)]}


def fit_elementwise_passes(path: str, row_name: str, gpu_key: str) -> float:
    """The `elementwise_passes` at which the planner predicts the ladder row `row_name` of the
    result at `path` exactly, every other constant of `gpu_key` as calibrated (the predicted step
    grows with the passes, so bisection finds it). How the H200 entry's passes were obtained."""
    import dataclasses

    with open(path) as f:
        result = json.load(f)
    row = next(r for r in result["sections"]["mfu_ladder"]["rows"] if r["name"] == row_name)
    w, gpu = ladder_workload(result, row), calibration.gpu(gpu_key)
    low, high = 0.0, 64.0
    for _ in range(60):
        mid = (low + high) / 2
        if predict(w, dataclasses.replace(gpu, elementwise_passes=mid)).iteration_s < row["step_time_s"]:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def gemm_fit(path: str, gpu_key: str) -> dict:
    """The GEMM size curve's two constants (`costs.gemm_s`: e_max, the asymptote with wave
    quantization taken out, and F_half) from the campaign's `rates` section at `path` (device
    time of bf16 GEMMs by shape). The planner's model, t = F / (P · e_max · F/(F + F_half) · q),
    q the shape's wave quantization on `gpu_key`'s SMs and tile, is linear in F once each time is
    multiplied by q · P: t · q · P = (F + F_half) / e_max. Least squares on the relative error.
    Returns both constants (F_half in GFLOP) and each row's measured and fitted µs."""
    import numpy as np

    with open(path) as f:
        rows = [r for r in json.load(f)["sections"]["rates"]["gemms"] if r.get("seconds")]
    if len(rows) < 2:
        raise ValueError(f"{path}: {len(rows)} timed GEMMs; the fit needs 2 or more")
    gpu = calibration.gpu(gpu_key)
    work = np.array([2.0 * r["m"] * r["k"] * r["n"] for r in rows])
    waves = np.array([costs.wave_efficiency(r["m"], r["n"], gpu) for r in rows])
    scaled = np.array([r["seconds"] for r in rows]) * waves * gpu.peak_flops  # = (F + F_half) / e_max
    design = np.stack([work, np.ones(len(rows))], axis=1)
    slope, intercept = relative_lstsq(design, scaled)
    fitted = (design @ [slope, intercept]) / (waves * gpu.peak_flops)
    return {"matmul_max_efficiency": float(1 / slope), "matmul_half_gflop": float(intercept / slope / 1e9),
            "rows": [{"m": r["m"], "k": r["k"], "n": r["n"], "measured_us": r["seconds"] * 1e6, "fitted_us": float(t * 1e6),
                      "error": float(t / r["seconds"] - 1)} for r, t in zip(rows, fitted)]}
