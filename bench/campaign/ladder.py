"""Campaign section b, the MFU ladder on one device: one MegaScale technique added per row.

    serial_dense_adamw  serial block, full causal attention (XLA), AdamW
    parallel_block      + the parallel block (one shared LayerNorm)
    sliding_window      + a sliding window (still XLA: the masked scores are all computed)
    fused_attention     + the faster of cuDNN's and the Pallas window attention
    fused_norm_gelu     + the Pallas LayerNorm and bias+GeLU kernels, at the largest batch they
                          then fit (they keep less for the backward; kept below only if faster)
    xla_flags           + tuned XLA flags (kept below only if faster)
    remat               + the faster of model.remat=elementwise and =dots, each at the largest batch
                          that then fits (kept below only if faster)
    lamb_4x_batch       + LAMB at 4x the global batch, by 4 microbatches of gradient accumulation
    dense_twin          the best row above again at window=null (MFU with full attention's FLOPs)
    dense_at_peer_batch with --batch, where the twin ran at another batch: the fastest AdamW row
                        at --batch again at window=null (the dense PyTorch peers' work)

Each row is `python -m bench.parallel.train_step` in its own process (`process`): XLA reads
XLA_FLAGS once per process, and an out-of-memory death or an XLA abort ends that row only. In a dry
run on the CPU (which proves plumbing) only the Pallas attention row trains;
the rows whose code the unit tests train (CPU_VALIDATE) are validated (`validated`: config checked,
estimate traced) and recorded as skipped, saying which tests train them. Before a
row starts, its batch is picked from the memory estimate (`model.pick_batch`); a row
that cannot fit even one sequence is recorded as "does not fit: ..." and never compiled. MFU
counts the FLOPs of the row's own model (window-aware, `megascale_jax.model.flops`), so a
window that XLA computes in full shows as *lower* MFU: the masked work is not useful work.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time

from bench.campaign import model, process

BASELINE = {"model.block": "serial", "model.window": "null", "model.attention": "xla", "optim.name": "adamw",
            "model.fused_norm": "false", "model.fused_mlp": "false", "model.remat": "none",
            "model.scan_unroll": 1}  # the layer scan rolled, as before configs/gpt_1b.yaml unrolled it: a lever
WINDOW = {False: 512, True: 16}  # keyed by dry_run; the dry run's sequence is 64 tokens
# Flags that exist in XLA:GPU (an unknown flag aborts the process) and matter on one GPU: the
# latency-hiding scheduler orders async work; double buffering overlaps the layer scan's
# parameter reads with the previous layer's compute.
TUNED_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",
                   "--xla_gpu_enable_while_loop_double_buffering=true")
LAMB_MICROBATCHES = 4
REMAT_CANDIDATES = ("elementwise", "dots")


def strongest_fixed(settings: dict) -> tuple[dict, tuple]:
    """(config changes, XLA flags) of the ladder's strongest configuration that does not depend on
    which rows won, for the sections that cannot see the ladder's result (levers, the op table):
    parallel block, the window, cuDNN attention on a GPU (the H200's faster kernel) and XLA's
    elsewhere, AdamW, the layer scan unrolled (+10% on an H200, 2026-11-28), no XLA flags: on an
    H200 the tuned flags gained 0.5% at 4 sequences (2026-11-23), lost 7% at 8 (2026-11-27) and
    did nothing at 8 (2026-11-28), so they are a lever, not the base."""
    gpu = settings["device"]["backend"] == "gpu"
    layers = model.load(model.base_overrides(settings["dry_run"])).model.layers
    changes = {**BASELINE, "model.block": "parallel", "model.window": WINDOW[settings["dry_run"]],
               "model.attention": "cudnn" if gpu else "xla", "model.scan_unroll": layers}
    return changes, ()


# In a dry run on the CPU (which proves the campaign's plumbing, and costs CI time per row) these
# rows are validated (`validated`), not trained: their code is trained by the unit tests named,
# and the rows that are trained (the Pallas attention row, in interpret mode, and the levers'
# base) prove a trained row's plumbing. How the ladder carries a row that won, or not, is
# tests/test_gpu_campaign.py's, with rows of made-up speeds. --tiny on a GPU trains every row.
CPU_VALIDATE = {
    "serial_dense_adamw": "the serial block's gradients are tests/model/test_model.py's; the levers' base trains "
                          "XLA's attention and AdamW",
    "fused_norm_gelu": "the Pallas norm and bias+GeLU kernels train like XLA in tests/model/test_kernels_in_model.py",
    "remat": "remat's loss, gradients and memory are tests/model/test_levers.py's and test_model.py's",
    "lamb_4x_batch": "LAMB at 4 microbatches is tests/training/test_lamb_batch.py's and test_optim.py's",
    "dense_twin": "the Pallas kernel's full causal attention is tests/kernels/test_kernels.py's",
}
STEPS = {False: (6, 2), True: (3, 1)}  # (train.steps, warm-up steps left out), keyed by dry_run
ROW_LIMIT_S = {False: 240, True: 120}
# A row is not started with less than this left before the section's deadline (--budget-s): on an
# H200 a 1.4B row took 20-45 s (compile, 6 steps), so one started later would only be killed.
MIN_ROW_S = 30


@dataclasses.dataclass
class Ladder:
    """Runs rows for one device; `settings` as the campaign passes them to its sections."""

    settings: dict
    work_dir: str

    @property
    def dry_run(self) -> bool:
        return self.settings["dry_run"]

    def row(self, name: str, changes: dict, microbatches: int = 1, batch: int | None = None,
            xla_flags: tuple = (), largest: bool = False, dry_run_skip: str = "", cpu_validate: str = "") -> dict:
        """Measure one row with `changes` as config overrides; `batch` sequences per microbatch
        (None: the campaign's --batch, else the largest the estimate allows; `largest`: the
        largest, whatever --batch says). `dry_run_skip`: why a dry run (which proves code paths,
        and costs CI time per row) need not run it. `cpu_validate`: why a dry run on the CPU need
        not train it (the unit tests named there train its code): it is validated instead
        (`validated`), not trained. The row is appended to the section's progress file."""
        row = self._row(name, changes, microbatches, batch, xla_flags, largest, dry_run_skip, cpu_validate)
        if self.settings.get("progress_file"):
            with open(self.settings["progress_file"], "a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    def time_left(self) -> float | None:
        """Seconds until the section's deadline (None: no deadline)."""
        deadline = self.settings.get("deadline")
        return None if deadline is None else deadline - time.time()

    def _row(self, name: str, changes: dict, microbatches: int, batch: int | None, xla_flags: tuple,
             largest: bool, dry_run_skip: str, cpu_validate: str = "") -> dict:
        overrides = row_overrides(self.dry_run, changes, microbatches)
        limit = self.settings["device"]["memory_limit_bytes"]
        if not largest:
            batch = batch or self.settings.get("batch")  # --batch: the same for every row
        if batch is None:
            batch, estimate = model.pick_batch(overrides, limit, self.dry_run, microbatches)
        else:
            estimate = model.estimate_bytes([*overrides, f"train.global_batch={batch * microbatches}"])
        row = {"name": name, "config": dict(changes), "microbatches": microbatches, "batch": batch,
               "global_batch": None if batch is None else batch * microbatches, "estimate_bytes": estimate,
               "xla_flags": list(xla_flags)}
        if batch is None or (limit is not None and estimate > model.HEADROOM * limit):
            return {**row, "error": model.does_not_fit(estimate, limit)}
        if changes.get("model.attention") == "cudnn" and self.settings["device"]["backend"] != "gpu":
            return {**row, "skipped": "skipped: needs a GPU"}
        if self.dry_run and dry_run_skip:
            return {**row, "skipped": f"skipped in the dry run: {dry_run_skip}"}
        steps, skip = STEPS[self.dry_run]
        if self.dry_run and cpu_validate and self.settings["device"]["backend"] == "cpu":
            return {**row, **validated([*overrides, f"train.global_batch={batch * microbatches}",
                                        f"train.steps={steps}"], cpu_validate)}
        left = self.time_left()
        if left is not None and left < MIN_ROW_S:
            return {**row, "skipped": f"skipped: not started, {max(left, 0):.0f} s left of the section's time "
                                      f"(--budget-s; a row needs {MIN_ROW_S})"}
        limit_s = ROW_LIMIT_S[self.dry_run] if left is None else min(ROW_LIMIT_S[self.dry_run], left)
        out = os.path.join(self.work_dir, f"{name}.json")
        env = dict(os.environ)
        if xla_flags:
            env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *xla_flags]).strip()
        command = process.python(
            "bench.parallel.train_step", "--config", model.CONFIG, "--name", name, "--out", out, "--skip", str(skip),
            "--run-dir", os.path.join(self.work_dir, name),
            *overrides, f"train.global_batch={batch * microbatches}", f"train.steps={steps}")
        done = process.run(command, env=env, limit_s=limit_s, prefix=f"  [{name}]")
        if not done.ok:
            return {**row, "error": done.failure(limit_s)}
        with open(out) as f:
            result = json.load(f)
        return {**row, **{k: result[k] for k in ("step_time_s", "tokens_per_s", "mfu", "peak_bytes_in_use",
                                                   "final_loss", "steps_measured", "data_wait_s")}}


VALIDATED = "its config loaded with every check the trainer makes, its forward and backward traced for its estimate"


def validated(overrides: list[str], why: str) -> dict:
    """A dry-run row that is not trained (`Ladder.row`'s `cpu_validate`): its overrides loaded
    and checked as `megascale_jax.train` would check them first (its memory estimate, already
    computed, traced its model's forward and backward), as a "skipped" row that says so; a
    configuration the checks refuse is the row's one-line error."""
    from megascale_jax.config import load_config

    try:
        load_config(model.CONFIG, overrides)
    except Exception as e:  # noqa: BLE001 — a refused configuration is this row's error, not the section's
        return {"error": f"config check: {process.one_line(e)}"}
    return {"skipped": f"skipped in the dry run: {why}", "validated": VALIDATED}


def row_overrides(dry_run: bool, changes: dict, microbatches: int = 1) -> list[str]:
    """Config overrides of a row, batch aside (`pick_batch` adds it)."""
    return model.base_overrides(dry_run) + [
        f"{k}={v}" for k, v in {**changes, "parallel.microbatches": microbatches}.items()]


def measured(row: dict) -> bool:
    return "tokens_per_s" in row


def faster(row: dict, before: dict) -> bool:
    """Whether `row` beat the row before it (both measured): the condition for keeping its change."""
    return measured(row) and measured(before) and row["tokens_per_s"] > before["tokens_per_s"]


def run(settings: dict) -> dict:
    model.host_only_jax()
    work_dir = tempfile.mkdtemp(prefix="campaign-ladder-")  # the rows' run directories and results
    try:
        return climb(Ladder(settings, work_dir))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def climb(ladder: Ladder) -> dict:
    """Every row in order, each adding one technique to the configuration of the row before."""
    dry_run = ladder.dry_run
    config = dict(BASELINE)
    rows = [ladder.row("serial_dense_adamw", config, cpu_validate=CPU_VALIDATE["serial_dense_adamw"])]
    # The levers' base runs the parallel block with the window (`strongest_fixed`): in the dry run
    # (which proves code paths, and costs CI time per row) these two rows are not run again.
    levers_run = "the levers' base runs this configuration's code"
    config["model.block"] = "parallel"
    rows.append(ladder.row("parallel_block", config, dry_run_skip=levers_run))
    config["model.window"] = WINDOW[dry_run]
    rows.append(ladder.row("sliding_window", config, dry_run_skip=levers_run))

    candidates = [ladder.row(f"fused_attention_{impl}", {**config, "model.attention": impl})
                  for impl in ("cudnn", "pallas")]
    rows.append(fastest_of("fused_attention", candidates, config))
    if measured(rows[-1]):  # else neither ran, and the next rows keep XLA attention
        config["model.attention"] = rows[-1]["config"]["model.attention"]

    # The Pallas norm and bias+GeLU keep less for the backward than XLA's fusions (H200,
    # 2026-11-27, batch 8: 49.7 against 75.0 GiB at the same speed), so, like remat below, they
    # run at the largest batch that then fits. Kept for the rows below only where faster: a kernel
    # that loses to XLA's own fusion is not a technique this configuration should carry on.
    fused = {**config, "model.fused_norm": "true", "model.fused_mlp": "true"}
    rows.append(ladder.row("fused_norm_gelu", fused, largest=True, cpu_validate=CPU_VALIDATE["fused_norm_gelu"]))
    rows[-1]["kept"] = faster(rows[-1], rows[-2])
    if rows[-1]["kept"]:
        config = fused
    # `carried`: the measured row whose configuration the next rows build on
    carried = rows[-1] if rows[-1]["kept"] else last_measured(rows[:-1])
    rows.append(ladder.row("xla_flags", config, batch=carried.get("batch"), xla_flags=TUNED_XLA_FLAGS,
                           dry_run_skip="XLA:CPU ignores XLA:GPU flags (the row above's program)"))
    # Kept only where faster, like the kernels: on an H200 they gained 0.5% at 4 sequences
    # (2026-11-23) and lost 7% at 8 (2026-11-27).
    rows[-1]["kept"] = faster(rows[-1], carried)
    flags = TUNED_XLA_FLAGS if rows[-1]["kept"] else ()
    if rows[-1]["kept"]:
        carried = rows[-1]
    # Rematerialisation trades recomputed FLOPs for memory; it pays only where the memory buys a
    # larger batch that runs faster, so each candidate takes the largest batch the estimate then
    # allows: elementwise (norms and activation from their inputs: ~no FLOPs) and dots.
    candidates = [ladder.row(f"remat_{policy}", {**config, "model.remat": policy}, xla_flags=flags,
                             largest=True, cpu_validate=CPU_VALIDATE["remat"]) for policy in REMAT_CANDIDATES]
    rows.append(fastest_of("remat", candidates, config))
    rows[-1]["kept"] = faster(rows[-1], carried)
    if rows[-1]["kept"]:
        config, carried = dict(rows[-1]["config"]), rows[-1]

    # Same memory per microbatch as the configuration carried this far, four of them per step.
    config = {**config, "optim.name": "lamb"}
    rows.append(ladder.row("lamb_4x_batch", config, microbatches=LAMB_MICROBATCHES, batch=carried.get("batch") or 1,
                           xla_flags=flags, cpu_validate=CPU_VALIDATE["lamb_4x_batch"]))
    rows.append(dense_twin(ladder, rows))
    if (same_batch := dense_at_batch(ladder, rows)) is not None:
        rows.append(same_batch)
    return {"config": os.path.relpath(model.CONFIG, model.REPO), "window": WINDOW[dry_run],
            "rows": rows}


def last_measured(rows: list[dict]) -> dict:
    """The last row of `rows` that was measured ({} if none was)."""
    return next((r for r in reversed(rows) if measured(r)), {})


def fastest_of(name: str, candidates: list[dict], config: dict) -> dict:
    """Row `name`: the fastest measured candidate, with every candidate beside it; where none ran,
    a row of `config` (the configuration carried so far) whose error says why each did not."""
    timed = [c for c in candidates if measured(c)]
    if timed:
        return {**max(timed, key=lambda c: c["tokens_per_s"]), "name": name, "candidates": candidates}
    if all("validated" in c for c in candidates):  # a dry run on the CPU: validated, none trained
        return {"name": name, "config": dict(config), "candidates": candidates,
                "skipped": "skipped in the dry run: every candidate validated, none trained"}
    return {"name": name, "config": dict(config), "candidates": candidates,
            "error": "; ".join(f"{c['name']}: {c.get('error') or c.get('skipped')}" for c in candidates)}


def dense_twin(ladder: Ladder, rows: list[dict]) -> dict:
    """The best row (highest MFU, or tokens/s where no row has an MFU) again at window=null, its
    batch, microbatches and flags kept: its MFU counted with full causal attention's FLOPs, so a
    window's smaller count cannot flatter the best number (issue 36, item 1)."""
    timed = [r for r in rows if measured(r)]
    if not timed:
        return {"name": "dense_twin", "config": {}, "error": "no row of the ladder was measured"}
    rated = [r for r in timed if r.get("mfu") is not None]
    best = max(rated, key=lambda r: r["mfu"]) if rated else max(timed, key=lambda r: r["tokens_per_s"])
    twin = ladder.row("dense_twin", {**best["config"], "model.window": "null"}, microbatches=best["microbatches"],
                      batch=best["batch"], xla_flags=tuple(best["xla_flags"]), cpu_validate=CPU_VALIDATE["dense_twin"])
    return {**twin, "twin_of": best["name"]}


def dense_at_batch(ladder: Ladder, rows: list[dict]) -> dict | None:
    """With --batch (the PyTorch peer's batch) where the dense twin ran at another batch (a remat
    row's larger one): the fastest AdamW row of one microbatch at that batch again at window=null,
    so that the dense peers have a row of ours doing their work (issue 36: ≥ 1.15× the dense
    peer). None where there is no such row or the twin already is one."""
    batch = ladder.settings.get("batch")
    twin = rows[-1]
    if batch is None or (measured(twin) and twin["batch"] == batch and twin["microbatches"] == 1):
        return None
    same = [r for r in rows if measured(r) and r["batch"] == batch and r["microbatches"] == 1
            and r["config"].get("optim.name") == "adamw" and str(r["config"].get("model.window")) != "null"]
    if not same:
        return None
    best = max(same, key=lambda r: r["tokens_per_s"])
    row = ladder.row("dense_at_peer_batch", {**best["config"], "model.window": "null"}, batch=batch,
                     xla_flags=tuple(best["xla_flags"]))
    return {**row, "twin_of": best["name"]}
