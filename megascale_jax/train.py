"""`python -m megascale_jax.train [--config YAML] [--run-dir DIR] [section.key=value ...]`

The whole training loop, top to bottom: validate the config and the data (nothing is compiled
before both pass), build the (dp, pp, tp) mesh, initialise sharded parameters and optimizer
state, compile one update step with donated state and explicit out shardings, then loop — data,
step, metrics — writing `RUN_DIR/config.yaml` and one `metrics.jsonl` record per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import signal
import sys
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megascale_jax import cli, run_dir as run_dirs
from megascale_jax.cluster import faults, heartbeat, rendezvous
from megascale_jax.cluster.self_test import device_self_test
from megascale_jax.config import Config, ConfigError, check_runtime, load_config, save_config
from megascale_jax.interop import hf_import
from megascale_jax.model import flops
from megascale_jax.model.transformer import Transformer, loss_fn
from megascale_jax.observe import device_profile, timings
from megascale_jax.parallel import layout, pipeline, sharding
from megascale_jax.parallel.mesh import check_forced_cpu_devices, make_mesh, use_cpu_devices
from megascale_jax.parallel.tensor_parallel import XLA_OVERLAP_FLAGS
from megascale_jax.training import checkpoint, compile_cache, data, snapshot, tokenizer
from megascale_jax.training.interrupt import Interrupted, StopRequest
from megascale_jax.training.hooks import Hooks
from megascale_jax.training.metrics import MetricsRecorder, NonFiniteStep, TrainingDiverged, itstime
from megascale_jax.training.observers import Observers
from megascale_jax.training.state import TrainState
from megascale_jax.training.triage import NonFiniteTriage, release
from megascale_jax.training.optim import current_learning_rate, layer_axes, learning_rate_schedule, make_optimizer

logger = cli.get_logger("train")


# ============================================================================ state and steps


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


def build_trainer(cfg: Config, mesh: Mesh) -> Trainer:
    model = Transformer(cfg.model, cfg.parallel)
    replicated = sharding.replicated(mesh)

    def dummy():
        return jnp.zeros((1, cfg.model.seq_len), jnp.int32)

    # Shapes and logical axes come from an abstract init; nothing is allocated (or compiled) here.
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), dummy()))["params"]
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
        m = cfg.parallel.microbatches
        if cfg.mesh.pp > 1:
            # The moments' sharding: the gradients' tp split and, with ZeRO-1, the dp split the
            # pipeline reduce-scatters them to.
            grad_specs = jax.tree.map(lambda s: s.spec, moment_shardings)
            return pipeline.loss_and_grads(cfg, mesh, params, batch, grad_specs)
        if m == 1:
            loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, batch))(params)
            return loss, grads
        # Microbatch j takes rows j, j+m, j+2m, ...: every dp shard holds a whole number of rows
        # of every microbatch, so the split is local (no communication).
        micro = batch.reshape(batch.shape[0] // m, m, -1).swapaxes(0, 1)
        micro = jax.lax.with_sharding_constraint(micro, NamedSharding(mesh, P(None, "dp", None)))

        def accumulate(carry, mb):
            loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, mb))(params)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(accumulate, zero, micro)
        return loss / m, jax.tree.map(lambda g: g / m, grads)

    def eval_loss(params, batch):
        # At pp > 1 through the pipeline, forward only: the plain model under GSPMD would gather
        # every stage's layer weights onto every device.
        if cfg.mesh.pp > 1:
            return pipeline.loss(cfg, mesh, params, batch)
        return loss_fn(model, params, batch)

    def train_step(state: TrainState, batch):
        loss, grads = loss_and_grads(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": current_learning_rate(opt_state)}
        updated = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
        # A non-finite step keeps the state it was given, so the host can replay it (training.triage).
        # The host sees a step's metrics one step late, after the next step was dispatched: that
        # step must keep it too. So a non-finite step marks the state held (step -1 - updates
        # done), and a held state passes through every step unchanged until the host releases it.
        finite = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"]) & (state.step >= 0)
        held = state.replace(step=jnp.where(state.step >= 0, -1 - state.step, state.step))
        return jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, held), metrics

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
            out_shardings=(state_shardings, metric_shardings), donate_argnums=0, compiler_options=options)),
        loss_and_grads=_with_rules(cfg, mesh, jax.jit(
            loss_and_grads, in_shardings=(param_shardings, batch_sharding), compiler_options=options)),
        eval_loss=_with_rules(cfg, mesh, jax.jit(
            eval_loss,
            in_shardings=(param_shardings, batch_sharding), out_shardings=replicated, compiler_options=options)),
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


# ============================================================================ the loop


def observers_for(cfg, run_dir: str, mesh, redis: str | None = None, job: str | None = None) -> Observers:
    """The observers this process runs for `cfg` (and, under a supervisor, for the Redis server
    `redis` and job id `job` it joined). Each capability adds its own line here."""
    return Observers(timings.observers(cfg, run_dir, mesh) + faults.from_env()
                     + heartbeat.observers(cfg, mesh, redis, job))


def train(cfg: Config, run_dir: str, train_batches: data.SequenceBatches,
          val_batches: data.SequenceBatches, redis: str | None = None, job: str | None = None) -> list[dict]:
    """Train `cfg.train.steps` steps; returns the metric records also written to metrics.jsonl.
    Under a supervisor, `redis` and `job` say where this process sends its heartbeats."""
    mesh = make_mesh(cfg.mesh)
    watch = observers_for(cfg, run_dir, mesh, redis, job)
    try:
        return _train_loop(cfg, run_dir, mesh, train_batches, val_batches, watch)
    except TrainingDiverged:
        watch.state("diverged", -1)  # the supervisor does not retry it on healthy devices
        raise
    except Interrupted as e:
        watch.state("interrupted", e.step)  # asked to stop: not a fault
        raise
    except BaseException:
        watch.state("failed", -1)
        raise
    finally:
        watch.close()


def _train_loop(cfg, run_dir, mesh, train_batches, val_batches, watch) -> list[dict]:
    from tqdm import tqdm

    watch.state("initialising", 0)
    t0 = time.perf_counter()
    clock = StartupClock()
    trainer = build_trainer(cfg, mesh)
    clock.lap("trainer")
    is_main = jax.process_index() == 0
    log = logger.info  # progress lines: rank 0's only (cli.setup_logging quiets the others)

    ckpt = checkpoint.Checkpointer(cfg, run_dirs.checkpoint_dir(cfg, run_dir), warn=logger.warning) \
        if cfg.checkpoint.every else None
    # The state's shapes from the optimizer's init alone: tracing the model again costs seconds.
    abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  jax.eval_shape(trainer.start_from, trainer.abstract_params),
                                  trainer.state_shardings)
    clock.lap("shapes")
    restored, to_canonical, from_snapshot = None, trainer.to_canonical, False
    if ckpt:
        ckpt.compile(abstract_state)  # before the restore, whose verification runs it
        if layout.permutes(cfg):  # compiled now: the first save's blocking time holds no compilation
            to_canonical = compile_cache.compile(trainer.to_canonical.lower(abstract_state), "to_canonical")
        clock.lap("checkpoint_compile")
    # With background_host_copy, snapshots copy on the device with the checkpointer's compiled
    # program (without checkpoints, the first snapshot compiles it).
    snapshots = snapshot.Snapshots(cfg, run_dirs.snapshot_dir(cfg, run_dir), warn=logger.warning,
                                   device_copy=ckpt.device_copy if ckpt else checkpoint.device_copy) \
        if cfg.checkpoint.memory_every else None
    if snapshots:  # newer than the newest checkpoint, or not used
        committed = run_dirs.committed_steps(ckpt.directory) if ckpt else []
        restored = snapshots.restore(abstract_state, newer_than=committed[-1] if committed else 0)
        from_snapshot = restored is not None
        clock.lap("snapshot_restore")
    if ckpt and not restored:
        restored = ckpt.restore_latest(abstract_state)
        clock.lap("restore")
    start = restored[1]["step"] if restored else 0  # steps done so far
    if snapshots:
        snapshots.discard_after(start)
    data_position = restored[1]["data_state"]["next_index"] if restored else 0
    if restored:  # a snapshot holds the stored (pipeline-ordered) state, a checkpoint the canonical
        state = restored[0] if from_snapshot else trainer.to_stored(restored[0])
    elif cfg.model.init_from:  # a new run from a Hugging Face model's weights, placed on this mesh
        weights = hf_import.load_params(cfg, trainer.abstract_params)
        state = trainer.start_from(jax.tree.map(
            lambda w, a: jax.make_array_from_callback(a.shape, a.sharding, lambda index: w[index]),
            weights, trainer.abstract_params))
        log(f"initialised from the Hugging Face model in {cfg.model.init_from}")
    else:  # through the cache: in a CPU job of several processes, process 0 compiles it for all
        state = compile_cache.compile(trainer.init.lower(), "init")()
    clock.lap("state")
    batches = data.Prefetcher(train_batches, trainer.batch_sharding, data_position, cfg.data.prefetch)
    first = batches.get()
    clock.lap("first_batch")
    watch.state("compiling", start)
    # Compile everything up front, so no step's time includes compilation.
    # Loaded without tracing on a restart (compile_cache.load_or_compile).
    config = cfg.to_dict()
    train_step = compile_cache.load_or_compile(
        "train_step", lambda: trainer.train_step.lower(state, first), config, (state, first))
    clock.lap("train_step")
    check_compiled_memory(cfg, train_step, state)
    profiler = device_profile.StepProfiler(train_step, run_dirs.profiles_dir(run_dir, jax.process_index()))
    eval_loss = compile_cache.load_or_compile(
        "eval_loss", lambda: trainer.eval_loss.lower(state.params, first), config, (state.params, first))
    clock.lap("eval_loss")
    resumed = f"resumed from {'memory snapshot' if from_snapshot else 'checkpoint'} step {start}; " if restored else ""
    log(f"mesh dp={cfg.mesh.dp} pp={cfg.mesh.pp} tp={cfg.mesh.tp} on {mesh.devices.size} "
        f"{jax.default_backend()} devices; {flops.param_count(cfg.model) / 1e6:.2f}M parameters; "
        f"{resumed}initialised and compiled in {time.perf_counter() - t0:.1f}s")
    if jax.process_index():  # every process's own breakdown, in its own log: where a restart waits
        print(clock.summary(), flush=True)
    else:
        log(clock.summary())

    def validation_loss(params) -> float:
        losses = [eval_loss(params, data.make_global_batch(val_batches, i, trainer.batch_sharding))
                  for i in range(cfg.train.eval_batches)]
        return float(jnp.mean(jnp.stack(losses)))

    if is_main:
        run_dirs.keep_records_up_to(run_dirs.metrics_path(run_dir), start)
    records: list[dict] = []
    # A progress bar on a terminal only: in a log file its redraws are noise (log lines remain).
    bar = tqdm(total=cfg.train.steps, initial=start, disable=not (is_main and sys.stderr.isatty()),
               unit="step", dynamic_ncols=True)
    last = cfg.train.steps
    hooks = Hooks(last)

    # ---- record hooks: each step's metrics, one step late
    def keep_record(record: dict) -> None:
        """metrics.jsonl and the progress bar."""
        records.append(record)
        if is_main:
            run_dirs.append_jsonl(run_dirs.metrics_path(run_dir), [record])
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")

    def log_record(record: dict) -> None:
        val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
        log(f"step {record['step']:5d} loss {record['loss']:.4f}{val} grad_norm {record['grad_norm']:.3f} "
            f"lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s")

    hooks.add_record("metrics", 1, keep_record)
    hooks.add_record("log", cfg.train.log_every, log_record)
    hooks.add_record("log evaluation", cfg.train.eval_every,  # evaluated steps between log lines
                     lambda r: None if itstime(r["step"], cfg.train.log_every, last) else log_record(r))
    recorder = MetricsRecorder(
        cfg.train.global_batch * cfg.model.seq_len,
        flops.mfu(1.0, cfg.model, mesh.devices.flat),  # MFU is linear in tokens/s: look peaks up once
        f"lower optim.lr (now {cfg.optim.lr}) or tighten optim.clip", watch, validation_loss, hooks.on_record)

    # ---- step hooks: what must see the step complete (each first records the step, `flush`)
    hooks.add("evaluate", cfg.train.eval_every, lambda step, state: recorder.flush(params=state.params))

    def start_trace(step: int) -> None:
        recorder.flush()  # a traced step runs alone: the one before it is finished first
        profiler.start(step)

    def stop_trace(step: int, state) -> None:
        try:
            recorder.flush()
        except BaseException:  # NonFiniteStep (the step is replayed, and traced again) or an error
            profiler.abandon()
            raise
        profiler.stop(step, watch)

    hooks.add("profile", cfg.observe.profile_every, stop_trace, before=start_trace, at_last=False)

    def log_saves(saves: list[dict]) -> None:
        """One line per finished save in checkpoints.jsonl: blocking vs total (until committed) seconds."""
        if is_main and saves:
            run_dirs.append_jsonl(run_dirs.saves_path(run_dir), saves)

    saved_step = None

    def save(step: int, state) -> None:
        nonlocal saved_step
        recorder.flush()  # a checkpoint is never newer than the metrics on disk
        watch.state("checkpointing", step)
        t_save = time.time()
        # The data position from the step, not the prefetcher's: a replay fetched ahead.
        log_saves(ckpt.save(step, to_canonical(state), {"next_index": data_position + step - start}))
        watch.phase(step, "checkpoint", t_save, time.time() - t_save)
        watch.state("training", step)
        saved_step = step
        # Like an evaluation, a save's blocking is not the next step's time: tokens/s and MFU stay
        # the training's, and ETTR (bench/ettr.py) counts the blocking as the overhead it is.
        recorder.restart_clock()

    if ckpt:
        hooks.add("checkpoint", cfg.checkpoint.every, save)

    def snapshot_to_memory(step: int, state) -> None:
        if step == saved_step:
            return  # just checkpointed
        recorder.flush()  # never a snapshot of a step whose loss was not seen finite
        wall = time.time()
        block_s = snapshots.save(step, state, data_position + step - start)
        watch.phase(step, "snapshot", wall, block_s)
        if is_main:
            run_dirs.append_jsonl(run_dirs.snapshots_path(run_dir), [{"step": step, "block_s": round(block_s, 4)}])
        recorder.restart_clock()  # like a save's blocking: not the next step's time

    if snapshots:
        hooks.add("memory snapshot", cfg.checkpoint.memory_every, snapshot_to_memory, at_last=False)

    stop = StopRequest(mesh)  # SIGINT/SIGTERM: finish the step in flight, checkpoint it, exit
    watch.state("training", start)
    recorder.restart_clock()
    triage = NonFiniteTriage(watch, device_self_test, logger.warning)
    hooks.add_record("nan triage", 1, triage.on_record)
    inject = faults.batch_fault_from_env(cfg.model.vocab)  # drills only: a one-off non-finite value on one process
    kept = {start + 1: first}  # batches of the steps not recorded yet: a replay runs them again
    step = start
    try:
        while step < last:
            step += 1
            try:
                # ---- data
                t_data, wall_data = time.perf_counter(), time.time()
                batch = kept[step] if step in kept else batches.get()
                kept[step] = batch
                data_wait = time.perf_counter() - t_data
                watch.phase(step, "data_wait", wall_data, data_wait)
                watch.before_step(step)
                hooks.before_step(step)
                # ---- step (arrival is marked before the call: a dispatch can block, and one stuck
                # behind a hung peer must still count as arrived)
                wall_dispatch, t_dispatch = time.time(), time.perf_counter()
                watch.phase(step, "dispatch", wall_dispatch, 0.0)
                state, metrics = train_step(state, inject(step, batch))
                watch.phase(step, "dispatch", wall_dispatch, time.perf_counter() - t_dispatch)
                stop_signal = stop.after_dispatch() if step < last else 0
                recorder.push(step, metrics, data_wait)  # records the step before this one
                kept = {s: b for s, b in kept.items() if s >= step}
                # ---- evaluation, profile, checkpoint: on their cadence
                hooks.after_step(step, state)
                # ---- interrupted: checkpoint this step (if its hook did not), wait for the commit, stop
                if stop_signal:
                    recorder.flush()
                    saved = False
                    if ckpt:
                        if saved_step != step:
                            save(step, state)
                        log_saves(ckpt.poll(wait=True))  # until committed: the message promises it
                        saved = step in run_dirs.committed_steps(ckpt.directory)
                    if saved and snapshots:
                        snapshots.remove_all()
                    raise Interrupted(step, stop_signal, saved)
                if ckpt:
                    log_saves(ckpt.poll())
            except NonFiniteStep as e:
                # ---- a non-finite step: the state is still the one before it; run it again, once
                step = triage.replay_from(e)
                state = release(state, step, trainer.state_shardings.step)
    finally:
        stop.close()
        bar.close()
        batches.close()
        if ckpt:
            log_saves(ckpt.close())
    if snapshots:
        snapshots.remove_all()  # the final state is in the last checkpoint, or nowhere by request
    watch.state("done", cfg.train.steps)
    log(run_summary(records, start, time.perf_counter() - t0))
    return records


class StartupClock:
    """Seconds spent in each phase of a start or restart, in order, for the log."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = now - self._last
        self._last = now

    def summary(self) -> str:
        return "start-up phases: " + ", ".join(f"{phase} {s:.2f}s" for phase, s in self.laps.items())


def run_summary(records: list[dict], start: int, wall_s: float) -> str:
    """The one line every run ends with: steps, wall time, final losses, mean throughput."""
    if not records:
        return f"nothing to train: already at step {start}"
    val = [r["val_loss"] for r in records if "val_loss" in r]
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in records)
    return (f"done: steps {start + 1}-{records[-1]['step']} in {wall_s:.1f}s; final loss {records[-1]['loss']:.4f}"
            + (f", val_loss {val[-1]:.4f}" if val else "")
            + f"; mean {tokens / sum(r['step_time_s'] for r in records):.0f} tokens/s")


# ============================================================================ command line


def check_memory(cfg: Config) -> None:
    """The memory estimate against what this process's devices have, before anything compiles."""
    device = jax.local_devices()[0]
    if device.platform == "cpu":  # simulated devices share this host's RAM
        import psutil

        local = cfg.mesh.cpu_devices_per_process(jax.process_count())
        flops.check_fits(cfg, psutil.virtual_memory().available, local, "available RAM on this host")
    else:
        limit = (device.memory_stats() or {}).get("bytes_limit")
        flops.check_fits(cfg, limit, 1, f"one {device.device_kind}")


def check_compiled_memory(cfg: Config, compiled, state) -> None:
    """XLA's own buffer assignment for the compiled step against the accelerator's memory: the
    pre-flight check that is exact where `check_memory`'s estimate is not (on an H200 the step
    peaked at 1.3-1.7x the estimate, and steps the estimate passed died of RESOURCE_EXHAUSTED).
    Refuses before the first step; CPU devices share the host's RAM and keep the estimate alone."""
    device = jax.local_devices()[0]
    if device.platform == "cpu" or not cfg.train.memory_check:
        return
    limit = (device.memory_stats() or {}).get("bytes_limit")
    copy = sum(s.data.nbytes for leaf in jax.tree.leaves(state) for s in leaf.addressable_shards
               if s.device == device) if cfg.checkpoint.background_host_copy else 0
    flops.check_compiled_fits(compiled.memory_analysis(), limit, f"one {device.device_kind}", copy)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m megascale_jax.train", description=__doc__.splitlines()[0],
        epilog="Config keys: sections mesh, model, parallel, optim, train, data, checkpoint, supervisor, observe; "
               "every key is documented in megascale_jax/config.py (and README.md, 'Configuring a run'). "
               "--print-config shows them all with their resolved values.")
    parser.add_argument("--config", default=None, help="YAML config (default: configs/tiny_cpu.yaml)")
    parser.add_argument("--run-dir", default=None, help="output directory (default: runs/<config>-<time>)")
    parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0, for multi-host runs")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=None,
                        help="this process's rank (default 0; with --redis: handed out in order of arrival)")
    parser.add_argument("--redis", default=None, metavar="redis://HOST:PORT",
                        help="rendezvous through Redis (rank, coordinator, barriers) instead of --coordinator, "
                             "and send heartbeats to the supervisor there")
    parser.add_argument("--job", default=None,
                        help="job id shared by the workers of one launch (default: $MEGASCALE_JOB, else "
                             "slurm-$SLURM_JOB_ID-$SLURM_RESTART_COUNT, $JOBSET_NAME-$JOBSET_RESTART_ATTEMPT "
                             "or 'default')")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (the YAML a run writes to RUN_DIR/config.yaml) and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. mesh.dp=2 train.steps=20")
    return cli.parse(parser, argv)


def warn_if_the_schedule_changes(cfg: Config, run_dir: str, resume_step: int) -> None:
    """The learning rate decays over `train.steps`: continuing a run with another value (raised to
    train longer) bends the schedule from some step on. Said in one line, not done silently."""
    try:
        with open(run_dirs.config_path(run_dir)) as f:
            before = int(yaml.safe_load(f)["train"]["steps"])
    except (OSError, TypeError, KeyError, ValueError, yaml.YAMLError):
        return  # no readable earlier config: nothing to compare with
    counts = jnp.arange(resume_step, cfg.train.steps)  # the updates still to come: count n makes step n + 1
    planned, now = (learning_rate_schedule(cfg.optim, total)(counts) for total in (before, cfg.train.steps))
    differ = np.flatnonzero(~np.isclose(np.asarray(planned), np.asarray(now), rtol=1e-6, atol=0))
    if before != cfg.train.steps and differ.size:  # not while both are still warming up
        i = int(differ[0])
        logger.warning(f"train.steps {before} -> {cfg.train.steps}: the learning-rate schedule decays over "
                       f"train.steps, so it changes from step {resume_step + i + 1} on (lr {float(now[i]):.2e} "
                       f"there, {float(planned[i]):.2e} as planned)")


def prepare_run_dir(run_dir: str | None, cfg: Config, config_path: str | None
                    ) -> tuple[str, run_dirs.RunDirLock | None]:
    """The run directory, locked for this run (None: a launcher holds the lock for its workers),
    checked for a run it could not continue, with the resolved config written into it."""
    run_dir = run_dir or run_dirs.default_run_dir(config_path)
    lock = None
    if not run_dirs.held_for_us(run_dir):
        try:
            lock = run_dirs.RunDirLock(run_dir).acquire()
        except run_dirs.RunDirInUse as e:
            raise ConfigError(str(e)) from None
        except OSError as e:
            raise ConfigError(f"cannot write --run-dir {run_dir!r}: {e.strerror}; pass a writable directory")
    try:
        if os.path.exists(run_dirs.metrics_path(run_dir)):
            # A run directory with checkpoints is resumed (train() restores the newest good one).
            steps = run_dirs.committed_steps(run_dirs.checkpoint_dir(cfg, run_dir))
            held = cfg.checkpoint.memory_every and run_dirs.snapshot_steps(run_dirs.snapshot_dir(cfg, run_dir))
            if not (steps or held):
                raise ConfigError(f"--run-dir {run_dir!r} already holds a run (metrics.jsonl) but no checkpoint "
                                  "to resume from; pass a new --run-dir")
            if steps and steps[-1] >= cfg.train.steps:
                raise ConfigError(f"--run-dir {run_dir!r} already holds a finished run (checkpoint at step "
                                  f"{steps[-1]}, train.steps={cfg.train.steps}); raise train.steps to continue "
                                  "it or pass a new --run-dir")
            if steps:
                warn_if_the_schedule_changes(cfg, run_dir, steps[-1])
        try:
            os.makedirs(run_dir, exist_ok=True)
            save_config(cfg, run_dirs.config_path(run_dir))
            if cfg.data.source == "tokens":  # which tokenizer the token ids mean, when it is known
                tokenizer.record_in_run_dir(cfg.data.path, run_dir)
        except OSError as e:
            raise ConfigError(f"cannot write --run-dir {run_dir!r}: {e.strerror}; pass a writable directory")
    except ConfigError:
        if lock:
            lock.release()  # refused: nothing of ours stays behind
        raise
    return run_dir, lock


def warm_up() -> None:
    """What main() imports only once it runs, imported ahead by a warm standby worker
    (cluster/standby.py), so that a restart pays for neither."""
    timings.summary_writer_class()


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the loop's own handler (training/interrupt.py) is in place
        logger.warning("interrupted during start-up, before the first step; nothing new was saved")
        return 128 + signal.SIGINT


def _main(argv) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:  # validated, nothing started
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        if cfg.parallel.tp_overlap == "xla":  # must be set before the backend starts; ignored off-GPU
            os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *XLA_OVERLAP_FLAGS]).strip()
        try:
            use_cpu_devices(cfg.mesh.cpu_devices_per_process(args.num_processes))
        except RuntimeError:
            pass  # backend already started (called in-process); check_runtime reports a mismatch
        coordinator, process_id, job = args.coordinator, args.process_id or 0, None
        if args.redis:
            job = args.job or rendezvous.job_id_from_env()
            member = rendezvous.join(args.redis, job, args.num_processes, args.process_id)
            coordinator, process_id = member.coordinator, member.rank
        if coordinator:
            rendezvous.start_distributed(coordinator, args.num_processes, process_id)
        cli.setup_logging(jax.process_index(), jax.process_count(), quiet=jax.process_index() != 0)
        check_runtime(cfg, jax.default_backend(), jax.device_count(), jax.process_count())
        check_forced_cpu_devices(jax.default_backend(), cfg.mesh.cpu_devices_per_process(args.num_processes),
                                 os.environ.get("XLA_FLAGS", ""))
        resuming = args.run_dir and run_dirs.committed_steps(run_dirs.checkpoint_dir(cfg, args.run_dir))
        if cfg.model.init_from and not resuming:  # a resumed run's weights are in its checkpoint
            hf_import.check(cfg)
        check_memory(cfg)
        corpus = data.load_corpus(cfg)
        # Built here so that too little data is a one-line error before anything compiles.
        train_batches = data.SequenceBatches.from_config(cfg, corpus.tokens, "train")
        val_batches = data.SequenceBatches.from_config(cfg, corpus.tokens, "val")
        epochs = cfg.train.steps * cfg.train.global_batch / train_batches.n_train
        logger.info(f"data: {corpus.description}; {train_batches.n_train:,} training sequences of "
                    f"{cfg.model.seq_len} tokens; {cfg.train.steps:,} steps of {cfg.train.global_batch} "
                    f"sequences are {epochs:.3g} epochs")
        run_dir, lock = args.run_dir, None
        if jax.process_index() == 0:
            run_dir, lock = prepare_run_dir(args.run_dir, cfg, args.config)
    except (ConfigError, data.DataError, rendezvous.RendezvousError) as e:
        return cli.user_error(e)
    try:
        with compile_cache.use(run_dir, cfg.train.compile_cache) as cache:  # before anything compiles
            train(cfg, run_dir, train_batches, val_batches, args.redis, job)
        if cache:  # every process's own count, in its own log (ranks > 0 log warnings only)
            logger.info(cache.summary()) if jax.process_index() == 0 else print(cache.summary(), flush=True)
    except ConfigError as e:  # checkpoint.dir unwritable, or a checkpoint of another model shape
        return cli.user_error(e)
    except TrainingDiverged as e:
        return cli.user_error(e, code=3)
    except checkpoint.CheckpointUnreadable as e:  # a fault like a crash: the restart falls back
        return cli.user_error(e, code=1)
    except Interrupted as e:
        if jax.process_index() == 0:
            resume = cli.resume_command("megascale_jax.train", sys.argv[1:] if argv is None else list(argv),
                                        args.run_dir, run_dir)
            logger.warning(cli.interrupted(e.step if e.saved else None, resume))
        return e.exit_code
    finally:
        if lock:
            lock.release()
    logger.info(f"run directory: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
