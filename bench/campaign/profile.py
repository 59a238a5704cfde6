"""Campaign section e, profiled steps: a short training run with `observe.profile_every` on the
device, checked end to end — every profiled step has a device_compute (> 0) and a
device_collective row for the device (on one GPU its collectives take 0 s), and the report
draws device_heatmap.png, which is copied next to the campaign's result.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from bench.campaign import model, process

STEPS, PROFILE_EVERY = 6, 2
TRAIN_LIMIT_S = 400
# A smaller version of the ladder's model: the section checks the profiler's rows, not speed.
SHAPE = {False: ["model.layers=4"], True: ["model.attention=xla"]}  # keyed by dry_run (cuDNN needs a GPU)


def run(settings: dict) -> dict:
    scratch = tempfile.mkdtemp(prefix="campaign-profile-")
    try:
        return checked_run(os.path.join(scratch, "run"), settings)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def checked_run(run_dir: str, settings: dict) -> dict:
    from megascale_jax.observe import report, timings

    dry_run = settings["dry_run"]
    # The run in a process of its own, as a user starts it; its failure comes back as one line.
    done = process.run(
        [sys.executable, "-m", "megascale_jax.train", "--config", model.CONFIG, "--run-dir", run_dir,
         *model.base_overrides(dry_run), *SHAPE[dry_run], "train.global_batch=4", "parallel.microbatches=1",
         f"train.steps={STEPS}", f"observe.profile_every={PROFILE_EVERY}", "train.eval_every=0"],
        env=dict(os.environ), limit_s=TRAIN_LIMIT_S, prefix="  [train]")
    if not done.ok:
        raise RuntimeError(f"megascale_jax.train: {done.failure(TRAIN_LIMIT_S)}")

    t = timings.read_timings(run_dir)
    compute, devices, steps = t.device_matrix("device_compute")
    collective, collective_devices, collective_steps = t.device_matrix("device_collective")
    expected = list(range(PROFILE_EVERY, STEPS + 1, PROFILE_EVERY))
    if steps.tolist() != expected or not (compute > 0).all():
        raise RuntimeError(f"device_compute rows: steps {steps.tolist()} (expected {expected}), "
                           f"seconds {compute.tolist()} (expected all > 0)")
    if collective_steps.tolist() != expected or collective_devices.tolist() != devices.tolist():
        raise RuntimeError(f"device_collective rows for steps {collective_steps.tolist()} and devices "
                           f"{collective_devices.tolist()}; expected steps {expected} on devices {devices.tolist()}")

    summary = report.write_report(run_dir)
    heatmap = os.path.join(run_dir, "report", "device_heatmap.png")
    if not os.path.isfile(heatmap) or os.path.getsize(heatmap) == 0:
        raise RuntimeError(f"the report drew no device_heatmap.png; its summary says: {summary.strip()[-300:]}")
    copied = settings["png_stem"] + "_device_heatmap.png"
    shutil.copyfile(heatmap, copied)
    return {"profiled_steps": expected, "devices": devices.tolist(),
            "device_compute_s": compute.tolist(), "device_collective_s": collective.tolist(),
            "device_heatmap": copied}
