"""Campaign section d, checkpoints: blocking vs total save time and restore time for 1, 4 and 16
GB of training state on the device, through the trainer's own `Checkpointer`
(bench/checkpoint.py's `measure_size`, here on a one-device mesh: the state lives in GPU memory
and the blocking stage is the device-to-host copy plus the on-device checksums).
"""

from __future__ import annotations

import shutil
import tempfile

import campaign_process
from checkpoint import TABLE_HEADER, measure_size  # bench/checkpoint.py

SIZES_GB = {False: (1.0, 4.0, 16.0), True: (1 / 16, 1 / 8)}  # keyed by dry_run; arrays are 64 MB each
REPEATS = {False: 2, True: 1}


def run(settings: dict) -> dict:
    from megascale_jax.config import load_config
    from megascale_jax.parallel.mesh import make_mesh

    dry_run = settings["dry_run"]
    repeats = REPEATS[dry_run]
    cfg = load_config(None, ["mesh.dp=1", "mesh.tp=1", "checkpoint.keep=1", f"train.steps={repeats}"])
    mesh = make_mesh(cfg.mesh)
    directory = tempfile.mkdtemp(prefix="campaign-ckpt-")
    rows = []
    try:
        print(TABLE_HEADER)
        for size in SIZES_GB[dry_run]:
            try:
                rows.append(measure_size(cfg, mesh, directory, size, repeats))
            except Exception as e:  # noqa: BLE001 — e.g. 16 GB not fitting: the smaller sizes still count
                rows.append({"state_gb": size, "error": campaign_process.one_line(e)})
                print(f"{size:>9.2f}  {rows[-1]['error']}", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return {"repeats": repeats, "sizes": rows}
