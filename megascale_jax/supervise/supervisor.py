"""The driver's half of MegaScale's robust training (§4): watch the workers, detect a fault,
diagnose, restart from the newest checkpoint — or give up with a report.

The supervisor is the loop that ties the steps together, attempt after attempt:
* run — one attempt's workers (a `WorkerGroup` in the warm processes of a `StandbyPool`, on the
  slots placement.py assigns) until they finish or a fault is detected;
* detect — detect.py names the fault and its latency (crash, hang, stall, diverged,
  config_error, a failed device self-test, a straggler), from exit codes, heartbeats and timings;
* decide — policy.py's pure `decide`: done, give up, or restart — on the same slots, with spares
  for ranks found faulty, or on a smaller mesh — after diagnostics (diagnose.py) when it asks;
  then one `verdict` event names what happened and what is excluded for it (verdict.py);
* recover — exclude the faulty slots, promote spares or shrink, set aside what a restart from
  step 0 must not see, and resume from the newest checkpoint or memory snapshot;
* grow back — a slot given back (RUN_DIR/returned_hosts.txt) stands by as a spare; a shrunk job
  stops at its next memory snapshot or checkpoint and resumes on the larger mesh from it (`Grow`:
  a planned restart, not a fault; it counts against no `supervisor.max_restarts`).
Meanwhile the embedded Redis is restarted if it dies (transport.py) and drills fire (drills.py).
Every event is one line of `RUN_DIR/events.jsonl` and one printed summary line (events.py); rank
0's progress (step, loss, tokens/s, every `train.log_every` steps) is printed too.

A stop request (`request_stop`: SIGINT/SIGTERM to the launcher) is passed on to every worker,
which finishes its step in flight and checkpoints it; the driver waits for them, judging no
faults meanwhile, and exits 128 + the signal. A second request kills the workers at once.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time

from megascale_jax.config import Config
from megascale_jax import run_dir as run_dirs
from megascale_jax.cli import get_logger, interrupted
from megascale_jax.observe.hangs import describe_exit
from megascale_jax.supervise import diagnose, policy, verdict
from megascale_jax.supervise.detect import (Fault, HeartbeatMonitor, StragglerWatch, exit_fault, log_worker_events,
                                            await_exit, peer_exit, with_explained_exit)
from megascale_jax.supervise.drills import Drill, Drills
from megascale_jax.supervise.events import EventLog
from megascale_jax.supervise.placement import Placement, Shape, grown
from megascale_jax.supervise.policy import Done, GiveUp, Shrink, Spare
from megascale_jax.supervise.transport import RedisLink
from megascale_jax.supervise.workers import StandbyPool, WorkerGroup
from megascale_jax.supervise.zygote import Zygote

log = get_logger("supervise", tag="[supervisor] ")
rank0 = get_logger("supervise.progress", tag="[rank 0] ")  # rank 0's progress, from its heartbeat


@dataclasses.dataclass
class Job:
    """What the supervisor runs: `python -m megascale_jax.train` on `nprocs` local processes."""

    cfg: Config
    run_dir: str
    nprocs: int
    worker_args: list[str]  # --config/--run-dir and overrides, as each worker gets them
    job_id: str
    env: dict
    diagnose_args: list[str] | None  # diagnostics workers' --config and overrides; None: no diagnosis
    startup_timeout_s: float = 300.0
    poll_s: float = 0.1
    spares: int = 0  # standby workers beyond nprocs (launch --spares)
    resume_command: str | None = None  # what continues the run, where not the same command (cli.resume_command)


@dataclasses.dataclass
class Grow:
    """A planned stop: slots came back, and the shrunk job resumes on `shape` from the newest
    restorable step, once that is at least `from_step` (the step reached when it was planned)."""

    shape: Shape
    from_step: int
    at: float = 0.0  # when the attempt was stopped for it


@dataclasses.dataclass
class Attempt:
    """One attempt's workers, their heartbeats, and what the driver has said of them so far."""

    number: int  # 0 for the first, then one per restart
    group: WorkerGroup
    monitor: HeartbeatMonitor
    resume_step: int | None  # the step it restores from, until its `resumed` event is logged
    alive_at: float  # the last poll at which every worker still ran
    started: bool = False  # the `started` event was logged (attempt 0)
    stop_passed_on: bool = False  # a stop request was passed on to the workers
    progress_printed: int | None = None  # rank 0's last step on the console (None: not started)

    @property
    def nprocs(self) -> int:
        return len(self.group.processes)


class Supervisor:
    def __init__(self, job: Job, redis_url: str, server=None, drills: list[Drill] = ()):
        cfg = job.cfg
        self.job = job
        self.events = EventLog(job.run_dir)
        self.redis = RedisLink(redis_url, self.events, server)
        self.drills = Drills(drills, cfg, job.run_dir)
        self.stragglers = StragglerWatch(cfg, job.run_dir, self.events)
        self.faults: list[Fault] = []
        self.placement = Placement(job.nprocs, job.spares)
        self.shape = Shape(job.nprocs, cfg.mesh.dp, cfg.parallel.microbatches)  # smaller after a shrink
        self.devices_per_process = cfg.mesh.size // job.nprocs
        self.pool: StandbyPool | None = None  # warm worker processes, one per slot, while running
        self.diagnose_pool: StandbyPool | None = None  # warm diagnostics processes, one per active slot
        self.attempt_started = 0.0  # wall time the current attempt started
        self.drill_at: float | None = None  # injection time of the drill fired in this attempt
        self.stop_signal = 0  # the signal of a stop request, 0 while none
        self.stop_codes: dict[int, int] = {}  # the workers' exit codes after a stop request
        self.stopped_at, self.stopped_for = 0.0, "the fault"  # when and why the last attempt ended
        self.grow: Grow | None = None  # a grow planned in this attempt, once slots came back
        self.returned_mtime, self.returned_read = 0.0, 0  # returned_hosts.txt as last read, its lines taken
        self.restarts = 0  # recoveries so far (a grow is an attempt, not a restart)
        self.longest_silence = 0.0  # the longest heartbeat silence of a rank that went on training, any attempt

    def request_stop(self, signum: int) -> None:
        """SIGINT/SIGTERM to the launcher (called from its signal handler)."""
        name = signal.Signals(signum).name
        # print, not logging: this runs in a signal handler, where logging's locks may be held.
        if self.stop_signal:
            print(f"\n[supervisor] second {name}: killing the workers now", flush=True)
            raise SystemExit(128 + signum)  # unwinds through _attempt, which kills the workers
        self.stop_signal = signum
        print(f"\n[supervisor] {name}: the workers finish the step in flight and checkpoint it "
              "(send it again to kill them at once)", flush=True)

    def run(self) -> int:
        """0 when training finished, 1 when the driver gave up (report printed), 128 + signal when
        stopped by a signal."""
        # Warm processes for the first attempt's ranks only; the spares' are started with the
        # refills, once training runs: 7 processes importing jax at launch on this 2-core machine
        # (4 ranks + 3 spares) delayed the first step by the spares' imports.
        # Every warm process is a fork of one zygote that imported the workers' modules once
        # (supervise/zygote.py): a refill costs milliseconds, not an interpreter's imports each.
        self.zygote = Zygote("megascale_jax.train", self.job.env)
        self.pool = StandbyPool("megascale_jax.train", self.job.env, self.job.nprocs, self.zygote)
        # Warm diagnostics processes for the active slots, started once training runs (refill):
        # at launch they would take the CPU from the workers' own start-up. The module's main(argv)
        # runs one diagnostics worker, its warm_up() does the imports.
        self.diagnose_pool = StandbyPool(diagnose.__name__, self.job.env, 0, self.zygote)
        try:
            return self._run()
        finally:
            self.pool.close()
            self.diagnose_pool.close()
            self.zygote.close()

    def _run(self) -> int:
        """Attempt after attempt: run, detect, decide, recover."""
        restarts, resume_step, number = 0, None, 0
        while True:
            if self.stop_signal:
                return self._stopped(restarts)
            self.restarts = restarts
            fault, last_step = self._attempt(number, resume_step)
            number += 1
            if isinstance(fault, Grow):
                resume_step = self._grow_back(fault, last_step)
                continue
            # A fault before the first step: the heartbeats of start-up say step 0, yet the
            # attempt was at its restore point.
            last_step = max(last_step, resume_step or 0)
            if self.stop_signal:
                return self._stopped(restarts)
            if fault is not None:
                self._record(fault, last_step, restarts)
            action = self._decide(fault, restarts)
            if isinstance(action, Done):
                # How near a healthy rank came to being called hung: the margin a hang_timeout_s has.
                self.events.log("done", action.reason, restarts=restarts,
                                longest_heartbeat_silence_s=round(self.longest_silence, 2),
                                hang_timeout_s=self.job.cfg.supervisor.hang_timeout_s)
                self._free_excluded_snapshots()
                return 0
            if isinstance(action, (Spare, Shrink, GiveUp)) and action.evict:
                self._exclude(action.evict)
            if isinstance(action, Shrink):
                self._shrink(action.shape)
            if isinstance(action, GiveUp):
                return self._give_up(action.reason, restarts)
            restarts += 1
            resume_step = self._restart(fault, last_step, restarts)
            if resume_step is None:
                return 0

    # ------------------------------------------------------------------ one attempt

    def _attempt(self, number: int, resume_step: int | None) -> tuple[Fault | Grow | None, int]:
        """Run the workers until they finish, a fault is detected or a grow is due; returns (fault
        or grow, last step seen)."""
        attempt = self._launch(number, resume_step)
        fault, ended = None, False
        try:
            while not ended and fault is None:
                time.sleep(self.job.poll_s)
                now, codes = time.time(), attempt.group.exit_codes()
                if self.stop_signal:  # they checkpoint and exit 128 + signal: no fault is judged
                    ended = self._pass_on_stop(attempt, codes)
                elif any(code != 0 for code in codes.values()) or len(codes) == attempt.nprocs:
                    fault, ended = self._exited(attempt, codes, now), True
                else:
                    fault = self._watch(attempt, set(codes), now)
            return fault, attempt.monitor.max_step
        finally:
            attempt.group.stop()
            self.longest_silence = max(self.longest_silence, *attempt.monitor.longest_silence.values(), 0.0)
            if isinstance(fault, Grow):
                fault.at = time.time()
            elif fault is not None and fault.rank is not None:
                fault.log_tail = attempt.group.log_tail(fault.rank)
                # A worker that said its error line (heartbeat) is believed over its log, whose last
                # error can be a peer's failure JAX printed before this worker's own line.
                fault.error = fault.error or attempt.group.last_error(fault.rank)

    def _launch(self, number: int, resume_step: int | None) -> Attempt:
        """The attempt's workers on the active slots (the shape's overrides after a shrink)."""
        job, sv = self.job, self.job.cfg.supervisor
        job_id = f"{job.job_id}-{number}"
        env = {**job.env, **self.drills.attempt_env(shrunk=self.shape.dp < self.job.cfg.mesh.dp)}
        nprocs = self.shape.nprocs
        group = WorkerGroup("megascale_jax.train", [*job.worker_args, *self._shape_overrides(), "--redis",
                                                    self.redis.url, "--job", job_id, "--num-processes", str(nprocs)],
                            nprocs, env, run_dirs.logs_dir(job.run_dir), "worker",
                            header=f"attempt {number}, job {job_id}, slots {self.placement.active}",
                            pool=self.pool, slots=self.placement.active,
                            hosts=[self.placement.hosts[slot] for slot in self.placement.active])
        monitor = HeartbeatMonitor(self.redis.client, job_id, nprocs, sv.hang_timeout_s, job.startup_timeout_s,
                                   time.time(), sv.stall_steps, sv.stall_floor_s)
        self.drill_at, self.grow = None, None
        attempt = Attempt(number, group, monitor, resume_step, alive_at=time.time())
        self.attempt_started = time.time()
        return attempt

    def _pass_on_stop(self, attempt: Attempt, codes: dict[int, int]) -> bool:
        """The stop request to every worker, once; True when all of them exited."""
        if not attempt.stop_passed_on:
            for rank in range(attempt.nprocs):
                attempt.group.signal(rank, self.stop_signal)
            attempt.stop_passed_on = True
        if len(codes) == attempt.nprocs:
            self.stop_codes = codes
            return True
        return False

    def _exited(self, attempt: Attempt, codes: dict[int, int], now: float) -> Fault | None:
        """A worker failed (its fault) or all of them finished (None)."""
        monitor = attempt.monitor
        failed = {rank: code for rank, code in codes.items() if code != 0}
        if failed:
            if monitor.poll(now):  # what they said before exiting (e.g. nan_triage: diverged)
                log_worker_events(monitor, self.events)
            failed = with_explained_exit(attempt.group, failed)
            return exit_fault(failed, self.drill_at or attempt.alive_at, time.time())
        if monitor.poll(now):  # their last beats: a short attempt's only sign of a step
            self._log_start(attempt, now)
        return None

    def _watch(self, attempt: Attempt, finished: set[int], now: float) -> Fault | Grow | None:
        """One look at the running workers: keep Redis up, read the heartbeats, say what they say,
        fire the drills due, and judge them (a fault, a grow due, or None)."""
        monitor = attempt.monitor
        attempt.alive_at = now
        self.redis.keep_alive(monitor, now, died_at=self.drill_at or now)
        if not monitor.poll(now):
            return None
        self._log_start(attempt, now)
        if monitor.resumed_from() is not None:  # training again: the CPU can spare the imports
            self.pool.refill(self.placement.active + self.placement.spares)
            if self.job.diagnose_args is not None:
                self.diagnose_pool.refill(self.placement.active)
        self.redis.note_heartbeats_back(monitor, set(range(attempt.nprocs)) - finished, now)
        self._print_progress(attempt)
        self._fire_drill(attempt, now)
        self.drills.slow_down(attempt.group, monitor.records, self.placement)
        fault = (log_worker_events(monitor, self.events) or monitor.check(now, finished=finished)
                 or self._check_stragglers(now))
        if fault and fault.cause == "crash" and fault.exit_code is None:
            fault = self._peer_exit(attempt.group, fault, attempt.alive_at) or fault
        if fault and fault.cause == "unreadable_checkpoint" and fault.exit_code is None:
            # Said by its heartbeat; its error line (which checkpoint, why) is printed on its way out.
            fault.exit_code = await_exit(attempt.group, fault.rank)
        if fault and self.drill_at:
            fault.at = self.drill_at
        return fault or self._grow_due(attempt)

    def _log_start(self, attempt: Attempt, now: float) -> None:
        """The `started` event (attempt 0) or `resumed` event (after a fault), once some rank
        finished a step."""
        monitor = attempt.monitor
        start = monitor.first_step_from()
        if start is None:
            return
        if attempt.number == 0 and not attempt.started:
            attempt.started = True
            since = now - self.attempt_started
            self.events.log("started", f"training started, {since:.1f}s after the launch", step=monitor.max_step,
                            since_launch_s=since, phases_s=monitor.start_phases())
        if attempt.resume_step is not None:
            since = now - self.stopped_at
            fallback = f" (checkpoint {attempt.resume_step} was unreadable)" if start < attempt.resume_step else ""
            self.events.log("resumed", f"training resumed past step {start}{fallback}, {since:.1f}s after "
                            f"{self.stopped_for}", step=monitor.max_step, from_step=start, since_fault_s=since,
                            restarts=self.restarts, attempt=attempt.number,
                            relaunched_after_fault_s=self.attempt_started - self.stopped_at,
                            phases_s=monitor.start_phases())
            attempt.resume_step = None

    def _print_progress(self, attempt: Attempt) -> None:
        """Rank 0's progress on the console: where an attempt starts (the step it resumed from: a
        checkpoint's or a memory snapshot's), then step, loss and tokens/s every `train.log_every`
        steps (the heartbeat seen when a multiple is passed; the workers' own logs stay in logs/)."""
        record = attempt.monitor.records.get(0, {})
        step, every = record.get("step", 0), max(1, self.job.cfg.train.log_every)
        if attempt.progress_printed is None:  # this attempt's start, once rank 0 restored or initialised
            if record.get("state") in ("compiling", "training"):
                if step:
                    rank0.info(f"resumed from step {step}")
                attempt.progress_printed = step
            return
        if "loss" not in record or step // every <= attempt.progress_printed // every:
            return
        attempt.progress_printed = step
        rank0.info(f"step {step:5d} loss {record['loss']:.4f} {record['tokens_per_s']:.0f} tokens/s")

    def _peer_exit(self, group: WorkerGroup, raised: Fault, alive_at: float) -> Fault | None:
        """The exit of a peer of the rank whose loop raised, if one follows within the grace
        (detect.peer_exit); timed from the drill, if one fired, else from `alive_at`."""
        return peer_exit(group, raised, self.drill_at or alive_at)

    def _fire_drill(self, attempt: Attempt, now: float) -> None:
        """The next drill if it is due, and with it those given as one (`KIND:R1,R2@WHEN`: faults at once)."""
        while fired := self.drills.fire(attempt.group, attempt.monitor.records, attempt.monitor.max_step,
                                        self.placement, self.shape.nprocs, self.redis.server, now):
            self.drill_at = now
            self.events.log("drill", fired.pop("summary"), **fired)
            if not (self.drills.pending and self.drills.pending[0].together):
                break

    def _check_stragglers(self, now: float) -> Fault | None:
        """Log newly flagged stragglers of this attempt; the first one is a fault if they are to be
        evicted (detect.StragglerWatch)."""
        return self.stragglers.check(now, since=self.attempt_started)

    def _stopped(self, restarts: int) -> int:
        """The end of a run stopped by a signal: which checkpoint it can resume from."""
        steps = run_dirs.committed_steps(run_dirs.checkpoint_dir(self.job.cfg, self.job.run_dir))
        codes = self.stop_codes
        odd = {r: c for r, c in codes.items() if c not in (0, 128 + self.stop_signal)}
        where = f"checkpoint step {steps[-1]}" if steps else "no checkpoint"
        self.events.log("interrupted", f"stopped by {signal.Signals(self.stop_signal).name}; newest {where}"
                        + (f"; {', '.join(f'rank {r} {describe_exit(c)}' for r, c in odd.items())}" if odd else ""),
                        signal=self.stop_signal, step=steps[-1] if steps else None, restarts=restarts)
        log.logger.info(interrupted(steps[-1] if steps else None, self.job.resume_command))
        return 128 + self.stop_signal

    # ------------------------------------------------------------------ after a fault

    def _record(self, fault: Fault, last_step: int, restarts: int) -> None:
        """The fault into the job's list (the report's) and the event log."""
        fault.step = last_step
        self.faults.append(fault)
        self.stopped_at, self.stopped_for = fault.at, "the fault"
        self.events.log("fault", f"{fault.cause} of rank {fault.rank} ({fault.detail}); detected in "
                        f"{fault.latency_s:.2f}s at step {last_step}" + (f": {fault.error}" if fault.error else ""),
                        cause=fault.cause, rank=fault.rank, detail=fault.detail, latency_s=fault.latency_s,
                        step=last_step, restarts=restarts, error=fault.error, exit_code=fault.exit_code)

    def _decide(self, fault: Fault | None, restarts: int) -> policy.Action:
        """The policy's decision (policy.py), with the diagnostics it asks for run first."""
        earlier = self.faults[:-1] if fault is not None else self.faults
        previous = earlier[-1] if earlier else None
        slots = policy.Slots(len(self.placement.spares), self.placement.healthy(), self.shape,
                             self.devices_per_process)
        action, findings = policy.decide(fault, previous, restarts, self.job.cfg, slots), None
        if isinstance(action, policy.Diagnose):
            findings = self._diagnose(restarts)
            action = policy.decide(fault, previous, restarts, self.job.cfg, slots, faulty=findings)
        if fault is not None:
            excluded = action.evict if isinstance(action, (Spare, Shrink, GiveUp)) else {}
            said = verdict.judge(fault, findings, excluded)
            self.events.log("verdict", said.summary, verdict=said.kind, rank=said.rank, cause=fault.cause,
                            excluded={str(r): why for r, why in excluded.items()},
                            action=type(action).__name__.lower(), restarts=restarts)
        return action

    def _diagnose(self, restarts: int) -> dict[int, str]:
        """The diagnostics' findings (rank -> why). A lost host is found first, by being
        unreachable (locally: a `host` drill's slot): the diagnostics need every host of the mesh,
        so they do not run, and the lost host is the finding — never a stand-in process's
        collectives read as wrong values (supervise/verdict.py)."""
        lost = {rank: verdict.host_lost(host) for rank, host in self.drills.lost_hosts(self.placement).items()}
        if lost:
            self.events.log("diagnosis", "; ".join(f"rank {r}: {why}" for r, why in lost.items()) +
                            " (the other ranks not tested: the diagnostics need every host of the mesh)",
                            faulty={str(r): why for r, why in lost.items()}, duration_s=0.0, restarts=restarts)
            return lost
        if self.job.diagnose_args is None:
            return {}
        env = {**self.job.env, **self.drills.diagnosis_env(self.placement)}
        report = diagnose.run([*self.job.diagnose_args, *self._shape_overrides()], self.shape.nprocs,
                              self.redis.url, f"{self.job.job_id}-diag{restarts}", env,
                              run_dirs.logs_dir(self.job.run_dir), pool=self.diagnose_pool,
                              slots=self.placement.active)
        log.info("diagnostics:\n" + report.table())
        faulty = report.faulty()
        found = ", ".join(f"rank {r}: {why}" for r, why in faulty.items()) or "all ranks healthy"
        self.events.log("diagnosis", found, faulty={str(r): why for r, why in faulty.items()},
                        duration_s=report.duration_s, restarts=restarts)
        return faulty

    def _shape_overrides(self) -> list[str]:
        """The overrides of a shrunk mesh (none before a shrink)."""
        cfg = self.job.cfg
        return [] if self.shape == Shape(self.job.nprocs, cfg.mesh.dp, cfg.parallel.microbatches) \
            else self.shape.overrides()

    def _exclude(self, faulty: dict[int, str]) -> None:
        """Exclude the faulty ranks' slots for the rest of the job, then give their ranks spares
        while spares last (placement.py)."""
        for rank, why in sorted(faulty.items()):
            slot = self.placement.evict(rank, why)
            host = self.placement.hosts[slot]
            run_dirs.append_lines(run_dirs.excluded_hosts_path(self.job.run_dir), [host])
            self.events.log("evict", f"rank {rank} on {host} excluded for the rest of the job: {why}",
                            rank=rank, slot=slot, host=host, reason=why)
        for rank, slot in self.placement.replace():
            self.events.log("spare_promoted", f"spare {self.placement.hosts[slot]} takes rank {rank}",
                            rank=rank, slot=slot, host=self.placement.hosts[slot],
                            spares_left=len(self.placement.spares))

    def _free_excluded_snapshots(self) -> None:
        """The job is done: the memory snapshots on slots it excluded (which no worker of it runs
        on any more, to remove them at its end) are removed; its slots are this machine's."""
        cfg = self.job.cfg
        if cfg.checkpoint.memory_every:
            root = run_dirs.snapshot_dir(cfg, self.job.run_dir)
            for slot in self.placement.excluded:
                shutil.rmtree(run_dirs.host_snapshot_dir(root, self.placement.hosts[slot]), ignore_errors=True)

    def _shrink(self, shape: Shape) -> None:
        """The next attempts run on `shape`, fewer data-parallel replicas (policy.Shrink)."""
        self.events.log("shrink", f"no spare left: resuming on dp={shape.dp} x {shape.microbatches} microbatches "
                        f"({shape.nprocs} processes) instead of dp={self.shape.dp} x {self.shape.microbatches}; "
                        "same global batch", dp=shape.dp, microbatches=shape.microbatches, nprocs=shape.nprocs,
                        was={"dp": self.shape.dp, "microbatches": self.shape.microbatches,
                             "nprocs": self.shape.nprocs})
        self.placement.shrink(shape.nprocs)
        self.shape = shape

    def _restart(self, fault: Fault, last_step: int, restarts: int) -> int | None:
        """Ready restart number `restarts`: the step it resumes from, None when that is the end."""
        sv = self.job.cfg.supervisor
        resume_step, source = self._prepare_restart(restarts)
        if resume_step >= self.job.cfg.train.steps:
            self.events.log("done", f"the final checkpoint (step {resume_step}) was committed before the "
                            "fault; nothing to redo", restarts=restarts)
            return None
        lost = max(0, last_step - resume_step)
        self.events.log("restart", f"restart {restarts}/{sv.max_restarts} from {source or 'the start:'} step {resume_step} "
                        f"({lost} steps lost)", cause=fault.cause, rank=fault.rank, resume_step=resume_step,
                        resume_from=source,
                        steps_lost=lost, restarts=restarts)
        return resume_step

    def _newest_restorable(self) -> tuple[int, str | None]:
        """The newest step a restart can resume from and what from ("checkpoint", "memory
        snapshot", None for step 0): the newest of the committed checkpoints and of the memory
        snapshots of which every process of one attempt has a file or a peer's copy — the last
        attempt's after a shrink or grow, resharded onto the new mesh (training/snapshot.py; the
        workers may still reject one and fall back)."""
        cfg = self.job.cfg
        steps = run_dirs.committed_steps(run_dirs.checkpoint_dir(cfg, self.job.run_dir))
        # Only what the next attempt's hosts hold: an excluded host's RAM is out of its reach.
        reachable = [self.placement.hosts[slot] for slot in self.placement.active if slot != -1]
        held = run_dirs.recoverable_snapshot_steps(run_dirs.snapshot_dir(cfg, self.job.run_dir), hosts=reachable) \
            if cfg.checkpoint.memory_every else []
        if held and (not steps or held[-1] >= steps[-1]):  # as new as the checkpoint: RAM, not disk
            return held[-1], "memory snapshot"
        return (steps[-1], "checkpoint") if steps else (0, None)

    def _prepare_restart(self, restarts: int) -> tuple[int, str | None]:
        """The step the next attempt resumes from and what from (`_newest_restorable`)."""
        step, source = self._newest_restorable()
        if source is not None:
            return step, source
        # A worker refuses a run directory with metrics but no checkpoint: set them aside, kept.
        metrics = run_dirs.metrics_path(self.job.run_dir)
        if os.path.exists(metrics):
            os.replace(metrics, f"{metrics}.before-restart-{restarts}")
        return 0, None

    # ------------------------------------------------------------------ growing back

    def _take_back_returned(self) -> None:
        """Hosts newly listed in RUN_DIR/returned_hosts.txt: their slots, if this job excluded them,
        stand by again as spares (placement.readmit), and leave excluded_hosts.txt."""
        path = run_dirs.returned_hosts_path(self.job.run_dir)
        try:
            if os.stat(path).st_mtime == self.returned_mtime:
                return
            self.returned_mtime = os.stat(path).st_mtime
            with open(path) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return
        new, self.returned_read = lines[self.returned_read:], len(lines)
        for host in (line.strip() for line in new):
            slot = self.placement.readmit(host)
            if slot is None:
                continue
            self.drills.repaired(slot)
            run_dirs.remove_lines(run_dirs.excluded_hosts_path(self.job.run_dir), [host])
            self.events.log("readmit", f"{host} is back: it stands by as a spare", slot=slot, host=host,
                            spares=len(self.placement.spares))

    def _grow_due(self, attempt: Attempt) -> Grow | None:
        """A shrunk job whose healthy slots now hold a larger mesh: plan the grow once it trains,
        and return it once a memory snapshot or checkpoint at least as new as the plan's step is
        restorable (the steps after it are redone: one or two)."""
        self._take_back_returned()
        if self.grow is None and attempt.monitor.first_step_from() is not None:
            shape = grown(self.job.cfg, self.shape, self.placement.healthy(), self.devices_per_process)
            if shape is not None:
                self.grow = Grow(shape, attempt.monitor.max_step)
        if self.grow is None:
            return None
        step, _ = self._newest_restorable()
        return self.grow if self.grow.from_step <= step < self.job.cfg.train.steps else None

    def _grow_back(self, grow: Grow, last_step: int) -> int:
        """The next attempt runs on the grown shape, from the newest restorable step: its resume step."""
        was, shape = self.shape, grow.shape
        self.placement.grow(shape.nprocs)
        self.shape, self.stopped_at, self.stopped_for = shape, grow.at, "the stop to grow"
        resume_step, source = self._newest_restorable()
        lost = max(0, last_step - resume_step)
        self.events.log("grow", f"slots back: resuming on dp={shape.dp} x {shape.microbatches} microbatches "
                        f"({shape.nprocs} processes) instead of dp={was.dp} x {was.microbatches}, from {source} "
                        f"step {resume_step} ({lost} steps redone)", dp=shape.dp, microbatches=shape.microbatches,
                        nprocs=shape.nprocs, was={"dp": was.dp, "microbatches": was.microbatches, "nprocs": was.nprocs},
                        resume_step=resume_step, resume_from=source, steps_lost=lost)
        return resume_step

    def _give_up(self, reason: str, restarts: int) -> int:
        self.events.log("give_up", reason, restarts=restarts, faults=len(self.faults))
        lines = ["gave up — fault report"]
        for i, f in enumerate(self.faults):
            lines.append(f"  {i + 1}. {f.cause} of rank {f.rank} at step {f.step}: {f.detail} "
                         f"(detected in {f.latency_s:.2f}s)" + (f"\n     error: {f.error}" if f.error else ""))
        if self.faults and self.faults[-1].log_tail:
            lines.append("  last lines of its log:\n" + "\n".join(f"    | {line}" for line in self.faults[-1].log_tail))
        lines.append(f"  restarts: {restarts}; reason: {reason}\n  worker logs: {run_dirs.logs_dir(self.job.run_dir)}; "
                     f"events: {self.events.path}")
        # what is kept: the newest committed checkpoint, and how to go on from it
        steps = run_dirs.committed_steps(run_dirs.checkpoint_dir(self.job.cfg, self.job.run_dir))
        again = f"resume with: {self.job.resume_command}" if self.job.resume_command else "re-run the same command to resume"
        lines.append(f"  newest committed checkpoint: step {steps[-1]} — {again}" if steps
                     else f"  no committed checkpoint — {again} from the start")
        log.info("\n".join(lines))
        return 1
