"""Campaign section c, the PyTorch peer: the MFU ladder's first three rows in transformers.

    serial_dense_adamw  <->  LlamaForCausalLM (serial pre-norm block), SDPA causal
    parallel_block      <->  GPTNeoXForCausalLM with use_parallel_residual=True, SDPA causal
    sliding_window      <->  the same GPT-NeoX with FlexAttention and a sliding-window block mask
                             of the ladder's window (a token sees itself and the previous window-1)

Same work as our row: the model is built from a config object (nothing is downloaded) with the
row's shape (layers, d_model, heads, vocab, seq_len), trained on the batch the ladder picks for
that row, for the row's train.steps steps, on exactly the token rows `megascale_jax.train` feeds
it (`token_batches`: the same corpus, packing, split and order), with the same next-token loss
(inputs batch[:, :-1], targets batch[:, 1:], mean cross entropy in float32) and the same AdamW
(learning-rate schedule, betas, eps, weight decay on matrices only, global-norm clipping). fp32
parameters under bf16 autocast (as model.dtype=bfloat16 computes); on a GPU the loss (forward
and cross entropy) runs under torch.compile. Each row records its loss after every step and
which steps were timed (the ladder's: after its warm-up steps), so losses and speed compare one
to one. The blocks are not identical, and the differences are recorded: Llama's MLP is SwiGLU
with RMSNorm (its width is 2/3 of ours, so the matmul FLOPs match), and GPT-NeoX's parallel
block has two LayerNorms where MegaScale's shares one. MFU uses the FLOPs of our matching row
(`flops.model_flops_per_token`, window-aware), so tokens/s and MFU compare one to one.

The window row falls back to SDPA with an explicit boolean sliding-window mask ("sdpa+mask",
with the reason in `fallback`) where FlexAttention cannot run: always on the CPU (--dry-run;
FlexAttention has no backward there), and on a GPU when it fails (an error other than running
out of memory). A row that fails is one line of error; the section goes on.

Skipped with one line when torch or transformers is not importable. In --dry-run it runs tiny
on the CPU without torch.compile, whose CPU backend spends minutes compiling C++; --tiny on a GPU
runs the same tiny shapes there, compiled, FlexAttention included: a smoke test of the GPU path.
"""

from __future__ import annotations

import gc
import json
import statistics
import time

from bench.campaign import ladder, model, process
from megascale_jax.model import flops

# Peer row -> (family, changes to the ladder's BASELINE besides the window). Run in this order,
# the claims' rows first (a lent GPU's call may end before the last): the same-work row, then the
# dense row of the same block, then Llama.
PEERS = {"sliding_window": ("gpt_neox", {"model.block": "parallel"}),
         "parallel_block": ("gpt_neox", {"model.block": "parallel"}),
         "serial_dense_adamw": ("llama", {})}
ROW_ORDER = ("serial_dense_adamw", "parallel_block", "sliding_window")  # the ladder's, for the result
# A row is not started with less than this left before the section's deadline (--budget-s): on an
# H200 a 1.4B peer row took about 80 s (torch.compile, 6 steps); one started later would be killed
# with the section, and a killed section's rows count for no claim.
MIN_ROW_S = 90
WINDOWED = "sliding_window"
CPU_FALLBACK = "on the CPU: FlexAttention has no backward there (and the peer runs without torch.compile)"


def row_changes(row: str, dry_run: bool) -> dict:
    """Our ladder row's config changes (as `ladder.climb` sets them) that the peer row mirrors."""
    changes = ladder.BASELINE | PEERS[row][1]
    if row == WINDOWED:
        changes = changes | {"model.window": ladder.WINDOW[dry_run]}
    return changes


def token_batches(cfg) -> list:
    """The (global_batch, seq_len + 1) int32 token rows of steps 1..train.steps, as numpy: what
    `megascale_jax.train` feeds a fresh run of `cfg` (its Prefetcher starts at data index 0)."""
    from megascale_jax.training import data

    batches = data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train")
    return [batches.rows(index, 0, cfg.train.global_batch) for index in range(cfg.train.steps)]


def learning_rates(cfg) -> list[float]:
    """Our optimizer's learning rate for each of the train.steps updates (optax counts from 0:
    with warm-up, the first update's rate is 0)."""
    from megascale_jax.training.optim import learning_rate_schedule

    schedule = learning_rate_schedule(cfg.optim, cfg.train.steps)
    return [float(schedule(i)) for i in range(cfg.train.steps)]


def window_mask_mod(window: int):
    """FlexAttention's mask_mod of our sliding window: key kv visible to query q when
    q - window < kv <= q (megascale_jax.model.attention.sliding_window_mask)."""
    def mask_mod(batch, head, q, kv):
        return (kv <= q) & (q - kv < window)
    return mask_mod


def attention_mask(attention: str, seq_len: int, window: int | None, device: str):
    """What the model's `attention_mask=` gets: None (SDPA's own causal mask), a FlexAttention
    BlockMask, or a boolean (1, 1, seq, seq) mask, True where a query may attend. Both masks are
    4-D, which transformers' mask creation passes through to the attention as they are."""
    import torch

    if attention == "sdpa":
        return None
    if attention == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(window_mask_mod(window), None, None, seq_len, seq_len, device=device)
    q = torch.arange(seq_len, device=device)[:, None]
    kv = torch.arange(seq_len, device=device)[None, :]
    return window_mask_mod(window)(None, None, q, kv)[None, None]


def build(family: str, m, device, attention: str = "sdpa"):
    """A randomly initialised causal LM of `family` with the shape of ModelConfig `m`."""
    import transformers

    shape = dict(vocab_size=m.vocab, hidden_size=m.d_model, num_hidden_layers=m.layers,
                 num_attention_heads=m.heads, max_position_embeddings=m.seq_len, tie_word_embeddings=False,
                 use_cache=False, attn_implementation="flex_attention" if attention == "flex_attention" else "sdpa")
    if family == "llama":
        # SwiGLU has three matrices: 2/3 of our GeLU MLP's width gives the same FLOPs (rounded
        # to a multiple of 64, as tensor cores want).
        width = max(64, 64 * round(2 * m.mlp_dim / 3 / 64))
        config = transformers.LlamaConfig(num_key_value_heads=m.kv_heads, intermediate_size=width, **shape)
        lm = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPTNeoXConfig(intermediate_size=m.mlp_dim, hidden_act="gelu_pytorch_tanh",
                                            use_parallel_residual=True, **shape)
        lm = transformers.GPTNeoXForCausalLM(config)
    return lm.to(device).train()


def adamw(lm, o, fused: bool):
    """torch's AdamW as our optax.adamw: decay on matrices (embedding, projections, head) only,
    never on norms or biases (`optim.decay_mask`); the rate is set per step."""
    import torch

    params = [p for p in lm.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=0.0, betas=(o.b1, o.b2), eps=o.eps, fused=fused)


def update(lm, optimizer, rate: float, clip: float | None) -> None:
    """One update from the gradients in `lm` as our optax chain makes it: clip to global norm
    `clip` (None: no clipping), then AdamW at learning rate `rate`; the gradients are cleared."""
    import torch

    if clip is not None:
        torch.nn.utils.clip_grad_norm_(lm.parameters(), clip)
    for group in optimizer.param_groups:
        group["lr"] = rate
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def next_token_loss(lm, mask, device: str):
    """loss(batch) as our `transformer.loss_fn`: inputs batch[:, :-1], targets batch[:, 1:],
    the mean cross entropy over every position in float32. (transformers' `labels=` would drop
    each sequence's last target: it shifts the labels inside the same window as the inputs.)"""
    import torch

    def loss(batch):
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = lm(input_ids=batch[:, :-1], attention_mask=mask).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    return loss


def train(family: str, cfg, device: str, skip: int, peak: float | None, attention: str) -> dict:
    """Train the peer on `device` for cfg.train.steps steps on our row's token rows, timing the
    steps after the first `skip`; its numbers."""
    import torch

    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    m, steps = cfg.model, cfg.train.steps
    lm = build(family, m, device, attention)
    optimizer = adamw(lm, cfg.optim, fused=device == "cuda")
    loss = next_token_loss(lm, attention_mask(attention, m.seq_len, m.window, device), device)
    forward = torch.compile(loss) if device == "cuda" else loss
    # All steps' rows on the device before the first step: no data time inside a timed step.
    batches = [torch.from_numpy(b).long().to(device) for b in token_batches(cfg)]
    rates = learning_rates(cfg)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    losses, times = [], []
    for index, batch in enumerate(batches):
        start = time.perf_counter()
        value = forward(batch)
        value.backward()
        update(lm, optimizer, rates[index], cfg.optim.clip)
        sync()
        times.append(time.perf_counter() - start)
        losses.append(value.detach())
    step_s = statistics.median(times[skip:])  # the steps our row times: after its warm-up
    tokens_per_s = cfg.train.global_batch * m.seq_len / step_s
    losses = [float(v) for v in losses]
    return {"family": family, "attention": attention, "window": m.window, "device": device,
            "compiled": forward is not loss, "batch": cfg.train.global_batch, "vocab": m.vocab, "steps": steps,
            "timed_steps": list(range(skip + 1, steps + 1)), "parameters": sum(p.numel() for p in lm.parameters()),
            "our_parameters": flops.param_count(m), "step_time_s": step_s, "tokens_per_s": tokens_per_s,
            "mfu": None if peak is None else tokens_per_s * flops.model_flops_per_token(m) / peak,
            "peak_bytes_in_use": torch.cuda.max_memory_allocated() if device == "cuda" else None,
            "losses": losses, "final_loss": losses[-1]}


def measure(family: str, cfg, device: str, skip: int, peak: float | None) -> dict:
    """The peer row of `cfg` (its batch is train.global_batch) on `device`: SDPA causal without a
    window; with one, FlexAttention, or SDPA with a boolean window mask where it cannot run."""
    import torch

    if cfg.model.window is None:
        return train(family, cfg, device, skip, peak, "sdpa")
    if device == "cpu":
        return {**train(family, cfg, device, skip, peak, "sdpa+mask"), "fallback": CPU_FALLBACK}
    try:
        return train(family, cfg, device, skip, peak, "flex_attention")
    except torch.cuda.OutOfMemoryError:
        raise  # the boolean mask's SDPA needs more memory, not less
    except Exception as e:  # noqa: BLE001 — e.g. FlexAttention failing to compile on this stack
        reason = f"flex_attention failed: {process.one_line(e)}"
    # Outside the except block: the traceback (and the failed model it holds) is gone.
    gc.collect()
    torch.cuda.empty_cache()
    return {**train(family, cfg, device, skip, peak, "sdpa+mask"), "fallback": reason}


def run(settings: dict) -> dict:
    try:
        import torch
        import transformers
    except ImportError as e:
        return {"skipped": f"skipped: torch/transformers not importable ({e})"}
    dry_run, found = settings["dry_run"], settings["device"]
    model.host_only_jax()
    # --tiny on a GPU (dry_run at the device's own backend) smoke-tests the compiled GPU path.
    device = "cuda" if found["backend"] == "gpu" and torch.cuda.is_available() else "cpu"
    if not dry_run and device == "cpu":  # a CPU build would take an hour at 1.4B parameters
        return {"skipped": f"skipped: torch {torch.__version__} sees no CUDA device"}
    steps, skip = ladder.STEPS[dry_run]  # our rows': the losses compare step by step, the same steps timed
    peak = flops.peak_flops(found["device_kind"])
    rows = []
    for row, (family, _) in PEERS.items():
        left = None if settings.get("deadline") is None else settings["deadline"] - time.time()
        if left is not None and left < MIN_ROW_S:
            rows.append({"row": row, "family": family, "skipped": f"skipped: not started, {max(left, 0):.0f} s left "
                                                                  f"of the section's time (a row needs {MIN_ROW_S})"})
            continue
        overrides = ladder.row_overrides(dry_run, row_changes(row, dry_run))
        batch = settings.get("batch")  # --batch: the ladder's rows ran at it too
        if batch is None:
            batch, estimate = model.pick_batch(overrides, found["memory_limit_bytes"], dry_run)
        if batch is None:
            rows.append({"row": row, "family": family,
                         "error": model.does_not_fit(estimate, found["memory_limit_bytes"])})
            continue
        try:
            cfg = model.load([*overrides, f"train.global_batch={batch}", f"train.steps={steps}"])
            rows.append({"row": row, **measure(family, cfg, device, skip, peak)})
        except Exception as e:  # noqa: BLE001 — one peer failing (e.g. out of memory) leaves the others
            rows.append({"row": row, "family": family, "batch": batch, "error": process.one_line(e)})
        if settings.get("progress_file"):  # kept (`rows_done`) if the section is killed after it
            with open(settings["progress_file"], "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
        gc.collect()  # a failed row's model, held by its traceback until now
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # one peer's cached blocks are not the next one's memory
    rows.sort(key=lambda r: ROW_ORDER.index(r["row"]))
    return {"torch": torch.__version__, "transformers": transformers.__version__, "rows": rows}
