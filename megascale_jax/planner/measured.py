"""This project's own GPU measurements as planner workloads: the MFU ladder of the GPU campaign
(`python -m bench.campaign`, results in bench/results/gpu_<device>_<date>.json).

Each measured ladder row is the ladder's config file (recorded in the result) with the row's
overrides, batch and microbatches on one GPU. `validation_table(path, gpu_key)` predicts every row's step time and
sets it beside the measured median. The H200 entry of configs/calibration.yaml takes one of its
numbers from this table (elementwise passes, fitted to the `xla_flags` row); the other rows
check it.
"""

from __future__ import annotations

import json
import os

from megascale_jax.config import load_config
from megascale_jax.planner import calibration
from megascale_jax.planner.predict import predict
from megascale_jax.planner.workload import from_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def row_config(config_file: str, row: dict):
    """A ladder row's config: `config_file` (relative to the checkout) with the row's changes."""
    overrides = [f"{k}={v}" for k, v in row["config"].items()] + [
        f"parallel.microbatches={row['microbatches']}", f"train.global_batch={row['global_batch']}"]
    return load_config(os.path.join(REPO, config_file), overrides, planning=True)


def validation_table(path: str, gpu_key: str) -> list[dict]:
    """Predicted vs measured step seconds for every ladder row that ran, with relative error."""
    with open(path) as f:
        ladder = json.load(f)["sections"]["mfu_ladder"]
    gpu = calibration.gpu(gpu_key)
    table = []
    for row in (r for r in ladder["rows"] if r.get("step_time_s")):
        predicted = predict(from_config(row_config(ladder["config"], row), 1), gpu).iteration_s
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
    parts = predict(from_config(row_config(config_file, row), 1), calibration.gpu(gpu_key)).parts
    measured = dict.fromkeys(PLANNER_KINDS, 0.0)
    for part, seconds in section["by_part"].items():
        if part != "total":
            measured[OP_TABLE_KINDS[part]] += seconds
    return [{"kind": kind, "measured_s": measured[kind], "predicted_s": sum(parts[p] for p in PLANNER_KINDS[kind])}
            for kind in PLANNER_KINDS]
