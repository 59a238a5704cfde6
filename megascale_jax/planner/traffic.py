"""Bytes one GPU of the last pipeline stage (the one the iteration time follows) sends per
iteration, per mesh axis, with ring collectives: the planner's communication volume, which
`tests/planner -k traffic` checks against the collectives of the compiled step
(`observe.collectives`).

For a buffer of B bytes over a group of n: an all-reduce sends 2(n−1)/n·B, an all-gather or a
reduce-scatter (n−1)/n·B, a point-to-point send B. Sequence parallelism's all-gather +
reduce-scatter and collective matmul's ring of permutes send what one all-reduce sends.

Symbols: A = one microbatch's activation on one GPU (seqs × seq_len/cp × d_model × activation
bytes), m the microbatches, L the layers, P the stage's parameters per GPU
(`workload.stage_params`), K = one microbatch's keys (or values) of one position on one GPU
(seqs × kv_heads·head_dim/tp × activation bytes).
"""

from __future__ import annotations

import dataclasses

from megascale_jax import pipeline_schedule
from megascale_jax.model import flops
from megascale_jax.planner import costs
from megascale_jax.planner.workload import Workload, edge_matrices, from_config, model_config, stage_params

LOSS_BYTES = 4  # the loss's vocab-split reductions (max, sum, the target's logit) are float32


all_reduce, gather = costs.ring_all_reduce_bytes, costs.ring_all_gather_bytes


def activation_bytes(w: Workload) -> float:
    """A: one microbatch's residual stream on one GPU (whole over tp)."""
    return w.microbatch_tokens * w.d_model * w.activation_bytes


def boundary_bytes(w: Workload) -> float:
    """One pipeline send: A, or A/tp when each tp rank sends its share (`pp_split_over_tp`)."""
    return activation_bytes(w) / (w.tp if w.pp_split_over_tp else 1)


def layer_tp_collectives(w: Workload) -> int:
    """tp all-reduces (or their equivalents) of one layer and microbatch: 1 per pass for the
    parallel block, 2 for the serial, over the forward, the backward, and a recomputed forward
    under full recompute."""
    return (1 if w.block == "parallel" else 2) * (2 + (1 if w.recompute == "full" else 0))


def ticks(w: Workload) -> int:
    """Rows of the schedule's table: the pipeline loop's iterations (each sends both ways)."""
    return pipeline_schedule.build(w.schedule, w.pp, w.virtual, w.microbatches).ticks


def layer_runs(w: Workload) -> int:
    """Layer forwards (each with its backward) one GPU runs per iteration: m·L/pp, or, when idle
    ticks compute masked chunks (`masked_idle_ticks`), one chunk of L/(pp·v) layers every tick."""
    if w.pp > 1 and w.masked_idle_ticks:
        return ticks(w) * w.layers // (w.pp * w.virtual)
    return w.microbatches * w.layers // w.pp


def tp_bytes(w: Workload) -> dict[str, float]:
    """tp, per iteration:
    * layers: layer_runs × layer_tp_collectives × all_reduce(A), plus with Megatron's
      asynchronous backward under sequence parallelism (`tp_backward_overlap`) each column group's
      input re-gathered, gather(A) per group and layer run;
    * head (last stage), per microbatch: the backward's all_reduce(A), plus with sequence
      parallelism the forward's gather(A) — GSPMD all-reduces the whole activation and slices
      it (`gspmd_edges`) where Megatron reduce-scatters; and the loss's three float32
      all-reduces of one value per token;
    * embedding (pp = 1: the last stage is also the first), per microbatch: the lookup's
      all_reduce(A), or, under sequence parallelism with `gspmd_edges`, the vocab-split table
      all-gathered and its float32 gradient all-reduced; Megatron's lookup (this project's with
      sequence parallelism, `tensor_parallel.embed_lookup`) reduce-scatters A, and its backward
      all-gathers the gradient.
    """
    n = w.tp
    if n == 1:
        return {"layers": 0.0, "head": 0.0, "embedding": 0.0}
    a, m = activation_bytes(w), w.microbatches
    layers = layer_runs(w) * layer_tp_collectives(w) * all_reduce(a, n)
    if w.tp_backward_overlap and w.sequence_parallel:  # Megatron's backward re-gathers each column group's input
        layers += layer_runs(w) * (1 if w.block == "parallel" else 2) * gather(a, n)
    head_backward = all_reduce(a, n) if not w.sequence_parallel or w.gspmd_edges else gather(a, n)
    head = m * (head_backward + (gather(a, n) if w.sequence_parallel else 0.0)
                + 3 * all_reduce(w.microbatch_tokens * LOSS_BYTES, n))
    embedding = 0.0
    if w.pp == 1:
        table = w.vocab * w.d_model * w.param_bytes
        if w.sequence_parallel and w.gspmd_edges:
            embedding = m * (gather(table, n) + all_reduce(table, n))
        else:
            embedding = m * (2 * gather(a, n) if w.sequence_parallel else all_reduce(a, n))
    return {"layers": layers, "head": head, "embedding": embedding}


def pp_bytes(w: Workload) -> dict[str, float]:
    """pp, per iteration: every tick sends one activation forward and one cotangent back,
    2 · ticks · boundary_bytes (A/tp under sequence parallelism, split like the residual stream); after
    the loop the embedding's and head's gradients, replicated on every stage, are all-reduced
    over pp — after the dp reduction, so with ZeRO-1 only their 1/dp share."""
    if w.pp == 1:
        return {"sends": 0.0, "edge_gradients": 0.0}
    return {"sends": 2 * ticks(w) * boundary_bytes(w),
            "edge_gradients": all_reduce(edge_gradient_bytes(w), w.pp) if w.edge_on_every_stage else 0.0}


def edge_gradient_bytes(w: Workload) -> float:
    """The embedding's and head's gradients one GPU sums over pp after the loop (edges on every
    stage): one matrix or two (`workload.edge_matrices`), 1/tp of each, with ZeRO-1 1/dp of that."""
    return edge_matrices(w) * w.vocab * w.d_model / w.tp * w.grad_bytes / (w.dp if w.zero1 else 1)


def dp_bytes(w: Workload, params: float | None = None) -> dict[str, float]:
    """dp, per iteration: the gradients' all_reduce(P · grad bytes) — with ZeRO-1 their
    reduce-scatter and the updated parameters' all-gather, gather(P · grad bytes) +
    gather(P · param bytes). With `dp_reduce_per_microbatch` (a runtime that leaves the reduction
    to GSPMD inside the accumulation loop, as this project did at pp = 1 before
    parallel/microbatches.py) each of the m microbatches all-reduces its gradients, ZeRO-1 or not,
    and ZeRO-1 adds the parameters' all-gather. With `reduce_scatter_every_microbatch` (sharded
    gradients, Llama 3's FSDP) each of the m microbatches reduce-scatters its gradients,
    m · gather(P · grad bytes), and the parameters are gathered once, gather(P · param bytes)."""
    if w.dp == 1:
        return {"gradients": 0.0, "parameters": 0.0}
    params = stage_params(w) if params is None else params  # given: the exact count one device holds
    grads = params * w.grad_bytes
    if w.reduce_scatter_every_microbatch:
        return {"gradients": w.microbatches * gather(grads, w.dp), "parameters": gather(params * w.param_bytes, w.dp)}
    if w.dp_reduce_per_microbatch:
        return {"gradients": w.microbatches * all_reduce(grads, w.dp),
                "parameters": gather(params * w.param_bytes, w.dp) if w.zero1 else 0.0}
    if w.zero1:
        return {"gradients": gather(grads, w.dp), "parameters": gather(params * w.param_bytes, w.dp)}
    return {"gradients": all_reduce(grads, w.dp), "parameters": 0.0}


def kv_position_bytes(w: Workload) -> float:
    """K: the keys (or the values) of one position for one microbatch on one GPU, its tp share of
    the kv heads (one head where tp does not divide them: `flops.kv_width_per_device`)."""
    return w.microbatch_seqs * flops.kv_width_per_device(model_config(w), w.tp) * w.activation_bytes


def cp_forward_passes(w: Workload) -> int:
    """Forwards of a layer's attention per microbatch: 2 where the backward reruns it (full
    recompute, or selective: the attention core; the keys the dots need are recomputed, halo
    and gather included, since a collective's output is not what the remat policy saves).
    Measured: the compiled step at cp 8, window 24, moved 376,832 bytes more over cp with
    model.remat=full or dots than without, exactly one direction of its 4 layers' halos."""
    return 2 if w.recompute in ("full", "selective") else 1


def cp_bytes(w: Workload, params: float | None = None) -> dict[str, float]:
    """cp, per iteration (parallel/context_parallel.py; 0 at cp = 1):
    * attention, per layer run and direction (forward: keys and values; backward: their
      gradients), m·L/pp runs, the forward again where recomputed (`cp_forward_passes`):
      - window w: the halo, the h = min(w−1, (cp−1)·seq_len/cp) positions before the slice by
        ppermute from the ranks before it, 2·h·K (k and v); a window longer than a slice takes
        one permute a slice it reaches back, the same positions in all;
      - full attention: k and v all-gathered (their gradients reduce-scattered), 2·gather(seq_len·K);
    * gradients: the weights are replicated over cp, so their gradients are all-reduced over cp,
      all_reduce(P · grad bytes, cp) — with ZeRO-1 P/dp, the dp shard the reduce-scatter left
      (`cp_reduced_params`) — after the dp reduction (not once over dp × cp), once a step: the accumulation and the pipeline are manual over cp as over dp
      (parallel/microbatches.py); with `cp_reduce_per_microbatch` (a runtime that leaves the
      accumulation to GSPMD, as this project's did before) once per microbatch, m times."""
    if w.cp == 1:
        return {"attention": 0.0, "gradients": 0.0}
    k = kv_position_bytes(w)
    if w.window is None:
        per_direction = 2 * gather(w.seq_len * k, w.cp)
    else:
        per_direction = 2 * halo_positions(w) * k
    attention = layer_runs(w) * (cp_forward_passes(w) + 1) * per_direction
    params = stage_params(w) if params is None else params
    reductions = w.microbatches if w.cp_reduce_per_microbatch else 1
    return {"attention": attention, "gradients": reductions * all_reduce(cp_reduced_params(w, params) * w.grad_bytes, w.cp)}


def cp_reduced_params(w: Workload, params: float) -> float:
    """The gradient values a device reduces over cp: after the dp reduction, with ZeRO-1 only its
    dp shard of them (a reduce-scatter left 1/dp; parallel/microbatches.py), else all."""
    return params / w.dp if w.zero1 and w.dp > 1 and not w.cp_reduce_per_microbatch else params


def halo_positions(w: Workload) -> int:
    """h: the positions of keys a rank receives per sequence and layer under a window."""
    return flops.halo_length(w.window, w.seq_len, w.cp)


def halo_hops(w: Workload) -> list[int]:
    """The halo's positions by permute: from rank r−1 its last min(h, seq_len/cp), from r−2 the
    slice before those, ... (`context_parallel.with_halo`)."""
    n, left, hops = w.seq_len // w.cp, halo_positions(w), []
    while left > 0:
        hops.append(min(n, left))
        left -= hops[-1]
    return hops


def bytes_per_axis(w: Workload, params: float | None = None) -> dict[str, float]:
    """{'tp': ..., 'pp': ..., 'cp': ..., 'dp': ...}: each axis's components summed; `params`: the
    parameters one device holds, where known exactly (else the workload's count, which leaves out
    norms and biases)."""
    return {"tp": sum(tp_bytes(w).values()), "pp": sum(pp_bytes(w).values()),
            "cp": sum(cp_bytes(w, params).values()), "dp": sum(dp_bytes(w, params).values())}


def ideal_bytes_per_axis(cfg, gpus: int, params: float) -> dict[str, float]:
    """The ideal a compiled step's collectives are set beside (`bench.parallel.collective_bytes`,
    `plan --compile`): these formulas for `cfg` on `gpus` GPUs with one gradient reduction per
    step, over `params`, the parameters one device holds (counted from the compiled state)."""
    w = dataclasses.replace(from_config(cfg, gpus), dp_reduce_per_microbatch=False, cp_reduce_per_microbatch=False)
    return bytes_per_axis(w, params=params)
