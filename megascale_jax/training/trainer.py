"""What one config compiles to on one mesh: the model, its sharded train state, and the jitted
steps (`build_trainer`).

The state's shardings come from an abstract init (nothing allocated), the optimizer's moments
follow the parameters (split over dp too with ZeRO-1), and `train_step` updates the state with
donated buffers and explicit out shardings. A non-finite step keeps the state it was given, so
the host can replay it (training/triage.py). Every jitted function runs with the mesh and the
logical-axis rules in scope (`_with_rules`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from megascale_jax.config import Config
from megascale_jax.model import flops
from megascale_jax.model.transformer import Transformer, loss_fn, score_fn
from megascale_jax.parallel import context_parallel, layout, microbatches, pipeline, sharding
from megascale_jax.training import compile_cache, save_copy
from megascale_jax.training.optim import current_learning_rate, layer_axes, make_optimizer
from megascale_jax.training.state import TrainState


@dataclasses.dataclass
class Trainer:
    """Everything compiled for one config on one mesh."""

    cfg: Config
    mesh: Mesh
    model: Transformer
    state_shardings: TrainState
    abstract_params: Any  # ShapeDtypeStructs with shardings, for lowering without allocating
    batch_sharding: NamedSharding
    init: Callable[[], TrainState]
    start_from: Callable[[Any], TrainState]  # given parameters (canonical order): step 0, fresh moments
    # The layers' stored order is the pipeline's (`parallel.layout`); checkpoints hold the canonical.
    to_canonical: Callable[[TrainState], TrainState]
    to_stored: Callable[[TrainState], TrainState]
    train_step: Callable[[TrainState, jax.Array], tuple[TrainState, dict]]
    loss_and_grads: Callable[[Any, jax.Array], tuple[jax.Array, Any]]  # params in stored order
    eval_loss: Callable[[Any, jax.Array], jax.Array]
    # (params, batch, mask) -> each row's summed target log-probabilities and all-greedy flag, replicated
    # (downstream evaluation: training/downstream.py)
    score_rows: Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


# The name scope of the optimizer update, a branch of the train step's hold (a lax.cond): its
# collectives (norms, ZeRO-1's gather) carry it in their op_name, as `observe.collectives` counts.
OPTIMIZER_UPDATE = "optimizer_update"


def branch_runs(cfg: Config, stage: int) -> dict[str, int]:
    """How many times per step a device of pipeline stage `stage` runs each scoped branch of the
    train step (`observe.collectives.bytes_per_axis`): the optimizer update once, the pipeline's
    branches as `pipeline.branch_runs` counts them."""
    return {OPTIMIZER_UPDATE: 1, **(pipeline.branch_runs(cfg, stage) if cfg.mesh.pp > 1 else {})}


def build_trainer(cfg: Config, mesh: Mesh) -> Trainer:
    model = Transformer(cfg.model, cfg.parallel)
    replicated = sharding.replicated(mesh)

    def dummy():
        return jnp.zeros((1, cfg.model.seq_len), jnp.int32)

    # Shapes and logical axes come from an abstract init; nothing is allocated (or compiled) here.
    # A restart reads them from the run's compile cache instead of tracing the model again.
    boxed = compile_cache.remember("abstract_params", cfg.to_dict(),
                                   lambda: jax.eval_shape(lambda: model.init(jax.random.key(0), dummy()))["params"])
    optimizer = make_optimizer(cfg.optim, cfg.train.steps, layer_axes(boxed))
    param_shardings = sharding.param_shardings(boxed, mesh, cfg)
    abstract_params = nn.unbox(boxed)
    moment_shardings = param_shardings
    if cfg.parallel.zero1:
        moment_shardings = jax.tree.map(
            lambda s, x: sharding.zero1_sharding(s, x.shape, mesh), param_shardings, abstract_params)
    opt_shardings = staged(lambda: optax.tree_map_params(
        optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, abstract_params), moment_shardings,
        transform_non_params=lambda _: replicated))
    state_shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)

    def start_from(params) -> TrainState:
        params = layout.to_stored(cfg, params)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))

    def init() -> TrainState:
        # threefry is partitionable, so values depend on the seed only, never on the shardings.
        return start_from(nn.unbox(model.init(jax.random.key(cfg.train.seed), dummy()))["params"])

    def loss_and_grads(params, batch):
        # The moments' sharding: the gradients' tp split and, with ZeRO-1, the dp split the
        # pipeline or the accumulation reduce-scatters them to.
        grad_specs = jax.tree.map(lambda s: s.spec, moment_shardings)
        if cfg.mesh.pp > 1:
            return pipeline.loss_and_grads(cfg, mesh, params, batch, grad_specs)
        return microbatches.loss_and_grads(cfg, model, mesh, params, batch, cfg.parallel.microbatches, grad_specs)

    def eval_loss(params, batch):
        # At pp > 1 through the pipeline, forward only: the plain model under GSPMD would gather
        # every stage's layer weights onto every device.
        if cfg.mesh.pp > 1:
            return pipeline.loss(cfg, mesh, params, batch)
        if cfg.mesh.cp > 1:  # each cp rank its slice, as the training step runs it
            return context_parallel.mean_over_slices(cfg, mesh, lambda p, b: loss_fn(model, p, b))(params, batch)
        return loss_fn(model, params, batch)

    def score_rows(params, batch, mask):
        if cfg.mesh.pp > 1:  # through the pipeline, as eval_loss
            return pipeline.score(cfg, mesh, params, batch, mask)
        if cfg.mesh.cp > 1:
            score = lambda p, b, m: score_fn(model, p, b, m)
            return context_parallel.scores_over_slices(cfg, mesh, score)(params, batch, mask)
        return score_fn(model, params, batch, mask)

    def train_step(state: TrainState, batch):
        loss, grads = loss_and_grads(state.params, batch)
        grad_norm = optax.tree.norm(grads)
        # A non-finite step keeps the state it was given, so the host can replay it (training.triage).
        # The host sees a step's metrics one step late, after the next step was dispatched: that
        # step must keep it too. So a non-finite step marks the state held (step -1 - updates
        # done), and a held state passes through every step unchanged until the host releases it.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (state.step >= 0)

        @functools.partial(pipeline.scoped, OPTIMIZER_UPDATE)  # its collectives: once per step
        def update(state):
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params, grad_norm=grad_norm)
            return TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                              opt_state=opt_state)

        def hold(state):
            return state.replace(step=jnp.where(state.step >= 0, -1 - state.step, state.step))

        # A cond, not a select between the updated and the given state: the select kept the
        # updated state in temporaries beside the donated one (on XLA:CPU +0.55x the parameters'
        # bytes, 9% of a small step's peak); the cond updates in place (tests/training/test_triage).
        new = jax.lax.cond(finite, update, hold, state)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": current_learning_rate(new.opt_state)}
        return new, metrics

    def reorder(convert, **jit_options):
        """A whole-state layer-order conversion: compiled, or the identity where the orders agree."""
        if not layout.permutes(cfg):
            return lambda state: state
        return _with_rules(cfg, mesh, jax.jit(functools.partial(convert, cfg), out_shardings=state_shardings,
                                              compiler_options=options, **jit_options))

    metric_shardings = {"loss": replicated, "grad_norm": replicated, "lr": replicated}
    batch_sharding = sharding.batch_sharding(mesh)
    options = compiler_options(mesh.devices.flat[0].platform)
    return Trainer(
        cfg=cfg, mesh=mesh, model=model, state_shardings=state_shardings, batch_sharding=batch_sharding,
        abstract_params=jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                     abstract_params, param_shardings),
        init=_with_rules(cfg, mesh, jax.jit(init, out_shardings=state_shardings, compiler_options=options)),
        start_from=_with_rules(cfg, mesh, jax.jit(start_from, out_shardings=state_shardings, compiler_options=options)),
        to_canonical=reorder(layout.to_canonical), to_stored=reorder(layout.to_stored, donate_argnums=0),
        train_step=_with_rules(cfg, mesh, jax.jit(
            train_step, in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, metric_shardings), donate_argnums=0 if cfg.train.donate else (),
            compiler_options=options)),
        loss_and_grads=_with_rules(cfg, mesh, jax.jit(
            loss_and_grads, in_shardings=(param_shardings, batch_sharding), compiler_options=options)),
        eval_loss=_with_rules(cfg, mesh, jax.jit(
            eval_loss,
            in_shardings=(param_shardings, batch_sharding), out_shardings=replicated, compiler_options=options)),
        score_rows=_with_rules(cfg, mesh, jax.jit(
            score_rows, in_shardings=(param_shardings, batch_sharding, batch_sharding),
            out_shardings=(replicated, replicated), compiler_options=options)),
    )


def staged(fn: Callable[[], Any]) -> Any:
    """fn(), run inside a trace, so that the jax.numpy operations it applies to constants are traced
    and dropped rather than each compiled and run. optax.tree_map_params runs the optimizer's init
    (the learning-rate schedule at step 0: ~20 small programs); processes the compilation cache
    cannot serve compiled them on every restart."""
    result = []

    def record():
        result.append(fn())
        return ()
    jax.make_jaxpr(record)()
    return result[0]


def compiler_options(platform: str) -> dict | None:
    """XLA options for compiling the steps on `platform`: none, except one workaround on the CPU.

    XLA:CPU's `all-reduce-promotion` pass (it widens bf16 all-reduces to f32) aborts the whole
    process (`Invalid binary instruction opcode copy`, SIGABRT) on an all-reduce that GSPMD emits
    for bf16 models with tp > 1. On the CPU we skip that one pass; its all-reduces then sum in
    bf16, within the bf16 tolerance the tests state. GPU compilations get no options: what runs on
    a GPU is exactly what XLA would do by default."""
    return {"xla_disable_hlo_passes": "all-reduce-promotion"} if platform == "cpu" else None


def _with_rules(cfg: Config, mesh: Mesh, fn):
    """Trace and run `fn` with the mesh and the logical-axis rules in scope."""

    def in_scope(call, *args):
        with jax.set_mesh(mesh), sharding.axis_rules(cfg):
            return call(*args)

    wrapped = functools.partial(in_scope, fn)
    wrapped.lower = functools.partial(in_scope, fn.lower)
    # `.trace(...).lower(lowering_platforms=("cuda",))` lowers for a GPU from a CPU-only host
    # (tests/parallel/test_cuda_lowering.py); `.lower` alone lowers for the mesh's own platform.
    wrapped.trace = functools.partial(in_scope, fn.trace)
    return wrapped


def compile_steps(cfg: Config, trainer: Trainer, state: TrainState, batch: jax.Array, clock) -> tuple[Callable, Callable | None]:
    """`train_step` and `eval_loss` compiled for these shapes before the first step, so that no
    step's time includes a compilation; loaded without tracing on a restart (compile_cache).
    `eval_loss` is None with `train.eval_batches=0` (no validation loss)."""
    config = cfg.to_dict()
    train_step = compile_cache.load_or_compile(
        "train_step", lambda: trainer.train_step.lower(state, batch), config, (state, batch))
    clock.lap("train_step")
    check_compiled_memory(cfg, train_step, state)
    if cfg.train.eval_batches == 0:
        return train_step, None
    eval_loss = compile_cache.load_or_compile(
        "eval_loss", lambda: trainer.eval_loss.lower(state.params, batch), config, (state.params, batch))
    clock.lap("eval_loss")
    return train_step, eval_loss


def saves_state(cfg) -> bool:
    """Whether the run copies its state for saving at all (checkpoints or memory snapshots): only
    then does checkpoint.background_host_copy hold a copy of it on the device."""
    return cfg.checkpoint.every > 0 or cfg.checkpoint.memory_every > 0


def check_compiled_memory(cfg: Config, compiled, state) -> None:
    """XLA's own buffer assignment for the compiled step against the accelerator's memory: the
    pre-flight check that is exact where `check_memory`'s estimate is not (on an H200 the step
    peaked at 1.3-1.7x the estimate, and steps the estimate passed died of RESOURCE_EXHAUSTED).
    Refuses before the first step; CPU devices share the host's RAM and keep the estimate alone.
    A background save's copy of the state is not counted: it is capped to what fits beside the
    step (`device_copy_cap`)."""
    limit = _device_limit(cfg)
    if limit is not None:
        flops.check_compiled_fits(compiled.memory_analysis(), limit, f"one {jax.local_devices()[0].device_kind}")


def device_copy_cap(cfg: Config, compiled, state) -> int | None:
    """The bytes per device a background save may copy on the device (`flops.device_copy_bytes`:
    what fits beside the compiled step, at most checkpoint.device_copy_gib); None where the whole
    state may be, or where no copy is made on the device at all."""
    if not (cfg.checkpoint.background_host_copy and saves_state(cfg)):
        return None
    state_bytes = sum(save_copy.bytes_per_device(x) for x in jax.tree.leaves(state))
    limit = _device_limit(cfg)
    step_bytes = flops.compiled_bytes(compiled.memory_analysis()) if limit is not None else 0
    on_device = flops.device_copy_bytes(state_bytes, step_bytes, limit, cfg.checkpoint.device_copy_gib)
    return None if on_device >= state_bytes else on_device


def _device_limit(cfg: Config) -> int | None:
    """The bytes jax may use on this process's first accelerator (None on CPUs, or with
    train.memory_check=false)."""
    device = jax.local_devices()[0]
    if device.platform == "cpu" or not cfg.train.memory_check:
        return None
    return (device.memory_stats() or {}).get("bytes_limit")
