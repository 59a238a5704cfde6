"""Campaign section c, the PyTorch peer: the MFU ladder's first two rows in transformers.

    serial_dense_adamw  <->  LlamaForCausalLM (serial pre-norm block)
    parallel_block      <->  GPTNeoXForCausalLM with use_parallel_residual=True

Both are built from config objects (nothing is downloaded) with the ladder's shape (layers,
d_model, heads, vocab, seq_len) and the batch the ladder picks for that row, fp32 parameters
under bf16 autocast (as model.dtype=bfloat16 computes), SDPA attention, AdamW, and the forward
under torch.compile on a GPU. The blocks are not identical, and the differences are recorded:
Llama's MLP is SwiGLU with RMSNorm (its width is 2/3 of ours, so the matmul FLOPs match), and
GPT-NeoX's parallel block has two LayerNorms where MegaScale's shares one. MFU uses the FLOPs of
our matching row (`flops.model_flops_per_token`), so tokens/s and MFU compare one to one.

Skipped with one line when torch or transformers is not importable. In --dry-run it runs tiny
on the CPU without torch.compile, whose CPU backend spends minutes compiling C++.
"""

from __future__ import annotations

import statistics
import time

from bench.campaign import ladder, model, process
from megascale_jax.model import flops

# (warm-up steps, timed steps), keyed by dry_run; the warm-up includes torch.compile.
STEPS = {False: (3, 10), True: (1, 2)}
PEERS = {"serial_dense_adamw": "llama", "parallel_block": "gpt_neox"}


def build(family: str, m, device):
    """A randomly initialised causal LM of `family` with the shape of ModelConfig `m`."""
    import transformers

    shape = dict(vocab_size=m.vocab, hidden_size=m.d_model, num_hidden_layers=m.layers,
                 num_attention_heads=m.heads, max_position_embeddings=m.seq_len, tie_word_embeddings=False,
                 use_cache=False, attn_implementation="sdpa")
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


def measure(family: str, cfg, batch: int, dry_run: bool, peak: float | None) -> dict:
    import torch

    torch.manual_seed(0)
    device = "cpu" if dry_run else "cuda"
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    lm = build(family, cfg.model, device)
    optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-4, fused=device == "cuda")
    forward = torch.compile(lm) if device == "cuda" else lm
    tokens = torch.randint(0, cfg.model.vocab, (batch, cfg.model.seq_len),
                           generator=torch.Generator().manual_seed(1)).to(device)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    warmup, timed = STEPS[dry_run]
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(timed):
        start = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_per_s = batch * cfg.model.seq_len / step_s
    return {"family": family, "device": device, "compiled": forward is not lm, "batch": batch,
            "parameters": sum(p.numel() for p in lm.parameters()),
            "our_parameters": flops.param_count(cfg.model), "step_time_s": step_s, "tokens_per_s": tokens_per_s,
            "mfu": None if peak is None else tokens_per_s * flops.model_flops_per_token(cfg.model) / peak,
            "peak_bytes_in_use": torch.cuda.max_memory_allocated() if device == "cuda" else None,
            "final_loss": float(loss.detach())}


def run(settings: dict) -> dict:
    try:
        import torch
        import transformers
    except ImportError as e:
        return {"skipped": f"skipped: torch/transformers not importable ({e})"}
    dry_run, found = settings["dry_run"], settings["device"]
    model.host_only_jax()
    if not dry_run and not torch.cuda.is_available():  # a CPU build would take an hour at 1.4B parameters
        return {"skipped": f"skipped: torch {torch.__version__} sees no CUDA device"}
    peak = flops.peak_flops(found["device_kind"])
    rows = []
    for row, family in PEERS.items():
        changes = ladder.BASELINE | ({"model.block": "parallel"} if row == "parallel_block" else {})
        overrides = ladder.row_overrides(dry_run, changes)
        batch = settings.get("batch")  # --batch: the ladder's rows ran at it too
        if batch is None:
            batch, estimate = model.pick_batch(overrides, found["memory_limit_bytes"], dry_run)
        if batch is None:
            rows.append({"row": row, "family": family,
                         "error": model.does_not_fit(estimate, found["memory_limit_bytes"])})
            continue
        try:
            rows.append({"row": row, **measure(family, model.load(overrides), batch, dry_run, peak)})
        except Exception as e:  # noqa: BLE001 — one peer failing (e.g. out of memory) leaves the other
            rows.append({"row": row, "family": family, "batch": batch, "error": process.one_line(e)})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the first peer's cached blocks are not the second's memory
    return {"torch": torch.__version__, "transformers": transformers.__version__, "rows": rows}
