"""Gradient accumulation without a pipeline (pp = 1): the batch in `m` microbatches, their losses
and gradients summed in a `lax.scan` and averaged: the same mean loss as the whole batch at once,
in 1/m of the activation memory. At pp > 1 the pipeline (pipeline.py) microbatches itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megascale_jax.model.transformer import loss_fn


def loss_and_grads(model, mesh: Mesh, params, batch: jax.Array, m: int):
    """The mean loss over `batch` and its gradient with respect to `params`, `m` microbatches at a time."""
    if m == 1:
        return jax.value_and_grad(lambda p: loss_fn(model, p, batch))(params)
    # Microbatch j takes rows j, j+m, j+2m, ...: every dp shard holds a whole number of rows
    # of every microbatch, so the split is local (no communication).
    micro = batch.reshape(batch.shape[0] // m, m, -1).swapaxes(0, 1)
    micro = jax.lax.with_sharding_constraint(micro, NamedSharding(mesh, P(None, "dp", None)))

    def accumulate(carry, mb):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, mb))(params)
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(accumulate, zero, micro)
    return loss / m, jax.tree.map(lambda g: g / m, grads)
