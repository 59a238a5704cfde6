"""Fault detection, the driver's first step: what went wrong, with which rank, and when.

Each kind of fault comes with its latency (detection time minus the fault's time: a drill's
injection, else the last sign of health):
* crash — a worker exits non-zero or by a signal (noticed within one poll). Survivors of a dead
  JAX peer abort with SIGABRT later; the first non-aborted exit is blamed (`exit_fault`). A
  rank whose loop raised defers to a peer that exits a moment later (`peer_exit`).
* hang — a worker's heartbeat stops changing for `supervisor.hang_timeout_s` (e.g. SIGSTOP).
* stall — heartbeats go on but the step does not advance in state `training` (a stuck collective)
  for `supervisor.stall_floor_s`, or `supervisor.stall_steps` times the rank's recent median step if longer
  (an overloaded host's slow phase, or a model whose steps take longer than the timeout).
* nan_triage — the workers replay a non-finite step once themselves (training/triage.py) and
  report it in their heartbeats: finite → `transient` (logged; training goes on; a device whose
  self-test failed is a `device` fault), non-finite again → `diverged`, below
  (`log_worker_events`).
* diverged — exit code 3 (non-finite loss, again when replayed).
* unreadable_checkpoint — exit code 4: a process found the newest checkpoint damaged and moved it
  aside (training/checkpoint.py); every process falls back to the previous one on the restart.
* not_saved — exit code 5: the run's final checkpoint could not be written (a full disk); the
  newest good checkpoint is older, and a restart would fail the same way until space is freed.
* config_error — exit code 2: a user mistake, or a control plane the worker refused to trust (a
  Redis password refused, a coordinator record that fails verification: cluster/rendezvous.py).
* straggler — every `supervisor.straggler_check_s` the driver runs the straggler statistic on
  the last `observe.straggler_window` steps of the workers' phase timings
  (`stragglers.find_stragglers(trailing=True)`) and logs each newly flagged rank as a `straggler`
  event (once per window of steps), and each device that computes slowly in profiled
  steps (`observe.profile_every`, `stragglers.flag_slow_devices`) as a `slow_device` event;
  with `supervisor.evict_stragglers=true` the first of them is also a fault (`StragglerWatch`).
What is done about a fault is policy.py's decision; this module only names it (`Fault`).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import statistics
import time
from typing import Callable

import redis

from megascale_jax.cli import EXIT_CONFIG_ERROR, EXIT_DIVERGED, EXIT_NOT_SAVED, EXIT_UNREADABLE_CHECKPOINT, get_logger
from megascale_jax.cluster.rendezvous import HEARTBEAT_FIELDS, heartbeat_key
from megascale_jax.config import Config
from megascale_jax.observe.hangs import describe_exit
from megascale_jax.observe.timings import read_timings
from megascale_jax.supervise.events import EventLog

log = get_logger("supervise", tag="[supervisor] ")

PEER_EXIT_GRACE_S = 1.0  # how long a raised loop waits for a peer's exit to be seen (see peer_exit)
EXIT_CAUSES = {EXIT_CONFIG_ERROR: "config_error", EXIT_DIVERGED: "diverged", EXIT_UNREADABLE_CHECKPOINT: "unreadable_checkpoint",
               EXIT_NOT_SAVED: "not_saved",
               -signal.SIGABRT: "aborted"}


@dataclasses.dataclass
class Fault:
    cause: str  # crash | aborted | hang | stall | diverged | config_error | unreadable_checkpoint | straggler | device
    rank: int | None
    detail: str
    at: float  # wall time of the fault
    detected: float  # wall time of its detection
    log_tail: list[str] = dataclasses.field(default_factory=list)  # the faulty rank's last log lines
    error: str = ""  # the line that names the cause: the worker's heartbeat's, else its log's (workers.last_error_line)
    step: int | None = None  # the highest step any heartbeat reported before the fault
    exit_code: int | None = None  # the faulty worker's exit code (negative: the signal), if it exited

    @property
    def latency_s(self) -> float:
        return self.detected - self.at


# ============================================================================ worker exits


def exit_fault(failed: dict[int, int], at: float, now: float) -> Fault:
    """The fault of the workers that exited non-zero (rank -> exit code), `at` the fault's time.
    A SIGABRT is the survivors' reaction to a dead peer: the first other exit is blamed, an exit
    that names its cause (EXIT_CAUSES) before a plain crash."""
    rank = min(failed, key=lambda r: (failed[r] == -signal.SIGABRT, failed[r] not in EXIT_CAUSES, r))
    code = failed[rank]
    others = "; ".join(f"rank {r} {describe_exit(c)}" for r, c in failed.items() if r != rank)
    detail = describe_exit(code) + (f"; also {others}" if others else "")
    return Fault(EXIT_CAUSES.get(code, "crash"), rank, detail, at, now, exit_code=code)


def _exits_within_grace(group, enough: Callable[[dict[int, int]], bool]) -> dict[int, int]:
    """The workers' exit codes so far (rank -> code) once `enough` of them are seen, waiting up to
    PEER_EXIT_GRACE_S. `group`: a workers.WorkerGroup."""
    deadline = time.time() + PEER_EXIT_GRACE_S
    while not enough(codes := group.exit_codes()) and time.time() < deadline:
        time.sleep(0.05)
    return codes


def with_explained_exit(group, failed: dict[int, int]) -> dict[int, int]:
    """`failed` (rank -> exit code), with the exits that follow within PEER_EXIT_GRACE_S when
    every one so far is a Python exception (exit code 1): often a survivor's failed collective
    after a peer exited with a cause of its own (an unreadable checkpoint, exit code 4), which
    `exit_fault` then blames. A kill or an explained exit is taken at once."""
    if set(failed.values()) != {1}:
        return failed
    codes = _exits_within_grace(group, lambda codes: len(codes) == len(group.processes)
                                or any(c not in (0, 1) for c in codes.values()))
    return {r: c for r, c in codes.items() if c != 0}


def await_exit(group, rank: int) -> int | None:
    """`rank`'s exit code once it exits, waiting up to PEER_EXIT_GRACE_S; None if it has not."""
    return _exits_within_grace(group, lambda codes: rank in codes).get(rank)


def peer_exit(group, raised: Fault, at: float) -> Fault | None:
    """A rank whose loop raised (heartbeat `failed`) is often a survivor of a peer that died:
    the peer's broken connections make its collectives fail, and its heartbeat can arrive
    before the dead peer's exit is reaped. The peer that exited within PEER_EXIT_GRACE_S is
    the fault (`at` its time) — or the raised rank itself when its exit names the cause
    (EXIT_CAUSES: an unreadable checkpoint, a divergence); None if neither. `group`: a
    workers.WorkerGroup."""
    def blamable(codes):
        return {r: c for r, c in codes.items() if c != 0 and (r != raised.rank or c in EXIT_CAUSES)}
    failed = blamable(_exits_within_grace(group, lambda codes: bool(blamable(codes))))
    return exit_fault(failed, at, time.time()) if failed else None


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


# A worker's last state, said before its exit (which may wait on JAX's shutdown): the fault it names.
ENDED_BY = {"diverged": ("diverged", "non-finite loss or gradient norm (see its log)"),
            "unreadable_checkpoint": ("unreadable_checkpoint", "the newest checkpoint is unreadable (see its log)"),
            "failed": ("crash", "the training loop raised (see its log)")}  # its exception is in its log
# Ends a worker diagnosed in itself, never a symptom of a peer's fault ("failed" can be: a peer
# that died makes the others' collectives raise): `HeartbeatMonitor.check` looks for these first.
SELF_DIAGNOSED = ("diverged", "unreadable_checkpoint")
STARTUP_STATES = ("initialising", "compiling")  # bounded by the startup timeout, not the hang timeout
START_PHASES = (*STARTUP_STATES, "training")  # in order; the `started` and `resumed` events time them
RECENT_STEPS = 10  # the step times a stall is judged against (supervisor.stall_steps)


class HeartbeatMonitor:
    """Reads the heartbeats of one attempt's workers and notices those that stop or stall.

    Times are the driver's arrival times of changed records, not the workers' clocks."""

    def __init__(self, client: redis.Redis, job: str, nprocs: int, hang_timeout_s: float,
                 startup_timeout_s: float, now: float, stall_steps: float = 5.0, stall_floor_s: float | None = None):
        self.client, self.keys = client, [heartbeat_key(job, r) for r in range(nprocs)]
        self.hang_timeout_s, self.startup_timeout_s, self.stall_steps = hang_timeout_s, startup_timeout_s, stall_steps
        # silence and a slow step are judged apart: the floor defaults to the silence timeout
        self.stall_floor_s = hang_timeout_s if stall_floor_s is None else stall_floor_s
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
        # logged already: (step, outcome) of NaN triages, ("damaged", step) of damaged checkpoints
        self.triaged: set[tuple] = set()
        self.reachable = True
        # rank -> the longest time between two of its heartbeats while it trained, by its own clock:
        # how close a healthy rank came to hang_timeout_s (a silence that ends the attempt is never
        # closed by a beat). The worker's clock, not the arrivals: a driver busy for a while (a
        # drill's files, a straggler check) sees the next beat late, yet judges no hang for it.
        self.longest_silence: dict[int, float] = {}

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
                self._track_silence(rank, self.records.get(rank), record)
                self.arrived[rank] = now
                self._track_step_time(rank, record)
                self._track_progress(rank, record, now)
                self._track_start(rank, record["state"], now)
                phase = "startup" if record["state"] in STARTUP_STATES else record["state"]
                if self.state_since.get(rank, ("",))[0] != phase:
                    self.state_since[rank] = (phase, now)
            self.records[rank] = record
        return True

    def _track_silence(self, rank: int, before: dict | None, record: dict) -> None:
        """The gap between two beats in state training: exact when no beat came between them, else
        their mean gap (the driver read only the last of several)."""
        if not before or before.get("state") != "training" or record["state"] != "training":
            return
        beats = record["seq"] - before["seq"]
        if beats > 0 and isinstance(record.get("time"), (int, float)) and isinstance(before.get("time"), (int, float)):
            gap = (record["time"] - before["time"]) / beats
            self.longest_silence[rank] = max(self.longest_silence.get(rank, 0.0), gap)

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
        """How long a step may take before it is a stall: stall_floor_s, or stall_steps times the
        rank's median step over its last RECENT_STEPS (heartbeat samples), whichever is longer."""
        times = self.step_times.get(rank)
        return max(self.stall_floor_s, self.stall_steps * statistics.median(times.values())) if times \
            else self.stall_floor_s

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

    def _ended(self, rank: int, state: str, now: float) -> Fault:
        cause, detail = ENDED_BY[state]
        return Fault(cause, rank, detail, self.arrived[rank], now, error=self.records[rank].get("error", ""))

    def check(self, now: float, finished: set[int]) -> Fault | None:
        """A rank that ended by an error, or a hang or stall among the ranks still running, if any.
        An end a rank diagnosed in itself (SELF_DIAGNOSED: divergence, an unreadable checkpoint)
        is the cause even where a peer also looks silent (waiting on that rank, or its beat
        late), so it is looked for first. In a stuck collective every rank stalls at the same
        step: the one blamed is the one that arrived at the fewest steps."""
        running = [rank for rank in range(len(self.keys)) if rank not in finished]
        for rank in running:
            state = self.records.get(rank, {}).get("state")
            if state in SELF_DIAGNOSED:
                return self._ended(rank, state, now)
        stalled = []
        for rank in running:
            state = self.records.get(rank, {}).get("state")
            if state in ENDED_BY:
                return self._ended(rank, state, now)
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


def log_worker_events(monitor: HeartbeatMonitor, events: EventLog) -> Fault | None:
    """The workers' own events (heartbeat `events`), each logged once: every process reports
    the same NaN triage (the loss is all-reduced), with its own device self-test, and the same
    damaged checkpoint it went past (training/checkpoint.py: wrong values, found by every process
    at once). A failed self-test is a fault of that rank."""
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
                # the verdict of a NaN the workers replayed finite on healthy devices (supervise/verdict.py);
                # a diverged one is a fault, judged by the driver, as is a failed self-test (below)
                said = {"verdict": "transient NaN"} if fields["outcome"] == "transient" and test.get("ok") else {}
                events.log("nan_triage", f"step {fields['step']} {what}", rank=rank, **fields, **said)
            if event["kind"] == "damaged_checkpoint" and ("damaged", fields["step"]) not in monitor.triaged:
                monitor.triaged.add(("damaged", fields["step"]))  # every process found it: said once
                events.log("damaged_checkpoint", f"checkpoint step {fields['step']} is damaged ({fields['error']}): "
                           "moved aside, and every process went on from the one before in this attempt",
                           rank=rank, **fields, verdict="damaged checkpoint")
            if test and not test.get("ok") and fault is None:
                fault = Fault("device", rank, f"device self-test failed after a transient NaN at step "
                              f"{fields['step']}: {test}", time.time(), time.time())
    return fault


# ============================================================================ stragglers


class StragglerWatch:
    """The periodic straggler check over the last `observe.straggler_window` steps of the run's
    phase timings, and what it already logged: a flagged rank is one event per window of steps,
    each slow device one event per job."""

    def __init__(self, cfg: Config, run_dir: str, events: EventLog):
        self.cfg, self.run_dir, self.events = cfg, run_dir, events
        self.flagged_until: dict[int, int] = {}  # rank -> the last step of its last logged window, this attempt
        self.attempt_since: float | None = None
        self.slow_devices_seen: set[int] = set()  # device ids already logged
        self.checked_at = 0.0

    def check(self, now: float, since: float) -> Fault | None:
        """Log newly flagged stragglers among the timings written since `since` (the attempt's
        start); the first one is a fault if they are to be evicted."""
        sv, observe = self.cfg.supervisor, self.cfg.observe
        if not sv.straggler_check_s or not observe.timings or now - self.checked_at < sv.straggler_check_s:
            return None
        self.checked_at = now
        if since != self.attempt_since:  # a new attempt: its timings (and ranks) start afresh
            self.flagged_until.clear()
            self.attempt_since = since
        from megascale_jax.observe import stragglers

        try:
            t = read_timings(self.run_dir, since=since)
            flagged = stragglers.find_stragglers(t, observe.straggler_threshold, observe.straggler_window,
                                                 trailing=True)
            slow = stragglers.flag_slow_devices(t, observe.straggler_threshold)
        except (OSError, ValueError) as e:  # timings not written yet, or a torn row
            log.warning(f"warning: straggler check skipped: {e}")
            return None
        complete = [f for f in flagged if f["last_step"] - f["first_step"] + 1 == observe.straggler_window]
        # A trailing window moves with every check: a rank late for long is logged once per
        # window of steps (windows that do not overlap the one logged), not at every check.
        new = [f for f in complete if f["first_step"] > self.flagged_until.get(f["rank"], 0)]
        faults = []
        for f in new:
            self.flagged_until[f["rank"]] = f["last_step"]
            self.events.log("straggler", f"rank {f['rank']} on {f['host']} arrived {f['lateness']:.0%} of a step "
                            f"late over steps {f['first_step']}-{f['last_step']}", **f)
            faults.append(Fault("straggler", f["rank"], f"{f['lateness']:.0%} of a step late over steps "
                                f"{f['first_step']}-{f['last_step']} (threshold {f['threshold']:.0%})", now, now))
        # A device that computes slowly while its host dispatches on time (profiled steps only).
        for d in (d for d in slow if d["device"] not in self.slow_devices_seen):
            self.slow_devices_seen.add(d["device"])
            where = f"device {d['device']} ({d['coords']}) of rank {d['rank']} on {d['host']}"
            self.events.log("slow_device", f"{where} computes {d['excess']:.0%} longer than the median device", **d)
            faults.append(Fault("straggler", d["rank"], f"{where} computes {d['excess']:.0%} longer than the "
                                f"median device (threshold {d['threshold']:.0%})", now, now))
        return faults[0] if faults and sv.evict_stragglers else None
