"""Campaign section f, levers: the one-GPU speed levers of issue 36, each alone on one base
configuration, with its measured change in tokens/s. Levers that lose stay in the table. They run
in the order of `measure`'s plan (what each tells that no other section measures first), not the
order listed here, so a call's budget that ends the section early keeps the most.

    base                 the ladder's strongest fixed configuration (`ladder.strongest_fixed`:
                         parallel block, the window, cuDNN attention on a GPU, the layer scan
                         unrolled, no XLA flags), AdamW, the largest batch that fits
    loss_chunks          + the loss in 8 sequence slices (model.loss_chunks: no whole fp32 logits)
    fp8                  + model.fp8=true (the layers' GEMMs in FP8, model/fp8.py) with Triton GEMMs
                         off: compiled for an H200 without a GPU, Triton GEMM fusions take FP8 dots
                         as bf16 products of upcast operands, cuBLAS takes them as cuBLASLt's FP8
                         GEMM (tests/aot asserts every layer GEMM); compare with triton_gemm_off
                         (the bf16 step with the same GEMM library) as well as the base (GPU only)
    scan_rolled          the layer scan rolled (model.scan_unroll=1; unrolled won +10% on an H200,
                         2026-11-28, and became configs/gpt_1b.yaml's default)
    head_grad_float32    + model.head_grad_float32: the LM head's backward GEMMs on the float32
                         logits' gradient, as before 2026-11-27 (the default runs them in bf16)
    fused_norm_gelu      + the Pallas LayerNorm and bias+GeLU kernels
    remat_elementwise    + model.remat=elementwise (norms and MLP activation recomputed in the
                         backward) at the largest batch that then fits
    remat_elementwise_same_batch  the same at the base's batch: what recomputing from bf16 inputs
                         saves in memory traffic, apart from the batch it buys (on an H200 the
                         remat row at 19 sequences took 15% less time a token than 8 without it)
    remat_dots           + model.remat=dots at the largest batch that then fits
    half_batch           the base at half its batch: what the batch buys
    no_donation          train.donate=false (the step's output state a second copy) at the largest
                         batch that then fits: what donating the state buys
    xla_flags            + the ladder's tuned XLA flags (GPU only)
    triton_gemm_off      + --xla_gpu_enable_triton_gemm=false: cuBLAS for every GEMM (GPU only)
    command_buffers_off  + --xla_gpu_enable_command_buffer= : no CUDA graphs (GPU only)
    cublaslt             + --xla_gpu_enable_cublaslt=true: GEMMs through cuBLASLt, whose epilogue
                         can take the bias (and GeLU) that XLA otherwise fuses apart (GPU only).
                         (XLA's horizontal fusion, a lever until 2026-11-28, has no flag in jax
                         0.11.2's XLA: `--xla_gpu_use_horizontal_fusion` aborted the process)

Each row is the MFU ladder's row runner (`ladder.Ladder.row`): its own process, its batch from the
memory estimate, a row that does not fit or fails is that row's one-line error. Each row's
`delta_tokens_per_s` and `delta_pct` are against the base row of this section, same run. In a
dry run on the CPU only the base trains; the others are validated or skipped
(CPU_VALIDATE, `ladder.validated`).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from bench.campaign import ladder, model

LOSS_CHUNKS = 8
# Levers whose configuration a ladder row also runs: in a dry run on the GPU (--tiny, which proves
# code paths) they are not run twice.
LADDER_RUNS = ("fused_norm_gelu", "remat_elementwise", "remat_elementwise_same_batch", "remat_dots")
# In a dry run on the CPU (which proves the campaign's plumbing, and costs CI time per row) these
# levers are validated (`ladder.validated`), not trained: the unit tests named train their code.
# The base is trained: a lever row's plumbing (each row's change against it is
# tests/test_gpu_campaign.py's, with made-up speeds).
CPU_VALIDATE = {
    "half_batch": "the base's configuration, trained at another batch",
    "loss_chunks": "the sliced loss's value and gradients are tests/model/test_levers.py's",
    "scan_rolled": "the ladder's rows train the rolled layer scan (the unrolled one's equality is tests/model/test_levers.py's)",
    "no_donation": "train.donate=false is tests/model/test_flops.py's",
    "fused_norm_gelu": ladder.CPU_VALIDATE["fused_norm_gelu"],
    "remat_elementwise": ladder.CPU_VALIDATE["remat"],
    "remat_elementwise_same_batch": ladder.CPU_VALIDATE["remat"],
    "remat_dots": ladder.CPU_VALIDATE["remat"],
}
GPU_FLAGS = {"xla_flags": ladder.TUNED_XLA_FLAGS,
             "triton_gemm_off": ("--xla_gpu_enable_triton_gemm=false",),
             "command_buffers_off": ("--xla_gpu_enable_command_buffer=",),
             "cublaslt": ("--xla_gpu_enable_cublaslt=true",),
             "fp8": ("--xla_gpu_enable_triton_gemm=false",)}
# Levers that change the configuration as well as the flags
FLAG_LEVER_CHANGES = {"fp8": {"model.fp8": "true"}}


def run(settings: dict) -> dict:
    model.host_only_jax()
    work_dir = tempfile.mkdtemp(prefix="campaign-levers-")
    try:
        return measure(ladder.Ladder(settings, work_dir))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def measure(runner: ladder.Ladder) -> dict:
    base, flags = ladder.strongest_fixed(runner.settings)
    gpu = runner.settings["device"]["backend"] == "gpu"
    # On a GPU the base row also dumps XLA's GEMM autotuning choices, for `plan --compile --xla-option
    # xla_gpu_load_autotune_results_from=FILE` to compile the program the GPU ran (docs/compile.md).
    autotune = os.path.join(runner.work_dir, "autotune_base.txt")
    dump = (f"--xla_gpu_dump_autotune_results_to={autotune}",) if gpu else ()
    first = runner.row("base", base, xla_flags=(*flags, *dump))
    batch = first.get("batch") or 1

    def lever(name: str, changes: dict, dry_run_skip: str = "", **how) -> dict:
        # (on the CPU a LADDER_RUNS row is validated, as the ladder's own row is)
        skip = "the ladder's dry run runs this configuration's code" if name in LADDER_RUNS and gpu else dry_run_skip
        return runner.row(name, changes, xla_flags=flags, dry_run_skip=skip, cpu_validate=CPU_VALIDATE.get(name, ""),
                          **how)

    def flag_lever(name: str) -> dict:  # an XLA:GPU flag added to the base's own
        row_flags, changes = (*flags, *GPU_FLAGS[name]), {**base, **FLAG_LEVER_CHANGES.get(name, {})}
        if not gpu:
            return {"name": name, "config": changes, "xla_flags": list(row_flags),
                    "skipped": "skipped: needs a GPU (XLA:GPU flags)"}
        return runner.row(name, changes, batch=batch, xla_flags=row_flags)

    # In the order of what each tells that no other section measures, so that a call whose budget
    # ends the section early keeps the most: the GEMM backend and the loss first; configurations
    # the ladder also runs (fused kernels, remat, the flags) later; the float32 head, whose GEMM
    # the 2026-11-27 profile already timed (15.5 ms, ~220 TFLOP/s), last.
    rows = [
        flag_lever("triton_gemm_off"),
        flag_lever("fp8"),
        lever("loss_chunks", {**base, "model.loss_chunks": LOSS_CHUNKS}, batch=batch),
        lever("scan_rolled", {**base, "model.scan_unroll": 1}, batch=batch),
        flag_lever("command_buffers_off"),
        flag_lever("cublaslt"),
        lever("remat_elementwise_same_batch", {**base, "model.remat": "elementwise"}, batch=batch),
        lever("no_donation", {**base, "train.donate": "false"}, largest=True),
        lever("half_batch", base, batch=max(1, batch // 2)),
        flag_lever("xla_flags"),
        lever("fused_norm_gelu", {**base, "model.fused_norm": "true", "model.fused_mlp": "true"}, batch=batch),
        lever("remat_elementwise", {**base, "model.remat": "elementwise"}, largest=True),
        lever("remat_dots", {**base, "model.remat": "dots"}, largest=True),
        lever("head_grad_float32", {**base, "model.head_grad_float32": "true"}, batch=batch,
              dry_run_skip="on a CPU the head's backward is float32 either way (transformer.mixed_dots_backend)"),
    ]
    for row in rows:
        if ladder.measured(row) and ladder.measured(first):
            row["delta_tokens_per_s"] = row["tokens_per_s"] - first["tokens_per_s"]
            row["delta_pct"] = 100 * row["delta_tokens_per_s"] / first["tokens_per_s"]
    tuned = None
    if os.path.exists(autotune):
        with open(autotune) as f:
            tuned = f.read()
    return {"config": base, "xla_flags": list(flags), "base": first, "rows": rows, "autotune_results": tuned}
