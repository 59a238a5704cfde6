"""What a pipeline stage keeps between a chunk's forward and its backward (`parallel.pp_stash`).

A strategy wraps the chunk function `fn(chunk, x, docs)` and has `forward(chunk, x, docs) ->
(y, saved)` (run the chunk, say what to keep in a stash slot), `skipped(x)` (a slot's worth for
an idle tick), `empty(slots, act)` (the stash) and `backward(chunk, saved, docs) -> (y, vjp)` (the
chunk's output and its vjp over (chunk, x), from what was kept). `docs` is the microbatch's packed
documents' layout (`model.documents.layout`, None without `model.document_eos`): not differentiated,
never stashed — the executor recomputes it from the microbatch's tokens for the forward and again
for the backward, so whatever of the chunk's residuals depends on it only (the attention masks,
the restarted rotary angles) is rebuilt, not kept:

* `InputStash` (`inputs`, default): the chunk's input; the backward recomputes the forward
  inside its `jax.vjp` — one extra chunk forward per backward, `slots` activations of memory.
* `ResidualStash` (`residuals`): the vjp residuals that depend on the activation
  (`residuals.activation_dependent_residuals`) and the chunk output; the backward rebuilds the
  weight-only residuals from a vjp at a zero activation and runs no forward.
* `NoStash`: evaluation, where no backward follows.

The executor (`parallel.pipeline`) runs them; its docstring says where they sit in a tick.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from megascale_jax.parallel.residuals import activation_dependent_residuals


class InputStash:
    """`pp_stash=inputs`: keep the chunk input; the backward recomputes the chunk in its vjp. The
    last chunk's forward is not run at all (its backward, in the same tick, recomputes it)."""

    runs_last_forward = False

    def __init__(self, fn, chunk, act, docs):
        self.fn = fn

    def empty(self, slots: int, act):
        return jnp.zeros((slots, *act.shape), act.dtype)

    def forward(self, chunk, x, docs):
        return self.fn(chunk, x, docs), x

    def skipped(self, x):
        return x

    def backward(self, chunk, saved, docs):
        return jax.vjp(lambda chunk, x: self.fn(chunk, x, docs), chunk, saved)


class ResidualStash:
    """`pp_stash=residuals`: keep the activation-dependent vjp residuals and the chunk output; the
    backward rebuilds the weight-only residuals from the parameters and runs no forward."""

    runs_last_forward = True

    def __init__(self, fn, chunk, act, docs):
        self.fn = fn
        self.depends, self.avals = activation_dependent_residuals(fn, chunk, act, docs)
        self.kept = [a for a, d in zip(self.avals, self.depends) if d]

    def _check(self, leaves, where: str):
        same = [(x.shape, x.dtype) for x in leaves] == [(a.shape, a.dtype) for a in self.avals]
        assert same, f"the {where} vjp differs from the analysed one"

    def empty(self, slots: int, act):
        return [jnp.zeros((slots, *a.shape), a.dtype) for a in self.kept], jnp.zeros((slots, *act.shape), act.dtype)

    def forward(self, chunk, x, docs):
        y, vjp = jax.vjp(lambda chunk, x: self.fn(chunk, x, docs), chunk, x)
        leaves = jax.tree.leaves(vjp)
        self._check(leaves, "forward")
        return y, ([leaf for leaf, d in zip(leaves, self.depends) if d], y)

    def skipped(self, x):
        return [jnp.zeros(a.shape, a.dtype) for a in self.kept], x

    def backward(self, chunk, saved, docs):
        kept, y = saved
        # The activation path of this vjp is dead code (its residuals are replaced below); what
        # depends on the parameters and `docs` only is rebuilt here, for this microbatch's docs.
        rebuilt, treedef = jax.tree.flatten(jax.vjp(lambda chunk, x: self.fn(chunk, x, docs), chunk,
                                                    jnp.zeros_like(y))[1])
        self._check(rebuilt, "backward")
        kept = iter(kept)
        return y, treedef.unflatten([next(kept) if d else leaf for leaf, d in zip(rebuilt, self.depends)])


class NoStash:
    """Evaluation: no backward follows, so nothing is kept and every chunk's forward runs."""

    runs_last_forward = True

    def __init__(self, fn):
        self.fn = fn

    def forward(self, chunk, x, docs):
        return self.fn(chunk, x, docs), ()

    def skipped(self, x):
        return ()


STASHES = {"inputs": InputStash, "residuals": ResidualStash}
