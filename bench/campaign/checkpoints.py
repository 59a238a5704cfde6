"""Campaign section d, checkpoints: blocking vs total save time and restore time for 1, 4 and 16 GB
of training state on the device, through the trainer's own `Checkpointer`
(bench/resilience/checkpoint.py's `measure_size`, here on a one-device mesh: the state lives in
GPU memory). Twice: `sizes` with the blocking stage as orbax does it (the device-to-host copy
plus the on-device checksums), `background_sizes` with `checkpoint.background_host_copy=true` (a
copy on the device blocks; the host copy runs on a thread), whose blocking counts the device
copy's time.
"""

from __future__ import annotations

import shutil
import tempfile

from bench.campaign import process
from bench.resilience import checkpoint as resilience
from bench.resilience.checkpoint import TABLE_HEADER, measure_size

# keyed by dry_run; arrays of resilience.ARRAY_MB (64 MB) each, the dry run's of DRY_RUN_ARRAY_MB: one
# array and two, saved and restored as the GPU's are (the dry run proves the plumbing; less data
# is less of CI's time spent checksumming and writing)
SIZES_GB = {False: (1.0, 4.0, 16.0), True: (1 / 256, 1 / 128)}
DRY_RUN_ARRAY_MB = 4
REPEATS = {False: 2, True: 1}


def run(settings: dict) -> dict:
    from megascale_jax.config import load_config
    from megascale_jax.parallel.mesh import make_mesh

    dry_run = settings["dry_run"]
    if dry_run:  # this section's own process: the smaller arrays are the dry run's only
        resilience.ARRAY_MB = DRY_RUN_ARRAY_MB
    repeats = REPEATS[dry_run]
    base = ["mesh.dp=1", "mesh.tp=1", "checkpoint.keep=1", f"train.steps={repeats}"]
    result = {"repeats": repeats}
    for key, background in (("sizes", False), ("background_sizes", True)):
        cfg = load_config(None, [*base, f"checkpoint.background_host_copy={str(background).lower()}"])
        result[key] = measure_sizes(cfg, make_mesh(cfg.mesh), SIZES_GB[dry_run], repeats)
    return result


def measure_sizes(cfg, mesh, sizes_gb, repeats) -> list[dict]:
    directory = tempfile.mkdtemp(prefix="campaign-ckpt-")
    rows = []
    try:
        print(f"checkpoint.background_host_copy={cfg.checkpoint.background_host_copy}")
        print(TABLE_HEADER)
        for size in sizes_gb:
            try:
                rows.append(measure_size(cfg, mesh, directory, size, repeats))
            except Exception as e:  # noqa: BLE001 — e.g. 16 GB not fitting: the smaller sizes still count
                rows.append({"state_gb": size, "error": process.one_line(e)})
                print(f"{size:>9.2f}  {rows[-1]['error']}", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return rows
