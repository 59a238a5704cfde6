"""Campaign section e, profiled steps: a short training run with `observe.profile_every` on the
device, checked end to end — every profiled step has a device_compute (> 0) and a
device_collective row for the device (on one GPU its collectives take 0 s), and the report
draws device_heatmap.png, which is copied next to the campaign's result.

Then where the step's device time goes (`op_table`): the top ops of a traced train step, each
named as a part of the model, and the seconds per part. Sections run independently, so this one
cannot know the ladder's best row; it profiles the ladder's strongest fixed configuration
(`ladder.strongest_fixed`: parallel block, sliding window, cuDNN attention on a GPU or XLA's on
the CPU, AdamW) at the whole model's depth and the batch the memory estimate allows, and the
result says so (in a dry run on the CPU at the batch only, not at half of it too). On a GPU without CUDA graphs (XLA's command buffers): with them, the trace names
each graph (`command_buffer_N`), not the kernels in it, and no op has a model part (H200,
2026-11-27: the whole step "other").
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

from bench.campaign import ladder, model, process

STEPS, PROFILE_EVERY = 6, 2
TRAIN_LIMIT_S = 400
NO_CUDA_GRAPHS = "--xla_gpu_enable_command_buffer="  # an empty list of command-buffer op kinds
OP_TABLE_LIMIT_S = 300  # the whole model compiles in about a minute on an H100
# A dry run on the CPU (which proves plumbing, and costs CI time per process) runs the op table at
# the batch only: the half batch's is the same process again (its split is tests/test_gpu_campaign.py's).
HALF_NOT_IN_DRY_RUN = "not measured in the dry run on the CPU: the half batch's op table is the same run again"
# A smaller version of the ladder's model: the section checks the profiler's rows, not speed.
SHAPE = {False: ["model.layers=4"], True: ["model.attention=xla"]}  # keyed by dry_run (cuDNN needs a GPU)


def run(settings: dict) -> dict:
    model.host_only_jax()  # this process only plans and reads; the runs have processes of their own
    scratch = tempfile.mkdtemp(prefix="campaign-profile-")
    try:
        checked = checked_run(os.path.join(scratch, "run"), settings)
        try:
            table = op_table_run(os.path.join(scratch, "op_table.json"), settings)
        except RuntimeError as e:  # e.g. the whole model not fitting: the checked run's numbers still count
            table = {"op_table_error": process.one_line(e)}
        return {**checked, **table}
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


def op_table_run(out: str, settings: dict) -> dict:
    """`python -m bench.campaign.op_table` on `ladder.strongest_fixed` in a process of its own: its top
    ops, seconds per part and what it profiled; then the same at half the batch, so each part's
    time splits into what grows with the batch and what a step pays once (`batch_split`)."""
    dry_run = settings["dry_run"]
    changes, xla_flags = ladder.strongest_fixed(settings)
    if settings["device"]["backend"] == "gpu":
        xla_flags = (*xla_flags, NO_CUDA_GRAPHS)
    overrides = ladder.row_overrides(dry_run, changes)
    batch = settings.get("batch") or model.pick_batch(overrides, settings["device"]["memory_limit_bytes"], dry_run)[0]
    if batch is None:
        raise RuntimeError(f"op table: {model.does_not_fit(model.estimate_bytes(overrides), settings['device']['memory_limit_bytes'])}")
    env = dict(os.environ)
    if xla_flags:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *xla_flags]).strip()
    table = traced(out, overrides, batch, env)
    result = {"top_ops": table["top_ops"], "top_by_part": table["top_by_part"], "by_part": table["by_part"],
              "products": table.get("products"),
              "op_table": {"profiled": "the ladder's strongest fixed configuration (sections run independently: "
                                       "the best ladder row is not known here)",
                           "config": changes, "batch": batch, "xla_flags": list(xla_flags),
                           "steps_traced": table["steps_traced"], "busy_s": table["busy_s"], "device": table["device"]}}
    half = batch // 2
    if half < 1:
        return {**result, "batch_split": f"not measured: batch {batch} has no half"}
    if dry_run and settings["device"]["backend"] == "cpu":  # proves plumbing: the same process at another batch
        return {**result, "batch_split": HALF_NOT_IN_DRY_RUN}
    try:
        smaller = traced(out + ".half.json", overrides, half, env)
    except RuntimeError as e:  # the full batch's table still counts
        return {**result, "batch_split": process.one_line(e)}
    return {**result, "by_part_half_batch": {"batch": half, "by_part": smaller["by_part"]},
            "batch_split": batch_split(smaller["by_part"], half, table["by_part"], batch)}


def traced(out: str, overrides: list, batch: int, env: dict) -> dict:
    """One op table run (`bench.campaign.op_table`) at `batch`, in a process of its own."""
    done = process.run(process.python("bench.campaign.op_table", "--config", model.CONFIG, "--out", out,
                                      *overrides, f"train.global_batch={batch}"),
                       env=env, limit_s=OP_TABLE_LIMIT_S, prefix="  [op_table]")
    if not done.ok:
        raise RuntimeError(f"bench.campaign.op_table at batch {batch}: {done.failure(OP_TABLE_LIMIT_S)}")
    with open(out) as f:
        return json.load(f)


def batch_split(small: dict, small_batch: int, large: dict, large_batch: int) -> dict:
    """Each part's seconds (op table `by_part`, at two batches) as a line in the batch:
    t(b) = per_step_s + b · per_sequence_s, through the two measured points. What a step pays
    once (the optimizer, casts and copies of the parameters and gradients) against what grows
    with its sequences: the planner's per-step and per-token costs, measured apart (issue 40;
    one profile cannot tell them apart, and by differencing two ladder runs a step paid ~29 ms
    the planner prices as 11)."""
    split = {}
    for part in sorted(set(small) | set(large)):
        t_small, t_large = small.get(part, 0.0), large.get(part, 0.0)
        per_sequence = (t_large - t_small) / (large_batch - small_batch)
        split[part] = {"per_sequence_s": per_sequence, "per_step_s": t_large - large_batch * per_sequence}
    return split
