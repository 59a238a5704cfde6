"""Published measurements this project did not produce, as planner workloads.

* Megatron-LM weak scaling, Narayanan et al. SC'21, Table 1 (A100 80GB, Selene, 8 GPUs and 8 HDR
  NICs per node): achieved teraFLOP/s per GPU by Megatron's own count, 96·B·s·l·h²·(1 + s/6h +
  V/16lh) (full activation recomputation). Read from NVIDIA/Megatron-LM: the table image
  images/cases_april2021.png (commit 50a4b5f) and the paper's scripts examples/sc21/run_table_1.sh
  and CONFIG.sh (commit de7dc40): tp/pp split, attention heads, microbatch size, layers per
  virtual stage, `--DDP-impl torch` up to 18B and `local` from 39B, fp16, seq 2048, vocab
  51,200, `--checkpoint-activations` on every model.
* Korthikanti et al. 2022 ("Reducing Activation Recomputation"), Table 5: iteration seconds with
  full recomputation and with selective recomputation + sequence parallelism, dp = 1. Values as
  transcribed in calculon-ai/calculon calculon/llm/validation.py (seqsel_tab5), configurations
  from its models/*.json and validation/seqsel/tab5/*.json (interleaving 3 for 175B and 530B).

* MegaScale, Jiang et al., NSDI '24 (arXiv 2402.15627), §6.1: Table 2 (175B, A100, 8 x 200 Gb/s
  NICs per node, TP 8, PP 8, interleaved with 6 virtual stages, seq 2048, vocab 64,000, 128
  heads; iteration seconds of Megatron-LM commit 285068c8 and of MegaScale at 256-12,288 GPUs)
  and Table 3 (MFU after each optimization, 175B on 256 GPUs, batch 256, the last row batch 768).
  Read from the paper's text as stored in the code corpus (the full paper, Tables 1-3).
* Llama 3, "The Llama 3 Herd of Models" (arXiv 2407.21783, §3.3.2, Table 4): 405B on 8,192 and
  16,384 H100s (TP 8, PP 16, DP 64/128, seq 8,192, 16M tokens per batch): 430 and 400 BF16
  TFLOP/s per GPU, in PaLM's MFU definition (the paper cites Chowdhery et al. 2023 for it:
  6N + 12·L·H·Q·T FLOPs per token, `palm_flops_per_token`). Its third row (context parallelism 16
  at seq 131,072) is not used: the planner does not model context parallelism.

Where a source leaves a setting out, the choice made here is written beside the workload and was
made before the comparison was run. `validation.py` predicts every row, each source with a
calibration that no value of which was fitted to that source.
"""

from __future__ import annotations

import dataclasses

from megascale_jax.model import flops
from megascale_jax.planner import calibration
from megascale_jax.planner.predict import layer_times, predict, sharded_gradient_link
from megascale_jax.planner.workload import Workload, model_config

SEQ, VOCAB = 2048, 51200

# (name, heads, hidden, layers, tp, pp, gpus, global batch, microbatch, layers per virtual stage,
#  published TFLOP/s per GPU)
MEGATRON_SC21 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, None, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, None, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, None, 142),
    ("18B", 48, 6144, 40, 8, 1, 256, 1024, 8, None, 135),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536, 4, None, 138),
    ("76B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 5, 140),
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 5, 148),
    ("310B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 3, 155),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 1, 163),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 1, None, 163),
]

# (name, heads, hidden, layers, tp, pp, gpus, global batch, microbatch, virtual, full s, selective+SP s)
KORTHIKANTI_TAB5 = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49),
]


def megatron_workload(heads, hidden, layers, tp, pp, gpus, batch, micro, virtual, recompute="full",
                      sequence_parallel=False, dp_overlap="none") -> Workload:
    dp = gpus // (tp * pp)
    return Workload(
        layers=layers, d_model=hidden, heads=heads, kv_heads=heads, head_dim=hidden // heads,
        mlp_dim=4 * hidden, vocab=VOCAB, seq_len=SEQ, window=None, block="serial", global_batch=batch,
        gpus=gpus, tp=tp, pp=pp, virtual=virtual, microbatches=batch // (dp * micro),
        schedule="interleaved_1f1b" if virtual > 1 else ("1f1b" if pp > 1 else "gpipe"),
        recompute=recompute, sequence_parallel=sequence_parallel, zero1=False, fused_attention=False,
        tp_overlap=False, pp_async=False, pp_split_over_tp=True, edge_on_every_stage=False,
        dp_overlap=dp_overlap, activation_bytes=2, grad_bytes=4, param_bytes=2,
        megatron_optimizer=True, gradient_norm=True, tied_embedding=True)


def sc21_workload(row) -> Workload:
    _, heads, hidden, layers, tp, pp, gpus, batch, micro, per_virtual, _ = row
    virtual = layers // pp // per_virtual if per_virtual else 1
    torch_ddp = gpus <= 256  # `--DDP-impl torch` (overlapping the backward) up to 18B
    w = megatron_workload(heads, hidden, layers, tp, pp, gpus, batch, micro, virtual,
                          dp_overlap="backward" if torch_ddp else "none")
    # torch DDP keeps autograd's param.grad, no main_grad accumulator (Megatron's local DDP adds
    # one, `_make_param_hook`): nothing to accumulate at one microbatch (1.7B-7.5B); the 18B row's
    # 3 fp16 adds into param.grad are not priced (under 1% of its iteration)
    return dataclasses.replace(w, grad_accumulator=not torch_ddp)


def sc21_flops(row) -> float:
    """Megatron's FLOPs per iteration with recomputation: 96·B·s·l·h²·(1 + s/6h + V/16lh)."""
    _, _, h, l, *_ = row
    batch = row[7]
    return 96 * batch * SEQ * l * h**2 * (1 + SEQ / (6 * h) + VOCAB / (16 * l * h))


def tab5_workload(row, selective: bool) -> Workload:
    """Korthikanti et al.'s runs, on the Megatron-LM of 2022 (sequence parallelism came in March
    2022): its backward overlaps the column-parallel linears' input-gradient collectives with their
    weight-gradient GEMMs (`tp_backward_overlap`: the asynchronous all-reduce without sequence
    parallelism, the reduce-scatter and the input's re-gather with it; Megatron-LM commits
    cf7efd4 of Aug 2021 and 02bb1f5 of Mar 2022)."""
    _, heads, hidden, layers, tp, pp, gpus, batch, micro, virtual, _, _ = row
    w = megatron_workload(heads, hidden, layers, tp, pp, gpus, batch, micro, virtual,
                          recompute="selective" if selective else "full", sequence_parallel=selective)
    return dataclasses.replace(w, tp_backward_overlap=True)


# ------------------------------------------------------------------ MegaScale (NSDI '24)

# Table 2: (batch, GPUs, Megatron-LM iteration s, MegaScale iteration s). The paper's MFU and
# throughput columns follow from these (throughput = batch x 2048 / iteration).
MEGASCALE_TAB2 = [
    (768, 256, 40.0, 32.0), (768, 512, 21.2, 16.5), (768, 768, 15.2, 11.5), (768, 1024, 11.9, 8.9),
    (6144, 3072, 29.02, 23.66), (6144, 6144, 14.78, 12.21), (6144, 8192, 12.24, 9.56), (6144, 12288, 8.57, 6.34),
]
# Table 2's MFU column for the same rows (Megatron-LM, MegaScale), for the speedups.
MEGASCALE_TAB2_MFU = [(53.0, 65.3), (49.9, 63.5), (46.7, 61.3), (44.7, 59.0),
                      (48.7, 59.1), (47.8, 57.3), (43.3, 54.9), (41.2, 55.2)]

# Table 3: MFU (%) after each optimization, applied cumulatively, 175B on 256 GPUs, batch 256.
MEGASCALE_TAB3 = [
    ("baseline (Megatron-LM)", 47.7), ("(1) parallel transformer block", 52.3), ("(2) sliding window attention", 53.3),
    ("(3) TP overlap", 55.5), ("(4) PP overlap", 58.0), ("(5) DP overlap", 59.5),
    ("(6) efficient operators", 61.2), ("(7) misc (data pipeline, problematic code)", 62.3),
    ("(8) LAMB, batch x3", 65.3),
]

# The paper gives no window size. Chosen: 1,024 (half the sequence). A check, not an input:
# Table 2's MFU and throughput imply 1.06e12 FLOPs per token for MegaScale against 1.077e12 for
# Megatron-LM, the difference an attention term counted over ~900-1,000 keys instead of 2,048.
MEGASCALE_WINDOW = 1024
MEGASCALE_VOCAB = 64000


def megascale_baseline(gpus: int, batch: int) -> Workload:
    """Megatron-LM (commit 285068c8, 2023) as MegaScale ran it: serial block, the interleaved
    schedule with 6 virtual stages, and (not stated in the paper; chosen as that Megatron's
    recommended 175B setting, without which 175B does not fit at microbatch 1) selective
    recomputation with sequence parallelism and the distributed optimizer (ZeRO-1: fp32 gradients
    reduce-scattered, bf16 parameters all-gathered, after the backward). Microbatch: 1 sequence
    (not stated). Attention: Megatron's unfused softmax (FlashAttention-2 is one of MegaScale's
    "efficient operators"). Pipeline sends: blocking, batched send/recv (MegaScale §3.2). Its
    backward's asynchronous tp communication (`tp_backward_overlap`: the column-parallel linears'
    reduce-scatters behind their weight-gradient GEMMs, the inputs' re-gathers behind the
    input-gradient GEMMs; megatron/core/tensor_parallel/layers.py at 285068c8)."""
    w = megatron_workload(128, 12288, 96, 8, 8, gpus, batch, 1, 6, recompute="selective", sequence_parallel=True)
    return dataclasses.replace(w, vocab=MEGASCALE_VOCAB, zero1=True, param_bytes=2, tp_backward_overlap=True)


# Each optimization of Table 3 as the mechanism it changes (MegaScale §3), applied in order.
MEGASCALE_STEPS = [
    # one shared norm; QKV and MLP-up one GEMM; one tp all-gather and reduce-scatter per pass, not two
    ("(1) parallel transformer block", dict(block="parallel", fused_block_gemms=True)),
    # attention scores over the window's keys only
    ("(2) sliding window attention", dict(window=MEGASCALE_WINDOW, banded_window=True)),
    # all-gather / reduce-scatter fused into the FFN GEMMs, chunked and pipelined (collective matmul)
    ("(3) TP overlap", dict(tp_overlap=True)),
    # send and receive decoupled and asynchronous, behind the tick's compute
    ("(4) PP overlap", dict(pp_async=True)),
    # per-chunk all-gather before the forward and reduce-scatter after the backward
    ("(5) DP overlap", dict(dp_overlap="chunks")),
    # FlashAttention-2: scores never stored, so the attention core needs no recompute
    ("(6) efficient operators", dict(fused_attention=True, recompute="none")),
    # prefetching and one loader per node: the planner charges the baseline no data time either,
    # so it prices this step at zero (no published measurement of the baseline's data wait)
    ("(7) misc (data pipeline, problematic code)", dict()),
    # LAMB's per-layer trust ratio (its optimizer passes: predict.optimizer_s); the batch, below
    ("(8) LAMB, batch x3", dict(optimizer="lamb")),
]


def megascale_workload(gpus: int, batch: int, steps: int = len(MEGASCALE_STEPS)) -> Workload:
    """The baseline with the first `steps` optimizations of Table 3 (all of them by default)."""
    w = megascale_baseline(gpus, batch)
    for _, change in MEGASCALE_STEPS[:steps]:
        if change:
            w = dataclasses.replace(w, **change)
    return w


def megascale_rows(gpu: calibration.Gpu) -> list[dict]:
    rows = []
    for (batch, gpus, megatron_s, megascale_s) in MEGASCALE_TAB2:
        for system, w, published in (("Megatron-LM", megascale_baseline(gpus, batch), megatron_s),
                                     ("MegaScale", megascale_workload(gpus, batch), megascale_s)):
            pred = predict(w, gpu).iteration_s
            rows.append({"source": "MegaScale NSDI'24 Table 2", "model": "175B", "gpus": gpus,
                         "metric": f"iteration s, {system}, batch {batch}", "published": published,
                         "predicted": round(pred, 3), "error": pred / published - 1})
    return rows


def megascale_equal_work_pairs() -> list[dict]:
    """Table 2's rows that give every GPU the same work (same layout, same microbatches per
    iteration m = batch / dp) at two data-parallel sizes: 1,024 and 8,192 GPUs (m = 48), 768 and
    6,144 (m = 64). The planner prices each pair within 0.5% (its dp costs do not grow with dp
    beyond the ring's (n-1)/n and latency steps, milliseconds here); the published slowdown at
    the larger dp, per system, is what a model of scale would have to explain."""
    rows = {(n, b): (mt, ms) for b, n, mt, ms in MEGASCALE_TAB2}
    out = []
    for small, large in (((1024, 768), (8192, 6144)), ((768, 768), (6144, 6144))):
        for i, system in enumerate(("Megatron-LM", "MegaScale")):
            out.append({"system": system, "gpus": [small[0], large[0]], "dp": [small[0] // 64, large[0] // 64],
                        "microbatches": small[1] // (small[0] // 64),
                        "published_s": [rows[small][i], rows[large][i]],
                        "slowdown": round(rows[large][i] / rows[small][i] - 1, 4)})
    return out


def megascale_ablation(gpu: calibration.Gpu) -> list[dict]:
    """Table 3 beside the planner: each row's MFU and its gain over the previous row. 256 GPUs,
    batch 256; the last row at batch 768.

    Each row's MFU counts that row's own model FLOPs: from step (2) on, attention over the
    window's keys. That is the paper's convention: Table 3's last row is Table 2's 256-GPU
    MegaScale row (65.3%), and Table 2's MFU and throughput columns imply 1.061-1.074e12 FLOPs a
    token for MegaScale against 1.074-1.081e12 for Megatron-LM (`table2_flops_per_token`), the
    window-counted and the dense count of this model. So the window's own step gains only what
    it saves beyond the FLOPs it stops counting."""
    rows, previous = [], None
    for i, (name, published) in enumerate(MEGASCALE_TAB3):
        batch = 768 if name.startswith("(8)") else 256
        w = megascale_workload(256, batch, steps=min(i, len(MEGASCALE_STEPS) - 1))
        mfu = 100 * predict(w, gpu).mfu
        row = {"step": name, "published_mfu": published, "predicted_mfu": round(mfu, 2)}
        if previous:
            row["published_gain"] = round(published - previous["published_mfu"], 2)
            row["predicted_gain"] = round(mfu - previous["predicted_mfu"], 2)
        rows.append(row)
        previous = row
    return rows


def table2_flops_per_token() -> list[dict]:
    """The model FLOPs a token each Table 2 row's MFU counts: MFU × GPUs × 312 TFLOP/s (A100 bf16
    peak) / tokens a second (batch × 2,048 / iteration s), for both systems."""
    out = []
    for (batch, gpus, megatron_s, megascale_s), mfus in zip(MEGASCALE_TAB2, MEGASCALE_TAB2_MFU):
        counts = [mfu / 100 * gpus * 312e12 / (batch * SEQ / seconds)
                  for mfu, seconds in zip(mfus, (megatron_s, megascale_s))]
        out.append({"gpus": gpus, "batch": batch, "megatron_lm": counts[0], "megascale": counts[1]})
    return out


# ------------------------------------------------------------------ Llama 3 (H100)

# Table 4: (GPUs, DP, sequences per DP replica, published BF16 TFLOP/s per GPU)
LLAMA3_TAB4 = [(8192, 64, 32, 430), (16384, 128, 16, 400)]
# Llama 3 405B (Table 3 of the paper): 126 layers, model dim 16,384, FFN 53,248, 128 heads,
# 8 key/value heads, vocab 128,000, SwiGLU.
LLAMA3_405B = dict(layers=126, d_model=16384, heads=128, kv_heads=8, head_dim=128, mlp_dim=53248, vocab=128000)


def llama3_workload(gpus: int, dp: int, per_replica: int) -> Workload:
    """Llama 3 405B pre-training on H100s as §3.3.2 describes it: TP 8, PP 16, FSDP over dp
    (gradients and optimizer states sharded, parameters gathered once: ZeRO-1-like, gathered and
    reduced chunk by chunk), no activation recomputation, one layer fewer on the first and last
    stage (126 layers as 16 stages of 8 slots, the embedding and the head in the freed slots).
    Asynchronous pipeline sends ("we adopt asynchronous point-to-point communication in PP", §3.3.2)
    and fp32 gradient reduce-scatter ("reduce-scatter gradients in FP32", same section), every
    microbatch: FSDP keeps the gradients sharded ("Our use of FSDP for Llama 3 shards optimizer
    states and gradients, but for model shards we do not reshard after forward computation",
    same section), so each microbatch's fp32 gradients are reduce-scattered over dp and added to
    the shard ("FP32 gradients accumulation during backward computation over multiple
    micro-batches"), and the parameters are gathered once (`predict.sharded_gradient_nic`).
    Not stated, chosen: one sequence per microbatch, 8 virtual stages (one layer per chunk, as the
    paper's "first chunk holds only the embedding" implies), fused attention, sequence
    parallelism without tp overlap."""
    m = LLAMA3_405B
    return Workload(
        layers=128, d_model=m["d_model"], heads=m["heads"], kv_heads=m["kv_heads"], head_dim=m["head_dim"],
        mlp_dim=m["mlp_dim"], vocab=m["vocab"], seq_len=8192, window=None, block="serial",
        global_batch=dp * per_replica, gpus=gpus, tp=8, pp=16, virtual=8, microbatches=per_replica,
        schedule="interleaved_1f1b", recompute="none", sequence_parallel=True, zero1=True, fused_attention=True,
        tp_overlap=False, pp_async=True, pp_split_over_tp=True, edge_on_every_stage=False, dp_overlap="chunks",
        activation_bytes=2, grad_bytes=4, param_bytes=2, gated_mlp=True, last_stage_layers=7, first_stage_layers=7,
        reduce_scatter_every_microbatch=True)


def palm_flops_per_token(params: float, layers: int, heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token as PaLM defines model FLOPs utilization (Chowdhery et al. 2023,
    "PaLM", Appendix B): 6N + 12·L·H·Q·T, N every parameter (embeddings included), the attention
    term over the whole sequence T (not halved for the causal mask). Llama 3 states its MFU in
    this definition ("BF16 Model FLOPs Utilization (MFU; Chowdhery et al. (2023))", §3.3.2).
    Checked against PaLM's own numbers in tests/planner (238.3K tokens/s on 6,144 TPU v4 = 46.2%)."""
    return 6 * params + 12 * layers * heads * head_dim * seq_len


def llama3_flops_per_token(w: Workload) -> float:
    """PaLM's count for the 126-layer model (the workload's 128 layer slots hold 2 empty ones)."""
    model = model_config(dataclasses.replace(w, layers=LLAMA3_405B["layers"]))
    return palm_flops_per_token(flops.param_count(model), LLAMA3_405B["layers"], w.heads, w.head_dim, w.seq_len)


def llama3_rows(gpu: calibration.Gpu) -> list[dict]:
    """TFLOP/s per GPU as Llama 3 counts them (PaLM's MFU definition, `palm_flops_per_token`)
    over the predicted iteration."""
    rows = []
    for gpus, dp, per_replica, published in LLAMA3_TAB4:
        w = llama3_workload(gpus, dp, per_replica)
        pred = predict(w, gpu)
        tflops = llama3_flops_per_token(w) * w.global_batch * w.seq_len / (pred.iteration_s * gpus) / 1e12
        rows.append({"source": "Llama 3 (2024) Table 4", "model": "405B", "gpus": gpus,
                     "metric": "BF16 TFLOP/s per GPU", "published": published, "predicted": round(tflops, 1),
                     "error": tflops / published - 1})
    return rows


def llama3_split(gpu: calibration.Gpu) -> dict:
    """Where Llama 3's gap lies: its two 8K rows differ only in the microbatches per replica
    (M = 32, 16; same model, layout and per-GPU microbatch), so with the paper's own bubble,
    (PP-1)/(V·M) of the microbatches' time (§3.3.2), each row's iteration is t·(M + (PP-1)/V) + C:
    t the seconds of one microbatch on the busiest stage (its layers forward and backward with
    their tp collectives), C what each iteration pays once (dp, optimizer, edges). Two rows, two
    unknowns; solved here for the published rows (their iteration = PaLM FLOPs / published rate)
    and set beside the planner's t and C."""
    (g1, dp1, m1, r1), (g2, dp2, m2, r2) = LLAMA3_TAB4
    w1, w2 = llama3_workload(g1, dp1, m1), llama3_workload(g2, dp2, m2)
    tail = (w1.pp - 1) / w1.virtual
    it1, it2 = (llama3_flops_per_token(w) * w.global_batch * w.seq_len / (r * 1e12 * g)
                for w, r, g in ((w1, r1, g1), (w2, r2, g2)))
    t = (it1 - it2) / (m1 - m2)
    p = predict(w1, gpu).breakdown
    planner_t = (p["compute"] + p["tp"]) / m1
    # the dp link's timeline (sharded gradients: a reduce-scatter per microbatch), for both rows
    links = []
    for w in (w1, w2):
        pred = predict(w, gpu)
        busy = pred.breakdown["compute"] + pred.breakdown["tp"]
        nic = sharded_gradient_link(w, gpu, layer_times(w, gpu), busy)
        links.append({"gpus": w.gpus, "compute_end_s": round(busy + pred.breakdown["bubble"] + pred.breakdown["pp"], 3),
                      **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in nic.items()},
                      "iteration_s": round(pred.iteration_s, 3)})
    return {"published_iteration_s": [round(it1, 3), round(it2, 3)],
            "published_microbatch_s": round(t, 4), "published_per_iteration_s": round(it1 - t * (m1 + tail), 3),
            "planner_microbatch_s": round(planner_t, 4),
            "planner_per_iteration_s": round(p["dp"] + p["optimizer"] + p["pp"] + p["data"], 3),
            "planner_dp_link": links}


def sc21_rows(gpu: calibration.Gpu) -> list[dict]:
    rows = []
    for row in MEGATRON_SC21:
        pred = predict(sc21_workload(row), gpu)
        tflops = sc21_flops(row) / (pred.iteration_s * row[6]) / 1e12
        rows.append({"source": "Narayanan et al. SC'21 Table 1", "model": row[0], "gpus": row[6],
                     "metric": "TFLOP/s per GPU", "published": row[-1], "predicted": round(tflops, 2),
                     "error": tflops / row[-1] - 1})
    return rows


def tab5_rows(gpu: calibration.Gpu) -> list[dict]:
    rows = []
    for row in KORTHIKANTI_TAB5:
        for selective, published in ((False, row[-2]), (True, row[-1])):
            pred = predict(tab5_workload(row, selective), gpu)
            rows.append({"source": "Korthikanti et al. 2022 Table 5", "model": row[0], "gpus": row[6],
                         "metric": "iteration s, " + ("selective recompute + SP" if selective else "full recompute"),
                         "published": published, "predicted": round(pred.iteration_s, 3),
                         "error": pred.iteration_s / published - 1})
    return rows


def validation_table(gpu_key: str = "a100-80g") -> list[dict]:
    """The two Megatron-LM sources' rows (SC'21 Table 1, Korthikanti Table 5): what was measured,
    what the planner predicts, and the relative error (predicted / published − 1)."""
    gpu = calibration.gpu(gpu_key)
    return sc21_rows(gpu) + tab5_rows(gpu)
