"""Where every logical axis lives on the mesh: the one table that decides sharding.

Model code names logical axes (`batch`, `embed`, `heads`, ...) through flax's logical
partitioning and never builds a `PartitionSpec`. This module maps those names to mesh axes
(Megatron-style tensor parallelism: column-parallel QKV and first MLP matmul shard their output
features over tp, the row-parallel output projections shard their input features over tp, the
vocabulary is split over tp for the embedding and the LM head; the sequence over cp, context
parallelism) and derives the shardings of parameters, optimizer state (ZeRO-1 adds dp) and batches.

`LOGICAL_RULES` is the table; `rules_for(cfg)` is the table a run actually uses, with the two
decisions that depend on its config: sequence parallelism puts the residual stream's sequence
(`act_seq`) over tp, and grouped-query attention with fewer kv heads than tp ranks (Llama-70B:
8 kv heads at tp=16) replicates `kv_heads` over tp — every rank holds the k/v projections whole
(each kv head is used by tp/kv_heads ranks' query heads) and k and v enter attention whole on
every rank. The column-parallel matmul still computes 1/tp of their columns per rank
(`tensor_parallel.column_matmul`); GSPMD then all-gathers the projected k and v in every layer
(and all-reduces their gradients): kv_heads·head_dim values per token each, little beside the
residual stream's d_model.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from megascale_jax.config import Config

LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "dp"),
    ("seq", "cp"),  # context parallelism: each cp rank holds one slice of every sequence
    ("act_seq", "cp"),  # the residual stream's sequence axis: over tp with sequence parallelism
    ("embed", None),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("vocab", "tp"),
    ("layers", "pp"),  # pipeline stages hold contiguous blocks of layers
    ("norm", None),
)


def rules_for(cfg: Config | None = None) -> tuple[tuple[str, str | None], ...]:
    """`LOGICAL_RULES` as a run of `cfg` applies them (None: the table as it stands).

    With sequence parallelism the residual stream (`act_seq`) is split over tp between blocks
    (within each cp rank's slice, over cp and tp, where the sequence is split over cp too);
    when tp does not divide `model.kv_heads` (config validation then requires tp to be a multiple
    of it) the kv heads are replicated over tp instead of split."""
    rules = dict(LOGICAL_RULES)
    if cfg is not None:
        if cfg.parallel.sequence_parallel:
            rules["act_seq"] = ("cp", "tp") if cfg.mesh.cp > 1 else "tp"
        if cfg.model.kv_heads % cfg.mesh.tp:
            rules["kv_heads"] = None
    return tuple(rules.items())


def axis_rules(cfg: Config | None = None, manual: tuple[str, ...] = ()):
    """Context manager making `rules_for(cfg)` active for `nn.with_logical_constraint`.

    Inside a `shard_map` that is manual over some mesh axes, constraints may only name the
    remaining (automatic) axes: the `manual` ones are dropped from the rules."""
    def automatic(axis):  # an entry of the rules (None, a mesh axis or a tuple of them) less the manual axes
        kept = tuple(a for a in ((axis,) if isinstance(axis, str) else axis or ()) if a not in manual)
        return kept[0] if len(kept) == 1 else (kept or None)

    return nn.logical_axis_rules(tuple((name, automatic(axis)) for name, axis in rules_for(cfg)))


def per_device(fn, in_axes: tuple[tuple[str, ...], ...], out_axes: tuple[str, ...]):
    """`fn` applied to each device's shard of its arguments (logical axes `in_axes`, result
    `out_axes`): a `shard_map` manual over every mesh axis the caller leaves automatic, its specs
    the active rules' (`axis_rules`), so the arguments enter as the model already laid them out.

    For a custom call that must not meet GSPMD: jax's cuDNN attention partitions itself with a
    custom partitioner that fails when part of the mesh is manual (the gradient accumulation's and
    the pipeline's shard_map over dp: `AttributeError: 'GSPMDSharding' object has no attribute
    'spec'`) and with dp > 1 alone (an AssertionError), so no layout with dp > 1 or several
    microbatches compiled on GPUs (docs/compile.md). Per device, it sees local shapes only. Outside
    any mesh, or where every axis is manual already, `fn` is called as it is."""
    def on_shards(*args):
        mesh = jax.sharding.get_abstract_mesh()
        auto = frozenset(name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Auto)
        if mesh.empty or not auto:
            return fn(*args)
        specs = tuple(nn.logical_to_mesh_axes(axes) for axes in in_axes)
        if not all(_divides(spec, x.shape, mesh) for spec, x in zip(specs, args)):
            return fn(*args)  # a shape no layout splits (the init's one dummy sequence): left to GSPMD
        return jax.shard_map(fn, in_specs=specs, out_specs=nn.logical_to_mesh_axes(out_axes), axis_names=auto,
                             check_vma=False)(*args)
    return on_shards


def _divides(spec: P, shape: tuple[int, ...], mesh) -> bool:
    """Whether every dimension of `shape` splits evenly over the mesh axes `spec` puts it on."""
    sizes = dict(mesh.shape)
    for axes, size in zip(spec, shape):
        for axis in (axes,) if isinstance(axes, str) else (axes or ()):
            size, rest = divmod(size, sizes[axis])
            if rest:
                return False
    return True


def logical_to_spec(names) -> P:
    return nn.logical_to_mesh_axes(names, LOGICAL_RULES)


def param_shardings(boxed_abstract_params, mesh: Mesh, cfg: Config | None = None):
    """NamedShardings for a tree of `nn.Partitioned` (boxed) abstract parameters of a run of `cfg`."""
    specs = nn.get_partition_spec(boxed_abstract_params)
    return nn.logical_to_mesh_sharding(specs, mesh, rules_for(cfg))


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
    """Token batches (batch, seq_len + 1): batch over dp, replicated over pp, cp and tp.

    Not split over cp: a row holds the inputs and, one token on, the targets, seq_len + 1 tokens
    that no cp > 1 dividing seq_len divides. Each cp rank receives whole rows (4 bytes a token:
    256 KiB for a 64k-token row) and the model's constraints cut its slice out on the device,
    a local slice with no communication (tests/parallel/test_context_parallel.py)."""
    return NamedSharding(mesh, logical_to_spec(("batch", None)))


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
