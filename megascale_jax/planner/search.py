"""Every layout this project can run on N GPUs for one model and global batch, predicted.

A layout is the config's mesh and parallel section: tp (within a node, dividing the heads), cp
(context parallelism: 1, 2, 4, ... dividing seq_len), pp (dividing the layers), v (interleaving,
1/2/4), the microbatch count (for a pipeline a multiple of pp from pp up, else
gradient-accumulation steps), ZeRO-1 on or off, and sequence parallelism with collective matmul
on or off. Each candidate passes `config.validate` (planning) exactly as a user's config would,
so the search never proposes a layout the trainer refuses (cp > 1 today: no cuDNN attention under
full attention). A fused kernel on a slice is priced for its n queries: Pallas's runs only those
(at their offset into the keys); the w − 1 padded queries cuDNN's also runs there
(parallel/context_parallel.py) are not priced yet.

Every power-of-two cp is a candidate, not only long sequences': what cp costs (each layer's halo
or k/v gather, and the gradients' all-reduce over cp) and what it saves (activations and scores
1/cp or less, and a batch of fewer sequences than GPUs/tp can still use every GPU) are both
priced, so the ranking decides. On a short sequence of full attention a cp layout loses to dp
by its transfers and ranks below it (tested); with a window, XLA's attention on a slice scores
n × (n + w − 1) keys instead of seq_len², which the ranking weighs too. The candidates cp adds
are tried with every pp, as dp's are.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from megascale_jax.config import Config, ConfigError, validate
from megascale_jax import pipeline_schedule
from megascale_jax.planner.calibration import Gpu
from megascale_jax.model import flops
from megascale_jax.planner.predict import Prediction, predict
from megascale_jax.planner.workload import from_config

FIT_FRACTION = 0.75  # XLA preallocates 75% of a GPU's memory by default (XLA_PYTHON_CLIENT_MEM_FRACTION)
WORKSPACE_BYTES = 1 * 2**30  # a priori: cuBLAS/NCCL buffers and XLA temporaries beyond the estimate


@dataclasses.dataclass(frozen=True)
class Plan:
    cfg: Config
    prediction: Prediction
    memory: dict[str, float]  # bytes per device: parameters, gradients, optimizer, activations, workspace, total
    stash_slots: int  # pipeline stash slots per stage (0 without a pipeline)
    stash_slot_bytes: float  # what one slot holds per device (0 without a pipeline)
    fits: bool


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def with_layout(cfg: Config, gpus: int, tp: int, pp: int, cp: int = 1, **parallel) -> Config:
    mesh = dataclasses.replace(cfg.mesh, dp=gpus // (tp * pp * cp), pp=pp, tp=tp, cp=cp)
    return dataclasses.replace(cfg, mesh=mesh, parallel=dataclasses.replace(cfg.parallel, **parallel))


def plan(cfg: Config, gpus: int, gpu: Gpu) -> Plan:
    """Prediction and memory of `cfg` as laid out (its mesh must already span `gpus`)."""
    par = cfg.parallel
    slots = pipeline_schedule.build(par.pp_schedule, cfg.mesh.pp, par.pp_virtual, par.microbatches).slots \
        if cfg.mesh.pp > 1 else 0
    memory = dict(flops.memory_estimate(cfg))
    total = memory.pop("total") + WORKSPACE_BYTES
    memory |= {"workspace": WORKSPACE_BYTES, "total": total}
    return Plan(cfg, predict(from_config(cfg, gpus), gpu), memory, slots,
                flops.stash_slot_bytes(cfg) if slots else 0.0,
                memory["total"] <= FIT_FRACTION * gpu.hbm_bytes)


def microbatch_counts(per_replica: int, pp: int, v: int) -> list[int]:
    """Pipeline: pp, 2·pp, 4·pp, ... up to one sequence per microbatch; else 1, 2, 4, ..."""
    start = pp if pp > 1 else 1
    counts, m = [], start
    while m <= per_replica:
        if per_replica % m == 0:
            counts.append(m)
        m *= 2
    if pp > 1 and per_replica % pp == 0 and per_replica not in counts:
        counts.append(per_replica)
    return counts


def cp_sizes(seq_len: int, gpus: int) -> list[int]:
    """Context-parallel sizes to try: 1, 2, 4, ... dividing both the sequence and the GPUs."""
    sizes, cp = [], 1
    while cp <= gpus and seq_len % cp == 0:
        if gpus % cp == 0:
            sizes.append(cp)
        cp *= 2
    return sizes


def candidates(cfg: Config, gpus: int, gpus_per_node: int) -> Iterator[Config]:
    m = cfg.model
    for tp in [d for d in divisors(gpus) if d <= gpus_per_node]:
        for cp in cp_sizes(m.seq_len, gpus // tp):
            for pp in [d for d in divisors(gpus // (tp * cp)) if m.layers % d == 0]:
                yield from _layouts(cfg, gpus, tp, cp, pp)


def _layouts(cfg: Config, gpus: int, tp: int, cp: int, pp: int) -> Iterator[Config]:
    """Every schedule, microbatch count, ZeRO-1 and sequence-parallel choice for one mesh that
    `validate` accepts."""
    dp = gpus // (tp * pp * cp)
    if cfg.train.global_batch % dp:
        return
    for v in ((1, 2, 4) if pp > 1 else (1,)):
        schedule = "interleaved_1f1b" if v > 1 else "1f1b"
        for micro in microbatch_counts(cfg.train.global_batch // dp, pp, v):
            for zero1 in ((True, False) if dp > 1 else (False,)):
                for sp in ((True, False) if tp > 1 else (False,)):
                    layout = with_layout(cfg, gpus, tp, pp, cp, pp_virtual=v, pp_schedule=schedule,
                                         microbatches=micro, zero1=zero1, sequence_parallel=sp,
                                         tp_overlap="collective_matmul" if sp else "none")
                    try:
                        validate(layout, planning=True)
                    except ConfigError:
                        continue
                    yield layout


def search(cfg: Config, gpus: int, gpu: Gpu) -> list[Plan]:
    """Every valid layout, best predicted tokens/s first; those that do not fit come after all
    that do (they are reported, never recommended)."""
    plans = [plan(layout, gpus, gpu) for layout in candidates(cfg, gpus, gpu.gpus_per_node)]
    return sorted(plans, key=lambda p: (not p.fits, -p.prediction.tokens_per_s))


def family(base: Plan, gpu: Gpu, up_to: int) -> list[Plan]:
    """The layout's family (`--plot`): the same tp, cp, pp, v, schedule and sequences per
    microbatch, with dp = 1, 2, 4, ... while the GPUs stay within `up_to` and the global batch
    splits evenly."""
    c, batch = base.cfg.mesh, base.cfg.train.global_batch
    per_micro = batch // (c.dp * base.cfg.parallel.microbatches)
    out, dp = [], 1
    while dp * c.tp * c.pp * c.cp <= up_to:
        gpus = dp * c.tp * c.pp * c.cp
        if batch % (dp * per_micro) == 0:
            cfg = with_layout(base.cfg, gpus, c.tp, c.pp, c.cp, microbatches=batch // (dp * per_micro))
            try:
                validate(cfg, planning=True)
            except ConfigError:  # e.g. fewer microbatches than stages at this dp
                pass
            else:
                out.append(plan(cfg, gpus, gpu))
        dp *= 2
    return out
