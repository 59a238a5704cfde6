"""The model's `score_batch` on one device: what `python -m megascale_jax.evaluate` runs.

`batching.score` asks for the summed log-probability of each row's masked targets and whether
each was the argmax. Here that is the model's forward (`Transformer.apply`, the function the run
trained) followed by a float32 log-softmax, as HFLM takes `log_softmax(logits, dtype=float32)` of
the model's logits; jitted once for the batch shape. The Pallas kernels (fused_norm, fused_mlp)
and the GPU-only attention implementations compute the same function as the portable XLA code
(`model.decode` makes the same swap), so one device — a CPU too — reads any run.

The training loop scores the same rows on its mesh (`training.downstream`, `Trainer.score_rows`),
through the pipeline at pp > 1; the rows and the reduction (`transformer.target_scores`) are the
same.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from megascale_jax.config import ModelConfig
from megascale_jax.model.transformer import Transformer, score_fn


def as_batch(tokens: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The rows as the training batch's (B, L + 1) tokens: inputs are its first L, targets its
    last L (a row's targets are its inputs shifted by one, with the next token last)."""
    return np.concatenate([tokens[:, :1], targets], axis=1)


def one_device_scorer(model: ModelConfig, params):
    """`score_batch` for `batching.score`: the model with `params` (canonical, on one device)."""
    portable = dataclasses.replace(model, fused_norm=False, fused_mlp=False, attention="xla")
    net = Transformer(portable)

    run = jax.jit(functools.partial(score_fn, net))

    def score_batch(tokens, targets, mask):
        summed, greedy = run(params, jnp.asarray(as_batch(tokens, targets)), jnp.asarray(mask))
        return np.asarray(summed), np.asarray(greedy)

    return score_batch
