"""Optimizers: LAMB (MegaScale's choice for large batches) and AdamW, built from optax parts.

Both share: global-norm clipping, linear warmup then a cosine, linear or warmup-stable-decay
schedule (`optim.schedule`), and weight decay applied only to
matrices (projections, embedding, LM head) — never to norms or biases.

LAMB is optax's own composition (`scale_by_adam` → `add_decayed_weights` → trust ratio →
learning rate) with one change: the trust ratio ||w|| / ||update|| is computed **per layer**.
Our layers are stacked on a `layers` axis for `nn.scan`; optax's `scale_by_trust_ratio` would
take one norm over all layers at once, which is not LAMB's layer-wise adaptation. The layer axis
of each leaf is found by its logical name (`layer_axes`), not assumed to be the first; the order
of the layers along it does not matter (the pipeline stores them stage-major).

Under `jax.jit` with sharded parameters and state the norms are global (XLA inserts the
reductions), so ZeRO-1-sharded state gives exactly the unsharded update.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from megascale_jax.config import OptimConfig

# Leaf names of parameters that are matrices (weight decay applies to these).
DECAYED = frozenset({"wq", "wk", "wv", "wo", "wg", "w1", "w2", "embed", "head"})


NO_LAYER_AXIS = -1


def _leaf_name(path) -> str:
    return str(getattr(path[-1], "key", path[-1]))


def layer_axes(boxed_params):
    """For each parameter, the index of its logical axis named `layers` (`NO_LAYER_AXIS` if it has
    none), from flax's partitioning metadata (`nn.Partitioned` boxes, e.g. `jax.eval_shape` of
    the model's init)."""
    specs = nn.get_partition_spec(boxed_params)
    return jax.tree.map(lambda names: list(names).index("layers") if "layers" in tuple(names) else NO_LAYER_AXIS,
                        specs, is_leaf=lambda x: isinstance(x, P))


def decay_mask(params):
    return jax.tree_util.tree_map_with_path(lambda p, _: _leaf_name(p) in DECAYED, params)


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup` updates, then (`optim.schedule`) a cosine or a
    straight line down to lr · min_lr_ratio at `total_steps`, or warmup-stable-decay: `lr` held
    until the last `decay_fraction` of `total_steps`, then a straight line down over them."""
    decay_steps = max(total_steps, cfg.warmup + 1)
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup, decay_steps=decay_steps, end_value=end)
    warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup)
    if cfg.schedule == "linear":
        return optax.join_schedules([warmup, optax.linear_schedule(cfg.lr, end, decay_steps - cfg.warmup)],
                                    [cfg.warmup])
    decay_start = max(cfg.warmup, round(decay_steps * (1 - cfg.decay_fraction)))
    return optax.join_schedules([warmup, optax.constant_schedule(cfg.lr),
                                 optax.linear_schedule(cfg.lr, end, decay_steps - decay_start)],
                                [cfg.warmup, decay_start])


def scale_by_layerwise_trust_ratio(axes_of_layers, min_norm: float = 0.0) -> optax.GradientTransformation:
    """LAMB's trust ratio with one ratio per layer for stacked (scanned) parameters;
    `axes_of_layers` (like the parameters): each leaf's layer axis or `NO_LAYER_AXIS`."""

    def update_fn(updates, state, params):
        def ratio(u, p, layer_axis):
            stacked = layer_axis != NO_LAYER_AXIS and u.ndim > 1
            axes = tuple(i for i in range(u.ndim) if i != layer_axis) if stacked else None
            p_norm = jnp.sqrt(jnp.sum(jnp.square(p), axis=axes, keepdims=axes is not None))
            u_norm = jnp.sqrt(jnp.sum(jnp.square(u), axis=axes, keepdims=axes is not None))
            # As in optax: ratio 1 where either norm is zero (e.g. freshly zero-initialised biases).
            trust = jnp.where((p_norm > min_norm) & (u_norm > min_norm), p_norm / u_norm, 1.0)
            return u * trust.astype(u.dtype)

        return jax.tree.map(ratio, updates, params, axes_of_layers), state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)


def make_optimizer(cfg: OptimConfig, total_steps: int, axes_of_layers) -> optax.GradientTransformation:
    """The optimizer, its learning rate injected from the schedule (`optax.inject_hyperparams`): the
    state's `hyperparams["learning_rate"]` after an update is the rate that update used (what the
    metrics report), so the schedule is built once, here. `axes_of_layers`: see `layer_axes`."""
    return optax.inject_hyperparams(_optimizer, static_args=("cfg", "axes_of_layers"))(
        learning_rate=learning_rate_schedule(cfg, total_steps), cfg=cfg, axes_of_layers=axes_of_layers)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm, taking the gradients' global norm as `grad_norm=` where the
    caller has it: the train step computes it for its finite check, outside the cond that holds
    the update, and XLA cannot share one reduction across a cond's boundary (recomputed, it was a
    second full read of the gradients every step). Without it, the norm is computed here. The
    arithmetic is optax's, so the updates are the same bit for bit."""
    def update_fn(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        trigger = jnp.squeeze(norm < max_norm)
        return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm),
                            updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def _optimizer(learning_rate, cfg: OptimConfig, axes_of_layers) -> optax.GradientTransformation:
    clip = clip_by_global_norm(cfg.clip) if cfg.clip is not None else optax.identity()
    if cfg.name == "adamw":
        return optax.chain(clip, optax.adamw(learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                             weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(
        clip,
        optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
        optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
        scale_by_layerwise_trust_ratio(axes_of_layers),
        optax.scale_by_learning_rate(learning_rate),
    )


def current_learning_rate(opt_state) -> jax.Array:
    """The learning rate of the update that produced `opt_state`."""
    return opt_state.hyperparams["learning_rate"]
