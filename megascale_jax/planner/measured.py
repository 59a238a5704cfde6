"""This project's own GPU measurements as planner workloads: the MFU ladder of the GPU campaign
(`bench/gpu_campaign.py`, results in bench/results/gpu_<device>_<date>.json).

Each measured ladder row is configs/gpt_1b.yaml with the row's overrides, batch and
microbatches on one GPU. `validation_table(path, gpu_key)` predicts every row's step time and
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
LADDER_CONFIG = os.path.join(REPO, "configs", "gpt_1b.yaml")


def ladder_rows(path: str) -> list[dict]:
    """The measured rows of a campaign result's MFU ladder (rows that ran and were timed)."""
    with open(path) as f:
        result = json.load(f)
    ladder = result["sections"].get("mfu_ladder", {})
    return [r for r in ladder.get("rows", []) if r.get("step_time_s")]


def row_config(row: dict):
    overrides = [f"{k}={v}" for k, v in row["config"].items()] + [
        f"parallel.microbatches={row['microbatches']}", f"train.global_batch={row['global_batch']}"]
    return load_config(LADDER_CONFIG, overrides, planning=True)


def validation_table(path: str, gpu_key: str) -> list[dict]:
    """Predicted vs measured step seconds for every measured ladder row, with relative error."""
    gpu = calibration.gpu(gpu_key)
    table = []
    for row in ladder_rows(path):
        predicted = predict(from_config(row_config(row), 1), gpu).iteration_s
        table.append({"row": row["name"], "measured_s": row["step_time_s"], "predicted_s": predicted,
                      "error": predicted / row["step_time_s"] - 1})
    return table
