"""The driver's half of MegaScale's robust training (§4): watch the workers, detect a fault,
diagnose, restart from the newest checkpoint — or give up with a report.

Detection, each with its latency (detection time minus the fault's time: a drill's injection,
else the last sign of health):
* crash — a worker exits non-zero or by a signal (noticed within one poll). Survivors of a dead
  JAX peer abort with SIGABRT later; the first non-aborted exit is blamed.
* hang — a worker's heartbeat stops changing for `supervisor.hang_timeout_s` (e.g. SIGSTOP).
* stall — heartbeats go on but the step does not advance in state `training` (a stuck collective)
  for `hang_timeout_s`, or `supervisor.stall_steps` times the rank's recent median step if longer
  (an overloaded host's slow phase, or a model whose steps take longer than the timeout).
* nan_triage — the workers replay a non-finite step once themselves (training/triage.py) and
  report it in their heartbeats: finite → `transient` (logged; training goes on; a device whose
  self-test failed is a `device` fault), non-finite again → `diverged`, below.
* diverged — exit code 3 (non-finite loss, again when replayed). Restarting replays the same
  data bitwise, so it only helps when diagnostics blame a device; otherwise the driver gives up.
* config_error — exit code 2: a user mistake, reported and never retried.
* straggler — every `supervisor.straggler_check_s` the driver runs the straggler statistic on
  the workers' phase timings (`stragglers.find_stragglers`) and logs each newly flagged
  (rank, step window) as a `straggler` event, and each device that computes slowly in profiled
  steps (`observe.profile_every`, `stragglers.flag_slow_devices`) as a `slow_device` event;
  with `supervisor.evict_stragglers=true` the first of them is also a fault, and its slot is
  excluded like a faulty rank's (placement.py: a spare takes over, or the job shrinks).
Every event is one line of `RUN_DIR/events.jsonl` and one printed summary line; rank 0's
progress (step, loss, tokens/s, every `train.log_every` steps) is printed too.

A stop request (`request_stop`: SIGINT/SIGTERM to the launcher) is passed on to every worker,
which finishes its step in flight and checkpoints it; the driver waits for them, judging no
faults meanwhile, and exits 128 + the signal. A second request kills the workers at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import time

import redis

from megascale_jax.config import Config, ConfigError
from megascale_jax import run_dir as run_dirs
from megascale_jax.cli import get_logger, interrupted
from megascale_jax.cluster.rendezvous import HEARTBEAT_FIELDS, heartbeat_key
from megascale_jax.observe.timings import read_timings
from megascale_jax.observe.hangs import describe_exit
from megascale_jax.supervise import diagnose
from megascale_jax.supervise.drills import Drill, Drills
from megascale_jax.supervise.placement import Placement, Shape, shrunk
from megascale_jax.supervise.workers import StandbyPool, WorkerGroup, error_key

log = get_logger("supervise", tag="[supervisor] ")
rank0 = get_logger("supervise.progress", tag="[rank 0] ")  # rank 0's progress, from its heartbeat

PEER_EXIT_GRACE_S = 1.0  # how long a raised loop waits for a peer's exit to be seen (see _peer_exit)
EXIT_CAUSES = {2: "config_error", 3: "diverged", -signal.SIGABRT: "aborted"}


@dataclasses.dataclass
class Fault:
    cause: str  # crash | aborted | hang | stall | diverged | config_error | straggler | device
    rank: int | None
    detail: str
    at: float  # wall time of the fault
    detected: float  # wall time of its detection
    log_tail: list[str] = dataclasses.field(default_factory=list)  # the faulty rank's last log lines
    error: str = ""  # the line of its log that names the cause (workers.last_error_line)
    step: int | None = None  # the highest step any heartbeat reported before the fault
    exit_code: int | None = None  # the faulty worker's exit code (negative: the signal), if it exited

    @property
    def latency_s(self) -> float:
        return self.detected - self.at


class EventLog:
    """RUN_DIR/events.jsonl plus one printed line per event."""

    def __init__(self, run_dir: str):
        self.path = run_dirs.events_path(run_dir)

    def log(self, kind: str, summary: str, **fields) -> dict:
        record = {"time": time.time(), "kind": kind, **fields, "summary": summary}
        run_dirs.append_jsonl(self.path, [record])
        log.info(f"{kind}: {summary}")
        return record


# ============================================================================ heartbeats


def parse_heartbeat(raw: bytes, rank: int) -> dict | str:
    """The record, or why it is malformed."""
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return f"not JSON ({e})"
    if not isinstance(record, dict):
        return "not a JSON object"
    missing = [f for f in HEARTBEAT_FIELDS if f not in record]
    if missing:
        return f"missing {', '.join(missing)}"
    if record["rank"] != rank or not isinstance(record["step"], int) or not isinstance(record["seq"], int):
        return "rank, step or seq of the wrong value or type"
    return record


STARTUP_STATES = ("initialising", "compiling")  # bounded by the startup timeout, not the hang timeout
START_PHASES = (*STARTUP_STATES, "training")  # in order; the `started` and `resumed` events time them
RECENT_STEPS = 10  # the step times a stall is judged against (supervisor.stall_steps)


class HeartbeatMonitor:
    """Reads the heartbeats of one attempt's workers and notices those that stop or stall.

    Times are the driver's arrival times of changed records, not the workers' clocks."""

    def __init__(self, client: redis.Redis, job: str, nprocs: int, hang_timeout_s: float,
                 startup_timeout_s: float, now: float, stall_steps: float = 5.0):
        self.client, self.keys = client, [heartbeat_key(job, r) for r in range(nprocs)]
        self.hang_timeout_s, self.startup_timeout_s, self.stall_steps = hang_timeout_s, startup_timeout_s, stall_steps
        self.step_times: dict[int, dict[int, float]] = {}  # rank -> step -> its time, the last RECENT_STEPS seen
        self.started = now
        self.records: dict[int, dict] = {}
        self.arrived: dict[int, float] = {}  # rank -> when its record last changed
        self.step_since: dict[int, tuple[int, float, bool]] = {}  # rank -> (step, since, advanced before)
        self.bad: dict[int, bytes] = {}  # last malformed value warned about, per rank
        self.started_at: dict[int, int] = {}  # rank -> the step its first compiling/training beat said
        self.state_since: dict[int, tuple[str, float]] = {}  # rank -> (phase, when it began): "startup" or a state
        self.reached: dict[str, dict[int, float]] = {s: {} for s in START_PHASES}  # phase -> rank -> first seen there or later
        self.events_seen: set[tuple[int, int]] = set()  # (rank, event id) of the workers' events logged
        self.triaged: set[tuple[int, str]] = set()  # (step, outcome) of NaN triages logged
        self.reachable = True

    @property
    def max_step(self) -> int:
        return max((r["step"] for r in self.records.values()), default=0)

    def poll(self, now: float) -> bool:
        """Read all records; False while Redis is unreachable (then nothing can be judged)."""
        try:
            values = self.client.mget(self.keys)
        except redis.RedisError as e:
            if self.reachable:
                log.warning(f"warning: Redis unreachable ({e}); hang detection paused")
            self.reachable = False
            return False
        if not self.reachable:
            self.grace(now)
            self.reachable = True
        for rank, raw in enumerate(values):
            if raw is None:
                continue
            record = parse_heartbeat(raw, rank)
            if isinstance(record, str):
                if self.bad.get(rank) != raw:
                    log.warning(f"warning: ignoring malformed heartbeat of rank {rank}: {record}")
                    self.bad[rank] = raw
                continue
            if record["seq"] != self.records.get(rank, {}).get("seq"):
                self.arrived[rank] = now
                self._track_step_time(rank, record)
                self._track_progress(rank, record, now)
                self._track_start(rank, record["state"], now)
                phase = "startup" if record["state"] in STARTUP_STATES else record["state"]
                if self.state_since.get(rank, ("",))[0] != phase:
                    self.state_since[rank] = (phase, now)
            self.records[rank] = record
        return True

    def resumed_from(self) -> int | None:
        """The step training (re)started from, once some rank finished a step past it."""
        advanced = [self.started_at[r] for r, (_, _, a) in self.step_since.items() if a and r in self.started_at]
        return min(advanced) if advanced else None

    def _track_step_time(self, rank: int, record: dict) -> None:
        took = record.get("last_step_time_s")
        if record["state"] == "training" and isinstance(took, (int, float)) and took > 0:
            times = self.step_times.setdefault(rank, {})
            times[record["step"]] = float(took)
            for step in sorted(times)[:-RECENT_STEPS]:
                del times[step]

    def stall_limit(self, rank: int) -> float:
        """How long a step may take before it is a stall: hang_timeout_s, or stall_steps times the
        rank's median step over its last RECENT_STEPS (heartbeat samples), whichever is longer."""
        times = self.step_times.get(rank)
        return max(self.hang_timeout_s, self.stall_steps * statistics.median(times.values())) if times \
            else self.hang_timeout_s

    def _track_start(self, rank: int, state: str, now: float) -> None:
        # A phase shorter than a beat interval is never seen: a later state implies the earlier ones.
        later = START_PHASES.index(state) if state in START_PHASES else len(START_PHASES) - 1
        for phase in START_PHASES[:later + 1]:
            self.reached[phase].setdefault(rank, now)

    def start_phases(self) -> dict[str, float | None]:
        """Seconds from the attempt's launch until the last rank reached each start-up phase
        (`initialising`: every rank joined and beats; `compiling`: restored; `training`: compiled),
        None while some rank has not: where a restart's time goes."""
        n = len(self.keys)
        return {phase: round(max(by_rank.values()) - self.started, 2) if len(by_rank) == n else None
                for phase, by_rank in self.reached.items()}

    def first_step_from(self) -> int | None:
        """The step this attempt started from, once some rank reported a step past it (however
        short the job: unlike `resumed_from`, no two beats in state `training` are needed; a job
        that resumes and finishes between two beats shows it only in its `done` beat)."""
        past = [self.started_at[r] for r, record in self.records.items()
                if r in self.started_at and record["step"] > self.started_at[r]]
        return min(past) if past else None

    def _track_progress(self, rank: int, record: dict, now: float) -> None:
        """Progress counts in state `training` only: the jump to the resume step while
        restoring is no step, and compiling or checkpointing restarts the clock."""
        step, _, advanced = self.step_since.get(rank, (None, now, False))
        if record["state"] in ("compiling", "training"):
            self.started_at.setdefault(rank, record["step"])  # restored (or 0) before the first step
        if record["state"] != "training" or step is None:
            self.step_since[rank] = (record["step"], now, advanced)
        elif record["step"] != step:
            self.step_since[rank] = (record["step"], now, True)

    def grace(self, now: float) -> None:
        """Restart every timer (after a Redis outage: silence then proves nothing)."""
        self.arrived = {rank: now for rank in self.arrived}
        self.step_since = {rank: (s, now, a) for rank, (s, _, a) in self.step_since.items()}
        self.state_since = {rank: (s, now) for rank, (s, _) in self.state_since.items()}
        self.started = now

    def check(self, now: float, finished: set[int]) -> Fault | None:
        """A hang or stall among the ranks still running, if any. In a stuck collective every
        rank stalls at the same step: the one blamed is the one that arrived at the fewest steps."""
        stalled, running = [], []
        for rank in range(len(self.keys)):
            if rank in finished:
                continue
            running.append(rank)
            state = self.records.get(rank, {}).get("state")
            if state == "diverged":  # said before the exit, which may wait on JAX's shutdown
                return Fault("diverged", rank, "non-finite loss or gradient norm (see its log)", self.arrived[rank], now)
            if state == "failed":  # its exception is in its log; the exit may wait on JAX's shutdown
                return Fault("crash", rank, "the training loop raised (see its log)", self.arrived[rank], now)
            if state == "done":  # waiting for its peers at JAX's shutdown barrier: not a hang
                continue
            if rank not in self.arrived:
                if now - self.started > self.startup_timeout_s:
                    return Fault("hang", rank, f"no heartbeat within {self.startup_timeout_s:.0f}s of start",
                                 self.started, now)
                continue
            if now - self.arrived[rank] > self.hang_timeout_s:
                return Fault("hang", rank, f"no heartbeat for {now - self.arrived[rank]:.1f}s "
                             f"(last state {self.records[rank]['state']}, step {self.records[rank]['step']})",
                             self.arrived[rank], now)
            # Start-up (restore, compile) must end within the startup time even while the
            # heartbeat thread beats: a restore whose processes disagree waits in a barrier forever.
            phase, since = self.state_since[rank]
            if phase == "startup" and now - since > self.startup_timeout_s:
                return Fault("stall", rank, f"still {self.records[rank]['state']} {now - since:.0f}s after its first "
                             f"heartbeat (startup timeout {self.startup_timeout_s:.0f}s)", since, now)
            step, since, advanced = self.step_since[rank]
            # The first step after (re)compiling may be slow: until a step finished, allow the startup time.
            limit = self.stall_limit(rank) if advanced else self.startup_timeout_s
            if self.records[rank]["state"] == "training" and now - since > limit:
                stalled.append(Fault("stall", rank, f"heartbeats continue but step {step} has not advanced for "
                                     f"{now - since:.1f}s (limit {limit:.1f}s)", since, now))
        if not stalled:
            return None
        # A stopped rank (SIGSTOP) loses its heartbeats and its steps together, but a peer's stall
        # clock started at that peer's last step, which can precede the stopped rank's last
        # heartbeat: the peer's stall would be reported before the real hang. A rank silent for
        # over half the timeout (longer than any healthy heartbeat gap, which validation keeps
        # below it) is left to the hang check above, due within the other half.
        if any(now - self.arrived[r] > self.hang_timeout_s / 2 for r in running if r in self.arrived):
            return None
        # Peers in one stuck collective stop within a poll of each other, at finished steps at most
        # one apart (metrics are fetched one step late); blame among all of them, whether or not
        # their own stall clock has run out (a rank never seen advancing waits the startup time).
        fault, step = stalled[0], self.step_since[stalled[0].rank][0]
        stuck = [r for r in running if r in self.step_since and abs(self.step_since[r][0] - step) <= 1
                 and self.records[r]["state"] == "training"]
        fault.rank = min(stuck, key=lambda r: (self.records[r].get("arrived_step", -1), r))
        return fault


# ============================================================================ the driver


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


class Supervisor:
    def __init__(self, job: Job, redis_url: str, server=None, drills: list[Drill] = ()):
        self.job, self.redis_url, self.server = job, redis_url, server
        self.drills = Drills(drills, job.cfg, job.run_dir)
        self.events = EventLog(job.run_dir)
        self.client = redis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.faults: list[Fault] = []
        self.drill_at: float | None = None  # injection time of the drill fired in this attempt
        self.redis_restarted_at: float | None = None  # until every heartbeat reached the new server
        self.stragglers_seen: set[tuple] = set()  # (rank, first_step, last_step) already logged
        self.slow_devices_seen: set[int] = set()  # device ids already logged
        self.straggler_check_at = 0.0
        self.stop_signal = 0  # the signal of a stop request, 0 while none
        self.progress_printed: int | None = None  # rank 0's last step on the console (None: not started)
        self.stop_codes: dict[int, int] = {}  # the workers' exit codes after a stop request
        cfg = job.cfg
        self.placement = Placement(job.nprocs, job.spares)
        self.shape = Shape(job.nprocs, cfg.mesh.dp, cfg.parallel.microbatches)  # smaller after a shrink
        self.devices_per_process = cfg.mesh.size // job.nprocs
        self.attempt_started = 0.0  # wall time the current attempt started
        self.pool: StandbyPool | None = None  # warm worker processes, one per slot, while running
        self.diagnose_pool: StandbyPool | None = None  # warm diagnostics processes, one per active slot

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
        self.pool = StandbyPool("megascale_jax.train", self.job.env, self.job.nprocs + self.job.spares)
        # Warm diagnostics processes for the active slots, started once training runs (refill):
        # at launch they would take the CPU from the workers' own start-up. The module's main(argv)
        # runs one diagnostics worker, its warm_up() does the imports.
        self.diagnose_pool = StandbyPool(diagnose.__name__, self.job.env, 0)
        try:
            return self._run()
        finally:
            self.pool.close()
            self.diagnose_pool.close()

    def _run(self) -> int:
        sv = self.job.cfg.supervisor
        restarts, resume_step = 0, None
        while True:
            if self.stop_signal:
                return self._stopped(restarts)
            fault, last_step = self._attempt(restarts, resume_step)
            # A fault before the first step: the heartbeats of start-up say step 0, yet the
            # attempt was at its restore point.
            last_step = max(last_step, resume_step or 0)
            if self.stop_signal:
                return self._stopped(restarts)
            if fault is None:
                self.events.log("done", f"training finished after {restarts} restart(s)", restarts=restarts)
                return 0
            fault.step = last_step
            self.faults.append(fault)
            self.events.log("fault", f"{fault.cause} of rank {fault.rank} ({fault.detail}); detected in "
                            f"{fault.latency_s:.2f}s at step {last_step}" + (f": {fault.error}" if fault.error else ""),
                            cause=fault.cause, rank=fault.rank, detail=fault.detail, latency_s=fault.latency_s,
                            step=last_step, restarts=restarts, error=fault.error, exit_code=fault.exit_code)
            if fault.cause == "config_error":
                return self._give_up("a worker rejected the config or data (see its log); not retried", restarts)
            if self._repeated_crash():
                return self._give_up(f"the same {fault.cause} twice at step {last_step} ({fault.error}); "
                                     "it is deterministic, a restart would repeat it", restarts)
            faulty = self._diagnose(restarts)
            if fault.cause == "device" or (fault.cause == "straggler" and sv.evict_stragglers):
                faulty.setdefault(fault.rank, fault.detail)  # its own evidence, whatever diagnostics say
            if fault.cause == "diverged" and not faulty:
                return self._give_up("non-finite loss, again when the worker replayed the step, with healthy "
                                     "devices: a restart would replay it; lower optim.lr or tighten optim.clip",
                                     restarts)
            if restarts >= sv.max_restarts:
                return self._give_up(f"supervisor.max_restarts={sv.max_restarts} exhausted", restarts)
            if faulty and (why_not := self._evict(faulty)):
                return self._give_up(why_not, restarts)
            restarts += 1
            resume_step, source = self._prepare_restart(restarts)
            if resume_step >= self.job.cfg.train.steps:
                self.events.log("done", f"the final checkpoint (step {resume_step}) was committed before the "
                                "fault; nothing to redo", restarts=restarts)
                return 0
            lost = max(0, last_step - resume_step)
            self.events.log("restart", f"restart {restarts}/{sv.max_restarts} from {source or 'the start:'} step {resume_step} "
                            f"({lost} steps lost)", cause=fault.cause, rank=fault.rank, resume_step=resume_step,
                            resume_from=source,
                            steps_lost=lost, restarts=restarts)

    # ------------------------------------------------------------------ one attempt

    def _attempt(self, attempt: int, resume_step: int | None) -> tuple[Fault | None, int]:
        """Run the workers until they finish or a fault is detected; returns (fault, last step seen)."""
        job, sv = self.job, self.job.cfg.supervisor
        job_id = f"{job.job_id}-{attempt}"
        env = {**job.env, **self.drills.attempt_env()}
        nprocs = self.shape.nprocs
        group = WorkerGroup("megascale_jax.train", [*job.worker_args, *self._shape_overrides(), "--redis",
                                                    self.redis_url, "--job", job_id, "--num-processes", str(nprocs)],
                            nprocs, env, run_dirs.logs_dir(job.run_dir), "worker",
                            header=f"attempt {attempt}, job {job_id}, slots {self.placement.active}",
                            pool=self.pool, slots=self.placement.active)
        monitor = HeartbeatMonitor(self.client, job_id, nprocs, sv.hang_timeout_s, job.startup_timeout_s,
                                   time.time(), sv.stall_steps)
        self.drill_at, alive_at, fault, forwarded, started = None, time.time(), None, False, False
        self.attempt_started = time.time()
        self.progress_printed = None
        try:
            while True:
                time.sleep(job.poll_s)
                now = time.time()
                codes = group.exit_codes()
                if self.stop_signal:  # they checkpoint and exit 128 + signal: no fault is judged
                    if not forwarded:
                        for rank in range(nprocs):
                            group.signal(rank, self.stop_signal)
                        forwarded = True
                    if len(codes) == nprocs:
                        self.stop_codes = codes
                        return None, monitor.max_step
                    continue
                failed = {rank: code for rank, code in codes.items() if code != 0}
                if failed:
                    if monitor.poll(now):  # what they said before exiting (e.g. nan_triage: diverged)
                        self._log_worker_events(monitor)
                    fault = self._exit_fault(failed, alive_at, now)
                    return fault, monitor.max_step
                if len(codes) == nprocs:
                    if monitor.poll(now):  # their last beats: a short attempt's only sign of a step
                        started, resume_step = self._log_start(monitor, now, attempt, started, resume_step)
                    return None, monitor.max_step
                alive_at = now
                self._keep_redis_alive(monitor, now)
                if not monitor.poll(now):
                    continue
                started, resume_step = self._log_start(monitor, now, attempt, started, resume_step)
                if monitor.resumed_from() is not None:  # training again: the CPU can spare the imports
                    self.pool.refill(self.placement.active + self.placement.spares)
                    if self.job.diagnose_args is not None:
                        self.diagnose_pool.refill(self.placement.active)
                self._note_heartbeats_back(monitor, set(codes), now)
                self._print_progress(monitor)
                self._fire_drill(group, monitor, now)
                self.drills.slow_down(group, monitor.records, self.placement)
                fault = (self._log_worker_events(monitor) or monitor.check(now, finished=set(codes))
                         or self._check_stragglers(now))
                if fault and fault.cause == "crash" and fault.exit_code is None:
                    fault = self._peer_exit(group, fault, alive_at) or fault
                if fault:
                    if self.drill_at:
                        fault.at = self.drill_at
                    return fault, monitor.max_step
        finally:
            group.stop()
            if fault is not None and fault.rank is not None:
                fault.log_tail = group.log_tail(fault.rank)
                fault.error = group.last_error(fault.rank)

    def _log_start(self, monitor: HeartbeatMonitor, now: float, attempt: int, started: bool,
                   resume_step: int | None) -> tuple[bool, int | None]:
        """The `started` event (attempt 0) or `resumed` event (after a fault), once some rank
        finished a step; returns the updated (started, resume_step still awaited)."""
        start = monitor.first_step_from()
        if start is None:
            return started, resume_step
        if attempt == 0 and not started:
            started = True
            since = now - self.attempt_started
            self.events.log("started", f"training started, {since:.1f}s after the launch", step=monitor.max_step,
                            since_launch_s=since, phases_s=monitor.start_phases())
        if resume_step is not None:
            since = now - self.faults[-1].at
            fallback = f" (checkpoint {resume_step} was unreadable)" if start < resume_step else ""
            self.events.log("resumed", f"training resumed past step {start}{fallback}, {since:.1f}s after "
                            "the fault", step=monitor.max_step, from_step=start, since_fault_s=since,
                            restarts=attempt, relaunched_after_fault_s=self.attempt_started - self.faults[-1].at,
                            phases_s=monitor.start_phases())
            resume_step = None
        return started, resume_step

    def _log_worker_events(self, monitor: HeartbeatMonitor) -> Fault | None:
        """The workers' own events (heartbeat `events`), each logged once: every process reports
        the same NaN triage (the loss is all-reduced), with its own device self-test. A failed
        self-test is a fault of that rank."""
        fault = None
        for rank, record in sorted(monitor.records.items()):
            for event in record.get("events", []):
                if (rank, event["id"]) in monitor.events_seen:
                    continue
                monitor.events_seen.add((rank, event["id"]))
                fields = {k: v for k, v in event.items() if k not in ("id", "kind")}
                test = fields.get("self_test", {})
                if event["kind"] == "nan_triage" and (fields["step"], fields["outcome"]) not in monitor.triaged:
                    monitor.triaged.add((fields["step"], fields["outcome"]))
                    what = ("finite when replayed: a transient fault, training goes on" if fields["outcome"] == "transient"
                            else "non-finite again when replayed: diverged")
                    self.events.log("nan_triage", f"step {fields['step']} {what}", rank=rank, **fields)
                if test and not test.get("ok") and fault is None:
                    fault = Fault("device", rank, f"device self-test failed after a transient NaN at step "
                                  f"{fields['step']}: {test}", time.time(), time.time())
        return fault

    def _print_progress(self, monitor: HeartbeatMonitor) -> None:
        """Rank 0's progress on the console: where an attempt starts (the step it resumed from: a
        checkpoint's or a memory snapshot's), then step, loss and tokens/s every `train.log_every`
        steps (the heartbeat seen when a multiple is passed; the workers' own logs stay in logs/)."""
        record = monitor.records.get(0, {})
        step, every = record.get("step", 0), max(1, self.job.cfg.train.log_every)
        if self.progress_printed is None:  # this attempt's start, once rank 0 restored or initialised
            if record.get("state") in ("compiling", "training"):
                if step:
                    rank0.info(f"resumed from step {step}")
                self.progress_printed = step
            return
        if "loss" not in record or step // every <= self.progress_printed // every:
            return
        self.progress_printed = step
        rank0.info(f"step {step:5d} loss {record['loss']:.4f} {record['tokens_per_s']:.0f} tokens/s")

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

    def _peer_exit(self, group: WorkerGroup, raised: Fault, alive_at: float) -> Fault | None:
        """A rank whose loop raised (heartbeat `failed`) is often a survivor of a peer that died:
        the peer's broken connections make its collectives fail, and its heartbeat can arrive
        before the dead peer's exit is reaped. The peer that exited within PEER_EXIT_GRACE_S is
        the fault; None if none did."""
        deadline = time.time() + PEER_EXIT_GRACE_S
        while True:
            failed = {r: c for r, c in group.exit_codes().items() if c != 0 and r != raised.rank}
            if failed or time.time() >= deadline:
                return self._exit_fault(failed, alive_at, time.time()) if failed else None
            time.sleep(0.05)

    def _exit_fault(self, failed: dict[int, int], alive_at: float, now: float) -> Fault:
        rank = min(failed, key=lambda r: (failed[r] == -signal.SIGABRT, r))
        code = failed[rank]
        others = "; ".join(f"rank {r} {describe_exit(c)}" for r, c in failed.items() if r != rank)
        detail = describe_exit(code) + (f"; also {others}" if others else "")
        return Fault(EXIT_CAUSES.get(code, "crash"), rank, detail, self.drill_at or alive_at, now, exit_code=code)

    def _repeated_crash(self) -> bool:
        """The last two faults are the same worker exit at the same step with the same error line:
        a deterministic crash (a compiler abort, a bad op), which a restart from the same
        checkpoint replays. A drill or a kill has no error line and is always retried."""
        if len(self.faults) < 2:
            return False
        a, b = self.faults[-2:]
        return (a.exit_code is not None and b.exit_code is not None and bool(b.error) and a.cause == b.cause
                and a.step == b.step and error_key(a.error) == error_key(b.error))

    def _fire_drill(self, group: WorkerGroup, monitor: HeartbeatMonitor, now: float) -> None:
        fired = self.drills.fire(group, monitor.records, monitor.max_step, self.placement, self.shape.nprocs,
                                 self.server, now)
        if fired:
            self.drill_at = now
            self.events.log("drill", fired.pop("summary"), **fired)

    def _check_stragglers(self, now: float) -> Fault | None:
        """Log newly flagged stragglers; the first one is a fault if they are to be evicted."""
        sv, observe = self.job.cfg.supervisor, self.job.cfg.observe
        if not sv.straggler_check_s or not observe.timings or now - self.straggler_check_at < sv.straggler_check_s:
            return None
        self.straggler_check_at = now
        from megascale_jax.observe import stragglers

        try:
            t = read_timings(self.job.run_dir, since=self.attempt_started)
            flagged = stragglers.find_stragglers(t, observe.straggler_threshold, observe.straggler_window)
            slow = stragglers.flag_slow_devices(t, observe.straggler_threshold)
        except (OSError, ValueError) as e:  # timings not written yet, or a torn row
            log.warning(f"warning: straggler check skipped: {e}")
            return None
        complete = [f for f in flagged if f["last_step"] - f["first_step"] + 1 == observe.straggler_window]
        new = [f for f in complete if (f["rank"], f["first_step"], f["last_step"]) not in self.stragglers_seen]
        faults = []
        for f in new:
            self.stragglers_seen.add((f["rank"], f["first_step"], f["last_step"]))
            self.events.log("straggler", f"rank {f['rank']} on {f['host']} arrived {f['lateness']:.0%} of a step "
                            f"late over steps {f['first_step']}-{f['last_step']}", **f)
            faults.append(Fault("straggler", f["rank"], f"{f['lateness']:.0%} of a step late over steps "
                                f"{f['first_step']}-{f['last_step']} (threshold {f['threshold']:.0%})", now, now))
        # A device that computes slowly while its host dispatches on time (profiled steps only).
        for d in (d for d in slow if d["device"] not in self.slow_devices_seen):
            self.slow_devices_seen.add(d["device"])
            where = f"device {d['device']} (dp{d['dp']} pp{d['pp']} tp{d['tp']}) of rank {d['rank']} on {d['host']}"
            self.events.log("slow_device", f"{where} computes {d['excess']:.0%} longer than the median device", **d)
            faults.append(Fault("straggler", d["rank"], f"{where} computes {d['excess']:.0%} longer than the "
                                f"median device (threshold {d['threshold']:.0%})", now, now))
        return faults[0] if faults and sv.evict_stragglers else None

    def _keep_redis_alive(self, monitor: HeartbeatMonitor, now: float) -> None:
        """Restart the embedded server if it died; the workers' next heartbeats land in the new one."""
        if self.server is None or self.server.alive():
            return
        died_at = self.drill_at or now
        self.server.start()
        self.redis_restarted_at = time.time()
        monitor.grace(self.redis_restarted_at)
        self.events.log("redis_restart", f"embedded Redis died; restarted in {time.time() - died_at:.2f}s",
                        latency_s=now - died_at, restart_s=time.time() - died_at)

    def _note_heartbeats_back(self, monitor: HeartbeatMonitor, finished: set[int], now: float) -> None:
        """After a Redis restart: one event once every running rank's heartbeat reached the new server."""
        running = set(range(self.shape.nprocs)) - finished
        if self.redis_restarted_at and all(monitor.arrived.get(r, 0) > self.redis_restarted_at for r in running):
            self.events.log("heartbeats_resumed", f"all heartbeats back {now - self.redis_restarted_at:.2f}s "
                            "after the Redis restart", since_restart_s=now - self.redis_restarted_at)
            self.redis_restarted_at = None

    # ------------------------------------------------------------------ after a fault

    def _diagnose(self, restarts: int) -> dict[int, str]:
        if self.job.diagnose_args is None:
            return {}
        env = {**self.job.env, **self.drills.diagnosis_env(self.placement)}
        report = diagnose.run([*self.job.diagnose_args, *self._shape_overrides()], self.shape.nprocs,
                              self.redis_url, f"{self.job.job_id}-diag{restarts}", env,
                              run_dirs.logs_dir(self.job.run_dir), pool=self.diagnose_pool,
                              slots=self.placement.active)
        log.info("diagnostics:\n" + report.table())
        faulty = report.faulty()
        verdict = ", ".join(f"rank {r}: {why}" for r, why in faulty.items()) or "all ranks healthy"
        self.events.log("diagnosis", verdict, faulty={str(r): why for r, why in faulty.items()},
                        duration_s=report.duration_s, restarts=restarts)
        return faulty

    def _shape_overrides(self) -> list[str]:
        """The overrides of a shrunk mesh (none before a shrink)."""
        cfg = self.job.cfg
        return [] if self.shape == Shape(self.job.nprocs, cfg.mesh.dp, cfg.parallel.microbatches) \
            else self.shape.overrides()

    def _evict(self, faulty: dict[int, str]) -> str:
        """Exclude the faulty ranks' slots for the rest of the job, then give their ranks spares,
        or shrink (placement.py); '' when the next attempt can run, else why not."""
        sv = self.job.cfg.supervisor
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
        if self.placement.complete:
            return ""
        if sv.on_no_spare == "stop":
            return "a faulty rank was excluded and no spare is left (supervisor.on_no_spare=stop)"
        try:
            shape = shrunk(self.job.cfg, self.shape, self.placement.healthy(), self.devices_per_process)
        except ConfigError as e:
            return str(e)
        self.events.log("shrink", f"no spare left: resuming on dp={shape.dp} x {shape.microbatches} microbatches "
                        f"({shape.nprocs} processes) instead of dp={self.shape.dp} x {self.shape.microbatches}; "
                        "same global batch", dp=shape.dp, microbatches=shape.microbatches, nprocs=shape.nprocs,
                        was={"dp": self.shape.dp, "microbatches": self.shape.microbatches,
                             "nprocs": self.shape.nprocs})
        self.placement.shrink(shape.nprocs)
        self.shape = shape
        return ""

    def _prepare_restart(self, restarts: int) -> tuple[int, str | None]:
        """The step the next attempt resumes from and what from ("checkpoint", "memory snapshot",
        None for step 0): the newest of the committed checkpoints and of the memory snapshots
        every process of the next attempt holds on this host (training/snapshot.py; the workers
        may still reject one and fall back)."""
        cfg = self.job.cfg
        steps = run_dirs.committed_steps(run_dirs.checkpoint_dir(cfg, self.job.run_dir))
        held = run_dirs.snapshot_steps(run_dirs.snapshot_dir(cfg, self.job.run_dir), self.shape.nprocs) \
            if cfg.checkpoint.memory_every else []
        if held and (not steps or held[-1] > steps[-1]):
            return held[-1], "memory snapshot"
        if steps:
            return steps[-1], "checkpoint"
        # A worker refuses a run directory with metrics but no checkpoint: set them aside, kept.
        metrics = run_dirs.metrics_path(self.job.run_dir)
        if os.path.exists(metrics):
            os.replace(metrics, f"{metrics}.before-restart-{restarts}")
        return 0, None

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
        log.info("\n".join(lines))
        return 1
