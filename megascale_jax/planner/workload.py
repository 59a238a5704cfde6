"""A training layout as the cost models see it: model shape, mesh, schedule and the features
that decide what is recomputed and what overlaps. Built from this project's config
(`from_config`) or written out for a published run (tests/planner/published.py)."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

from megascale_jax.config import Config, ModelConfig
from megascale_jax.model import flops


@dataclasses.dataclass(frozen=True)
class Workload:
    # model
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_dim: int
    vocab: int
    seq_len: int
    window: Optional[int]
    block: Literal["parallel", "serial"]
    # batch and mesh
    global_batch: int  # sequences per iteration
    gpus: int
    tp: int
    pp: int
    virtual: int
    microbatches: int  # per data-parallel replica and iteration
    schedule: str
    # what is recomputed in the backward: nothing, the norms and activations (their inputs kept),
    # the attention core only, or every layer's forward
    recompute: Literal["none", "elementwise", "selective", "full"]
    sequence_parallel: bool
    zero1: bool
    fused_attention: bool  # flash-style kernel (cuDNN/Pallas) vs materialised scores (XLA, Megatron 2021)
    # overlap features
    tp_overlap: bool  # collective matmul hides tp transfers behind the matmuls
    pp_async: bool  # pipeline sends overlap the tick's compute (this project's ppermute) vs blocking
    pp_split_over_tp: bool  # each tp rank sends 1/tp of the boundary activation (sequence parallel,
                            # or Megatron's scatter/gather), instead of all of it
    edge_on_every_stage: bool  # embedding + head stored (and reduced over dp) on every pp stage
    # when the dp reduction runs: after the backward ("none"); overlapping one microbatch's
    # backward ("backward", this project's pipeline); or chunk by chunk, each chunk's parameters
    # all-gathered before its first forward and its gradients reduce-scattered after its last
    # backward, so only the first gather and the last reduce-scatter are exposed ("chunks":
    # MegaScale §3.2, PyTorch FSDP; predict.dp_s)
    dp_overlap: Literal["none", "backward", "chunks"]
    # how this project's runtime communicates (False for published Megatron runs)
    masked_idle_ticks: bool = False  # pp > 1 with explicit tp or cp collectives: idle ticks run masked chunks
    gspmd_edges: bool = False  # embedding and head partitioned by GSPMD (traffic.tp_bytes says how)
    dp_reduce_per_microbatch: bool = False  # gradients all-reduced once per microbatch (traffic.dp_bytes)
    activation_bytes: int = 2  # bf16/fp16 activations
    grad_bytes: int = 4  # gradients reduced in fp32
    param_bytes: int = 4  # fp32 parameters (all-gathered in full after a ZeRO-1 update)
    gated_mlp: bool = False  # SwiGLU: three MLP matrices (gate, up, down) instead of two
    # Unfused attention computes only the scores inside the window (a banded matmul, Beltagy et al.
    # 2020) instead of all of them and masking (XLA's attention, measured on our H200)
    banded_window: bool = False
    # This project's XLA attention under a window much shorter than the rank's queries: blocks of
    # this many queries, each scored against block + window - 1 keys (attention.banded_attention)
    xla_band_block: Optional[int] = None
    # Parallel block with fused GEMMs: the QKV and MLP-up projections read the one shared norm's
    # output and run as one GEMM (MegaScale §3.1, Figure 3) instead of two
    fused_block_gemms: bool = False
    # Layers on the stage that also runs the LM head, when the model's split gives it fewer
    # (Llama 3 drops one layer from the first and the last stage); None: layers / pp like the rest
    last_stage_layers: Optional[int] = None
    # Layers on the first stage when the split gives it fewer, the embedding in the freed slot
    # (Llama 3 §3.3.2: "the first model chunk on the first stage has only the embedding"); its
    # gradients are what stage 0 reduces over dp (predict.gradient_params). None: layers / pp
    first_stage_layers: Optional[int] = None
    # Weight gradients are added into a separate accumulator every microbatch (Megatron-LM's fp32
    # main_grad, Llama 3's FP32 accumulation; predict.gradient_accumulation_s); False where the
    # step has none (this project at one GPU and one microbatch: jax.value_and_grad directly)
    grad_accumulator: bool = True
    # Gradients kept sharded over dp across the microbatches (FSDP/ZeRO-2 without no_sync): each
    # microbatch's backward reduce-scatters its weight gradients, chunk by chunk, and adds its 1/dp
    # shard into the fp32 accumulator, instead of accumulating the whole gradient and reducing it
    # once per step. Llama 3 §3.3.2: "Our use of FSDP for Llama 3 shards optimizer states and
    # gradients"; the NIC that carries them then paces the step (predict.sharded_gradient_nic)
    reduce_scatter_every_microbatch: bool = False
    # Megatron-LM's asynchronous backward tp communication (LinearWithGradAccumulationAndAsync-
    # Communication, since Aug 2021): each column-parallel linear launches its input gradient's
    # all-reduce (with sequence parallelism: reduce-scatter) before its weight-gradient GEMM, which
    # hides it, and with sequence parallelism re-gathers its input before the input-gradient GEMM,
    # which hides that (predict.async_backward_tp_s). Without collective matmul (`tp_overlap`)
    tp_backward_overlap: bool = False
    # Megatron-LM's mixed-precision optimizer (optimizer.py, distrib_optimizer.py at 285068c8, and
    # de7dc40 for SC'21): the step also reads the gradients for the global norm and copies the
    # updated fp32 parameters into the 16-bit model; its contiguous fp32 gradient buffer is zeroed
    # every iteration and scaled by 1/dp before the reduction; the distributed optimizer copies the
    # gathered parameters back into the model (predict.optimizer_s)
    megatron_optimizer: bool = False
    # The output layer shares the input embedding's weights. Megatron-LM's GPT: with pp > 1 the
    # first and the last stage each hold a copy and all-reduce its gradients after the backward
    # (`allreduce_word_embedding_grads`). This project's model.tied_embeddings
    # (`edge_on_every_stage`): one matrix on every stage, its embedding and head gradients added
    # on the stage before the dp reduction and the sum over pp (`edge_matrices`;
    # predict.edge_gradients_s)
    tied_embedding: bool = False
    # The optimizer's update (predict.optimizer_s): AdamW, or LAMB, whose per-layer trust ratio needs
    # the norms of the parameters and the update before it scales the update (its update written
    # and read back, the parameters read again)
    optimizer: Literal["adamw", "lamb"] = "adamw"
    # The step reads every gradient once more for their global norm (this project's train step,
    # always: its finite check, the metrics and the clipping share one norm; Megatron-LM's
    # clip_grad_norm, every step; predict.optimizer_s)
    gradient_norm: bool = False
    # The LM head's logits recomputed in the backward (this project's model.loss_chunks > 1: each
    # slice's float32 logits dropped after its loss; predict.head_s)
    head_recompute: bool = False
    # The LM head's backward in float32 (this project's model.head_grad_float32): its weight-gradient
    # GEMM priced at the calibration's measured float32 GEMM rate (`fp32_gemm_tflops`; predict.head_s)
    head_grad_float32: bool = False
    # Context parallelism (this project's mesh.cp; parallel/context_parallel.py): every sequence
    # split into cp slices of seq_len/cp positions, one per rank; each layer's attention receives
    # the other ranks' keys and values it needs (the window's halo, or all of them by all-gather);
    # the weights are replicated over cp, so their gradients are reduced over dp and cp
    cp: int = 1
    # With m > 1 the gradients are all-reduced over cp once per microbatch, not once per step
    # (this project's accumulation is manual over dp only and GSPMD reduces over cp inside it;
    # traffic.cp_bytes)
    cp_reduce_per_microbatch: bool = False

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def microbatch_seqs(self) -> int:
        return self.global_batch // (self.dp * self.microbatches)

    @property
    def microbatch_tokens(self) -> int:
        """Positions of one microbatch one GPU holds: its sequences' cp slices (whole at cp = 1)."""
        return self.microbatch_seqs * (self.seq_len // self.cp)


def from_config(cfg: Config, gpus: int) -> Workload:
    """This project's run of `cfg` on `gpus` GPUs (dp = gpus / (tp·pp·cp)).

    * Recompute: the pipeline's default `pp_stash=inputs` reruns each chunk's forward in its
      backward ("full"); `residuals` and pp = 1 recompute nothing, unless `model.remat` asks:
      full reruns each layer ("full"), dots reruns its norms, GeLU and softmax ("selective",
      which this planner prices as the attention and its score pass), elementwise reruns the
      norms and the MLP activation ("elementwise": inside the backward's fusions, from inputs
      they read anyway, so priced as no HBM pass more; `predict.layer_times`).
    * The optimizer (`optim.name`), the logits recomputed by `model.loss_chunks` > 1 and the LM
      head's float32 backward (`model.head_grad_float32`) are priced (`predict.optimizer_s`,
      `predict.head_s`).
    * Priced as their default, by measurement or because they change no FLOPs or bytes the
      planner resolves (`notes` names the rest: RMSNorm, no biases, partial RoPE, collective
      matmul's pieces, a synchronous loader):
      `model.fused_norm` and `model.fused_mlp` (the Pallas kernels ran within 1% of XLA's fusion
      in the H200 ladders: 0.174 against 0.172 s at 4 sequences, 0.316 against 0.315 at 8);
      `model.attention=pallas` (cuDNN's fused-attention constants: in the model at 8 sequences
      it ran 4% slower, 2026-11-27); `model.scan_unroll` (the planner has no per-kernel launch
      cost). `notes` says so for a config that sets them.
    * Overlap: pipeline sends are asynchronous ppermutes; at pp > 1 each chunk's dp reduction runs
      inside the tick loop's cool-down ("backward"); at pp = 1 the gradients are reduced after
      the backward. Collective matmul (`tp_overlap=collective_matmul`) hides tp transfers.
    * Context parallelism: `mesh.cp` (dp = gpus / (tp·pp·cp)); with one microbatch and cp > 1 the
      step takes jax.value_and_grad's gradients directly and GSPMD reduces them (no accumulator).
    """
    m, mesh, par = cfg.model, cfg.mesh, cfg.parallel
    dp = gpus // (mesh.tp * mesh.pp * mesh.cp)
    return Workload(
        layers=m.layers, d_model=m.d_model, heads=m.heads, kv_heads=m.kv_heads, head_dim=m.head_dim,
        mlp_dim=m.mlp_dim, vocab=m.vocab, seq_len=m.seq_len, window=m.window, block=m.block,
        global_batch=cfg.train.global_batch, gpus=gpus, tp=mesh.tp, pp=mesh.pp, virtual=par.pp_virtual,
        microbatches=par.microbatches, schedule=par.pp_schedule,
        recompute="full" if m.remat == "full" or (mesh.pp > 1 and par.pp_stash == "inputs")
        else "selective" if m.remat == "dots" else "elementwise" if m.remat == "elementwise" else "none",
        sequence_parallel=par.sequence_parallel, zero1=par.zero1,
        fused_attention=m.attention in ("cudnn", "pallas"),
        tp_overlap=par.tp_overlap == "collective_matmul", pp_async=True,
        pp_split_over_tp=par.sequence_parallel, edge_on_every_stage=True,
        dp_overlap="backward" if mesh.pp > 1 else "none",
        # pipeline.explicit_collectives: tp's explicit edges or cp's halo (a collective every stage joins)
        masked_idle_ticks=(mesh.tp > 1 and par.tp_overlap != "xla") or mesh.cp > 1,
        gspmd_edges=par.tp_overlap == "xla",  # else Megatron's vocab-parallel edges (tensor_parallel.embed_lookup)
        dp_reduce_per_microbatch=False,  # at pp = 1 too: parallel/microbatches.py reduces once per step
        # parallel/microbatches.py: m = 1 with dp = cp = 1 takes jax.value_and_grad's gradients as
        # they are, otherwise a scan adds each microbatch's into zeros_like(params)
        grad_accumulator=not (mesh.pp == 1 and par.microbatches == 1 and dp == 1 and mesh.cp == 1),
        activation_bytes=2 if m.dtype == "bfloat16" else 4, gated_mlp=m.activation == "swiglu",
        optimizer=cfg.optim.name, head_recompute=m.loss_chunks > 1, head_grad_float32=m.head_grad_float32,
        tied_embedding=m.tied_embeddings, gradient_norm=True, cp=mesh.cp,
        cp_reduce_per_microbatch=False,  # the accumulation and the pipeline are manual over cp too
        xla_band_block=flops.band_block(m.seq_len // mesh.cp, m.window) if m.attention == "xla" else None)


def notes(cfg: Config) -> list[str]:
    """One line for each option of `cfg` the planner prices as its default (`from_config` says why)."""
    m, out = cfg.model, []
    if m.norm == "rmsnorm":
        out.append("model.norm=rmsnorm: priced as LayerNorm (the same HBM passes: one read and one write a value)")
    if not m.bias:
        out.append("model.bias=false: priced with biases (their adds run inside the GEMM and activation fusions; "
                   "their parameters are under 0.1% of the model's)")
    if m.rope_fraction < 1:
        out.append("model.rope_fraction<1: priced as full RoPE (its rotation is part of the measured elementwise passes)")
    if cfg.parallel.tp_overlap == "collective_matmul" and cfg.mesh.tp > 1:
        out.append("parallel.tp_chunks/tp_bidirectional: not priced (collective matmul's GEMMs priced at whole size, "
                   "its transfers hidden behind them)")
    if cfg.data.prefetch == 0:
        out.append("data.prefetch=0: the synchronous loader's time is not priced (data is charged 0)")
    if m.fused_norm or m.fused_mlp:
        out.append("model.fused_norm/fused_mlp: priced as XLA's fusion (the Pallas kernels ran within 1% of it on an H200)")
    if m.attention == "pallas":
        out.append("model.attention=pallas: priced with cuDNN's fused-attention constants (it ran 4% slower in the "
                   "model on an H200)")
    if m.scan_unroll > 1:
        out.append("model.scan_unroll: priced as 1 (it changes no FLOPs or bytes; kernel launches are not priced)")
    return out


def model_config(w: Workload) -> ModelConfig:
    """The model of `w` as this project's config describes one (for its FLOP count)."""
    return ModelConfig(layers=w.layers, d_model=w.d_model, heads=w.heads, kv_heads=w.kv_heads,
                       mlp_hidden=w.mlp_dim, vocab=w.vocab, seq_len=w.seq_len, window=w.window,
                       block=w.block, activation="swiglu" if w.gated_mlp else "gelu_tanh")


def edge_matrices(w: Workload) -> int:
    """vocab × d_model matrices every stage holds where the edges are on every stage: the
    embedding and the LM head, or the one matrix both use (`tied_embedding`)."""
    return 1 if w.tied_embedding else 2


def stage_params(w: Workload, last: bool = True) -> float:
    """Parameters one GPU of a stage holds: its layers and, on the last stage (or every stage
    where they are replicated), the embedding and LM head, all split over tp (but k/v when tp does
    not divide the kv heads: `flops.layer_params_per_device`)."""
    edge = edge_matrices(w) * w.vocab * w.d_model if w.edge_on_every_stage else (w.vocab * w.d_model if last else 0)
    return w.layers // w.pp * flops.layer_params_per_device(model_config(w), w.tp) + edge / w.tp
