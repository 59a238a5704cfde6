"""Iteration time, its breakdown, MFU and tokens/s of a `Workload` on a calibrated GPU.

One iteration on the busiest stage (the last: it also runs the LM head), lockstep:

    iteration = compute + tp + cp + bubble + pp + dp + optimizer + data

* compute: m microbatches × the stage's layers × (forward + backward + recompute), each
  layer's GEMMs (forward, input and weight gradient, each at its own shape) at the calibrated
  efficiency of their size times their wave quantization (`costs.gemm_s`), its attention core
  (a fused kernel, or GEMMs plus the scores' HBM traffic), its memory-bound passes
  (`costs.hbm_s`) and the backward's add of its weight gradients into the fp32 accumulator
  (`gradient_accumulation_s`), plus the LM head.
* tp: the tp collectives of every layer (2 per serial block and pass, 1 per parallel block),
  ring all-reduces on NVLink, minus what collective matmul hides behind the GEMMs, or what
  Megatron-LM's asynchronous backward hides behind the weight- and input-gradient GEMMs
  (`async_backward_tp_s`); and the LM head's and embedding's (`edge_tp_s`).
* cp (context parallelism, mesh.cp): every layer's keys and values received from the other cp
  ranks (the window's halo, or all of them by all-gather) and their gradients sent back,
  exposed (`cp_attention_s`). Compute, tp and the memory of activations are those of a rank's
  seq_len/cp positions; the weights are replicated over cp.
* bubble: (compute + tp + cp) · b/(1−b), b read off the schedule's table (`costs.bubble_fraction`).
* pp: boundary sends; blocking ones cost 2 per tick, asynchronous ones only what a tick's
  compute cannot hide.
* dp: the gradient reduction over dp (a reduce-scatter and the parameters' all-gather with
  ZeRO-1), over the NICs once a dp group leaves the node, minus what overlaps one microbatch's
  backward when the reduction runs inside the backward; then over cp, whose ranks hold the same
  weights (`cp_gradients_s`). With gradients kept sharded across the
  microbatches (`reduce_scatter_every_microbatch`, Llama 3's FSDP) every microbatch
  reduce-scatters its gradients; that traffic runs on the link's own timeline from the stage's
  first gradient on (`sharded_gradient_nic`), and dp is what it runs past the stage's compute.
* pp: also the edges' gradients summed over pp after the backward (`edge_gradients_s`):
  Megatron-LM's tied embedding between the first and last stage, or, with the embedding and
  head on every stage (this project), both (one matrix if tied) over every stage.
* optimizer: memory-bound passes over its share of parameters, gradients and moments, and
  Megatron-LM's own over its buffers (`optimizer_s`).
* data: 0 — the loader prefetches on the host, off the step's critical path; this model charges
  nothing for it.

Every NCCL transfer hidden behind compute still costs that compute the SMs it holds while both
run (`costs.held_sms_s`: k/S of the overlapped time, k = the calibration's `collective_sms`).
"""

from __future__ import annotations

import dataclasses

from megascale_jax import pipeline_schedule
from megascale_jax.model import flops
from megascale_jax.planner import costs, traffic
from megascale_jax.planner.calibration import Gpu
from megascale_jax.planner.workload import Workload, edge_matrices, model_config, stage_params

OPTIMIZER_BYTES_PER_PARAM = 28  # read param, grad, 2 moments (fp32) = 16; write param, 2 moments = 12
# LAMB (training/optim.py: Adam's update, weight decay, then each layer's trust ratio
# ||p|| / ||u||): the norms need the whole update before it is scaled, so the update is written
# by the first pass (which also reduces the norms) and read back with the parameter by the second
LAMB_EXTRA_BYTES_PER_PARAM = 12  # write the update (4); read it and the parameter again (8)


@dataclasses.dataclass(frozen=True)
class Prediction:
    iteration_s: float
    breakdown: dict[str, float]  # seconds: compute, tp, cp, bubble, pp, dp, optimizer, data
    tokens_per_s: float
    model_flops: float  # per iteration: 3 × forward, window-aware (MFU's numerator)
    mfu: float
    # the same seconds finer (`--explain`): compute by kind, exposed communication by axis and part
    parts: dict[str, float] = dataclasses.field(default_factory=dict)


def context(w: Workload) -> int:
    return w.seq_len if w.window is None else min(w.window, w.seq_len)


def layer_times(w: Workload, gpu: Gpu) -> dict[str, float]:
    """Seconds of one layer for one microbatch on one GPU: forward, backward, recompute, the GEMM
    time collective matmul can hide tp transfers behind (`gemm` forward, `gemm_input_gradient`), and the
    same work split by kind (gemm, attention, elementwise: forward + backward + recompute) for
    `--explain`. Each linear's three GEMMs (forward, input and weight gradient) are priced at their
    own shapes (`costs.linear_s`: the size curve and wave quantization)."""
    tokens = w.microbatch_tokens  # with cp: this rank's slice of each sequence, so everything per token is 1/cp
    d, h, k, hd, f, tp = w.d_model, w.heads, w.kv_heads, w.head_dim, w.mlp_dim, w.tp
    up_matrices = 2 if w.gated_mlp else 1  # SwiGLU's gate and up projections
    # Each linear as (k, n) per tp rank: x (tokens × k) · W (k × n); the GEMMs' own shapes decide
    # their wave quantization (`costs.linear_s`).
    qkv, up = (d, (h + 2 * k) * hd // tp), (d, f // tp)
    if w.block == "parallel" and w.fused_block_gemms:  # one GEMM reads the shared norm's output
        linears = [(d, qkv[1] + up_matrices * up[1])]
    else:
        linears = [qkv, *[up] * up_matrices]
    linears += [(h * hd // tp, d), (f // tp, d)]  # attention out, MLP down
    passes = [costs.linear_s(tokens, k_, n_, gpu) for k_, n_ in linears]
    gemm = sum(p["forward"] for p in passes)
    gemm_backward = sum(p["backward"] for p in passes)
    gemm_input_gradient = sum(p["input_gradient"] for p in passes)
    wave_forward = sum(p["forward_wave_loss"] for p in passes)
    wave_backward = sum(p["backward_wave_loss"] for p in passes)
    heads_here = h / tp
    queries = w.seq_len // w.cp  # each sequence's positions on this rank
    replicated, sharded = flops.ACT_VALUES_REPLICATED, flops.ACT_VALUES_TP_SHARDED
    act_values = tokens * d * (replicated + sharded / tp)
    if w.sequence_parallel:
        act_values = tokens * d * (replicated + sharded) / tp
    if w.fused_attention:  # only the visible (query, key) pairs: the kernel skips masked blocks
        # With cp, those of the last slice's queries: the busiest rank, which the step waits for
        # (under a window every rank whose slice starts past the first w positions has n·w pairs,
        # about 1/cp of the sequence's; under full attention the last has (2cp−1)/cp², rank 0 1/cp²)
        pairs = w.microbatch_seqs * heads_here * (costs.visible_pairs(w.seq_len, w.window)
                                                  - costs.visible_pairs(w.seq_len - queries, w.window))
        attention = costs.fused_attention_s(4 * hd * pairs, tokens * heads_here, gpu)
        attention_backward = (costs.FLASH_FWD_BWD - 1) * attention  # it recomputes the scores in its backward
        score_bytes = 0.0
    else:  # batched GEMMs per (sequence, head) and the scores written and read back from HBM.
        # Every (query, key) score is computed and then masked (on an H200, XLA attention ran
        # 0.331 s/step with a 512 window and 0.335 s without), unless the implementation computes
        # only the band inside the window (`banded_window`). With cp (context_parallel.py) a rank
        # scores its seq_len/cp queries against every key it holds: its own and those it received
        # (the window's halo, or all of them under full attention), the same count on every rank.
        # This project's XLA attention bands a window much shorter than the slice (`xla_band_block`):
        # each block of queries scores block + w - 1 keys.
        keys = (w.xla_band_block + w.window - 1 if w.xla_band_block else context(w) if w.banded_window
                else queries + flops.cp_received_positions(model_config(w), w.cp))
        per_head = 2 * queries * keys * hd
        attention = 2 * costs.matmul_s(w.microbatch_seqs * heads_here * per_head, gpu)  # one batched GEMM each
        attention_backward = 2 * attention
        score_bytes = w.microbatch_seqs * heads_here * queries * keys * flops.XLA_SCORE_VALUES \
            * w.activation_bytes
    # The scores' passes are the attention's; the rest (norms, GeLU, dropout, residuals) elementwise.
    score_pass = costs.hbm_s(gpu.elementwise_passes * score_bytes, gpu)
    elementwise = costs.hbm_s(gpu.elementwise_passes * act_values * w.activation_bytes, gpu)
    attention += score_pass
    attention_backward += 2 * score_pass
    forward = gemm + attention + elementwise
    backward = gemm_backward + attention_backward + 2 * elementwise
    accumulate = gradient_accumulation_s(flops.layer_params_per_device(model_config(w), tp), w, gpu)
    backward += accumulate
    # "elementwise" (this project's model.remat=elementwise) recomputes the norms and the activation
    # inside the backward's fusions from the inputs those fusions read anyway: no HBM pass more
    # (what it saves is memory; on an H200 its rows ran no slower a token, 2026-11-27)
    redo = {"none": (0.0, 0.0, 0.0), "elementwise": (0.0, 0.0, 0.0), "selective": (0.0, attention, 0.0),
            "full": (gemm, attention, elementwise)}[w.recompute]
    wave = wave_forward * (2 if w.recompute == "full" else 1) + wave_backward
    return {"forward": forward, "backward": backward, "recompute": sum(redo), "gemm": gemm,
            "gemm_backward": gemm_backward, "gemm_input_gradient": gemm_input_gradient,
            "kind": {"gemm": gemm + gemm_backward + redo[0] - wave,
                     "gemm wave quantization": wave, "attention": attention + attention_backward + redo[1],
                     "elementwise": 3 * elementwise + redo[2], "gradient accumulation": accumulate}}


def gradient_accumulation_s(params: float, w: Workload, gpu: Gpu) -> float:
    """Seconds one microbatch's backward spends adding its weight gradients (`params` of them, on
    one GPU) into the gradient accumulator: a memory-bound pass that reads and writes the
    accumulator, 2 × grad_bytes per parameter (fp32 in every source here). Every microbatch pays
    it, the first too: the accumulator is zeroed at the start of the step and added into.
    * Megatron-LM (SC'21, Korthikanti et al., MegaScale's baseline): the backward hook
      `param.main_grad.add_(param.grad.data)` per parameter and microbatch
      (NVIDIA/Megatron-LM megatron/model/distributed.py, DistributedDataParallel._make_param_hook),
      or, with gradient-accumulation fusion, the weight-gradient GEMM's epilogue reading and writing
      the fp32 main_grad; 2 × 4 bytes is the traffic common to both (the hook also reads the
      fp16/bf16 param.grad, not counted here: a lower bound).
    * Llama 3: "FP32 gradient accumulation during backward computation over multiple
      micro-batches" (§3.3.2). Its gradients stay sharded (`reduce_scatter_every_microbatch`), so
      the add goes into a 1/dp shard, but the same 8 bytes per parameter cross HBM: the fp32
      gradient written for the reduce-scatter and read back by it.
    The GEMMs cannot hide it: it runs after (or in the epilogue of) the GEMM that produces the
    gradient, on the same stream, and it is bound by the HBM bandwidth (datasheet). 0 where the
    step has no accumulator (`Workload.grad_accumulator`)."""
    return costs.hbm_s(2 * w.grad_bytes * params, gpu) if w.grad_accumulator else 0.0


def tp_collective_s(w: Workload, gpu: Gpu) -> float:
    """Seconds of tp transfers of one layer for one microbatch (forward, backward and the
    recomputed forward): ring all-reduces (all-gather + reduce-scatter with sequence
    parallelism, the same bytes) of the microbatch's activation."""
    if w.tp == 1:
        return 0.0
    link = gpu.nvlink if w.tp <= gpu.gpus_per_node else gpu.nic
    return traffic.layer_tp_collectives(w) * costs.ring_all_reduce_s(traffic.activation_bytes(w), w.tp, link)


def column_parallel_groups(w: Workload) -> list[list[tuple[int, int]]]:
    """A layer's column-parallel linears as (k, n) per tp rank, grouped by the input they read
    (one tp collective per group in each pass): the serial block's QKV and its MLP-up (SwiGLU's
    gate and up together) read two different norms' outputs; the parallel block's read one."""
    d, tp = w.d_model, w.tp
    qkv, up = (d, (w.heads + 2 * w.kv_heads) * w.head_dim // tp), (d, (2 if w.gated_mlp else 1) * w.mlp_dim // tp)
    return [[qkv, up]] if w.block == "parallel" else [[qkv], [up]]


def async_backward_tp_s(w: Workload, gpu: Gpu) -> float:
    """Exposed tp seconds of one layer and microbatch under Megatron-LM's asynchronous backward
    communication (`tp_backward_overlap`; megatron/core/tensor_parallel/layers.py at 285068c8,
    LinearWithGradAccumulationAndAsyncCommunication.backward):
    * the forward's (and a recomputed forward's) collectives: exposed, as `tp_collective_s`;
    * each column-parallel group's input gradient: an all-reduce, or with sequence parallelism a
      reduce-scatter, launched before the group's weight-gradient GEMMs and hidden behind them;
    * with sequence parallelism, each group's input re-gathered (the forward's all-gather is not
      kept) before its input-gradient GEMMs and hidden behind them: extra traffic, rarely exposed;
    * with sequence parallelism, the row-parallel outputs' gradients all-gathered (the forward's
      reduce-scatter's transpose): exposed, one per group.
    Without sequence parallelism the row-parallel linears' backward communicates nothing."""
    if w.tp == 1:
        return 0.0
    link = gpu.nvlink if w.tp <= gpu.gpus_per_node else gpu.nic
    a, tokens = traffic.activation_bytes(w), w.microbatch_tokens
    all_reduce, gather = costs.ring_all_reduce_s(a, w.tp, link), costs.ring_all_gather_s(a, w.tp, link)
    groups = column_parallel_groups(w)
    forwards = 2 if w.recompute == "full" else 1
    exposed = forwards * len(groups) * all_reduce
    for group in groups:
        weight_gradient = sum(costs.gemm_s(k, tokens, n, gpu) for k, n in group)
        input_gradient = sum(costs.gemm_s(tokens, n, k, gpu) for k, n in group)
        if w.sequence_parallel:
            exposed += costs.overlapped_s(gather, weight_gradient, gpu) + costs.overlapped_s(gather, input_gradient, gpu) + gather
        else:
            exposed += costs.overlapped_s(all_reduce, weight_gradient, gpu)
    return exposed


def edge_tp_s(w: Workload, gpu: Gpu) -> float:
    """Seconds of the LM head's and the embedding's tp collectives per iteration (bytes from
    `traffic.tp_bytes`, at the tp link's bandwidth, plus one ring's latency per microbatch and
    collective), not overlapped: the loss waits for the head's reductions."""
    if w.tp == 1:
        return 0.0
    link = gpu.nvlink if w.tp <= gpu.gpus_per_node else gpu.nic
    sent = traffic.tp_bytes(w)
    return (sent["head"] + sent["embedding"]) / link.bandwidth + 2 * w.microbatches * 2 * (w.tp - 1) * link.latency


def head_wave_loss_s(w: Workload, gpu: Gpu) -> float:
    """The part of `head_s` lost to the logits GEMMs' wave quantization."""
    logits = costs.linear_s(w.microbatch_tokens, w.d_model, w.vocab // w.tp, gpu)
    return logits["forward_wave_loss"] + logits["backward_wave_loss"]


def head_s(w: Workload, gpu: Gpu) -> float:
    """The LM head and loss for one microbatch on the last stage: the logits GEMM forward and its
    two backward GEMMs (`costs.linear_s`), and the fp32 logits' HBM passes.
    * `head_recompute` (this project's model.loss_chunks > 1): the backward runs the logits GEMM
      forward again, slice by slice;
    * `head_grad_float32`: the weight-gradient GEMM at the float32 GEMM rate this project measured
      (`Gpu.fp32_gemm_flops`; the calibration must have one: `require_priced`). On the H200
      profile of 2026-11-27 that GEMM alone ran in float32 (15.5 ms); the rest of the head's
      30.4 ms fits a bf16 input gradient."""
    tokens = w.microbatch_tokens
    logits = costs.linear_s(tokens, w.d_model, w.vocab // w.tp, gpu)
    backward = logits["backward"]
    if w.head_grad_float32:
        weight_gradient = costs.gemm_s(w.d_model, tokens, w.vocab // w.tp, gpu)
        backward += 2 * tokens * w.d_model * (w.vocab // w.tp) / gpu.fp32_gemm_flops - weight_gradient
    forwards = 2 if w.head_recompute else 1
    return forwards * logits["forward"] + backward \
        + costs.hbm_s(gpu.elementwise_passes * tokens * w.vocab / w.tp * 4, gpu) + head_accumulation_s(w, gpu)


def require_priced(w: Workload, gpu: Gpu) -> None:
    """Raise ValueError, one line naming the option, for a workload this calibration cannot price."""
    if w.head_grad_float32 and not gpu.fp32_gemm_flops:
        raise ValueError(f"model.head_grad_float32=true is not priced on {gpu.key}: no float32 GEMM rate "
                         f"measured for it (fp32_gemm_tflops in configs/calibration.yaml); set it false")


def head_accumulation_s(w: Workload, gpu: Gpu) -> float:
    """The LM head's share of `gradient_accumulation_s`: its vocab × d_model / tp weights."""
    return gradient_accumulation_s(w.vocab * w.d_model / w.tp, w, gpu)


def pp_s(w: Workload, gpu: Gpu, tick_compute: float) -> float:
    """Seconds of pipeline sends per iteration: every tick sends one activation forward and one
    cotangent back; blocking sends (Megatron's batched send/recv) cost both, asynchronous ones
    (MegaScale §3.2, this project's ppermute) only what the tick's compute cannot hide."""
    if w.pp == 1:
        return 0.0
    link = gpu.nvlink if w.tp * w.cp * w.pp <= gpu.gpus_per_node else gpu.nic  # mesh (dp, pp, cp, tp)
    send = costs.p2p_s(traffic.boundary_bytes(w), link)
    ticks = w.microbatches * w.virtual + w.pp - 1
    return ticks * (costs.overlapped_s(send, tick_compute, gpu) if w.pp_async else 2 * send)


def edge_gradients_s(w: Workload, gpu: Gpu) -> float:
    """Seconds of the edges' gradient sum over pp (pp > 1), exposed: it runs after the backward,
    before the optimizer.
    * Edges on every stage (`edge_on_every_stage`, this project's pipeline): their gradients,
      `traffic.edge_gradient_bytes`, a ring all-reduce over the pp stages.
    * Megatron-LM's tied embedding (`tied_embedding`): its vocab × d_model / tp gradients (grad
      bytes each) over the first and the last stage (`reduce_model_grads`)."""
    if w.pp == 1 or not (w.edge_on_every_stage or w.tied_embedding):
        return 0.0
    link = gpu.nvlink if w.tp * w.cp * w.pp <= gpu.gpus_per_node else gpu.nic  # mesh (dp, pp, cp, tp)
    if w.edge_on_every_stage:
        return costs.ring_all_reduce_s(traffic.edge_gradient_bytes(w), w.pp, link)
    return costs.ring_all_reduce_s(w.vocab * w.d_model / w.tp * w.grad_bytes, 2, link)


def optimizer_s(w: Workload, gpu: Gpu) -> float:
    """Seconds of the optimizer's memory-bound passes per iteration:
    * the update over the parameters this GPU updates (its 1/dp share with ZeRO-1): read the fp32
      parameter, gradient and two moments, write the parameter and moments, 28 bytes each, and
      with LAMB 12 more (`LAMB_EXTRA_BYTES_PER_PARAM`), and the gradients' global norm's read of
      each (`gradient_norm`, grad bytes: this project's step and Megatron-LM's clip_grad_norm);
    * with Megatron-LM's optimizer (`megatron_optimizer`), per updated parameter the copy of the
      fp32 parameter into the 16-bit model (`_copy_main_params_to_model_params`): 4 + param
      bytes; per parameter
      of the stage, its fp32 gradient buffer zeroed for the iteration (`zero_grad_buffer`, 4) and,
      with dp > 1, scaled by 1/dp before the reduction (read and write, 8), where the step has that
      buffer (`grad_accumulator`); with the distributed optimizer (ZeRO-1) the gathered parameters
      copied into the model's (read and write, 2 × param bytes). The fp16 runs' loss-scale check
      (another read and write of the gradients) is not counted."""
    params = stage_params(w)
    updated = params / (w.dp if w.zero1 else 1)
    nbytes = updated * (OPTIMIZER_BYTES_PER_PARAM + (LAMB_EXTRA_BYTES_PER_PARAM if w.optimizer == "lamb" else 0))
    if w.gradient_norm:
        nbytes += updated * w.grad_bytes
    if w.megatron_optimizer:
        nbytes += updated * (4 + w.param_bytes)
        if w.grad_accumulator:
            nbytes += params * (4 + (8 if w.dp > 1 else 0))
        if w.zero1:
            nbytes += params * 2 * w.param_bytes
    return costs.hbm_s(nbytes, gpu)


def dp_s(w: Workload, gpu: Gpu, backward_s: float, compute_s: float) -> float:
    """Seconds of exposed gradient synchronisation per iteration: over dp (`dp_axis_s`) and, the
    weights being replicated over cp too, over cp (`cp_gradients_s`): the reduction group is
    dp × cp, reduced as the step does it, over dp and then over cp."""
    return dp_axis_s(w, gpu, backward_s, compute_s) + cp_gradients_s(w, gpu)


def cp_link(w: Workload, gpu: Gpu):
    """The link a cp group's ranks share: the mesh is (dp, pp, cp, tp), so a cp group spans tp·cp
    adjacent GPUs, inside a node where those fit (as tp's test), else across the NICs."""
    return gpu.nvlink if w.tp * w.cp <= gpu.gpus_per_node else gpu.nic


def cp_gradients_s(w: Workload, gpu: Gpu) -> float:
    """The gradients' all-reduce over cp (`traffic.cp_bytes`: after the dp reduction, once per
    step, or per microbatch with `cp_reduce_per_microbatch`), priced exposed: it runs after the
    backward (or each microbatch's backward), which has nothing left to hide it behind. 0 at cp = 1."""
    if w.cp == 1:
        return 0.0
    reductions = w.microbatches if w.cp_reduce_per_microbatch else 1
    params = traffic.cp_reduced_params(w, stage_params(w))
    return reductions * costs.ring_all_reduce_s(params * w.grad_bytes, w.cp, cp_link(w, gpu))


def cp_attention_s(w: Workload, gpu: Gpu) -> float:
    """Seconds of one layer's key/value transfers over cp for one microbatch, exposed
    (`traffic.cp_bytes` says what moves): forward, its rerun where recomputed
    (`traffic.cp_forward_passes`) and backward, each:
    * window: the halo's permutes, one a slice it reaches back, α + bytes/β each (`costs.p2p_s`);
    * full attention: the all-gather of k and of v (backward: their gradients' reduce-scatters).
    Exposed: context_parallel.py permutes (or gathers) the keys and values as soon as the
    projection has made them and attends at once, so no compute is independent of the transfer;
    no ring overlaps a hop with a block's compute yet (docs/design.md, "Not yet")."""
    if w.cp == 1:
        return 0.0
    link, k = cp_link(w, gpu), traffic.kv_position_bytes(w)
    if w.window is None:
        one = 2 * costs.ring_all_gather_s(w.seq_len * k, w.cp, link)
    else:
        one = sum(costs.p2p_s(2 * positions * k, link) for positions in traffic.halo_hops(w))
    return (traffic.cp_forward_passes(w) + 1) * one


def dp_axis_s(w: Workload, gpu: Gpu, backward_s: float, compute_s: float) -> float:
    """Seconds of exposed dp communication per iteration: the gradients' reduction (a
    reduce-scatter with ZeRO-1, else an all-reduce) and, with ZeRO-1, the parameters' all-gather.
    * "none": both after the backward, exposed;
    * "backward": the reduction hides behind one microbatch's backward of the stage, the gather not;
    * "chunks": each of the v chunks gathers before its first forward and reduce-scatters after its
      last backward, behind the stage's compute; the first gather is prefetched behind the data
      loading, the last chunk's reduce-scatter cannot hide: 1/v of the reduction is exposed
      (MegaScale §3.2; its "1/(2*vpp_size)" of the traffic when both move equal bytes)."""
    if w.dp == 1:
        return 0.0
    link = gpu.nvlink if w.gpus <= gpu.gpus_per_node else gpu.nic
    if w.reduce_scatter_every_microbatch:
        # The gradients are reduce-scattered every microbatch, priced on the link's own timeline
        # (`sharded_gradient_nic`, in `predict`); here only the parameters' all-gather, once per
        # step: chunk by chunk before each chunk's first forward ("chunks"), the first chunk's exposed.
        gather = costs.ring_all_gather_s(stage_params(w) * w.param_bytes, w.dp, link)
        if w.dp_overlap == "chunks":
            return gather / w.virtual + costs.overlapped_s(gather - gather / w.virtual, compute_s, gpu)
        return gather
    grads = stage_params(w) * w.grad_bytes
    if w.zero1:
        reduce = costs.ring_all_gather_s(grads, w.dp, link)
        gather = costs.ring_all_gather_s(stage_params(w) * w.param_bytes, w.dp, link)
    else:
        reduce, gather = costs.ring_all_reduce_s(grads, w.dp, link), 0.0
    if w.dp_overlap == "chunks":
        # MegaScale §3.2: the first chunk's gather is prefetched at the start of the iteration,
        # behind the data loading; the last chunk's reduce-scatter, after the last backward, has
        # nothing left to hide behind. The paper's "1/(2·vpp_size)" of the traffic is this
        # when gather and reduce-scatter move equal bytes; here each at its own bytes (fp32
        # gradients, bf16 parameters)
        edge = reduce / w.virtual
        return edge + costs.overlapped_s(reduce + gather - edge, compute_s, gpu)
    if w.dp_overlap == "backward":
        return costs.overlapped_s(reduce, backward_s, gpu) + gather
    return reduce + gather


def gradient_params(w: Workload, stage: int) -> float:
    """Parameters whose gradients stage `stage` reduces over dp, per GPU: its layers (the last
    stage's `last_stage_layers`, the first's `first_stage_layers`, where the split gives them
    fewer), the LM head on the last stage and, where the first stage gave a layer's slot to it,
    the embedding on the first (both edges on every stage with `edge_on_every_stage`), split
    over tp."""
    last, first = stage == w.pp - 1, stage == 0 and w.pp > 1 and w.first_stage_layers is not None
    layers = w.layers // w.pp
    if last and w.last_stage_layers is not None:
        layers = w.last_stage_layers
    elif first:
        layers = w.first_stage_layers
    edge = edge_matrices(w) * w.vocab * w.d_model if w.edge_on_every_stage else w.vocab * w.d_model * (last + first)
    return layers * flops.layer_params_per_device(model_config(w), w.tp) + edge / w.tp


def sharded_gradient_nic(w: Workload, gpu: Gpu, chunk_forward_s: float, chunk_backward_s: float) -> dict:
    """The dp link's timeline when gradients stay sharded across microbatches
    (`reduce_scatter_every_microbatch`): every chunk's backward of every microbatch reduce-scatters
    that chunk's gradients over dp, G/v bytes with G = `gradient_params` · grad bytes, a ring
    reduce-scatter each (`costs.ring_all_gather_s`: (dp−1)/dp · G/v / β + (dp−1)·α).

    Mechanism. With sharded gradients a GPU holds only its 1/dp shard, so each microbatch's
    gradients must be reduced before they are added to it (PyTorch FSDP: reduce-scattering per
    microbatch "incurs the collective per microbatch backward but saves gradient memory (storing
    the sharded gradients)", pytorch/pytorch#126166; ZeRO-2, Rajbhandari et al. 2020, §5.2). Llama 3
    §3.3.2: "Our use of FSDP for Llama 3 shards optimizer states and gradients", "reduce-scatter
    gradients in FP32 across data parallel workers in FSDP". The reduce-scatters run on their own
    stream, behind the compute, but one link carries them all, in series, and none can start
    before the stage's first gradient exists:

        end(s) = max(first(s) + m·v·RS(s) + sends(s),  last(s) + RS(s))

    first(s) / last(s): the end of stage s's first / last backward tick on the lockstep timeline of
    the schedule's own table (a tick costs `chunk_forward_s` if any stage runs a forward in it, plus
    `chunk_backward_s` if any runs a backward, as `costs.bubble_fraction` counts them); sends(s):
    the pipeline sends stage s makes from its first gradient on (boundary bytes / β each), when
    they leave over the same link (pp across nodes, as dp). Returns the latest stage's times:
    {first_gradient_s, reduce_scatter_s (m·v·RS), pp_sends_s, end_s, stage}."""
    link = gpu.nvlink if w.gpus <= gpu.gpus_per_node else gpu.nic
    pp_link = gpu.nvlink if w.tp * w.cp * w.pp <= gpu.gpus_per_node else gpu.nic
    send = traffic.boundary_bytes(w) / link.bandwidth if w.pp > 1 and pp_link == link else 0.0
    if w.pp == 1:  # microbatches one after another: the first gradient after one forward and backward
        order = [((True,), (None,)), ((None,), (True,))] * w.microbatches
    else:
        table = pipeline_schedule.build(w.schedule, w.pp, w.virtual, w.microbatches)
        order = list(zip(table.forward, table.backward))
    chunks = w.pp * w.virtual
    latest = None
    for s in range(w.pp):
        rs = costs.ring_all_gather_s(gradient_params(w, s) * w.grad_bytes / w.virtual, w.dp, link)
        elapsed, first, last, sends = 0.0, None, None, 0
        for fwd, bwd in order:
            elapsed += chunk_forward_s * any(fwd) + chunk_backward_s * any(bwd)
            if bwd[s]:
                first = elapsed if first is None else first
                last = elapsed
            if first is not None and w.pp > 1:  # this tick's sends, the model's two ends excepted
                f, b = fwd[s], bwd[s]
                sends += (f is not None and f.chunk * w.pp + s != chunks - 1) + (b is not None and b.chunk * w.pp + s != 0)
        reduce_scatter = w.microbatches * w.virtual * rs
        end = max(first + reduce_scatter + sends * send, last + rs)
        if latest is None or end > latest["end_s"]:
            latest = {"first_gradient_s": first, "reduce_scatter_s": reduce_scatter, "pp_sends_s": sends * send,
                      "end_s": end, "stage": s}
    return latest


def sharded_gradient_link(w: Workload, gpu: Gpu, t: dict, busy_s: float) -> dict:
    """`sharded_gradient_nic` for a stage whose compute (and tp) takes `busy_s`: its chunk ticks
    split in the proportion of a layer's forward (`t`, `layer_times`) to its backward with recompute."""
    f, b = t["forward"], t["backward"] + t["recompute"]
    chunk = busy_s / (w.microbatches * w.virtual)
    return sharded_gradient_nic(w, gpu, chunk * f / (f + b), chunk * b / (f + b))


def predict(w: Workload, gpu: Gpu) -> Prediction:
    require_priced(w, gpu)
    m, stage_layers = w.microbatches, w.layers // w.pp
    t = layer_times(w, gpu)
    tp_comm = tp_collective_s(w, gpu)
    # Collective matmul fuses each tp collective with the GEMM that consumes or produces it: the
    # forward's (and a recomputed forward's) and the backward's input-gradient GEMMs, not the
    # weight-gradient ones, which no collective waits on.
    gemm_here = t["gemm"] * (2 if w.recompute == "full" else 1) + t["gemm_input_gradient"]
    if w.tp_overlap:
        tp_exposed = costs.overlapped_s(tp_comm, gemm_here, gpu)
    elif w.tp_backward_overlap:
        tp_exposed = async_backward_tp_s(w, gpu)
    else:
        tp_exposed = tp_comm
    head = head_s(w, gpu)
    layer = t["forward"] + t["backward"] + t["recompute"]
    # The pipeline runs at the pace of its busiest stage: usually the last (its layers + the head)
    last_layers = stage_layers if w.last_stage_layers is None else w.last_stage_layers
    if stage_layers * layer > last_layers * layer + head:
        last_layers, head = stage_layers, 0.0
    stage_layers = last_layers
    per_microbatch = stage_layers * layer + head
    compute = m * per_microbatch
    tp_layers, tp_edges = m * stage_layers * tp_exposed, edge_tp_s(w, gpu)
    tp = tp_layers + tp_edges
    cp = m * stage_layers * cp_attention_s(w, gpu)
    bubble_share = costs.bubble_fraction(w.schedule, w.pp, w.virtual, m,
                                         t["forward"], t["backward"] + t["recompute"])
    bubble = (compute + tp + cp) * bubble_share / (1 - bubble_share)
    pp = pp_s(w, gpu, (per_microbatch + stage_layers * tp_exposed) / w.virtual)
    dp = dp_s(w, gpu, stage_layers * t["backward"], compute)
    if w.reduce_scatter_every_microbatch and w.dp > 1:
        # the link's timeline against the stage's: what it runs past the lockstep end is exposed,
        # and its reduce-scatters hold SMs for as long as they run beside the compute
        busy = compute + tp
        link = sharded_gradient_link(w, gpu, t, busy)
        dp += costs.exposed_s(link["end_s"], busy + bubble + pp) + costs.held_sms_s(link["reduce_scatter_s"], busy, gpu)
    edges = edge_gradients_s(w, gpu)
    pp += edges
    optimizer = optimizer_s(w, gpu)
    breakdown = {"compute": compute, "tp": tp, "cp": cp, "bubble": bubble, "pp": pp, "dp": dp,
                 "optimizer": optimizer, "data": 0.0}
    runs = m * stage_layers
    head_waves = head_wave_loss_s(w, gpu) if head else 0.0
    head_accumulation = head_accumulation_s(w, gpu) if head else 0.0
    kind = t["kind"]
    parts = {"compute gemm": runs * kind["gemm"],
             "compute gemm wave quantization": runs * kind["gemm wave quantization"] + m * head_waves,
             "compute attention": runs * kind["attention"], "compute elementwise": runs * kind["elementwise"],
             "compute lm head": m * (head - head_waves - head_accumulation),
             "compute gradient accumulation": runs * kind["gradient accumulation"] + m * head_accumulation,
             "tp layers": tp_layers, "tp embedding+head": tp_edges, "cp keys+values": cp, "bubble": bubble,
             "pp sends": pp - edges, "pp edge gradients": edges,
             "dp gradients+parameters": dp, "optimizer": optimizer, "data": 0.0}
    iteration = sum(breakdown.values())
    tokens = w.global_batch * w.seq_len
    model_flops = tokens * flops.model_flops_per_token(model_config(w))
    return Prediction(iteration_s=iteration, breakdown=breakdown, tokens_per_s=tokens / iteration,
                      model_flops=model_flops, mfu=model_flops / (iteration * w.gpus * gpu.peak_flops), parts=parts)
