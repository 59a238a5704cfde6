"""The model the campaign's training sections run, and the batch it can afford on the device.

On a GPU it is configs/gpt_1b.yaml (1.4B parameters, seq 2048, bf16); in --dry-run the same
config shrunk to a few layers of width 64, so that every code path runs on the CPU in seconds.
The batch is chosen before anything is compiled (`estimate_bytes`): the largest batch whose
estimate fits in HEADROOM of the device's memory limit. The estimate traces the residuals the
backward keeps (as the row's model.remat leaves them); the ladder records it next to the
measured peak.
"""

from __future__ import annotations

import functools
import os

from bench.common import REPO
from megascale_jax.config import load_config
from megascale_jax.model import flops

CONFIG = os.path.join(REPO, "configs", "gpt_1b.yaml")
TINY = ["model.layers=2", "model.d_model=64", "model.heads=4", "model.kv_heads=4", "model.seq_len=64",
        "model.vocab=256"]
# The sections time steps: no checkpoint saves (the last step would save 22 GB of state), no
# TensorBoard event files in their run directories, no validation loss (its step is not even
# compiled: time no row needs, in a GPU call of 600 s), and no compilation cache (every row is a
# new program: writing its executable would cost time and be read by nothing).
QUIET = ["checkpoint.every=0", "observe.tensorboard=false", "train.eval_batches=0", "train.compile_cache=false"]
HEADROOM = 0.9  # of the memory limit: XLA's own workspace and fragmentation are not estimated
MAX_BATCH = {False: 64, True: 4}  # sequences per microbatch; keyed by dry_run


def base_overrides(dry_run: bool) -> list[str]:
    return (TINY if dry_run else []) + QUIET


def load(overrides: list[str]):
    """The config with `overrides`, checked as far as sizing needs (no data, no devices)."""
    return load_config(CONFIG, overrides, planning=True)


def estimate_bytes(overrides: list[str]) -> float:
    """Bytes one device needs for a training step of this one-device config: parameters,
    gradients and optimizer state as `flops.memory_estimate` counts them, plus what the backward
    keeps of one microbatch's forward (`residual_bytes`) and that microbatch's fp32 logits with
    their gradient. The residuals are traced, not modelled: on an H200, the modelled activations
    (17 values per token per layer) came out at half of what XLA allocated."""
    cfg = load(overrides)
    memory = flops.memory_estimate(cfg)
    micro = cfg.train.global_batch // cfg.parallel.microbatches
    logits = 2 * micro * cfg.model.seq_len * cfg.model.vocab * 4 / cfg.model.loss_chunks  # live: one slice's
    state = (memory["parameters"] + memory["gradients"] + memory.get("gradient accumulator", 0) + memory["optimizer"]
             + memory.get("undonated state", 0))
    return state + residual_bytes(cfg, micro) + logits


def host_only_jax() -> None:
    """Keep this process's JAX on the CPU: a section that only plans (the ladder, whose rows run
    in processes of their own; the PyTorch peer) must not start the GPU backend, which would
    reserve 75% of the GPU's memory for nothing. A config setting, so child processes do not
    inherit it the way they would inherit JAX_PLATFORMS."""
    import jax

    jax.config.update("jax_platforms", "cpu")


def residual_bytes(cfg, batch: int) -> float:
    """Bytes of the residuals that autodiff keeps from the forward for the backward, `batch`
    sequences, under the config's model.remat: traced abstractly (`jax.eval_shape` of `jax.vjp`, nothing
    runs) at one and two sequences, which fixes the line a + b·batch they lie on. cuDNN's
    attention cannot be traced without a GPU; the Pallas kernel's residuals stand in for it (both
    keep q, k, v, the output and the softmax statistics)."""
    import dataclasses

    model_cfg = cfg.model
    if model_cfg.attention == "cudnn":
        model_cfg = dataclasses.replace(model_cfg, attention="pallas")
    one, two = _residual_bytes_at_one_and_two(model_cfg)
    return one + (two - one) * (batch - 1)


@functools.lru_cache(maxsize=None)  # a batch search asks once per model, not once per batch
def _residual_bytes_at_one_and_two(model_cfg) -> tuple[int, int]:
    import jax
    import jax.numpy as jnp

    from megascale_jax.model import transformer

    model = transformer.Transformer(model_cfg)

    def traced(n: int) -> int:
        tokens = jnp.zeros((n, model_cfg.seq_len), jnp.int32)
        params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens)["params"])

        def residuals(p, t):
            return jax.vjp(lambda p: jnp.mean(model.apply({"params": p}, t)), p)[1]

        leaves = jax.tree.leaves(jax.eval_shape(residuals, params, jax.ShapeDtypeStruct(tokens.shape, jnp.int32)))
        return sum(x.size * x.dtype.itemsize for x in leaves)

    return traced(1), traced(2)


def pick_batch(overrides: list[str], limit_bytes: float | None, dry_run: bool, microbatches: int = 1
               ) -> tuple[int | None, float]:
    """(sequences per microbatch, its estimate): the largest batch up to MAX_BATCH whose estimate
    fits in HEADROOM x `limit_bytes` (no limit known: MAX_BATCH). (None, estimate at batch 1)
    when not even one sequence fits. The global batch is that times `microbatches`."""
    def estimate(batch: int) -> float:
        return estimate_bytes([*overrides, f"parallel.microbatches={microbatches}",
                               f"train.global_batch={batch * microbatches}"])

    best, best_estimate = None, estimate(1)
    for batch in range(1, MAX_BATCH[dry_run] + 1):
        needed = estimate(batch)
        if limit_bytes is not None and needed > HEADROOM * limit_bytes:
            break  # the estimate grows with the batch
        best, best_estimate = batch, needed
    return best, best_estimate


def does_not_fit(estimate: float, limit_bytes: float) -> str:
    limit = flops.format_bytes(HEADROOM * limit_bytes)
    return (f"does not fit: estimate {flops.format_bytes(estimate)} > limit {limit} "
            f"({HEADROOM:.0%} of {flops.format_bytes(limit_bytes)})")
