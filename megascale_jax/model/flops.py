"""Parameter count, model FLOPs per token, device peak FLOP/s, MFU and a per-device memory estimate.

FLOPs convention (Megatron-LM's, as in Narayanan et al. 2021 and the MegaScale paper):
* A matmul with an (m, n) weight costs 2·m·n FLOPs per token in the forward pass. Every weight
  matrix counts: attention q/k/v/o, MLP w1/w2 and the LM head (d × V). The embedding is a
  lookup and costs 0. Biases, norms, activations and the softmax are ignored (lower order).
* Attention scores (q·kᵀ) and values (p·v) cost 2·2·heads·head_dim·ctx per token and layer,
  where ctx = min(window, seq_len) keys per query (window=None → seq_len). Like Megatron we
  count the full ctx keys for every query — no halving for the causal mask.
* Training = forward + backward = 3 × forward; no activation recomputation is counted, so
  MFU measures useful model work, not the hardware's.
With kv_heads = heads and mlp_ratio = 4 the training FLOPs per token equal Megatron's
72·l·d²·(1 + s/(6d) + V/(12·l·d)) (its per-iteration formula divided by batch × seq_len).

`python -m megascale_jax.flops --config configs/gpt_175b.yaml mesh.dp=8 mesh.pp=8 mesh.tp=8`
prints these numbers for a config and a (possibly hypothetical) mesh, without JAX.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence


from megascale_jax import cli, pipeline_schedule
from megascale_jax.config import Config, ConfigError, ModelConfig, load_config

# ----------------------------------------------------------------------------- parameters


def layer_params(m: ModelConfig) -> int:
    """Parameters of one transformer layer (the model stacks `layers` of them)."""
    d, h, k, hd, f = m.d_model, m.heads, m.kv_heads, m.head_dim, m.mlp_dim
    norm = 2 * d if m.norm == "layernorm" else d  # scale (+ bias)
    norms = 1 if m.block == "parallel" else 2  # the parallel block shares one norm
    b = int(m.bias)
    attention = (d * h * hd + b * h * hd) + 2 * (d * k * hd + b * k * hd) + (h * hd * d + b * d)  # q, k+v, o
    mlp = m.mlp_up_matrices * (d * f + b * f) + (f * d + b * d)
    return norms * norm + attention + mlp


def layer_params_per_device(m: ModelConfig, tp: int) -> float:
    """One layer's parameters on one tp rank: 1/tp of them, except that the k and v projections
    are whole on every rank when tp does not divide `kv_heads` (each kv head replicated over
    tp/kv_heads ranks; norms and output biases, replicated too, are too small to count)."""
    kv = 0 if m.kv_heads % tp == 0 else 2 * (m.d_model + int(m.bias)) * m.kv_heads * m.head_dim
    return (layer_params(m) - kv) / tp + kv


def param_count(model_cfg: ModelConfig) -> int:
    """All parameters: embedding, LM head (unless tied), `layers` blocks, final norm."""
    m = model_cfg
    final_norm = 2 * m.d_model if m.norm == "layernorm" else m.d_model
    head = 0 if m.tied_embeddings else m.d_model * m.vocab
    return m.vocab * m.d_model + m.layers * layer_params(m) + final_norm + head


# ----------------------------------------------------------------------------- FLOPs


def forward_flops_per_token(model_cfg: ModelConfig) -> int:
    """Forward-pass FLOPs per token (see the module docstring for what is counted)."""
    m = model_cfg
    d, h, k, hd, f = m.d_model, m.heads, m.kv_heads, m.head_dim, m.mlp_dim
    layer_matmul_weights = d * h * hd + 2 * d * k * hd + h * hd * d + (m.mlp_up_matrices + 1) * d * f  # q, k+v, o, MLP
    ctx = m.seq_len if m.window is None else min(m.window, m.seq_len)
    layer_attention = 2 * 2 * h * hd * ctx  # q·kᵀ and p·v over ctx keys, no causal halving
    lm_head = 2 * d * m.vocab
    return m.layers * (2 * layer_matmul_weights + layer_attention) + lm_head


def model_flops_per_token(model_cfg: ModelConfig) -> int:
    """Training (forward + backward) model FLOPs per token = 3 × forward."""
    return 3 * forward_flops_per_token(model_cfg)


# ----------------------------------------------------------------------------- peak and MFU

# bf16 dense (no sparsity) tensor-core peaks from NVIDIA's datasheets. Matched as lower-case
# substrings of `device.device_kind`, most specific first ("h100 pcie" before "h100";
# "h200" also matches GH200, whose GPU is the H100/H200 SXM part).
_PEAK_BF16_DENSE = (
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h200 nvl", 835e12),
    ("h100", 989e12),  # SXM, e.g. "NVIDIA H100 80GB HBM3"
    ("h200", 989e12),
    ("a100", 312e12),  # SXM and PCIe alike
)


def peak_flops(device) -> Optional[float]:
    """Peak bf16 dense FLOP/s of a jax device (or a device_kind string); None if unknown (CPU...)."""
    kind = (device if isinstance(device, str) else getattr(device, "device_kind", "")).lower()
    for pattern, peak in _PEAK_BF16_DENSE:
        if pattern in kind:
            return peak
    return None  # never guess: an MFU against a made-up peak is worse than none


def mfu(tokens_per_s: float, model_cfg: ModelConfig, devices: Iterable) -> Optional[float]:
    """Model FLOPs utilisation over `devices`, or None when any device's peak is unknown."""
    peaks = [peak_flops(dev) for dev in devices]
    if not peaks or any(p is None for p in peaks):
        return None
    return tokens_per_s * model_flops_per_token(model_cfg) / sum(peaks)


# ----------------------------------------------------------------------------- memory

# Activation values kept per token and d_model per layer for backward (Korthikanti et al. 2022,
# "Reducing Activation Recomputation", Table 2: 10 + 24/tp bytes at 16 bits, i.e. 5 + 12/tp
# values; the 24/tp part lives inside tensor-parallel regions).
ACT_VALUES_REPLICATED, ACT_VALUES_TP_SHARDED = 5, 12
# What this project's compiled step keeps instead (the memory estimate's values; the planner's time
# model keeps Korthikanti's above): read off the buffers the gpt_1b step compiled for an H200 keeps
# for its backward (jax 0.11.2; docs/compile.md): 15 bf16 values per token and layer at tp 1 — the
# layer's input and its norm's output whole on every tp rank; q, k, v, the attention output and
# one more attention-wide value, the MLP-up's four and the activation's four split over tp. The
# lean GeLU/norm backward keeps fewer replicated values than Megatron's 5.
KEPT_VALUES_REPLICATED, KEPT_VALUES_TP_SHARDED = 2, 13
# Sequence parallelism: the replicated values split over tp, but the column-parallel GEMMs keep
# their all-gathered input (one whole value) for the weight gradient.
KEPT_SP_GATHERED = 1
# model.remat=dots keeps the GEMMs' outputs only: the row-parallel one whole, q, k, v and the
# MLP-up's four split over tp.
KEPT_DOTS_REPLICATED, KEPT_DOTS_TP_SHARDED = 1, 7
# model.attention=xla with a window much shorter than the sequence (attention.banded_attention):
# queries in blocks, each scored against the block + w - 1 keys its window reaches.
MIN_BLOCK = 64  # queries per block at least: smaller blocks are all overhead


def band_block(queries: int, window: int | None) -> int | None:
    """The query block banded attention uses for `queries` queries under `window`, or None when
    banding would not pay: the smallest divisor of `queries` that is at least window - 1 (each
    block's keys then span two blocks) and MIN_BLOCK, kept only where it cuts the scores to half
    or less (queries >= 4 blocks: block + w - 1 keys a query instead of all of them)."""
    if window is None:
        return None
    block = next((d for d in range(max(window - 1, MIN_BLOCK), queries + 1) if queries % d == 0), queries)
    return block if queries >= 4 * block else None


# model.attention=xla materialises (heads, seq, seq) scores and probabilities: 2 values each.
XLA_SCORE_VALUES = 2
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def halo_length(window: int, seq_len: int, cp: int) -> int:
    """Keys (and values) a cp rank receives per sequence and layer under a sliding window: the
    window−1 positions before its slice, at most what the ranks before the last hold. Here, without
    JAX, so that the planner and the trainer (`parallel/context_parallel.py`) use the one rule."""
    return min(window - 1, (cp - 1) * (seq_len // cp))


def cp_received_positions(m: ModelConfig, cp: int) -> int:
    """Positions of keys and values one cp rank receives per sequence and layer besides its own
    seq_len/cp: the halo under a window, every other rank's slice under full attention (k and v
    all-gathered over cp). 0 at cp = 1."""
    if cp == 1:
        return 0
    return halo_length(m.window, m.seq_len, cp) if m.window is not None else m.seq_len - m.seq_len // cp


def kv_width_per_device(m: ModelConfig, tp: int) -> int:
    """kv_heads × head_dim on one tp rank: 1/tp of them, or one head where tp does not divide the
    kv heads (each rank computes the kv head its query heads use)."""
    return m.kv_heads * m.head_dim // tp if m.kv_heads % tp == 0 else m.head_dim


def memory_estimate(cfg: Config) -> dict:
    """Rough bytes per device for the busiest device: parameters and gradients (fp32, sharded over
    tp and pp; k/v whole on every tp rank with fewer kv heads than tp ranks), two fp32 optimizer
    moments (÷dp with zero1) and stored activations: the values per token and layer the compiled
    step keeps (`KEPT_VALUES_*`; on GPUs `train.check_compiled_memory` checks the compiled step
    itself). `model.remat=full` keeps only layer inputs (`_chunk_values`). With
    pp > 1 they follow the pipeline table: its stash slots per stage (flat in m for 1F1B, m·v for
    gpipe) each hold one chunk's input (`pp_stash=inputs`, plus one chunk's residuals live while
    its backward recomputes it) or one chunk's residuals and output (`pp_stash=residuals`). The
    fp32 logits of one microbatch are added for the last stage (one sequence slice's with
    `model.loss_chunks`). Context parallelism (`mesh.cp`) splits every sequence: the values per
    token, the scores and the logits are those of a rank's seq_len/cp positions, plus the keys and
    values it receives (`cp_received_positions`); parameters, gradients and moments are replicated
    over cp and do not shrink. With `train.donate=false` the step's output state is a second copy.
    Gradient accumulation (several microbatches, dp > 1, or a pipeline) holds a float32
    accumulator beside the gradients; sequence parallelism splits the values
    tensor parallelism would replicate. The weight copies the compiled step holds besides (a rolled
    bf16 scan's converted weights, an unrolled remat's f32 slices, an interleaved stage's chunk) are
    parts of their own. Against the step compiled for a GPU (17 layouts, all within 5%):
    docs/compile.md."""
    m, mesh, par = cfg.model, cfg.mesh, cfg.parallel
    final_norm = 2 * m.d_model if m.norm == "layernorm" else m.d_model
    embed, head = m.vocab * m.d_model, (0 if m.tied_embeddings else m.d_model * m.vocab) + final_norm
    # The embedding and the LM head (with their gradients and moments) are replicated over pp:
    # every stage holds both, though only the first uses the embedding and the last the head (a
    # jax.Array spans its whole mesh; see parallel/pipeline.py), so they count on every stage.
    edge = embed + head
    params = m.layers // mesh.pp * layer_params_per_device(m, mesh.tp) + edge / mesh.tp
    optimizer = 2 * params * 4 / (mesh.dp if par.zero1 else 1)

    tokens = cfg.train.global_batch // (mesh.dp * par.microbatches) * (m.seq_len // mesh.cp)  # this rank's slice
    chunk, chunk_io = _chunk_values(cfg)
    if mesh.pp == 1:
        values = chunk
    else:
        slots = pipeline_schedule.build(par.pp_schedule, mesh.pp, par.pp_virtual, par.microbatches).slots
        values = slots * chunk_io + chunk if par.pp_stash == "inputs" else slots * (chunk + chunk_io)
    activations = values * _DTYPE_BYTES[m.dtype]
    activations += tokens * m.vocab / mesh.tp * 4 / m.loss_chunks  # fp32 logits for the loss: one slice's
    parts = {"parameters": params * 4, "gradients": params * 4, "optimizer": optimizer,
             "activations": activations}
    if mesh.pp > 1 or par.microbatches > 1 or (mesh.dp > 1 and mesh.cp == 1):
        # each microbatch's gradients are summed into a float32 accumulator (parallel/microbatches.py,
        # the pipeline's): whole on every dp replica, the dp reduction coming after the last one.
        # With cp > 1 and one microbatch GSPMD reduces jax.value_and_grad's gradients directly
        parts["gradient accumulator"] = params * 4
    if not cfg.train.donate:  # the step's new state beside the one it was given
        parts["undonated state"] = params * 4 + optimizer
    # Weights the compiled step holds beside the parameters (read off the compiles' buffers, jax
    # 0.11.2, bench/results/memory_estimate_aot.json):
    layer_weights = m.layers // mesh.pp * layer_params_per_device(m, mesh.tp)
    unrolled = m.scan_unroll >= m.layers // (mesh.pp * par.pp_virtual)
    if m.dtype == "bfloat16" and m.remat in ("none", "elementwise") and not unrolled:
        # a rolled layer scan stacks each layer's bf16 weights for the backward's GEMMs (unrolled,
        # the backward converts them again: 48.30 -> 45.67 GiB on the same-work row, measured 45.67)
        parts["bf16 weights kept for the backward"] = 2 * layer_weights
    if unrolled and m.remat in ("dots", "full"):
        # unrolled and rematerialised, XLA merges the forward's and the backward's slices of the
        # stacked parameters: an f32 copy of every layer's weights lives from one to the other
        # (5.1 GiB at remat=full on gpt_1b; rolled, the backward slices them again)
        parts["f32 layer weights sliced for the backward"] = 4 * layer_weights
    if mesh.pp > 1 and par.pp_virtual > 1:
        # an interleaved stage picks its chunk's parameters by a dynamic slice (an f32 copy) and
        # writes the chunk's gradient before adding it into the stage's
        parts["one chunk's weights and gradient"] = 2 * 4 * layer_weights / par.pp_virtual
    parts["total"] = sum(parts.values())
    return parts


def _chunk_values(cfg: Config) -> tuple[float, float]:
    """(values one pipeline chunk stores for its backward, values of one microbatch's activation
    passed between chunks), per device for one microbatch; at pp = 1 the chunk is every layer."""
    m, mesh, par = cfg.model, cfg.mesh, cfg.parallel
    micro_seqs = cfg.train.global_batch // (mesh.dp * par.microbatches)
    queries = m.seq_len // mesh.cp  # positions of each sequence this rank holds (all of it at cp = 1)
    received = cp_received_positions(m, mesh.cp)
    tokens = micro_seqs * queries
    replicated, sharded = ((KEPT_DOTS_REPLICATED, KEPT_DOTS_TP_SHARDED) if m.remat == "dots"
                           else (KEPT_VALUES_REPLICATED, KEPT_VALUES_TP_SHARDED))
    if par.sequence_parallel and mesh.tp > 1:
        replicated = replicated / mesh.tp + KEPT_SP_GATHERED
    per_layer = tokens * m.d_model * (replicated + sharded / mesh.tp)
    # cp: the keys and values received from the other ranks, kept for the attention's backward
    per_layer += 2 * micro_seqs * received * kv_width_per_device(m, mesh.tp)
    if m.attention == "xla":  # every score of the rank's queries against every key it holds
        # (or, banded under a window much shorter than the slice, the block + w - 1 its block reaches)
        block = band_block(queries, m.window)
        keys = block + m.window - 1 if block else queries + received
        per_layer += micro_seqs * m.heads / mesh.tp * queries * keys * XLA_SCORE_VALUES
    # model.remat=full keeps only each layer's input, plus one layer's activations while its
    # backward recomputes it (dots: its GEMMs' outputs, above).
    kept = tokens * m.d_model if m.remat == "full" else per_layer
    working = per_layer if m.remat == "full" else 0
    return m.layers // (mesh.pp * par.pp_virtual) * kept + working, tokens * m.d_model


def stash_slot_bytes(cfg: Config) -> float:
    """Bytes one pipeline stash slot holds on a device: one microbatch's chunk input
    (`pp_stash=inputs`), or that plus the chunk's residuals (`pp_stash=residuals`)."""
    chunk, chunk_io = _chunk_values(cfg)
    slot = chunk_io if cfg.parallel.pp_stash == "inputs" else chunk + chunk_io
    return slot * _DTYPE_BYTES[cfg.model.dtype]


def compiled_bytes(analysis) -> int:
    """Bytes a compiled program holds at its peak by XLA's buffer assignment (`memory_analysis()`):
    its arguments, its outputs that do not reuse a donated argument, its temporaries and code."""
    return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
            + analysis.temp_size_in_bytes + analysis.generated_code_size_in_bytes)


def device_copy_bytes(state_bytes: int, step_bytes: int, limit_bytes: Optional[float], cap_gib: Optional[float]) -> int:
    """How much of the state a save with checkpoint.background_host_copy copies on the device (per
    device): all of it where it fits beside the step (`step_bytes`: the compiled peak and the input
    batches) within `limit_bytes` (None: no limit known, a CPU), at most `checkpoint.device_copy_gib`
    (`cap_gib`; None: no cap of the user's). The rest goes to host memory while the step waits, so
    a save never takes a run past the device's memory."""
    on_device = state_bytes if cap_gib is None else min(state_bytes, int(cap_gib * 2**30))
    if limit_bytes is not None:
        on_device = min(on_device, max(0, int(limit_bytes - step_bytes)))
    return on_device


def check_compiled_fits(analysis, limit_bytes: Optional[float], where: str) -> None:
    """Refuse (ConfigError, one line) a compiled step that needs more than `limit_bytes`. (A
    background save's copy of the state is capped to what fits beside it: `device_copy_bytes`.)"""
    if analysis is None or limit_bytes is None:
        return
    needed = compiled_bytes(analysis)
    if needed <= limit_bytes:
        return
    raise ConfigError(
        f"the compiled train step needs {format_bytes(needed)} per device (XLA's buffer assignment: "
        f"{format_bytes(analysis.temp_size_in_bytes)} of temporaries), more than the {format_bytes(limit_bytes)} "
        f"of {where}; lower train.global_batch, raise parallel.microbatches, use model.attention=cudnn, or "
        "shard over more devices")


def check_fits(cfg: Config, limit_bytes: Optional[float], devices_sharing: int = 1, where: str = "device") -> None:
    """Refuse (ConfigError) a config whose `memory_estimate` cannot fit: before compiling, not as a
    RESOURCE_EXHAUSTED after it. `devices_sharing` devices draw on the same `limit_bytes` (the
    simulated CPU devices of one process share its RAM). The estimate is rough and assumes no
    rematerialisation, so it errs high: `train.memory_check=false` lets a user try anyway."""
    if limit_bytes is None or not cfg.train.memory_check:
        return
    parts = memory_estimate(cfg)
    needed = parts["total"] * devices_sharing
    if needed <= limit_bytes:
        return
    biggest = max((k for k in parts if k != "total"), key=parts.get)
    shared = f" ({devices_sharing} devices x {format_bytes(parts['total'])})" if devices_sharing > 1 else ""
    raise ConfigError(
        f"estimated memory {format_bytes(needed)}{shared}, mostly {biggest} {format_bytes(parts[biggest])}, exceeds "
        f"the {format_bytes(limit_bytes)} of {where}; shrink model.seq_len or train.global_batch, raise "
        "mesh.tp/mesh.pp or parallel.microbatches, or set train.memory_check=false to try anyway")


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# ----------------------------------------------------------------------------- CLI


def format_count(n: float) -> str:
    """A parameter count in the largest unit it reaches: 175.53B, 1.27M, 9.47K, 640."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = cli.ArgumentParser(prog="python -m megascale_jax.flops", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/gpt_175b.yaml")
    parser.add_argument("--target-mfu", type=float, default=0.5, help="MFU assumed for the step-time line")
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. mesh.dp=8 mesh.pp=8 mesh.tp=8")
    args = cli.parse(parser, argv)
    try:
        cfg = load_config(args.config, args.overrides, planning=True)
    except ConfigError as e:
        return cli.user_error(e)

    m, mesh = cfg.model, cfg.mesh
    n_devices = mesh.size
    params, per_token = param_count(m), model_flops_per_token(m)
    step_flops = per_token * cfg.train.global_batch * m.seq_len
    h100 = peak_flops("NVIDIA H100 80GB HBM3")
    print(f"parameters:           {params:,} ({format_count(params)})")
    print(f"FLOPs/token (train):  {per_token:.4g}  (forward {forward_flops_per_token(m):.4g}, window={m.window})")
    print(f"FLOPs/step (train):   {step_flops:.4g}  (global_batch {cfg.train.global_batch} x seq_len {m.seq_len})")
    print(f"step time at {args.target_mfu:.0%} MFU on {n_devices} x H100 SXM ({h100 / 1e12:.0f} TFLOP/s bf16): "
          f"{step_flops / (args.target_mfu * h100 * n_devices):.3g} s")
    cp = f" cp={mesh.cp}" if mesh.cp > 1 else ""
    print(f"memory per device (rough), mesh dp={mesh.dp} pp={mesh.pp}{cp} tp={mesh.tp}, "
          f"microbatches={cfg.parallel.microbatches}, zero1={cfg.parallel.zero1}:")
    for part, nbytes in memory_estimate(cfg).items():
        print(f"  {part:<12} {format_bytes(nbytes):>10}")  # a tiny model's MiB, not 0.00 GiB
    return 0
