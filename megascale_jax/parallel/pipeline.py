"""The pipeline executor: one SPMD program that runs a `pipeline_schedule` table over `pp`.

`loss_and_grads(cfg, mesh, params, batch)` returns the same loss and gradients as plain
autodiff of the whole model, computed by p stages in lockstep inside one `jax.shard_map` that is
manual over `pp` and `dp`, and `cp` where the sequence is split (each rank runs its slice of every
microbatch: `context_parallel.manual`); tp stays automatic: GSPMD shards each stage's matmuls as
usual.
`loss(cfg, mesh, params, batch)` is its forward-only twin, for evaluation. In the shard_map a
`Stage` is one stage's view and the forward half of its tick (evaluation's whole tick but the
loss), `TrainingTick` the training scan's body, `GradientPlacement` where each gradient lives.

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
* Stash, `parallel.pp_stash`, a strategy (`pipeline_stash`) with a `forward` (what to keep) and
  a `backward` (the chunk's output and vjp, from what was kept):
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
  overlap the backward work that follows (MegaScale's per-chunk reduce-scatter), and then, with
  cp > 1, sums it over cp (only the dp shard, with ZeRO-1). It sits under a `cond` whose
  predicate comes from the table row of the stage, the same on every dp and cp replica of the
  stage, and only replicas of one stage take part: they all join it or all skip it.
* Documents (`model.document_eos`: packed documents kept apart). A chunk needs its microbatch's
  document layout (ids for the attention mask, in-document positions for rotary) and the last
  stage the weights that drop the targets after an end-of-document token. The batch enters the
  shard_map split over dp only, so every stage already holds every microbatch's tokens: a stage
  recomputes the layout from them (`Stage.documents`: a cumsum and a cummax over (b, s) int32) for
  its forward's microbatch and again for its backward's. Sending the ids with the activations
  instead would move b·s int32 per hop each way (2/d_model of a bf16 activation) and put them in
  the stash; recomputing moves nothing and stashes nothing.
* Embedding and head. They are stored replicated over pp, although only stage 0 and stage p−1
  use them: a `jax.Array` covers every device of its mesh, so living on one stage only would
  take a second mesh (a second program). Their gradients are summed over pp and reduced over
  dp after the loop; `flops.memory_estimate` counts them, with their optimizer state, on every
  stage.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from megascale_jax.config import Config
from megascale_jax.model import documents
from megascale_jax.model.transformer import (chunked_cross_entropy, cross_entropy, embed_tokens, lm_head, lm_logits,
                                             norm, run_layers, target_scores)
from megascale_jax.parallel import context_parallel, sharding
from megascale_jax.parallel.pipeline_stash import STASHES, NoStash
from megascale_jax.parallel.reduce_scatter import reduce_scatter
from megascale_jax.pipeline_schedule import Schedule, build, forward_only

FIELDS = ("valid", "mb", "chunk", "slot")


def manual_axes(cfg: Config) -> tuple[str, ...]:
    """The axes the pipeline's shard_map is manual over: pp and dp, and cp where the sequence is
    split (each rank runs its slice; see `train_stage`)."""
    return ("dp", "pp", "cp") if cfg.mesh.cp > 1 else ("dp", "pp")


def schedule_for(cfg: Config) -> Schedule:
    return build(cfg.parallel.pp_schedule, cfg.mesh.pp, cfg.parallel.pp_virtual, cfg.parallel.microbatches)


def explicit_collectives(cfg: Config, mesh: Mesh) -> bool:
    """Whether a chunk runs explicit collectives: tp's (shard_map psum / all-gather / ppermute) or
    cp's (the attention halo's ppermute, or the keys' all-gather). They must not sit under a
    per-stage `cond`: stages that skip it never join the collective and the program hangs (a
    collective permute is one op across every device). Then every stage runs a chunk every tick
    and idle results are masked (`when`)."""
    return (mesh.shape["tp"] > 1 and cfg.parallel.tp_overlap != "xla") or mesh.shape["cp"] > 1


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


def reduce_over_dp(x, dim: int | None, tp_spec: P = P(), then: tuple[str, ...] = ()):
    """Sum over dp: a reduce-scatter along `dim` (the ZeRO-1 split), or an all-reduce; then over
    the manual axes `then` (cp: only the dp shard crosses it). A gradient split over tp
    (`tp_spec`) is reduced shard by shard, under a shard_map manual over tp: left to GSPMD, a
    reduce-scatter in this dp-manual region gathered the tp shards first, moving tp× the bytes
    over dp."""
    over_dp = (lambda y: jax.lax.psum(y, "dp")) if dim is None else (lambda y: reduce_scatter(y, "dp", dim))
    op = (lambda y: jax.lax.psum(over_dp(y), then)) if then else over_dp
    if all(a is None for a in tp_spec):
        return op(x)
    return jax.shard_map(op, in_specs=tp_spec, out_specs=tp_spec, axis_names={"tp"}, check_vma=False)(x)


def manual_spec(dim: int, first: str | None = None) -> P:
    """The shard_map out spec of a reduced gradient: `first` on dimension 0, dp on `dim` (≥ 0)."""
    out = [first] + [None] * max(dim, 0) if first else [None] * (dim + 1)
    if dim >= 0:
        out[dim] = "dp"
    return P(*out)


# ------------------------------------------------------------------ one stage, one tick


def zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


class Stage:
    """One stage inside the shard_map (manual over pp and dp): its chunks and microbatches, the
    embedding and head it may use, and the parts of a tick that training and evaluation share —
    its entry of a table row, the forward input, the chunk's forward, the head's loss."""

    def __init__(self, cfg: Config, masked: bool, scale: float, stage_layers, embed, final_norm, head, tokens):
        self.cfg, self.masked, self.scale = cfg, masked, scale
        self.embed, self.final_norm, self.head = embed, final_norm, head
        self.chunks, self.index, self.inputs, self.targets, self.act = stage_view(cfg, stage_layers, tokens)
        # Manual over cp (training): whole rows in, this rank's slice of the sequence through the
        # chunks; the documents' layout still from whole rows (its cumulative sums cross slices)
        self.whole_inputs = self.inputs
        if context_parallel.manual():
            self.inputs, self.targets = (context_parallel.own_slice(x, axis=2) for x in (self.inputs, self.targets))
            self.act = context_parallel.own_slice(self.act)

    def work(self, row, direction: str) -> dict:
        """This stage's entry of a table row for its forward ("f") or backward ("b"): valid, mb,
        chunk, slot and, for the backward, last (see `table_arrays`)."""
        return {k[2:]: row[k][self.index] for k in row if k.startswith(f"{direction}_")}

    def is_first_chunk(self, w):
        """Whether `w` is valid work of the model's first chunk (whose input is the embedding)."""
        return (w["valid"] > 0) & (self.index == 0) & (w["chunk"] == 0)

    def is_last_chunk(self, w):
        """Whether `w` is of the model's last chunk (the head and loss follow it); validity unchecked."""
        return (self.index == self.cfg.mesh.pp - 1) & (w["chunk"] == self.cfg.parallel.pp_virtual - 1)

    def run_chunk(self, chunk, x, docs):
        return run_layers(self.cfg.model, chunk, x, self.cfg.parallel, docs)

    def documents(self, mb):
        """Microbatch `mb`'s packed documents (`model.document_eos`), or None: recomputed from its
        input tokens, which every stage holds (see "Documents" above)."""
        eos = self.cfg.model.document_eos
        if eos is None:
            return None
        docs = documents.layout(self.whole_inputs[mb], eos)
        return documents.Documents(*map(context_parallel.own_slice, docs)) if context_parallel.manual() else docs

    def head_loss(self, final_norm, head, y, mb):
        """Microbatch `mb`'s share of the step's loss, from the last chunk's output `y`; with
        documents, the targets after an end-of-document token count zero."""
        c = self.cfg.model
        weights = None if c.document_eos is None else documents.trained_targets(self.inputs[mb], c.document_eos)
        if c.loss_chunks > 1:
            x = norm(c, final_norm, y)
            return self.scale * chunked_cross_entropy(c, x, head, self.targets[mb], self.cfg.parallel, weights)
        logits = lm_logits(c, final_norm, head, y, self.cfg.parallel)
        return self.scale * cross_entropy(logits, self.targets[mb], weights)

    def forward_input(self, f, act_in):
        """The embedding of microbatch f.mb for the first chunk, otherwise the activation received last tick."""
        embed = lambda: embed_tokens(self.cfg.model, self.embed, self.inputs[f["mb"]], self.cfg.parallel)
        return jax.lax.cond(self.is_first_chunk(f), scoped("pp_embed", embed), lambda: act_in)

    def forward(self, stash, f, f_valid, act_in, kept):
        """A tick's forward: the chunk of `f` on its input, what its backward needs (`stash`) put in
        slot f.slot of `kept`. Returns (the activation to send on, kept). The last chunk's forward
        runs only if the stash keeps something of it; otherwise its backward, in the same tick,
        recomputes it."""
        x_in = self.forward_input(f, act_in)
        run_forward = f_valid
        if not stash.runs_last_forward:
            run_forward &= ~self.is_last_chunk(f)
        chunk, docs = chunk_params_of(self.chunks, f["chunk"]), self.documents(f["mb"])
        act_out, saved = when(self.masked, run_forward, lambda x: stash.forward(chunk, x, docs),
                              lambda x: (x, stash.skipped(x)), x_in)
        return act_out, set_entry(kept, f["slot"], saved, f_valid)


class GradientPlacement:
    """Where each gradient lives, from `grad_specs` (see `loss_and_grads`): per leaf, the dimension
    its dp reduction scatters along (`dims`; -1: an all-reduce) and its tp split (`tp`). With cp > 1
    (the shard_map manual over cp too) each reduction is summed over cp after dp."""

    def __init__(self, specs, dp: int, constrain: bool, cp: int = 1):
        is_spec = lambda x: isinstance(x, P)
        self.dp, self.constrain = dp, constrain
        self.then = ("cp",) if cp > 1 else ()
        self.reduces = dp > 1 or cp > 1  # whether the gradients leave a stage through `reduce`
        self.dims = jax.tree.map(lambda s: -1 if dp == 1 or dp_dim(s) is None else dp_dim(s), specs, is_leaf=is_spec)
        # Each gradient's tp split (the manual axes dropped), in the stored layout — which is also a
        # chunk's, (c, ...) like (L, ...) — and in the loop's (v, c, ...). The accumulators keep it,
        # where GSPMD would otherwise choose, and the dp reduction works on it shard by shard.
        self.tp = jax.tree.map(lambda s: P(*(None if a in ("dp", "pp") else a for a in s)), specs, is_leaf=is_spec)
        self.loop_layers = jax.tree.map(lambda s: P(None, *s), self.tp["layers"], is_leaf=is_spec)
        # The tick's gradient accumulators: (layers, embed, (final_norm, head)).
        self.accumulators = (self.loop_layers, self.tp["embed"], (self.tp["final_norm"], self.tp["head"]))

    def keep_tp(self, tree, specs):
        """`tree` held to its tp split `specs`, when `grad_specs` named one."""
        return jax.tree.map(jax.lax.with_sharding_constraint, tree, specs) if self.constrain else tree

    def reduce(self, tree, key: str):
        """`tree`, gradients of `params[key]` (or of one chunk of the layers), summed over dp (and cp)."""
        return jax.tree.map(lambda x, k, t: reduce_over_dp(x, None if k < 0 else k, t, self.then), tree,
                            self.dims[key], self.tp[key])

    def empty_reduced(self, chunks):
        """Per chunk, the dp-reduced gradient: with ZeRO-1 1/dp of it along the split dimension."""
        dp = self.dp
        reduced = jax.tree.map(
            lambda x, d: jnp.zeros(x.shape[:d + 1] + (x.shape[d + 1] // dp,) + x.shape[d + 2:], x.dtype)
            if d >= 0 else jnp.zeros_like(x), chunks, self.dims["layers"])
        return self.keep_tp(reduced, self.loop_layers)


class TrainingTick:
    """The training step's `lax.scan` body on one stage: the forward (`Stage.forward`), the chunk's
    backward from what was kept, the gradient accumulators, the dp reduction of a chunk whose
    gradient is complete, then activations one stage on and cotangents one stage back."""

    def __init__(self, stage: Stage, stash, grads: GradientPlacement):
        self.stage, self.stash, self.grads = stage, stash, grads

    def __call__(self, carry, row):
        act_in, cot_in, kept, (g_layers, g_embed, g_head), reduced, loss = carry
        f, b = self.stage.work(row, "f"), self.stage.work(row, "b")
        f_valid, b_valid = f["valid"] > 0, b["valid"] > 0
        act_out, kept = self.stage.forward(self.stash, f, f_valid, act_in, kept)
        loss_add, d_chunk, d_head, dx = self.backward(b, b_valid, kept, cot_in)
        g_layers = set_entry(g_layers, b["chunk"], jax.tree.map(jnp.add, chunk_params_of(g_layers, b["chunk"]), d_chunk))
        grads = (g_layers, g_embed + self.embedding_grad(b, dx), jax.tree.map(jnp.add, g_head, d_head))
        if self.grads.reduces:
            reduced = self.grads.keep_tp(self.reduce_finished_chunk(b, g_layers, reduced), self.grads.loop_layers)
        grads = self.grads.keep_tp(grads, self.grads.accumulators)
        p = self.stage.cfg.mesh.pp
        return (send_forward(act_out, p), send_backward(dx, p), kept, grads, reduced, loss + loss_add), None

    def backward(self, b, b_valid, kept, cot_in):
        """The chunk's vjp from slot b.slot of `kept`, with last tick's cotangent or, for the last
        chunk, the gradient of the head and loss: (loss, d chunk, d (final_norm, head), dx)."""
        s = self.stage
        chunk = chunk_params_of(s.chunks, b["chunk"])

        def backward(saved):
            y, vjp = self.stash.backward(chunk, saved, s.documents(b["mb"]))
            loss_add, d_head, dy = self.output_cotangent(b, y, cot_in)
            d_chunk, dx = vjp(dy)
            return loss_add, d_chunk, d_head, dx

        def idle(saved):
            return jnp.zeros((), jnp.float32), zeros(chunk), zeros((s.final_norm, s.head)), jnp.zeros_like(s.act)

        return when(s.masked, b_valid, backward, idle, chunk_params_of(kept, b["slot"]))

    def output_cotangent(self, b, y, cot_in):
        """(loss, d(final_norm, head), dy): for the last chunk the gradient of head + loss at its
        output y, otherwise nothing and the cotangent received last tick."""
        s = self.stage

        def head_grads(y):
            mb_loss = lambda final_norm, head, y: s.head_loss(final_norm, head, y, b["mb"])
            value, grads = jax.value_and_grad(mb_loss, argnums=(0, 1, 2))(s.final_norm, s.head, y)
            return value, grads[:2], grads[2].astype(y.dtype)

        def no_head(y):
            return jnp.zeros((), jnp.float32), zeros((s.final_norm, s.head)), cot_in

        return jax.lax.cond(s.is_last_chunk(b), scoped("pp_head", head_grads), no_head, y)

    def embedding_grad(self, b, dx):
        """The embedding's gradient from the first chunk's input cotangent `dx`; zeros elsewhere."""
        s = self.stage
        embed = lambda e: embed_tokens(s.cfg.model, e, s.inputs[b["mb"]], s.cfg.parallel)
        return jax.lax.cond(s.is_first_chunk(b), scoped("pp_embed_grad", lambda dx: jax.vjp(embed, s.embed)[1](dx)[0]),
                            lambda dx: jnp.zeros_like(s.embed), dx)

    def reduce_finished_chunk(self, b, g_layers, reduced):
        """After a chunk's last microbatch: its gradient, summed over dp, into `reduced`."""
        def reduce_chunk(g_layers, reduced):
            done = self.grads.reduce(chunk_params_of(g_layers, b["chunk"]), "layers")
            return set_entry(reduced, b["chunk"], done)
        return jax.lax.cond((b["valid"] > 0) & (b["last"] > 0), scoped("pp_dp_reduce", reduce_chunk),
                            lambda _, r: r, g_layers, reduced)


# ------------------------------------------------------------------ training step


def loss_and_grads(cfg: Config, mesh: Mesh, params, batch, grad_specs=None):
    """Loss and gradients of `batch`; `params` and the layer gradients in stored order.

    `grad_specs` (a tree of PartitionSpecs like `params`): where each gradient lives — its tp
    split, kept by the accumulators inside the loop, and where it leaves the dp reduction: split
    over dp where a spec names dp (ZeRO-1: the optimizer moments' sharding, reached by a
    reduce-scatter), otherwise replicated (an all-reduce). Default: replicated."""
    specs = grad_specs if grad_specs is not None else jax.tree.map(lambda _: P(), params)
    if cfg.model.tied_embeddings:  # the last stage's head is the embedding's transpose; its gradient adds
        params, specs = with_tied_head(params), with_tied_head(specs)
    cp = mesh.shape["cp"]
    grads = GradientPlacement(specs, mesh.shape["dp"], constrain=grad_specs is not None, cp=cp)
    out = jax.tree.map(manual_spec, grads.dims)
    if cfg.model.tied_embeddings:  # the head's gradient leaves the stage folded into the embedding's
        out["head"] = None
    run = jax.shard_map(
        functools.partial(train_stage, cfg, explicit_collectives(cfg, mesh), grads, schedule_for(cfg)),
        mesh=mesh, axis_names=set(manual_axes(cfg)), check_vma=False,
        in_specs=(jax.tree.map(lambda _: P("pp"), params["layers"]), P(), P(), P(), P("dp")),
        out_specs=(P(), jax.tree.map(lambda d: manual_spec(d, "pp"), grads.dims["layers"]),
                   out["embed"], out["final_norm"], out["head"]))
    loss, g_layers, g_embed, g_norm, g_head = run(params["layers"], params["embed"], params["final_norm"],
                                                  params["head"], batch)
    if cfg.model.tied_embeddings:
        return loss, {"embed": g_embed, "layers": g_layers, "final_norm": g_norm}
    return loss, {"embed": g_embed, "layers": g_layers, "final_norm": g_norm, "head": g_head}


def train_stage(cfg: Config, masked: bool, grads: GradientPlacement, schedule: Schedule,
                stage_layers, embed, final_norm, head, tokens):
    """The shard_map body of `loss_and_grads`: one stage's ticks, then its gradients reduced over dp
    and cp (the layers' already, chunk by chunk inside the loop) and summed over pp. With cp > 1
    the shard_map is manual over cp as well: each rank runs its slice of every microbatch's
    sequence and sums its own tokens' gradients, which cross cp once a step (left to GSPMD, they
    were all-reduced over cp in every tick)."""
    manual = manual_axes(cfg)
    # loss = mean over microbatches, dp replicas and cp slices of per-slice means
    scale = 1.0 / (cfg.parallel.microbatches * grads.dp * cfg.mesh.cp)
    stage = Stage(cfg, masked, scale, stage_layers, embed, final_norm, head, tokens)
    accumulators = grads.keep_tp((zeros(stage.chunks), zeros(embed), zeros((final_norm, head))), grads.accumulators)
    with sharding.axis_rules(cfg, manual=manual):
        stash = STASHES[cfg.parallel.pp_stash](stage.run_chunk, chunk_params_of(stage.chunks, 0), stage.act,
                                               stage.documents(0))
        kept = stash.empty(schedule.slots, stage.act)
        reduced = grads.empty_reduced(stage.chunks) if grads.reduces else ()
        carry = (stage.act, stage.act, kept, accumulators, reduced, jnp.zeros((), jnp.float32))
        (_, _, _, (g_layers, g_embed, (g_norm, g_head)), reduced, loss), _ = jax.lax.scan(
            TrainingTick(stage, stash, grads), carry, table_arrays(schedule))
    if grads.reduces:
        g_layers = reduced
    g_layers = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), g_layers)
    if cfg.model.tied_embeddings:  # one matrix: its two gradients added before they travel, so
        # dp and pp move it once (reduced apart and summed after, they moved it twice)
        g_embed, g_head = g_embed + g_head.T, None
    if grads.reduces:  # over dp (and cp) first: with ZeRO-1 the sum over pp then moves 1/dp of the data
        g_embed, g_norm = grads.reduce(g_embed, "embed"), grads.reduce(g_norm, "final_norm")
        g_head = None if g_head is None else grads.reduce(g_head, "head")
    g_embed, g_norm, g_head = jax.lax.psum((g_embed, g_norm, g_head), "pp")
    return jax.lax.psum(loss, manual), g_layers, g_embed, g_norm, g_head


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
    scale = 1.0 / (cfg.parallel.microbatches * mesh.shape["dp"] * mesh.shape["cp"])
    run = jax.shard_map(
        functools.partial(evaluate_stage, cfg, explicit_collectives(cfg, mesh), scale, forward_only(schedule_for(cfg))),
        mesh=mesh, axis_names=set(manual_axes(cfg)), check_vma=False,
        in_specs=(jax.tree.map(lambda _: P("pp"), params["layers"]), P(), P(), P(), P("dp")), out_specs=P())
    return run(params["layers"], params["embed"], params["final_norm"], lm_head(cfg.model, params), batch)


def evaluate_stage(cfg: Config, masked: bool, scale: float, schedule: Schedule,
                   stage_layers, embed, final_norm, head, tokens):
    """The shard_map body of `loss`: one stage's ticks, each the training tick's forward (keeping
    nothing) and, after the last chunk, the head's loss; the loss summed over dp and pp (and cp)."""
    stage = Stage(cfg, masked, scale, stage_layers, embed, final_norm, head, tokens)
    loss = lambda y, mb, total: total + stage.head_loss(stage.final_norm, stage.head, y, mb)
    total = forward_ticks(cfg, schedule, stage, loss, jnp.zeros((), jnp.float32))
    return jax.lax.psum(total, manual_axes(cfg))


def forward_ticks(cfg: Config, schedule: Schedule, stage: Stage, head_out, out):
    """Every tick of a forward-only schedule on this stage: the chunk's forward (keeping nothing),
    the activation sent on, and after the model's last chunk `out = head_out(y, mb, out)`."""
    stash = NoStash(stage.run_chunk)

    def tick(carry, row):
        act_in, out = carry
        f = stage.work(row, "f")
        valid = f["valid"] > 0
        y, _ = stage.forward(stash, f, valid, act_in, ())
        out = jax.lax.cond(valid & stage.is_last_chunk(f), lambda y, out: head_out(y, f["mb"], out),
                           lambda y, out: out, y, out)
        return (send_forward(y, cfg.mesh.pp), out), None

    with sharding.axis_rules(cfg, manual=manual_axes(cfg)):
        (_, out), _ = jax.lax.scan(tick, (stage.act, out), table_arrays(schedule))
    return out


def score(cfg: Config, mesh: Mesh, params, batch, mask):
    """`transformer.target_scores` of each row of `batch` where `mask` is 1 (downstream evaluation),
    through the pipeline like `loss`: the forward-only schedule, each microbatch's rows scored on
    the last stage. Returns (summed log-probabilities, all greedy), one per row, split over dp."""
    run = jax.shard_map(
        functools.partial(score_stage, cfg, explicit_collectives(cfg, mesh), forward_only(schedule_for(cfg))),
        mesh=mesh, axis_names=set(manual_axes(cfg)), check_vma=False,
        in_specs=(jax.tree.map(lambda _: P("pp"), params["layers"]), P(), P(), P(), P("dp"), P("dp")),
        out_specs=(P("dp"), P("dp")))
    return run(params["layers"], params["embed"], params["final_norm"], lm_head(cfg.model, params), batch, mask)


def score_stage(cfg: Config, masked: bool, schedule: Schedule, stage_layers, embed, final_norm, head, tokens, mask):
    """The shard_map body of `score`: microbatch mb's rows' scores into row mb of the outputs on
    the last stage (zeros elsewhere), summed over pp; with cp, each rank's slice's, summed over cp
    (a row greedy where it is on every rank)."""
    stage = Stage(cfg, masked, 1.0, stage_layers, embed, final_norm, head, tokens)
    masks = mask.reshape(*stage.targets.shape[:2], -1)
    if context_parallel.manual():
        masks = context_parallel.own_slice(masks, axis=2)

    def scores(y, mb, out):
        logits = lm_logits(cfg.model, stage.final_norm, stage.head, y, cfg.parallel)
        summed, greedy = target_scores(logits, stage.targets[mb], masks[mb])
        return out[0].at[mb].set(summed), out[1].at[mb].set(greedy.astype(jnp.int32))

    rows = jnp.zeros(stage.targets.shape[:2], jnp.float32), jnp.zeros(stage.targets.shape[:2], jnp.int32)
    summed, greedy = jax.lax.psum(forward_ticks(cfg, schedule, stage, scores, rows), "pp")
    if context_parallel.manual():
        summed, greedy = jax.lax.psum(summed, "cp"), jax.lax.psum(greedy, "cp") // cfg.mesh.cp
    return summed.reshape(-1), greedy.reshape(-1) > 0
