"""`python -m megascale_jax.train [--config YAML] [--run-dir DIR] [section.key=value ...]`

The whole training run, top to bottom: validate the config and the data (nothing is compiled
before both pass), build the (dp, pp, tp) mesh and the trainer (training/trainer.py), choose
where to start (training/resume.py), compile the steps, then loop — data, step, log, evaluate,
checkpoint, interrupt — writing `RUN_DIR/config.yaml` and one `metrics.jsonl` record per step.
Each part lives with its owner under `training/`; this module composes them and holds the CLI.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time

from megascale_jax import cli

# Ctrl-C from here to the loop's own handler (training/interrupt.py): one line, exit 130, at once
# (the imports below take seconds, and JAX and XLA can hold a KeyboardInterrupt back).
STARTUP_LINE = "interrupted during start-up, before the first step; nothing new was saved"
if __name__ == "__main__":
    startup_interrupt = cli.StartupInterrupt(STARTUP_LINE)
    startup_interrupt.install()

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from megascale_jax import run_dir as run_dirs
from megascale_jax.cluster import faults, heartbeat, rendezvous
from megascale_jax.cluster.self_test import device_self_test
from megascale_jax.config import (Config, ConfigError, check_process_count, check_runtime, from_dict, load_config,
                                  save_config, with_device_defaults)
from megascale_jax.interop import hf_import
from megascale_jax.model import flops
from megascale_jax.observe import device_profile, timings
from megascale_jax.parallel.mesh import check_forced_cpu_devices, make_mesh, use_cpu_devices
from megascale_jax.parallel.tensor_parallel import XLA_OVERLAP_FLAGS
from megascale_jax.training import (checkpoint, compile_cache, data, downstream, mixture, progress, sample_at_end,
                                    streaming, tokenizer)
from megascale_jax.training.hooks import Hooks
from megascale_jax.training.interrupt import Interrupted, StopRequest
from megascale_jax.training.metrics import MetricsRecorder, NonFiniteStep, TrainingDiverged, itstime
from megascale_jax.training.observers import Observers
from megascale_jax.training.optim import learning_rate_schedule
from megascale_jax.training.resume import choose_start
from megascale_jax.training.saving import FinalSaveFailed, Saves
from megascale_jax.training.trainer import build_trainer, compile_steps, device_copy_cap
from megascale_jax.training.triage import NonFiniteTriage, release

logger = cli.get_logger("train")


# ============================================================================ the loop


def observers_for(cfg, run_dir: str, mesh, redis: str | None = None, job: str | None = None) -> Observers:
    """The observers this process runs for `cfg` (and, under a supervisor, for the Redis server
    `redis` and job id `job` it joined). Each capability adds its own line here."""
    return Observers(timings.observers(cfg, run_dir, mesh, logger.warning) + faults.from_env()
                     + heartbeat.observers(cfg, mesh, redis, job))


def train(cfg: Config, run_dir: str, train_batches: data.SequenceBatches | mixture.MixedBatches,
          val_batches: data.SequenceBatches | mixture.MixedBatches, redis: str | None = None, job: str | None = None,
          resume_step: int | None = None, tasks: list = (), clock: progress.StartupClock | None = None) -> list[dict]:
    """Train `cfg.train.steps` steps; returns the metric records also written to metrics.jsonl.
    Under a supervisor, `redis` and `job` say where this process sends its heartbeats; with
    `resume_step` no saved state newer than that step is restored; `tasks` (downstream.prepare):
    the downstream tasks scored at train.eval_tasks_every; `clock`: the start-up's phases so far."""
    clock = clock or progress.StartupClock()
    mesh = make_mesh(cfg.mesh)
    watch = observers_for(cfg, run_dir, mesh, redis, job)
    clock.lap("mesh")
    try:
        return _train_loop(cfg, run_dir, mesh, train_batches, val_batches, watch, resume_step, tasks, clock)
    except TrainingDiverged as e:
        watch.state("diverged", -1, cli.error_line(e))  # the supervisor does not retry it on healthy devices
        raise
    except checkpoint.CheckpointUnreadable as e:  # said before the exit (4), which may wait on JAX's shutdown
        watch.state("unreadable_checkpoint", -1, cli.error_line(e))
        raise
    except Interrupted as e:
        watch.state("interrupted", e.step)  # asked to stop: not a fault
        raise
    except BaseException:
        watch.state("failed", -1)
        raise
    finally:
        watch.close()


def _train_loop(cfg, run_dir, mesh, train_batches, val_batches, watch, resume_step, tasks, clock) -> list[dict]:
    # ---- start: the trainer, where it starts from, the first batch, the compiled steps
    watch.state("initialising", 0)
    t0 = time.perf_counter()
    trainer = build_trainer(cfg, mesh)
    clock.lap("trainer")
    # The state's shapes from the optimizer's init alone: tracing the model again costs seconds.
    abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  jax.eval_shape(trainer.start_from, trainer.abstract_params),
                                  trainer.state_shardings)
    clock.lap("shapes")
    saves = Saves(cfg, run_dir, trainer.to_canonical, abstract_state, logger.warning, clock)
    hf_weights = (lambda: hf_import.load_params(cfg, trainer.abstract_params)) if cfg.model.init_from else None
    start = choose_start(trainer, saves, abstract_state, clock, hf_weights, up_to=resume_step)
    for damaged in saves.damaged_checkpoints():  # gone past in this attempt: the supervisor's verdict
        watch.event("damaged_checkpoint", **damaged)
    state, last = start.state, cfg.train.steps
    feed = data.Feed(data.Prefetcher(train_batches, trainer.batch_sharding, start.data_position, cfg.data.prefetch),
                     start.step, watch)
    clock.lap("first_batch")
    watch.state("compiling", start.step)
    train_step, eval_loss = compile_steps(cfg, trainer, state, feed.first, clock)
    saves.cap_device_copy(device_copy_cap(cfg, train_step, state), abstract_state)
    log_start(cfg, mesh, start, time.perf_counter() - t0, clock)

    # ---- what runs around the step, each part on its cadence (training/hooks.py)
    hooks = Hooks(last)
    shown = progress.Progress(run_dir, start.step, last, jax.process_index() == 0, logger.info, logger.warning)
    shown.add_hooks(hooks, cfg.train.log_every, cfg.train.eval_every)
    recorder = MetricsRecorder(
        cfg.train.global_batch * cfg.model.seq_len,
        flops.mfu(1.0, cfg.model, mesh.devices.flat),  # MFU is linear in tokens/s: look peaks up once
        f"lower optim.lr (now {cfg.optim.lr}) or tighten optim.clip", watch,
        validation_loss(cfg, eval_loss, val_batches, trainer.batch_sharding), hooks.on_record,
        describe_data=train_batches.record_fields)  # a mixture's realised proportions
    add_evaluations(hooks, cfg, recorder, eval_loss is not None,
                    downstream.Downstream(cfg, tasks, trainer.score_rows, trainer.batch_sharding) if tasks else None)
    add_profiling(hooks, cfg, run_dir, train_step, recorder, watch)
    saves.begin(start.step, last, start.data_position, recorder, watch)
    saves.add_hooks(hooks)
    triage = NonFiniteTriage(watch, device_self_test, logger.warning)
    hooks.add_record("nan triage", 1, triage.on_record)
    inject = faults.batch_fault_from_env(cfg.model.vocab)  # drills only: a one-off non-finite value on one process
    stop = StopRequest(mesh)  # SIGINT/SIGTERM: finish the step in flight, checkpoint it, exit

    watch.state("training", start.step)
    recorder.restart_clock()
    step = start.step
    try:
        while step < last:
            step += 1
            try:
                batch = feed.batch(step)  # ---- data
                watch.before_step(step)
                hooks.before_step(step)
                state, metrics = dispatch(train_step, step, state, inject(step, batch), watch)  # ---- step
                stop_signal = stop.after_dispatch() if step < last else 0
                recorder.push(step, metrics, feed.wait_s)  # ---- log: records the step before this one
                feed.recorded_before(step)
                hooks.after_step(step, state)  # ---- evaluate, profile, checkpoint, snapshot
                if stop_signal:  # ---- interrupted: checkpoint this step, wait for the commit, stop
                    recorder.flush()
                    raise Interrupted(step, stop_signal, saves.for_interrupt(step, state))
                saves.poll()
            except NonFiniteStep as e:  # the state is still the one before it: run it again, once
                step = triage.replay_from(e)
                state = release(state, step, trainer.state_shardings.step)
    finally:
        stop.close()
        shown.close()
        feed.close()
        saves.close()
    saves.finished()
    watch.state("done", last)
    logger.info(progress.run_summary(shown.records, start.step, time.perf_counter() - t0, recorder.tokens_per_step))
    if cfg.train.sample_at_end:  # a few lines the trained model writes: what the loss means
        logger.info(sample_at_end.sample_text(cfg, run_dir, trainer, state))
    return shown.records


def dispatch(train_step, step: int, state, batch, watch):
    """Runs the step (asynchronously). Its arrival is marked before the call: a dispatch can
    block, and one stuck behind a hung peer must still count as arrived."""
    wall, t = time.time(), time.perf_counter()
    watch.phase(step, "dispatch", wall, 0.0)
    state, metrics = train_step(state, batch)
    watch.phase(step, "dispatch", wall, time.perf_counter() - t)
    return state, metrics


def validation_loss(cfg: Config, eval_loss, val_batches: data.SequenceBatches, batch_sharding):
    """params -> the mean loss over `train.eval_batches` validation batches (the same ones each time)."""
    def evaluate(params) -> float:
        losses = [eval_loss(params, data.make_global_batch(val_batches, i, batch_sharding))
                  for i in range(cfg.train.eval_batches)]
        return float(jnp.mean(jnp.stack(losses)))
    return evaluate


def add_evaluations(hooks: Hooks, cfg: Config, recorder, validates: bool, scored) -> None:
    """The validation loss every `train.eval_every` steps and the downstream tasks (`scored`) every
    `train.eval_tasks_every`, each also at the last step: one hook at the steps either is due,
    which records the step with what is due (with train.eval_batches=0 the same steps are
    recorded, without a validation loss)."""
    every, tasks_every, last = cfg.train.eval_every, cfg.train.eval_tasks_every, hooks.last

    def evaluate(step: int, state) -> None:
        val, tasks = itstime(step, every, last), scored is not None and itstime(step, tasks_every, last)
        if not (val or tasks):  # a step of the two cadences' common divisor that neither is due at
            return

        def fields(params) -> dict:
            found = {"val_loss": recorder.evaluate(params)} if val and validates else {}
            return {**found, **(scored.scores(params) if tasks else {})}

        recorder.flush(params=state.params if (val and validates) or tasks else None, evaluate=fields)

    hooks.add("evaluate", math.gcd(every, tasks_every) if scored is not None else every, evaluate)


def add_profiling(hooks: Hooks, cfg: Config, run_dir: str, train_step, recorder, watch) -> None:
    """Every `observe.profile_every` steps, one step traced alone: the step before it is recorded
    first, and a traced step that turns out non-finite is abandoned (it is replayed, and traced again)."""
    profiler = device_profile.StepProfiler(train_step, run_dirs.profiles_dir(run_dir, jax.process_index()))

    def start_trace(step: int) -> None:
        recorder.flush()
        profiler.start(step)

    def stop_trace(step: int, state) -> None:
        try:
            recorder.flush()
        except BaseException:
            profiler.abandon()
            raise
        profiler.stop(step, watch)

    hooks.add("profile", cfg.observe.profile_every, stop_trace, before=start_trace, at_last=False)


def log_start(cfg: Config, mesh, start, seconds: float, clock) -> None:
    resumed = f"resumed from {start.source} step {start.step}; " if start.resumed else ""
    if start.source == "Hugging Face model":
        logger.info(f"initialised from the Hugging Face model in {cfg.model.init_from}")
    cp = f" cp={cfg.mesh.cp}" if cfg.mesh.cp > 1 else ""
    logger.info(f"mesh dp={cfg.mesh.dp} pp={cfg.mesh.pp}{cp} tp={cfg.mesh.tp} on {mesh.devices.size} "
                f"{jax.default_backend()} devices; {flops.param_count(cfg.model) / 1e6:.2f}M parameters; "
                f"{resumed}initialised and compiled in {seconds:.1f}s")
    if jax.process_index():  # every process's own breakdown, in its own log: where a restart waits
        print(clock.summary(), flush=True)
    else:
        logger.info(clock.summary())


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


def parse_args(argv):
    parser = cli.ArgumentParser(
        prog="python -m megascale_jax.train", description=__doc__.splitlines()[0],
        epilog="Config keys: sections mesh, model, parallel, optim, train, data, checkpoint, supervisor, observe; "
               "every key is documented in megascale_jax/config.py (and docs/configuring.md). "
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
    parser.add_argument("--resume-step", type=int, default=None, metavar="N",
                        help="continue the run from its committed checkpoint of step N, older than its newest; the "
                             "newer checkpoints are set aside (renamed STEP.set-aside), not deleted")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (the YAML a run writes to RUN_DIR/config.yaml) and exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. mesh.dp=2 train.steps=20")
    return cli.parse(parser, argv)


def warn_if_the_schedule_changes(cfg: Config, run_dir: str, resume_step: int) -> None:
    """A resumed run keeps the learning-rate schedule it started with unless the config given now
    changes it: `train.steps` (the schedule decays over it: raised to train longer, it bends from
    some step on) or any `optim` setting of the schedule (its kind, peak, warm-up, decay). Said in
    one line naming what changed and from which step, not done silently."""
    try:
        with open(run_dirs.config_path(run_dir)) as f:
            earlier = from_dict(yaml.safe_load(f))
    except (OSError, TypeError, KeyError, ValueError, AttributeError, yaml.YAMLError, ConfigError):
        return  # no readable earlier config: nothing to compare with
    if (earlier.train.steps, earlier.optim) == (cfg.train.steps, cfg.optim):
        return  # the same schedule: every restart of a supervised job, which must not pay for the jax ops below
    counts = jnp.arange(resume_step, cfg.train.steps)  # the updates still to come: count n makes step n + 1
    planned = learning_rate_schedule(earlier.optim, earlier.train.steps)(counts)
    now = learning_rate_schedule(cfg.optim, cfg.train.steps)(counts)
    differ = np.flatnonzero(~np.isclose(np.asarray(planned), np.asarray(now), rtol=1e-6, atol=0))
    if differ.size:  # not while both are still warming up
        i = int(differ[0])
        changed = [f"train.steps {earlier.train.steps} -> {cfg.train.steps}"] if earlier.train.steps != cfg.train.steps else []
        changed += [f"optim.{f.name} {getattr(earlier.optim, f.name)} -> {getattr(cfg.optim, f.name)}"
                    for f in dataclasses.fields(cfg.optim) if getattr(earlier.optim, f.name) != getattr(cfg.optim, f.name)]
        logger.warning(f"{', '.join(changed)}: the learning-rate schedule this run started with changes from step "
                       f"{resume_step + i + 1} on (lr {float(now[i]):.2e} there, {float(planned[i]):.2e} as planned)")


def prepare_run_dir(run_dir: str | None, cfg: Config, config_path: str | None, resume_step: int | None = None
                    ) -> tuple[str, run_dirs.RunDirLock | None]:
    """The run directory, locked for this run (None: a launcher holds the lock for its workers),
    checked for a run it could not continue, with the resolved config written into it. With
    `resume_step` (--resume-step) the checkpoints newer than it are set aside once every check
    has passed."""
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
        newer = []
        if resume_step is not None:
            committed = run_dirs.committed_steps(run_dirs.checkpoint_dir(cfg, run_dir))
            if resume_step not in committed:
                raise ConfigError(f"--resume-step {resume_step}: {run_dir!r} has no committed checkpoint of that step "
                                  f"(committed: {', '.join(map(str, committed)) or 'none'})")
            newer = [s for s in committed if s > resume_step]
        if os.path.exists(run_dirs.metrics_path(run_dir)):
            # A run directory with checkpoints is resumed (train() restores the newest good one).
            steps = [s for s in run_dirs.committed_steps(run_dirs.checkpoint_dir(cfg, run_dir))
                     if resume_step is None or s <= resume_step]
            held = cfg.checkpoint.memory_every and run_dirs.recoverable_snapshot_steps(run_dirs.snapshot_dir(cfg, run_dir))
            if not (steps or held):
                raise ConfigError(f"--run-dir {run_dir!r} already holds a run (metrics.jsonl) but no checkpoint "
                                  "to resume from; pass a new --run-dir")
            if steps and steps[-1] >= cfg.train.steps:
                raise ConfigError(f"--run-dir {run_dir!r} already holds a finished run (checkpoint at step "
                                  f"{steps[-1]}, train.steps={cfg.train.steps}); raise train.steps to continue "
                                  "it or pass a new --run-dir")
            if steps:
                # A config the newest checkpoint cannot continue is refused here, before config.yaml
                # is rewritten: a refusal leaves the run directory as it was (sample and export_hf
                # read the model's shape from that file).
                directory = run_dirs.checkpoint_dir(cfg, run_dir)
                if (saved := checkpoint.saved_config(directory, steps[-1])) is not None:
                    checkpoint.check_compatible(saved, cfg, steps[-1], directory)
                warn_if_the_schedule_changes(cfg, run_dir, steps[-1])
        try:
            for step in newer:  # every check passed: kept, under a name no resume reads
                where = os.path.join(run_dirs.checkpoint_dir(cfg, run_dir), str(step))
                aside = run_dirs.unused_name(where + ".set-aside")
                os.rename(where, aside)
                logger.info(f"--resume-step {resume_step}: checkpoint step {step} set aside as {aside}")
            os.makedirs(run_dir, exist_ok=True)
            save_config(cfg, run_dirs.config_path(run_dir))
            if cfg.data.source == "tokens":  # which tokenizer the token ids mean, when it is known
                # (a mixture's sources are in one tokenizer's ids: the first says which)
                tokenizer.record_in_run_dir(next(iter(cfg.data.mix)) if cfg.data.mix else cfg.data.path, run_dir)
        except OSError as e:
            raise ConfigError(f"cannot write --run-dir {run_dir!r}: {e.strerror}; pass a writable directory")
    except ConfigError:
        if lock:
            lock.release(undo=True)  # refused: nothing of ours stays behind, not even the lock file
        raise
    return run_dir, lock


def load_data(cfg: Config, run_dir: str | None) -> tuple:
    """(cfg, the corpus, the train and validation batches) of the run's data source; cfg with
    what the data decides (a streamed corpus's readers: recorded in config.yaml)."""
    if cfg.data.mix:  # several sources, each batch drawn from them by weight
        mixed = mixture.load(cfg)
        logger.info(f"data: a mixture of {len(cfg.data.mix)} sources: {mixed.description}")
        return cfg, mixed.corpus, mixed.train, mixed.val
    if cfg.data.stream:  # tokenized while training
        streamed = streaming.load(cfg, run_dir, jax.process_count())
        logger.info(f"data: {streamed.description}; {cfg.train.steps:,} steps of {cfg.train.global_batch} sequences")
        return streamed.cfg, streamed.corpus, streamed.train, streamed.val
    corpus = data.load_corpus(cfg)
    train_batches = data.SequenceBatches.from_config(cfg, corpus.tokens, "train")
    val_batches = data.SequenceBatches.from_config(cfg, corpus.tokens, "val")
    epochs = cfg.train.steps * cfg.train.global_batch / train_batches.n_train
    logger.info(f"data: {corpus.description}; {train_batches.n_train:,} training sequences of "
                f"{cfg.model.seq_len} tokens; {cfg.train.steps:,} steps of {cfg.train.global_batch} "
                f"sequences are {epochs:.3g} epochs")
    return cfg, corpus, train_batches, val_batches


def warm_up() -> None:
    """What main() imports only once it runs, imported ahead by a warm standby worker
    (cluster/standby.py), so that a restart pays for none of it. A standby always joins through
    Redis, which a trainer without --redis never imports: 0.13 s alone, ~0.25 s of every restarted
    worker's rendezvous with four processes starting on two cores (the `join` start-up phase)."""
    timings.tensorboard_writing()
    import redis  # noqa: F401
    import redis.backoff, redis.retry  # noqa: F401,E401 — redis_auth's check that the server is closed


def main(argv=None) -> int:
    if __name__ == "__main__":
        startup_interrupt.raise_from_here()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the loop's own handler (training/interrupt.py) is in place
        logger.warning(STARTUP_LINE)
        if __name__ == "__main__":
            startup_interrupt.reported()
        return 128 + signal.SIGINT


def _main(argv) -> int:
    args = parse_args(argv)
    clock = progress.StartupClock()  # every phase of a start, the log's "start-up phases" line
    try:
        cfg = load_config(args.config, args.overrides)
        # A task count the mesh cannot be split over: one line before JAX or the rendezvous starts
        # (with --print-config too, which is how configs/cluster/sbatch.sh checks it once per job).
        check_process_count(cfg.mesh, args.num_processes, os.environ.get("JAX_PLATFORMS"))
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
        clock.lap("config")
        if args.redis:
            job = args.job or rendezvous.job_id_from_env()
            member = rendezvous.join(args.redis, job, args.num_processes, args.process_id)
            coordinator, process_id = member.coordinator, member.rank
            clock.lap("join")
        if coordinator:
            rendezvous.start_distributed(coordinator, args.num_processes, process_id)
            clock.lap("distributed")
        cli.setup_logging(jax.process_index(), jax.process_count(), quiet=jax.process_index() != 0)
        check_runtime(cfg, jax.default_backend(), jax.device_count(), jax.process_count())
        clock.lap("backend")
        check_forced_cpu_devices(jax.default_backend(), cfg.mesh.cpu_devices_per_process(args.num_processes),
                                 os.environ.get("XLA_FLAGS", ""))
        cfg = with_device_defaults(cfg, jax.default_backend())  # written so to the run directory
        resuming = args.run_dir and run_dirs.committed_steps(run_dirs.checkpoint_dir(cfg, args.run_dir))
        if cfg.model.init_from and not resuming:  # a resumed run's weights are in its checkpoint
            hf_import.check(cfg)
        check_memory(cfg)
        # Built here so that too little data is a one-line error before anything compiles.
        cfg, corpus, train_batches, val_batches = load_data(cfg, args.run_dir)
        # jsonl/parquet: attention inside each document (every layout keeps documents apart)
        cfg = data.with_documents_apart(cfg, corpus)
        tasks = downstream.prepare(cfg, corpus.token_file)  # train.eval_tasks, tokenized before anything compiles
        run_dir, lock = args.run_dir, None
        if jax.process_index() == 0:
            run_dir, lock = prepare_run_dir(args.run_dir, cfg, args.config, args.resume_step)
            if corpus.token_file:  # data.source=jsonl|parquet: which tokenizer the ids mean
                tokenizer.record_in_run_dir(corpus.token_file, run_dir)
        clock.lap("data")
    except (ConfigError, data.DataError, rendezvous.RendezvousError) as e:
        return cli.user_error(e)
    try:
        with compile_cache.use(run_dir, cfg.train.compile_cache) as cache:  # before anything compiles
            train(cfg, run_dir, train_batches, val_batches, args.redis, job, args.resume_step, tasks, clock)
        if cache:  # every process's own count, in its own log (ranks > 0 log warnings only)
            logger.info(cache.summary()) if jax.process_index() == 0 else print(cache.summary(), flush=True)
    except (ConfigError, data.DataError) as e:  # checkpoint.dir unwritable, a checkpoint of another model
        return cli.user_error(e)  # shape; a bad shard a streamed corpus reaches (data.stop_at_bad_line)
    except TrainingDiverged as e:
        return cli.user_error(e, code=cli.EXIT_DIVERGED)
    except checkpoint.CheckpointUnreadable as e:  # the restart falls back; no machine is to blame
        return cli.user_error(e, code=cli.EXIT_UNREADABLE_CHECKPOINT)
    except FinalSaveFailed as e:  # a full disk: the steps since the newest good checkpoint are not on disk
        return cli.user_error(e, code=cli.EXIT_NOT_SAVED)
    except Interrupted as e:
        if jax.process_index() == 0:
            resume = cli.resume_command("megascale_jax.train", sys.argv[1:] if argv is None else list(argv),
                                        args.run_dir, run_dir)
            logger.warning(cli.interrupted(e.step if e.saved else None, resume))
        return e.exit_code
    finally:
        if lock:
            lock.release()
        if cfg.data.stream:  # its tokenizing workers
            train_batches.close()
    logger.info(f"run directory: {run_dir}")
    return 0


if __name__ == "__main__":
    code = main()
    if code == cli.EXIT_UNREADABLE_CHECKPOINT and jax.process_count() > 1:
        # Its peers wait for this process in orbax's restore barrier, and JAX's shutdown at exit
        # waits for them (shutdown_timeout_seconds, 300 s): under SLURM, where no driver ends the
        # processes, the job stood still that long before srun saw an exit. Its error line is out
        # and the heartbeat's last beat sent (train's `watch.close()`): leave now; srun
        # --kill-on-bad-exit (or the driver) ends the others.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
