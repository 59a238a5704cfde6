"""Where every logical axis lives on the mesh: the one table that decides sharding.

Model code names logical axes (`batch`, `embed`, `heads`, ...) through flax's logical
partitioning and never builds a `PartitionSpec`. This module maps those names to mesh axes
(Megatron-style tensor parallelism: column-parallel QKV and first MLP matmul shard their output
features over tp, the row-parallel output projections shard their input features over tp, the
vocabulary is split over tp for the embedding and the LM head) and derives the shardings of
parameters, optimizer state (ZeRO-1 adds dp) and batches.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "dp"),
    ("seq", None),
    ("act_seq", None),  # the residual stream's sequence axis: over tp with sequence parallelism
    ("embed", None),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("vocab", "tp"),
    ("layers", "pp"),  # pipeline stages hold contiguous blocks of layers
    ("norm", None),
)


def axis_rules(manual: tuple[str, ...] = (), sequence_parallel: bool = False):
    """Context manager making `LOGICAL_RULES` active for `nn.with_logical_constraint`.

    With sequence parallelism the residual stream (`act_seq`) is split over tp between blocks.
    Inside a `shard_map` that is manual over some mesh axes, constraints may only name the
    remaining (automatic) axes: the `manual` ones are dropped from the rules."""
    rules = dict(LOGICAL_RULES)
    if sequence_parallel:
        rules["act_seq"] = "tp"
    return nn.logical_axis_rules(tuple((name, None if axis in manual else axis) for name, axis in rules.items()))


def logical_to_spec(names) -> P:
    return nn.logical_to_mesh_axes(names, LOGICAL_RULES)


def param_shardings(boxed_abstract_params, mesh: Mesh):
    """NamedShardings for a tree of `nn.Partitioned` (boxed) abstract parameters."""
    specs = nn.get_partition_spec(boxed_abstract_params)
    return nn.logical_to_mesh_sharding(specs, mesh, LOGICAL_RULES)


def zero1_sharding(sharding: NamedSharding, shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """ZeRO-1: additionally split an optimizer moment over dp.

    dp goes on the largest dimension that is not sharded yet and divides evenly by dp; a moment
    with no such dimension (a tiny bias) stays replicated over dp, which costs little memory.
    """
    dp = mesh.shape["dp"]
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    if dp == 1:
        return sharding
    free = [i for i, (axis, size) in enumerate(zip(spec, shape)) if axis is None and size % dp == 0]
    if not free:
        return sharding
    best = max(free, key=lambda i: (shape[i], -i))
    spec[best] = "dp"
    return NamedSharding(mesh, P(*spec))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches (batch, seq): batch over dp, replicated over pp and tp."""
    return NamedSharding(mesh, logical_to_spec(("batch", "seq")))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def describe(shardings, shapes) -> dict[str, str]:
    """`{'path/to/param': 'shape -> spec'}`, for the notebook and the logs."""
    flat_s = jax.tree_util.tree_flatten_with_path(shardings)[0]
    flat_x = jax.tree_util.tree_leaves(shapes)
    out = {}
    for (path, s), x in zip(flat_s, flat_x):
        name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        out[name] = f"{tuple(np.shape(x))} -> {s.spec}"
    return out
