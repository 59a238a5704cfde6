"""The pipeline executor: one SPMD program that runs a `pipeline_schedule` table over `pp`.

`loss_and_grads(cfg, mesh, params, batch)` returns the same loss and gradients as plain
autodiff of the whole model, computed by p stages in lockstep inside one `jax.shard_map` that is
manual over `pp` and `dp` (tp stays automatic: GSPMD shards each stage's matmuls as usual).
`loss(cfg, mesh, params, batch)` is its forward-only twin, for evaluation.

* Layout. The layer parameters arrive in the stored, stage-major order (`parallel.layout`):
  stage s's block of the `layers -> pp` sharding is its v chunks, in the order it runs them, and
  the executor only reshapes it to `(v, c, ...)`. No weight or gradient moves between devices
  and nothing is re-laid out, for any v. The embedding runs on stage 0 and the final norm, LM
  head and loss on stage p−1 (see "Embedding and head" below for where they are stored).
* Ticks. A `lax.scan` over the table's rows (compile time and HLO size do not grow with m).
  Each tick a stage (1) takes its forward input — the embedding for chunk 0, otherwise the
  activation received last tick — runs the chunk and stashes what its backward needs in a slot;
  (2) runs its backward on the cotangent received last tick (for the last chunk, on the
  gradient of head + loss, so in 1F1B F and B of the last chunk share a tick); (3) if that was
  the chunk's last microbatch, reduces the chunk's gradient over dp; (4) sends the activation
  to stage s+1 and the cotangent to stage s−1 (ring).
* Stash, `parallel.pp_stash`, a strategy with a `forward` (what to keep) and a `backward` (the
  chunk's output and vjp, from what was kept):
  - `inputs` (`InputStash`, default): a slot holds the chunk's input only; the backward
    recomputes the chunk's forward inside its `jax.vjp`. Residual memory is
    `slots × one microbatch activation` (flat in m for 1F1B), at the price of one extra chunk
    forward per backward (reported MFU counts model FLOPs only, so it shows this cost).
  - `residuals` (`ResidualStash`): the forward is the chunk's `jax.vjp`; a slot holds the vjp
    residuals that depend on the activation (found once at trace time by a dependence walk over
    the residual jaxpr, `residuals.activation_dependent_residuals`) and the chunk output (the
    head's input). The weight-only residuals are rebuilt in the backward from a vjp at a zero
    activation whose activation path is dead code, so the backward does no forward: about F+B
    instead of 2F+B of compute per chunk, for several times the input stash's memory.
* Overlap. Both `ppermute`s are issued unconditionally at the end of the tick and depend only on
  that tick's compute of their own direction, so XLA's scheduler may start the activation
  transfer while the backward still runs. Compute sits under `lax.cond` (idle stages skip it);
  pipeline collectives never do — a `ppermute` under a per-stage predicate hangs, because the
  stages that skip it never join. With explicit tp collectives inside the chunk
  (`tp_overlap != xla`) the chunk compute is not skipped but masked (`when`).
* Data parallelism inside the loop. A stage's chunk gradient is complete after the chunk's last
  microbatch's backward, which for every chunk but the first runs while other chunks still have
  backward work (the cool-down). That tick reduces it over dp — an all-reduce, or with ZeRO-1 a
  reduce-scatter straight to the optimizer moments' dp split (`grad_specs`) — so the transfer can
  overlap the backward work that follows (MegaScale's per-chunk reduce-scatter). It sits under
  a `cond` whose predicate comes from the table row of the stage, the same on every dp replica
  of the stage, and only dp replicas of one stage take part: they all join it or all skip it.
* Embedding and head. They are stored replicated over pp, although only stage 0 and stage p−1
  use them: a `jax.Array` covers every device of its mesh, so living on one stage only would
  take a second mesh (a second program). Their gradients are summed over pp and reduced over
  dp after the loop; `flops.memory_estimate` counts them, with their optimizer state, on every
  stage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from megascale_jax.config import Config
from megascale_jax.model.transformer import cross_entropy, embed_tokens, lm_head, lm_logits, run_layers
from megascale_jax.parallel import sharding
from megascale_jax.parallel.pipeline_schedule import Schedule, build, forward_only
from megascale_jax.parallel.residuals import activation_dependent_residuals

FIELDS = ("valid", "mb", "chunk", "slot")


def schedule_for(cfg: Config) -> Schedule:
    return build(cfg.parallel.pp_schedule, cfg.mesh.pp, cfg.parallel.pp_virtual, cfg.parallel.microbatches)


def explicit_tp(cfg: Config, mesh: Mesh) -> bool:
    """Whether tp collectives are explicit (shard_map psum / all-gather / ppermute). They must not
    sit under a per-stage `cond`: stages that skip it never join the collective and the program
    hangs. Then every stage runs a chunk every tick and idle results are masked (`when`)."""
    return mesh.shape["tp"] > 1 and cfg.parallel.tp_overlap != "xla"


def when(masked: bool, pred, fn, otherwise, x):
    """`fn(x) if pred else otherwise(x)`: a `cond`, or with `masked` both run and `where` picks."""
    if not masked:
        return jax.lax.cond(pred, fn, otherwise, x)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), fn(x), otherwise(x))


def scoped(name: str, fn):
    """`fn` under a jax name scope: a branch's collectives carry `name` in their HLO op_name, which
    is how `observe.collectives` counts a branch's collectives (`branch_runs` says how often)."""
    def run(*args):
        with jax.named_scope(name):
            return fn(*args)
    return run


def branch_runs(cfg: Config, stage: int) -> dict[str, int]:
    """How many times per step a device of `stage` runs each scoped branch of the training step:
    the embedding (and its gradient) once per microbatch on stage 0, the head and loss once per
    microbatch on the last stage, the dp reduction once per chunk on every stage."""
    p, v, m = cfg.mesh.pp, cfg.parallel.pp_virtual, cfg.parallel.microbatches
    return {"pp_embed": m if stage == 0 else 0, "pp_embed_grad": m if stage == 0 else 0,
            "pp_head": m if stage == p - 1 else 0, "pp_dp_reduce": v}


def send_forward(x, p: int):
    """Each stage's `x` to the next stage (ring: the last stage's goes to stage 0)."""
    return jax.lax.ppermute(x, "pp", [(i, (i + 1) % p) for i in range(p)])


def send_backward(x, p: int):
    """Each stage's `x` to the previous stage (ring)."""
    return jax.lax.ppermute(x, "pp", [(i, (i - 1) % p) for i in range(p)])


def stage_view(cfg: Config, stage_layers, tokens):
    """Inside the shard_map: this stage's layers as `(v, c, ...)` (its stored block, reshaped),
    its index, its dp shard's batch cut into microbatch inputs and targets, and a zero
    activation of one microbatch."""
    m, v = cfg.parallel.microbatches, cfg.parallel.pp_virtual
    micro = tokens.reshape(m, -1, tokens.shape[-1])
    inputs, targets = micro[:, :, :-1], micro[:, :, 1:]
    act = jnp.zeros((inputs.shape[1], inputs.shape[2], cfg.model.d_model), cfg.model.dtype)
    chunks = jax.tree.map(lambda x: x.reshape(v, x.shape[0] // v, *x.shape[1:]), stage_layers)
    return chunks, jax.lax.axis_index("pp"), inputs, targets, act


def table_arrays(schedule: Schedule) -> dict[str, np.ndarray]:
    """The table as int32 arrays `[tick, stage]`, scanned over as the loop's xs. `b_last` marks the
    backward after which a stage's chunk has seen every microbatch (its gradient is complete)."""
    out = {}
    for direction, table in (("f", schedule.forward), ("b", schedule.backward)):
        for field in FIELDS:
            out[f"{direction}_{field}"] = np.array(
                [[0 if w is None else (1 if field == "valid" else getattr(w, field)) for w in row] for row in table],
                dtype=np.int32)
    last = np.zeros((schedule.ticks, schedule.stages), np.int32)
    final_tick = {}
    for tick, row in enumerate(schedule.backward):
        for stage, w in enumerate(row):
            if w is not None:
                final_tick[(stage, w.chunk)] = tick
    for (stage, _), tick in final_tick.items():
        last[tick, stage] = 1
    out["b_last"] = last
    return out


def chunk_params_of(tree, j):
    """Entry j of every leaf's leading axis (a virtual chunk's parameters or gradients)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, j, keepdims=False), tree)


def set_entry(tree, j, new, keep=True):
    """Entry j of every leaf's leading axis replaced by `new` where `keep` (else left as it was)."""
    def put(buf, x):
        old = jax.lax.dynamic_index_in_dim(buf, j, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(keep, x, old), j, 0)
    return jax.tree.map(put, tree, new)


def dp_dim(spec) -> int | None:
    """The dimension a gradient is split over dp in `spec` (ZeRO-1), or None (replicated)."""
    for dim, axes in enumerate(spec or ()):
        if axes == "dp" or (isinstance(axes, tuple) and "dp" in axes):
            return dim
    return None


def reduce_over_dp(x, dim: int | None, tp_spec: P = P()):
    """Sum over dp: a reduce-scatter along `dim` (the ZeRO-1 split), or an all-reduce. A gradient
    split over tp (`tp_spec`) is reduced shard by shard, under a shard_map manual over tp: left to
    GSPMD, a reduce-scatter in this dp-manual region gathered the tp shards first, moving tp×
    the bytes over dp."""
    if dim is None:
        op = lambda y: jax.lax.psum(y, "dp")
    else:
        op = lambda y: jax.lax.psum_scatter(y, "dp", scatter_dimension=dim, tiled=True)
    if all(a is None for a in tp_spec):
        return op(x)
    return jax.shard_map(op, in_specs=tp_spec, out_specs=tp_spec, axis_names={"tp"}, check_vma=False)(x)


def manual_spec(dim: int, first: str | None = None) -> P:
    """The shard_map out spec of a reduced gradient: `first` on dimension 0, dp on `dim` (≥ 0)."""
    out = [first] + [None] * max(dim, 0) if first else [None] * (dim + 1)
    if dim >= 0:
        out[dim] = "dp"
    return P(*out)


# ------------------------------------------------------------------ stash strategies


class InputStash:
    """`pp_stash=inputs`: keep the chunk input; the backward recomputes the chunk in its vjp. The
    last chunk's forward is not run at all (its backward, in the same tick, recomputes it)."""

    runs_last_forward = False

    def __init__(self, fn, chunk, act):
        self.fn = fn

    def empty(self, slots: int, act):
        return jnp.zeros((slots, *act.shape), act.dtype)

    def forward(self, chunk, x):
        return self.fn(chunk, x), x

    def skipped(self, x):
        return x

    def backward(self, chunk, saved):
        return jax.vjp(self.fn, chunk, saved)


class ResidualStash:
    """`pp_stash=residuals`: keep the activation-dependent vjp residuals and the chunk output; the
    backward rebuilds the weight-only residuals from the parameters and runs no forward."""

    runs_last_forward = True

    def __init__(self, fn, chunk, act):
        self.fn = fn
        self.depends, self.avals = activation_dependent_residuals(fn, chunk, act)
        self.kept = [a for a, d in zip(self.avals, self.depends) if d]

    def _check(self, leaves, where: str):
        same = [(x.shape, x.dtype) for x in leaves] == [(a.shape, a.dtype) for a in self.avals]
        assert same, f"the {where} vjp differs from the analysed one"

    def empty(self, slots: int, act):
        return [jnp.zeros((slots, *a.shape), a.dtype) for a in self.kept], jnp.zeros((slots, *act.shape), act.dtype)

    def forward(self, chunk, x):
        y, vjp = jax.vjp(self.fn, chunk, x)
        leaves = jax.tree.leaves(vjp)
        self._check(leaves, "forward")
        return y, ([leaf for leaf, d in zip(leaves, self.depends) if d], y)

    def skipped(self, x):
        return [jnp.zeros(a.shape, a.dtype) for a in self.kept], x

    def backward(self, chunk, saved):
        kept, y = saved
        # The activation path of this vjp is dead code (its residuals are replaced below).
        rebuilt, treedef = jax.tree.flatten(jax.vjp(self.fn, chunk, jnp.zeros_like(y))[1])
        self._check(rebuilt, "backward")
        kept = iter(kept)
        return y, treedef.unflatten([next(kept) if d else leaf for leaf, d in zip(rebuilt, self.depends)])


STASHES = {"inputs": InputStash, "residuals": ResidualStash}


# ------------------------------------------------------------------ training step


def loss_and_grads(cfg: Config, mesh: Mesh, params, batch, grad_specs=None):
    """Loss and gradients of `batch`; `params` and the layer gradients in stored order.

    `grad_specs` (a tree of PartitionSpecs like `params`): where each gradient lives — its tp
    split, kept by the accumulators inside the loop, and where it leaves the dp reduction: split
    over dp where a spec names dp (ZeRO-1: the optimizer moments' sharding, reached by a
    reduce-scatter), otherwise replicated (an all-reduce). Default: replicated."""
    p, v, m = cfg.mesh.pp, cfg.parallel.pp_virtual, cfg.parallel.microbatches
    dp = mesh.shape["dp"]
    schedule = schedule_for(cfg)
    table, slots = table_arrays(schedule), schedule.slots
    last_stage, last_chunk = p - 1, v - 1
    scale = 1.0 / (m * dp)  # loss = mean over microbatches and dp replicas of per-microbatch means
    masked = explicit_tp(cfg, mesh)  # idle stages compute and mask instead of skipping (`when`)
    specs = grad_specs if grad_specs is not None else jax.tree.map(lambda _: P(), params)
    if cfg.model.tied_embeddings:  # the last stage's head is the embedding's transpose; its gradient adds
        params, specs = with_tied_head(params), with_tied_head(specs)
    is_spec = lambda x: isinstance(x, P)
    # Per gradient leaf, the dimension its dp reduction scatters along; -1: all-reduce.
    dims = jax.tree.map(lambda s: -1 if dp == 1 or dp_dim(s) is None else dp_dim(s), specs, is_leaf=is_spec)
    # Each gradient's tp split (the manual axes dropped), in the stored layout — which is also a
    # chunk's, (c, ...) like (L, ...) — and in the loop's (v, c, ...). The accumulators keep it,
    # where GSPMD would otherwise choose, and the dp reduction works on it shard by shard.
    tp_specs = jax.tree.map(lambda s: P(*(None if a in ("dp", "pp") else a for a in s)), specs, is_leaf=is_spec)
    loop_layer_specs = jax.tree.map(lambda s: P(None, *s), tp_specs["layers"], is_leaf=is_spec)
    reduce = lambda tree, d, tp: jax.tree.map(lambda x, k, t: reduce_over_dp(x, None if k < 0 else k, t), tree, d, tp)
    keep_tp = lambda tree, specs: (tree if grad_specs is None else
                                   jax.tree.map(jax.lax.with_sharding_constraint, tree, specs))

    def body(stage_layers, embed, final_norm, head, tokens):
        chunks, stage, inputs, targets, act = stage_view(cfg, stage_layers, tokens)
        fn = lambda pc, x: run_layers(cfg.model, pc, x, cfg.parallel)
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)

        def forward_input(f, act_in):
            first = (f["valid"] > 0) & (stage == 0) & (f["chunk"] == 0)
            return jax.lax.cond(first, scoped("pp_embed", lambda: embed_tokens(cfg.model, embed, inputs[f["mb"]])),
                                lambda: act_in)

        def output_cotangent(b, y, cot_in):
            """(loss, d(final_norm, head), dy): for the last chunk the gradient of head + loss at its
            output y, otherwise nothing and the cotangent received last tick."""
            def head_grads(y):
                def mb_loss(fn, h, y):
                    return scale * cross_entropy(lm_logits(cfg.model, fn, h, y), targets[b["mb"]])
                value, grads = jax.value_and_grad(mb_loss, argnums=(0, 1, 2))(final_norm, head, y)
                return value, grads[:2], grads[2].astype(y.dtype)

            def no_head(y):
                return jnp.zeros((), jnp.float32), zeros((final_norm, head)), cot_in

            is_last = (stage == last_stage) & (b["chunk"] == last_chunk)
            return jax.lax.cond(is_last, scoped("pp_head", head_grads), no_head, y)

        def embedding_grad(b, dx):
            return jax.lax.cond(
                (b["valid"] > 0) & (stage == 0) & (b["chunk"] == 0),
                scoped("pp_embed_grad",
                       lambda dx: jax.vjp(lambda e: embed_tokens(cfg.model, e, inputs[b["mb"]]), embed)[1](dx)[0]),
                lambda dx: jnp.zeros_like(embed), dx)

        def reduce_finished_chunk(b, g_layers, reduced):
            """After a chunk's last microbatch: its gradient, summed over dp, into `reduced`."""
            def reduce_chunk(g_layers, reduced):
                done = reduce(chunk_params_of(g_layers, b["chunk"]), dims["layers"], tp_specs["layers"])
                return set_entry(reduced, b["chunk"], done)
            return jax.lax.cond((b["valid"] > 0) & (b["last"] > 0), scoped("pp_dp_reduce", reduce_chunk),
                                lambda _, r: r, g_layers, reduced)

        def tick(carry, row):
            act_in, cot_in, kept, (g_layers, g_embed, g_head), reduced, loss = carry
            f = {k[2:]: row[k][stage] for k in row if k.startswith("f_")}
            b = {k[2:]: row[k][stage] for k in row if k.startswith("b_")}
            f_valid, b_valid = f["valid"] > 0, b["valid"] > 0

            # --- forward: run the chunk and keep what its backward needs
            x_in = forward_input(f, act_in)
            run_forward = f_valid
            if not stash.runs_last_forward:
                run_forward &= ~((stage == last_stage) & (f["chunk"] == last_chunk))
            chunk_f = chunk_params_of(chunks, f["chunk"])
            act_out, saved = when(masked, run_forward, lambda x: stash.forward(chunk_f, x),
                                  lambda x: (x, stash.skipped(x)), x_in)
            kept = set_entry(kept, f["slot"], saved, f_valid)

            # --- backward: the chunk's vjp from what was kept, with last tick's cotangent or, for
            # the last chunk, the gradient of the head and loss
            chunk_b = chunk_params_of(chunks, b["chunk"])

            def backward(saved):
                y, vjp = stash.backward(chunk_b, saved)
                loss_add, d_head, dy = output_cotangent(b, y, cot_in)
                d_chunk, dx = vjp(dy)
                return loss_add, d_chunk, d_head, dx

            def idle(saved):
                return jnp.zeros((), jnp.float32), zeros(chunk_b), zeros((final_norm, head)), jnp.zeros_like(act)

            loss_add, d_chunk, d_head, dx = when(masked, b_valid, backward, idle, chunk_params_of(kept, b["slot"]))
            g_layers = set_entry(g_layers, b["chunk"], jax.tree.map(jnp.add, chunk_params_of(g_layers, b["chunk"]), d_chunk))
            grads = (g_layers, g_embed + embedding_grad(b, dx), jax.tree.map(jnp.add, g_head, d_head))
            if dp > 1:
                reduced = keep_tp(reduce_finished_chunk(b, g_layers, reduced), loop_layer_specs)
            grads = keep_tp(grads, grad_tp_specs)

            # --- communication: activations one stage on, cotangents one stage back
            return (send_forward(act_out, p), send_backward(dx, p), kept, grads, reduced, loss + loss_add), None

        grad_tp_specs = (loop_layer_specs, tp_specs["embed"], (tp_specs["final_norm"], tp_specs["head"]))
        grads = keep_tp((zeros(chunks), zeros(embed), zeros((final_norm, head))), grad_tp_specs)
        with sharding.axis_rules(cfg, manual=("dp", "pp")):
            stash = STASHES[cfg.parallel.pp_stash](fn, chunk_params_of(chunks, 0), act)  # read by tick
            kept = stash.empty(slots, act)
            # Per chunk, the dp-reduced gradient: with ZeRO-1 1/dp of it along the split dimension.
            reduced = jax.tree.map(
                lambda x, d: jnp.zeros(x.shape[:d + 1] + (x.shape[d + 1] // dp,) + x.shape[d + 2:], x.dtype)
                if d >= 0 else jnp.zeros_like(x), chunks, dims["layers"]) if dp > 1 else ()
            reduced = keep_tp(reduced, loop_layer_specs) if dp > 1 else ()
            carry = (act, act, kept, grads, reduced, jnp.zeros((), jnp.float32))
            (_, _, _, (g_layers, g_embed, (g_norm, g_head)), reduced, loss), _ = jax.lax.scan(tick, carry, table)
        if dp > 1:
            g_layers = reduced
        g_layers = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), g_layers)
        if dp > 1:  # over dp first: with ZeRO-1 the sum over pp then moves 1/dp of the data
            g_embed, g_norm, g_head = (reduce(x, dims[k], tp_specs[k]) for x, k in
                                       ((g_embed, "embed"), (g_norm, "final_norm"), (g_head, "head")))
        g_embed, g_norm, g_head = jax.lax.psum((g_embed, g_norm, g_head), "pp")
        return jax.lax.psum(loss, ("dp", "pp")), g_layers, g_embed, g_norm, g_head

    layer_in = jax.tree.map(lambda _: P("pp"), params["layers"])
    out = jax.tree.map(manual_spec, dims)
    layer_out = jax.tree.map(lambda d: manual_spec(d, "pp"), dims["layers"])
    run = jax.shard_map(
        body, mesh=mesh, axis_names={"pp", "dp"}, check_vma=False,
        in_specs=(layer_in, P(), P(), P(), P("dp")),
        out_specs=(P(), layer_out, out["embed"], out["final_norm"], out["head"]))
    loss, g_layers, g_embed, g_norm, g_head = run(params["layers"], params["embed"], params["final_norm"],
                                                  params["head"], batch)
    if cfg.model.tied_embeddings:
        return loss, {"embed": g_embed + g_head.T, "layers": g_layers, "final_norm": g_norm}
    return loss, {"embed": g_embed, "layers": g_layers, "final_norm": g_norm, "head": g_head}


def with_tied_head(tree):
    """A tree of parameters (or their PartitionSpecs) with `head` added as the embedding's transpose."""
    embed = tree["embed"]
    if isinstance(embed, P):
        return {**tree, "head": P(*reversed(tuple(embed) + (None,) * (2 - len(embed))))}
    return {**tree, "head": embed.T}


# ------------------------------------------------------------------ evaluation


def loss(cfg: Config, mesh: Mesh, params, batch):
    """The loss of `batch` through the pipeline, forward only (evaluation): the forward half of the
    training schedule (`forward_only`), activations passed on as in training, the head and loss
    on the last stage. Layer weights stay on their stages (no all-gather over pp, unlike running
    the plain model under GSPMD); equals the single-device loss."""
    p, v, m = cfg.mesh.pp, cfg.parallel.pp_virtual, cfg.parallel.microbatches
    table = table_arrays(forward_only(schedule_for(cfg)))
    scale = 1.0 / (m * mesh.shape["dp"])
    masked = explicit_tp(cfg, mesh)

    def body(stage_layers, embed, final_norm, head, tokens):
        chunks, stage, inputs, targets, act = stage_view(cfg, stage_layers, tokens)

        def tick(carry, row):
            act_in, total = carry
            f = {k[2:]: row[k][stage] for k in row if k.startswith("f_")}
            valid = f["valid"] > 0
            first = valid & (stage == 0) & (f["chunk"] == 0)
            x = jax.lax.cond(first, lambda: embed_tokens(cfg.model, embed, inputs[f["mb"]]), lambda: act_in)
            chunk = chunk_params_of(chunks, f["chunk"])
            y = when(masked, valid, lambda x: run_layers(cfg.model, chunk, x, cfg.parallel), lambda x: x, x)
            last = valid & (stage == p - 1) & (f["chunk"] == v - 1)
            total += jax.lax.cond(
                last, lambda y: scale * cross_entropy(lm_logits(cfg.model, final_norm, head, y), targets[f["mb"]]),
                lambda y: jnp.zeros((), jnp.float32), y)
            return (send_forward(y, p), total), None

        with sharding.axis_rules(cfg, manual=("dp", "pp")):
            (_, total), _ = jax.lax.scan(tick, (act, jnp.zeros((), jnp.float32)), table)
        return jax.lax.psum(total, ("dp", "pp"))

    run = jax.shard_map(
        body, mesh=mesh, axis_names={"pp", "dp"}, check_vma=False,
        in_specs=(jax.tree.map(lambda _: P("pp"), params["layers"]), P(), P(), P(), P("dp")), out_specs=P())
    return run(params["layers"], params["embed"], params["final_norm"], lm_head(cfg.model, params), batch)
