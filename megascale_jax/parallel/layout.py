"""The stored order of the stacked layers is the order the pipeline runs them.

The model stacks its layers on a leading `layers` axis, `(L, ...)`, in network order (the
*canonical* order). With p stages and v virtual chunks of c = L/(p·v) layers, the pipeline runs
chunk g = j·p + s (layers [g·c, (g+1)·c)) as virtual chunk j of stage s. So interleaving
(v > 1) needs stage s to hold layers that are not contiguous in network order.

The train state therefore keeps the layers in *stored* (stage-major) order: stage 0's chunks
j = 0..v−1, then stage 1's, and so on. The sharding rule `layers -> pp` cuts the stored axis into
p contiguous blocks, so stage s holds exactly its own chunks, in the order it runs them. A step
moves no weight and no gradient between devices, and re-lays out nothing: the executor only
reshapes its local block `(v·c, ...)` to `(v, c, ...)`.

For p = 1 or v = 1 the two orders are the same and nothing is ever permuted. Otherwise the
permutation is applied only at the edges of a run:
* `to_stored` when the state is made: at init, and after a checkpoint is restored;
* `to_canonical` when the state leaves: before a checkpoint is saved.

Checkpoints hold the canonical order, so a run resumes bitwise on any mesh and any schedule.
The order applies to every leaf under a `layers` key, in the parameters and in the optimizer
state (its moments mirror the parameter tree), always on the leading axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from megascale_jax.config import Config


def stored_order(layers: int, stages: int, virtual: int) -> np.ndarray:
    """`order[k]`: the canonical index of the layer at stored position k."""
    c = layers // (stages * virtual)
    return np.array([(j * stages + s) * c + i for s in range(stages) for j in range(virtual) for i in range(c)])


def permutes(cfg: Config) -> bool:
    """Whether stored and canonical order differ for this config."""
    return cfg.mesh.pp > 1 and cfg.parallel.pp_virtual > 1


def _under_layers(path) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


def _reorder(tree, order: np.ndarray):
    index = jnp.asarray(order)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.take(x, index, axis=0) if _under_layers(path) else x, tree)


def to_stored(cfg: Config, tree):
    """Canonical -> stored order, for every leaf under a `layers` key of `tree`."""
    if not permutes(cfg):
        return tree
    return _reorder(tree, stored_order(cfg.model.layers, cfg.mesh.pp, cfg.parallel.pp_virtual))


def to_canonical(cfg: Config, tree):
    """Stored -> canonical order: the inverse of `to_stored`."""
    if not permutes(cfg):
        return tree
    return _reorder(tree, np.argsort(stored_order(cfg.model.layers, cfg.mesh.pp, cfg.parallel.pp_virtual)))
