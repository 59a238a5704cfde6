"""The model's `score_batch` on one device: what `python -m megascale_jax.evaluate` runs.

`batching.score` asks for the summed log-probability of each row's masked targets and whether
each was the argmax. Here that is the model's forward (`Transformer.apply`, the function the run
trained) followed by a float32 log-softmax, as HFLM takes `log_softmax(logits, dtype=float32)` of
the model's logits; jitted once for the batch shape. The Pallas kernels (fused_norm, fused_mlp)
and the GPU-only attention implementations compute the same function as the portable XLA code
(`model.decode` makes the same swap), so one device — a CPU too — reads any run.

The training loop will supply its own, sharded over the mesh; the rows and the reduction stay the
same (`batching`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from megascale_jax.config import ModelConfig
from megascale_jax.model.transformer import Transformer


def reduce_logits(logits, targets, mask):
    """(sum of the masked targets' log-probabilities [B], every masked target the argmax [B])
    from logits [B, L, V]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    greedy = (jnp.argmax(logits, axis=-1) == targets) | (mask == 0)
    return jnp.sum(picked * mask, axis=-1), jnp.all(greedy, axis=-1)


def one_device_scorer(model: ModelConfig, params):
    """`score_batch` for `batching.score`: the model with `params` (canonical, on one device)."""
    portable = dataclasses.replace(model, fused_norm=False, fused_mlp=False, attention="xla")
    net = Transformer(portable)

    @jax.jit
    def run(params, tokens, targets, mask):
        return reduce_logits(net.apply({"params": params}, tokens), targets, mask)

    def score_batch(tokens, targets, mask):
        summed, greedy = run(params, jnp.asarray(tokens), jnp.asarray(targets), jnp.asarray(mask))
        return np.asarray(summed), np.asarray(greedy)

    return score_batch
