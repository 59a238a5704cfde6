"""The pipeline executor: one SPMD program that runs a `pipeline_schedule` table over `pp`.

`loss_and_grads(cfg, mesh, params, batch)` returns the same loss and gradients as plain
autodiff of the whole model, computed by p stages in lockstep inside one `jax.shard_map` that is
manual over `pp` and `dp` (tp stays automatic: GSPMD shards each stage's matmuls as usual).

* Layout. Network chunk g = j·p + s (virtual chunk j of stage s) is layers [g·c, (g+1)·c),
  c = L/(p·v). The stacked `(L, ...)` layer parameters are viewed as `(v, p, c, ...)` and stage s
  receives `[:, s]`; for v = 1 this is exactly the contiguous `layers -> pp` sharding of the
  stored parameters, so no weights move. The embedding runs on stage 0 and the final norm, LM
  head and loss on stage p−1; their gradients are summed over pp at the end.
* Ticks. A `lax.scan` over the table's rows (compile time and HLO size do not grow with m).
  Each tick a stage (1) takes its forward input — the embedding for chunk 0, otherwise the
  activation received last tick — runs the chunk and stashes what its backward needs in a slot;
  (2) runs its backward: the chunk's vjp applied to the cotangent received last tick (for the
  last chunk, to the gradient of head + loss, so in 1F1B F and B of the last chunk share a tick);
  (3) sends the activation to stage s+1 and the cotangent to stage s−1 (ring).
* Stash, `parallel.pp_stash`:
  - `inputs` (default): a slot holds the chunk's input only; the backward recomputes the chunk's
    forward inside its `jax.vjp`. Residual memory is `slots × one microbatch activation` (flat
    in m for 1F1B), at the price of one extra chunk forward per backward (reported MFU counts
    model FLOPs only, so it shows this cost).
  - `residuals`: the forward is the chunk's `jax.vjp`; a slot holds the vjp residuals that depend
    on the activation (found once at trace time by a dependence walk over the residual jaxpr,
    `residuals.activation_dependent_residuals`) and the chunk output (the head's input). The weight-only
    residuals — the parameters, per-layer weight slices of the layer scan, rotary tables, masks —
    are not stashed but rebuilt in the backward from a vjp at a zero activation whose activation
    path is dead code, so the backward does no forward: about F+B instead of 2F+B of compute per
    chunk. The price is memory: every layer's activation residuals per slot — norm and MLP
    intermediates and, with `model.attention=xla`, the heads × seq × seq attention probabilities
    — still flat in m for 1F1B but several times the input stash (3× at d_model 64, seq 64).
* Overlap. Both `ppermute`s are issued unconditionally at the end of the tick and depend only on
  that tick's compute of their own direction: the activation send depends on the forward only,
  the cotangent send on the backward only, so XLA's scheduler may start the activation transfer
  while the backward still runs. Compute sits under `lax.cond`/`lax.switch` (idle stages skip it);
  collectives never do — a `ppermute` under a per-device predicate hangs.
* Data parallelism is manual too: each dp replica accumulates its gradients over all
  microbatches locally and they are summed over dp once, after the loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from megascale_jax.parallel import sharding
from megascale_jax.config import Config
from megascale_jax.model.transformer import cross_entropy, embed_tokens, lm_logits, run_layers
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


def send_forward(x, p: int):
    """Each stage's `x` to the next stage (ring: the last stage's goes to stage 0)."""
    return jax.lax.ppermute(x, "pp", [(i, (i + 1) % p) for i in range(p)])


def stage_view(cfg: Config, stage_layers, tokens):
    """Inside the shard_map: this stage's layers `(v, c, ...)`, its index, its dp shard's batch cut
    into microbatch inputs and targets, and a zero activation of one microbatch."""
    m = cfg.parallel.microbatches
    micro = tokens.reshape(m, -1, tokens.shape[-1])
    inputs, targets = micro[:, :, :-1], micro[:, :, 1:]
    act = jnp.zeros((inputs.shape[1], inputs.shape[2], cfg.model.d_model), cfg.model.dtype)
    return jax.tree.map(lambda x: x[0], stage_layers), jax.lax.axis_index("pp"), inputs, targets, act


def _table_arrays(schedule: Schedule) -> dict[str, np.ndarray]:
    """The table as int32 arrays `[tick, stage]`, scanned over as the loop's xs."""
    out = {}
    for direction, table in (("f", schedule.forward), ("b", schedule.backward)):
        for field in FIELDS:
            out[f"{direction}_{field}"] = np.array(
                [[0 if w is None else (1 if field == "valid" else getattr(w, field)) for w in row] for row in table],
                dtype=np.int32)
    return out


def to_stages(layers, p: int, v: int):
    """(L, ...) stacked layers -> (p, v, c, ...): stage-major, then virtual chunk."""
    def split(x):
        c = x.shape[0] // (p * v)
        return x.reshape(v, p, c, *x.shape[1:]).swapaxes(0, 1)
    return jax.tree.map(split, layers)


def from_stages(stages, p: int, v: int):
    """Inverse of `to_stages`."""
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[3:]), stages)


def chunk_params_of(tree, j):
    """Entry j of every leaf's leading axis (a virtual chunk's parameters or gradients)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, j, keepdims=False), tree)


def same_leaves(leaves, avals) -> bool:
    """The vjp traced now has the residual leaves (shapes, dtypes) the analysis was made for."""
    return [(x.shape, x.dtype) for x in leaves] == [(a.shape, a.dtype) for a in avals]


def loss_and_grads(cfg: Config, mesh: Mesh, params, batch):
    p, v, m = cfg.mesh.pp, cfg.parallel.pp_virtual, cfg.parallel.microbatches
    dp = mesh.shape["dp"]
    schedule = schedule_for(cfg)
    table = _table_arrays(schedule)
    last_stage, last_chunk = p - 1, v - 1
    scale = 1.0 / (m * dp)  # loss = mean over microbatches and dp replicas of per-microbatch means
    masked = explicit_tp(cfg, mesh)  # idle stages compute and mask instead of skipping (`when`)
    keep_residuals = cfg.parallel.pp_stash == "residuals"

    def body(stage_layers, embed, final_norm, head, tokens):
        stage_layers, stage, inputs, targets, act = stage_view(cfg, stage_layers, tokens)
        fn = lambda pc, x: run_layers(cfg.model, pc, x, cfg.parallel)

        def work(row):
            """This stage's forward and backward entries of a table row."""
            f = {k[2:]: row[k][stage] for k in row if k.startswith("f_")}
            b = {k[2:]: row[k][stage] for k in row if k.startswith("b_")}
            return f, b, f["valid"] > 0, b["valid"] > 0

        def forward_input(f, f_valid, act_in):
            first = f_valid & (stage == 0) & (f["chunk"] == 0)
            return jax.lax.cond(first, lambda: embed_tokens(cfg.model, embed, inputs[f["mb"]]), lambda: act_in)

        def output_cotangent(b, y, cot_in):
            """(loss, d(final_norm, head), dy): for the last chunk the gradient of head + loss at its
            output y, otherwise nothing and the cotangent received last tick."""
            def head_grads(y):
                def mb_loss(fn, h, y):
                    return scale * cross_entropy(lm_logits(cfg.model, fn, h, y), targets[b["mb"]])
                value, grads = jax.value_and_grad(mb_loss, argnums=(0, 1, 2))(final_norm, head, y)
                return value, grads[:2], grads[2].astype(y.dtype)

            def no_head(y):
                return jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, (final_norm, head)), cot_in

            is_last = (stage == last_stage) & (b["chunk"] == last_chunk)
            return jax.lax.cond(is_last, head_grads, no_head, y)

        def accumulate(grads, b, d_chunk, d_head_pair, dx):
            d_embed = jax.lax.cond(
                (b["valid"] > 0) & (stage == 0) & (b["chunk"] == 0),
                lambda dx: jax.vjp(lambda e: embed_tokens(cfg.model, e, inputs[b["mb"]]), embed)[1](dx)[0],
                lambda dx: jnp.zeros_like(embed), dx)
            g_layers, g_embed, g_head_pair = grads
            current = chunk_params_of(g_layers, b["chunk"])
            g_layers = jax.tree.map(lambda g, c, d: jax.lax.dynamic_update_index_in_dim(g, c + d, b["chunk"], 0),
                                    g_layers, current, d_chunk)
            return g_layers, g_embed + d_embed, jax.tree.map(jnp.add, g_head_pair, d_head_pair)

        def communicate(act_out, dx):
            """Activations one stage on, cotangents one stage back (ring)."""
            act_next = send_forward(act_out, p)
            cot_next = jax.lax.ppermute(dx, "pp", [(i, (i - 1) % p) for i in range(p)])
            return act_next, cot_next

        def tick(carry, row):
            act_in, cot_in, stash, grads, loss = carry
            f, b, f_valid, b_valid = work(row)

            # --- forward: stash the chunk input, run the chunk (the last chunk runs in its backward)
            x_in = forward_input(f, f_valid, act_in)
            kept = jax.lax.dynamic_index_in_dim(stash, f["slot"], keepdims=False)
            stash = jax.lax.dynamic_update_index_in_dim(stash, jnp.where(f_valid, x_in, kept), f["slot"], 0)
            run_forward = f_valid & ~((stage == last_stage) & (f["chunk"] == last_chunk))
            forward = lambda x: fn(chunk_params_of(stage_layers, f["chunk"]), x)
            act_out = when(masked, run_forward, forward, lambda x: x, x_in)

            # --- backward: recompute the chunk from its stashed input, vjp with a cotangent that is
            # last tick's, or for the last chunk the gradient of the head and loss
            x_saved = jax.lax.dynamic_index_in_dim(stash, b["slot"], keepdims=False)
            chunk = chunk_params_of(stage_layers, b["chunk"])

            def backward(x):
                y, vjp = jax.vjp(fn, chunk, x)
                loss_add, d_head_pair, dy = output_cotangent(b, y, cot_in)
                d_chunk, dx = vjp(dy)
                return loss_add, d_chunk, d_head_pair, dx

            def idle(x):
                return (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, chunk),
                        jax.tree.map(jnp.zeros_like, (final_norm, head)), jnp.zeros_like(x))

            loss_add, d_chunk, d_head_pair, dx = when(masked, b_valid, backward, idle, x_saved)
            grads = accumulate(grads, b, d_chunk, d_head_pair, dx)
            act_next, cot_next = communicate(act_out, dx)
            return (act_next, cot_next, stash, grads, loss + loss_add), None

        def tick_residuals(carry, row):
            """`pp_stash=residuals`: the forward keeps the vjp's activation-dependent residuals (and
            the chunk output, for the head), the backward rebuilds the weight-only residuals from
            the parameters and runs the vjp without recomputing the chunk."""
            act_in, cot_in, (stash, outputs), grads, loss = carry
            f, b, f_valid, b_valid = work(row)

            # --- forward (every chunk, the last included): run the chunk's vjp, stash what
            # depends on the activation and the output
            x_in = forward_input(f, f_valid, act_in)

            def forward(x):
                y, vjp = jax.vjp(fn, chunk_params_of(stage_layers, f["chunk"]), x)
                leaves = jax.tree.leaves(vjp)
                assert same_leaves(leaves, res_avals), "forward vjp differs from the analysed one"
                return y, [l for l, d in zip(leaves, depends) if d]

            def skip(x):
                return x, [jnp.zeros(a.shape, a.dtype) for a in stashed_avals]

            act_out, res = when(masked, f_valid, forward, skip, x_in)
            put = lambda buf, new: jax.lax.dynamic_update_index_in_dim(
                buf, jnp.where(f_valid, new, jax.lax.dynamic_index_in_dim(buf, f["slot"], keepdims=False)),
                f["slot"], 0)
            stash = [put(buf, r) for buf, r in zip(stash, res)]
            outputs = put(outputs, act_out)

            # --- backward: stashed residuals + weight-only residuals rebuilt from the parameters
            chunk = chunk_params_of(stage_layers, b["chunk"])
            saved = ([jax.lax.dynamic_index_in_dim(buf, b["slot"], keepdims=False) for buf in stash],
                     jax.lax.dynamic_index_in_dim(outputs, b["slot"], keepdims=False))

            def backward(saved):
                res, y = saved
                # The activation path of this vjp is dead code (its residuals are replaced below).
                rebuilt, treedef = jax.tree.flatten(jax.vjp(fn, chunk, jnp.zeros_like(act))[1])
                assert same_leaves(rebuilt, res_avals), "backward vjp differs from the analysed one"
                res = iter(res)
                vjp = treedef.unflatten([next(res) if d else leaf for leaf, d in zip(rebuilt, depends)])
                loss_add, d_head_pair, dy = output_cotangent(b, y, cot_in)
                d_chunk, dx = vjp(dy)
                return loss_add, d_chunk, d_head_pair, dx

            def idle(saved):
                return (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, chunk),
                        jax.tree.map(jnp.zeros_like, (final_norm, head)), jnp.zeros_like(saved[1]))

            loss_add, d_chunk, d_head_pair, dx = when(masked, b_valid, backward, idle, saved)
            grads = accumulate(grads, b, d_chunk, d_head_pair, dx)
            act_next, cot_next = communicate(act_out, dx)
            return (act_next, cot_next, (stash, outputs), grads, loss + loss_add), None

        slots = lambda shape, dtype: jnp.zeros((schedule.slots, *shape), dtype)
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
        grads = (zeros(stage_layers), zeros(embed), zeros((final_norm, head)))
        with sharding.axis_rules(manual=("dp", "pp"), sequence_parallel=cfg.parallel.sequence_parallel):
            if keep_residuals:  # read by tick_residuals
                depends, res_avals = activation_dependent_residuals(
                    fn, chunk_params_of(stage_layers, 0), act)
                stashed_avals = [a for a, d in zip(res_avals, depends) if d]
                stash = ([slots(a.shape, a.dtype) for a in stashed_avals], slots(act.shape, act.dtype))
            else:
                stash = slots(act.shape, act.dtype)
            carry = (act, act, stash, grads, jnp.zeros((), jnp.float32))
            (_, _, _, grads, loss), _ = jax.lax.scan(tick_residuals if keep_residuals else tick, carry, table)
        g_layers, g_embed, (g_norm, g_head) = grads
        g_layers = jax.lax.psum(jax.tree.map(lambda x: x[None], g_layers), "dp")
        g_embed, g_norm, g_head, loss = jax.lax.psum((g_embed, g_norm, g_head, loss), ("dp", "pp"))
        return loss, g_layers, g_embed, g_norm, g_head

    stages = to_stages(params["layers"], p, v)
    stage_spec = jax.tree.map(lambda _: P("pp"), stages)
    run = jax.shard_map(
        body, mesh=mesh, axis_names={"pp", "dp"}, check_vma=False,
        in_specs=(stage_spec, P(), P(), P(), P("dp")),
        out_specs=(P(), stage_spec, P(), P(), P()))
    loss, g_stages, g_embed, g_norm, g_head = run(stages, params["embed"], params["final_norm"], params["head"], batch)
    grads = {"embed": g_embed, "layers": from_stages(g_stages, p, v), "final_norm": g_norm, "head": g_head}
    return loss, grads


def loss(cfg: Config, mesh: Mesh, params, batch):
    """The loss of `batch` through the pipeline, forward only (evaluation): the forward half of the
    training schedule (`forward_only`), activations passed on as in training, the head and loss
    on the last stage. Layer weights stay on their stages (no all-gather over pp, unlike running
    the plain model under GSPMD); equals the single-device loss."""
    p, v, m = cfg.mesh.pp, cfg.parallel.pp_virtual, cfg.parallel.microbatches
    table = _table_arrays(forward_only(schedule_for(cfg)))
    scale = 1.0 / (m * mesh.shape["dp"])
    masked = explicit_tp(cfg, mesh)

    def body(stage_layers, embed, final_norm, head, tokens):
        stage_layers, stage, inputs, targets, act = stage_view(cfg, stage_layers, tokens)

        def tick(carry, row):
            act_in, total = carry
            f = {k[2:]: row[k][stage] for k in row if k.startswith("f_")}
            valid = f["valid"] > 0
            first = valid & (stage == 0) & (f["chunk"] == 0)
            x = jax.lax.cond(first, lambda: embed_tokens(cfg.model, embed, inputs[f["mb"]]), lambda: act_in)
            chunk = chunk_params_of(stage_layers, f["chunk"])
            y = when(masked, valid, lambda x: run_layers(cfg.model, chunk, x, cfg.parallel), lambda x: x, x)
            last = valid & (stage == p - 1) & (f["chunk"] == v - 1)
            total += jax.lax.cond(
                last, lambda y: scale * cross_entropy(lm_logits(cfg.model, final_norm, head, y), targets[f["mb"]]),
                lambda y: jnp.zeros((), jnp.float32), y)
            return (send_forward(y, p), total), None

        with sharding.axis_rules(manual=("dp", "pp"), sequence_parallel=cfg.parallel.sequence_parallel):
            (_, total), _ = jax.lax.scan(tick, (act, jnp.zeros((), jnp.float32)), table)
        return jax.lax.psum(total, ("dp", "pp"))

    stages = to_stages(params["layers"], p, v)
    run = jax.shard_map(
        body, mesh=mesh, axis_names={"pp", "dp"}, check_vma=False,
        in_specs=(jax.tree.map(lambda _: P("pp"), stages), P(), P(), P(), P("dp")), out_specs=P())
    return run(stages, params["embed"], params["final_norm"], params["head"], batch)
