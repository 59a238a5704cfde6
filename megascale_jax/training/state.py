"""The training state: what a step updates and a checkpoint holds."""

from __future__ import annotations

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from megascale_jax.config import Config
from megascale_jax.model.transformer import Transformer
from megascale_jax.training.optim import layer_axes, make_optimizer


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # number of updates applied so far
    params: Any
    opt_state: Any


def abstract_state(cfg: Config) -> TrainState:
    """The state's shapes and dtypes for `cfg` (ShapeDtypeStructs, nothing allocated)."""
    model = Transformer(cfg.model, cfg.parallel)
    boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, cfg.model.seq_len), jnp.int32))["params"]
    params = nn.unbox(boxed)
    optimizer = make_optimizer(cfg.optim, cfg.train.steps, layer_axes(boxed))
    return TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                      opt_state=jax.eval_shape(optimizer.init, params))
