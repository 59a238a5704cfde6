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

`validation_table()` predicts every row with the A100 entry of configs/calibration.yaml, whose
estimates were written down before this comparison was first run and not tuned to it since.
"""

from __future__ import annotations

from megascale_jax.planner import calibration
from megascale_jax.planner.predict import predict
from megascale_jax.planner.workload import Workload

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
        dp_overlap=dp_overlap, activation_bytes=2, grad_bytes=4, param_bytes=2)


def sc21_workload(row) -> Workload:
    _, heads, hidden, layers, tp, pp, gpus, batch, micro, per_virtual, _ = row
    virtual = layers // pp // per_virtual if per_virtual else 1
    torch_ddp = gpus <= 256  # `--DDP-impl torch` (overlapping the backward) up to 18B
    return megatron_workload(heads, hidden, layers, tp, pp, gpus, batch, micro, virtual,
                             dp_overlap="backward" if torch_ddp else "none")


def sc21_flops(row) -> float:
    """Megatron's FLOPs per iteration with recomputation: 96·B·s·l·h²·(1 + s/6h + V/16lh)."""
    _, _, h, l, *_ = row
    batch = row[7]
    return 96 * batch * SEQ * l * h**2 * (1 + SEQ / (6 * h) + VOCAB / (16 * l * h))


def tab5_workload(row, selective: bool) -> Workload:
    _, heads, hidden, layers, tp, pp, gpus, batch, micro, virtual, _, _ = row
    return megatron_workload(heads, hidden, layers, tp, pp, gpus, batch, micro, virtual,
                             recompute="selective" if selective else "full", sequence_parallel=selective)


def validation_table(gpu_key: str = "a100-80g") -> list[dict]:
    """One row per published measurement: what was measured, what the planner predicts, and the
    relative error (predicted / published − 1)."""
    gpu = calibration.gpu(gpu_key)
    rows = []
    for row in MEGATRON_SC21:
        pred = predict(sc21_workload(row), gpu)
        tflops = sc21_flops(row) / (pred.iteration_s * row[6]) / 1e12
        rows.append({"source": "Narayanan et al. SC'21 Table 1", "model": row[0], "gpus": row[6],
                     "metric": "TFLOP/s per GPU", "published": row[-1], "predicted": round(tflops, 2),
                     "error": tflops / row[-1] - 1})
    for row in KORTHIKANTI_TAB5:
        for selective, published in ((False, row[-2]), (True, row[-1])):
            pred = predict(tab5_workload(row, selective), gpu)
            rows.append({"source": "Korthikanti et al. 2022 Table 5", "model": row[0], "gpus": row[6],
                         "metric": "iteration s, " + ("selective recompute + SP" if selective else "full recompute"),
                         "published": published, "predicted": round(pred.iteration_s, 3),
                         "error": pred.iteration_s / published - 1})
    return rows
