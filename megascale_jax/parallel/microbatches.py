"""Gradient accumulation without a pipeline (pp = 1): the batch in `m` microbatches, their losses
and gradients summed and averaged — the same mean loss as the whole batch at once, in 1/m of the
activation memory. At pp > 1 the pipeline (pipeline.py) microbatches itself.

The gradients cross dp once per step, not once per microbatch. Left to GSPMD, a `lax.scan` over
microbatches of a replicated parameter's gradient all-reduces inside every iteration (m× the
ideal dp bytes; measured 2.0×, 2.4× with ZeRO-1, at m = 2). So the accumulation runs inside a
`shard_map` manual over dp (tp stays automatic): each dp replica sums its own rows' gradients
locally, and only the sum leaves it — an all-reduce, or with ZeRO-1 a reduce-scatter straight into
the optimizer moments' dp shard (`pipeline.reduce_over_dp`, shard by shard over tp).

The same over cp, whose ranks hold one slice of each sequence with the weights replicated: the
`shard_map` is manual over cp as well, the model cuts its rank's slice out of whole rows
(`context_parallel.manual`), each rank sums its own tokens' gradients over the microbatches, and
the sum crosses cp once, after the dp reduction (with ZeRO-1 only the dp shard crosses cp). Left
to GSPMD, the gradients were all-reduced over cp inside every microbatch (gpt_1b at 128k, cp 8,
8 microbatches: 3.9× the once-a-step bytes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from megascale_jax.model.transformer import loss_fn
from megascale_jax.parallel import context_parallel, sharding
from megascale_jax.parallel.pipeline import dp_dim, manual_spec, reduce_over_dp


def loss_and_grads(cfg, model, mesh: Mesh, params, batch: jax.Array, m: int, grad_specs):
    """The mean loss over `batch` and its gradient with respect to `params`, `m` microbatches at a
    time. `grad_specs` (PartitionSpecs like `params`): where each gradient leaves the reduction —
    split over dp where a spec names dp (ZeRO-1), else replicated; its tp split is kept."""
    dp = mesh.shape["dp"]
    # One batch on one replica, nothing to accumulate or reduce over: GSPMD's step as it is
    if m == 1 and dp == 1 and mesh.shape["cp"] == 1:
        return jax.value_and_grad(lambda p: loss_fn(model, p, batch))(params)
    is_spec = lambda x: isinstance(x, P)
    manual = context_parallel.SLICED if mesh.shape["cp"] > 1 else ("dp",)
    # the dimension each gradient leaves split over dp (ZeRO-1), -1 for replicated
    dims = jax.tree.map(lambda s: -1 if dp == 1 or dp_dim(s) is None else dp_dim(s), grad_specs, is_leaf=is_spec)
    tp_specs = jax.tree.map(lambda s: P(*(None if a in ("dp", "pp") else a for a in s)), grad_specs, is_leaf=is_spec)
    out_specs = jax.tree.map(lambda d: P() if d < 0 else manual_spec(d), dims)
    replicas = dp * mesh.shape["cp"]  # each holds its rows' (and, over cp, its tokens') share of the mean

    def replica(params, tokens):
        """One dp replica's rows (whole rows: each cp rank its slice of them): microbatch j takes
        its rows j, j+m, j+2m, ..."""
        micro = tokens.reshape(tokens.shape[0] // m, m, -1).swapaxes(0, 1)

        def accumulate(carry, mb):
            loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, mb))(params)
            grads = jax.tree.map(jax.lax.with_sharding_constraint, grads, tp_specs)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        with sharding.axis_rules(cfg, manual=manual):
            zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(accumulate, zero, micro)
        scale = 1.0 / (m * replicas)  # a mean over microbatches, replicas and cp slices of per-slice means
        grads = jax.tree.map(lambda g, d, t: reduce_over_dp(g * scale, None if d < 0 else d, t, then=manual[1:]),
                             grads, dims, tp_specs)
        return jax.lax.psum(loss * scale, manual), grads

    return jax.shard_map(replica, mesh=mesh, axis_names=set(manual), check_vma=False,
                         in_specs=(P(), P("dp")), out_specs=(P(), out_specs))(params, batch)
