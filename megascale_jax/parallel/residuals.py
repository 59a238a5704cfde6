"""Which residuals of a chunk's `jax.vjp` depend on its input activation (`pp_stash=residuals`).

A vjp's residuals are partly the parameters or weight-derived copies (per-layer slices of the
stacked weights, casts, rotary tables, masks) and partly functions of the activation. The
pipeline stashes only the latter per microbatch and rebuilds the former from the parameters in
the backward, so it needs to know, once at trace time, which leaf is which.

The answer is a forward dependence analysis over the residual function's jaxpr
(`jax.make_jaxpr`, public API): an equation's outputs depend on the input if any of its inputs
does. That rule alone would mark every output of the layer `scan` (and so every stacked weight
slice it emits) as activation-dependent, since the activation is one of the scan's inputs; so
the walk recurses into the sub-jaxprs of `scan` (iterating the carry to a fixed point), `cond`
(any branch; all outputs if the branch index depends on it) and of call-like primitives (pjit,
remat, custom_jvp/vjp calls, shard_map) whose inputs and outputs map one to one. Other
primitives with sub-jaxprs (`while`) are treated conservatively: all outputs depend if any input
does, which can only stash more, never give a wrong gradient.
"""

from __future__ import annotations

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal


def activation_dependent_residuals(fn, params, x, *context) -> tuple[tuple[bool, ...], tuple]:
    """For each leaf of the residuals of the vjp of `fn(params, x, *context)` over (params, x) (in
    `jax.tree.leaves` order): whether it depends on `x`, and its aval. `context` (e.g. a packed
    batch's document layout) is an input like the parameters: what depends on it alone is not
    marked, so the caller rebuilds it from the context it has then."""
    avals = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)

    def residuals(p, x, context):
        return jax.tree.leaves(jax.vjp(lambda p, x: fn(p, x, *context), p, x)[1])

    closed = jax.make_jaxpr(residuals)(avals(params), avals(x), avals(context))
    n_params, n_x = len(jax.tree.leaves(params)), len(jax.tree.leaves(x))
    inputs = [n_params <= i < n_params + n_x for i in range(len(closed.jaxpr.invars))]
    return tuple(depends_on_inputs(closed.jaxpr, inputs)), tuple(closed.out_avals)


def depends_on_inputs(jaxpr: Jaxpr, inputs: list[bool]) -> list[bool]:
    """Per output of `jaxpr`, whether it depends on an input flagged True in `inputs`."""
    tainted = {v for v, flag in zip(jaxpr.invars, inputs) if flag}
    is_tainted = lambda v: not isinstance(v, Literal) and v in tainted
    for eqn in jaxpr.eqns:
        flags = _equation(eqn, [is_tainted(v) for v in eqn.invars])
        tainted.update(v for v, flag in zip(eqn.outvars, flags) if flag)
    return [is_tainted(v) for v in jaxpr.outvars]


def _inner(j) -> Jaxpr:
    return j.jaxpr if isinstance(j, ClosedJaxpr) else j


def _equation(eqn, flags: list[bool]) -> list[bool]:
    n_out = len(eqn.outvars)
    if not any(flags):
        return [False] * n_out
    name, params = eqn.primitive.name, eqn.params
    if name == "scan":
        return _scan(_inner(params["jaxpr"]), params["num_consts"], params["num_carry"], flags)
    if name == "cond":  # invars: branch index, then the operands
        if flags[0]:
            return [True] * n_out
        per_branch = [depends_on_inputs(_inner(b), flags[1:]) for b in params["branches"]]
        return [any(column) for column in zip(*per_branch)]
    inner = [_inner(params[k]) for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in params]
    if name != "while" and inner and len(inner[0].invars) == len(flags) and len(inner[0].outvars) == n_out:
        return depends_on_inputs(inner[0], flags)
    return [True] * n_out


def _scan(body: Jaxpr, n_consts: int, n_carry: int, flags: list[bool]) -> list[bool]:
    """A scan's outputs (carry, then stacked ys): the carry's dependence grows to a fixed point."""
    consts, carry, xs = flags[:n_consts], flags[n_consts:n_consts + n_carry], flags[n_consts + n_carry:]
    while True:
        out = depends_on_inputs(body, consts + carry + xs)
        new_carry = [a or b for a, b in zip(carry, out[:n_carry])]
        if new_carry == carry:
            return new_carry + out[n_carry:]
        carry = new_carry
