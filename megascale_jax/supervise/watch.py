"""`python -m megascale_jax.supervise.watch`: the hang watcher of a SLURM job step.

Under SLURM no driver reads the workers' heartbeats (configs/cluster/sbatch.sh is the one
supervisor in the allocation). A task that dies ends the step through srun, and a task whose
process stops (SIGSTOP, a wedged host) through JAX's coordination service; but a task that hangs
while its threads live — a deadlock in the step, a stuck collective — keeps beating to both, and
its peers wait for it without end. The batch script runs this module beside each `srun` step:

* it reads the step's Redis heartbeats with the supervisor's own `detect.HeartbeatMonitor` — the
  same rules and settings as under `launch`: a hang is `supervisor.hang_timeout_s` of silence, a
  stall that long (`supervisor.stall_floor_s`, or `supervisor.stall_steps` x the recent step time)
  without a step in state `training`; start-up (joining, restoring, compiling) is allowed
  `--startup-timeout` (300 s, launch's default), as is the first step after it; a checkpoint or
  an evaluation restarts the step clock; a rank `done` is not judged; while Redis is unreachable
  nothing is; once a rank says `interrupted` (scancel, a preemption: they checkpoint and exit)
  nothing is either;
* when the monitor names a fault, it records it in RUN_DIR/events.jsonl — a `fault` event as the
  supervisor's, with every rank's last state and step and the ranks that made no progress — and
  ends the step at once: `scancel --signal=KILL` of the step named `--step-name` (sbatch.sh names
  each `srun` step by its rendezvous job id). srun fails, and the script's path for a failed step
  takes over: diagnostics, then a restart in the allocation from the newest checkpoint.
  SIGKILL, not the step's SIGTERM: a deadlocked loop never acts on the stop request its SIGTERM
  handler makes, and SLURM would wait `KillWait` (30 s by default) before its SIGKILL. The same
  holds for an end a rank says in its heartbeat before its exit (an unreadable checkpoint: its
  peer waits in the restore's barrier, which no SIGTERM ends); a loop that raised (`failed`) is
  given EXIT_GRACE_S first, for srun to see its exit.

It decides nothing else: what follows a failed step (diagnose, restart, requeue) is the script's.
The script ends the watcher when the step ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from megascale_jax import cli
from megascale_jax.cluster import redis_auth
from megascale_jax.config import ConfigError, load_config
from megascale_jax.supervise.detect import Fault, HeartbeatMonitor, log_worker_events
from megascale_jax.supervise.events import EventLog

log = cli.get_logger("supervise.watch", tag="[watch] ")

EXIT_GRACE_S = 5.0  # a rank whose loop raised: how long srun has to see its exit before the watcher ends the step


class StepWatch:
    """One step's heartbeats (a `HeartbeatMonitor`) and the decision to end it: `judge` each poll."""

    def __init__(self, monitor: HeartbeatMonitor, events: EventLog):
        self.monitor, self.events = monitor, events
        self.raised_seen: dict[int, float] = {}  # rank -> when its `failed` state was first judged

    def judge(self, now: float) -> Fault | None:
        """Read the heartbeats; the fault to end the step for, or None."""
        monitor = self.monitor
        if not monitor.poll(now):  # Redis unreachable: silence proves nothing
            return None
        fault = log_worker_events(monitor, self.events)  # NaN triages; a failed device self-test is a fault
        if any(r.get("state") == "interrupted" for r in monitor.records.values()):
            return None  # a stop request: every task checkpoints and exits
        fault = fault or monitor.check(now, finished=set())
        if fault and fault.cause == "crash" and fault.exit_code is None:
            # The rank's loop raised and it is exiting: srun sees the exit and ends the step. The
            # watcher steps in only if that exit does not come (it can wait on a peer at JAX's shutdown).
            if now - self.raised_seen.setdefault(fault.rank, now) < EXIT_GRACE_S:
                return None
        return fault

    def ranks(self, now: float) -> dict[str, dict]:
        """Every rank's last state and step, with the seconds since its heartbeat last changed and
        since its step last advanced."""
        m = self.monitor
        return {str(rank): {"state": record["state"], "step": record["step"],
                            "silent_s": round(now - m.arrived[rank], 1) if rank in m.arrived else None,
                            "no_progress_s": round(now - m.step_since[rank][1], 1) if rank in m.step_since else None}
                for rank, record in sorted(m.records.items())}

    def stuck(self, now: float) -> list[int]:
        """The ranks not done whose heartbeat or step has stood still for over half the hang timeout
        (a healthy rank's heartbeat changes every `heartbeat_s`, its step every step)."""
        m, half = self.monitor, self.monitor.hang_timeout_s / 2
        return [rank for rank in range(len(m.keys))
                if m.records.get(rank, {}).get("state") != "done"
                and (rank not in m.arrived or now - m.arrived[rank] > half
                     or (rank in m.step_since and now - m.step_since[rank][1] > half))]

    def record(self, fault: Fault, now: float, **fields) -> dict:
        """The `fault` event, with the supervisor's fields (supervisor._record) and what the ranks said."""
        step = self.monitor.max_step
        fault.step = step
        stuck = self.stuck(now)
        return self.events.log(
            "fault", f"{fault.cause} of rank {fault.rank} ({fault.detail}); detected in {fault.latency_s:.2f}s at step "
            f"{step}; no progress on rank(s) {', '.join(map(str, stuck)) or 'none'}"
            + (f": {fault.error}" if fault.error else ""),
            cause=fault.cause, rank=fault.rank, detail=fault.detail, latency_s=fault.latency_s, step=step,
            error=fault.error, exit_code=fault.exit_code, stuck_ranks=stuck, ranks=self.ranks(now),
            detected_at=fault.detected, detected_by="watch", **fields)


def slurm_steps(slurm_job: str, name: str, run=subprocess.run) -> list[str]:
    """The ids (JOBID.STEPID) of job `slurm_job`'s running steps named `name`."""
    done = run(["squeue", "-h", "--steps", "-j", slurm_job, "-o", "%i %j"], capture_output=True, text=True,
               timeout=30)
    return [step for step, _, step_name in (line.strip().partition(" ") for line in done.stdout.splitlines())
            if step_name == name] if done.returncode == 0 else []


def end_step(slurm_job: str, name: str, run=subprocess.run, tries: int = 5) -> list[str]:
    """SIGKILL every task of the step(s) named `name` (scancel by step id); the steps ended, [] if
    none was found (after `tries` looks, a second apart: the controller may be busy)."""
    for attempt in range(tries):
        steps = slurm_steps(slurm_job, name, run)
        if steps:
            for step in steps:
                run(["scancel", "--signal=KILL", step], timeout=30)
            return steps
        if attempt + 1 < tries:
            time.sleep(1.0)
    return []


def parse_args(argv):
    parser = cli.ArgumentParser(prog="python -m megascale_jax.supervise.watch", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="the tasks' YAML config (its supervisor: section)")
    parser.add_argument("--run-dir", required=True, help="the tasks' run directory (events.jsonl)")
    parser.add_argument("--redis", required=True, metavar="redis://[USER@]HOST:PORT",
                        help=f"the job's Redis; its password in ${redis_auth.PASSWORD_FILE_ENV} or "
                             f"${redis_auth.PASSWORD_ENV}")
    parser.add_argument("--job", required=True, help="the tasks' rendezvous job id (their --job)")
    parser.add_argument("--nprocs", type=int, required=True, help="the step's task count")
    parser.add_argument("--step-name", default=None, help="the SLURM step to end on a fault (default: --job)")
    parser.add_argument("--slurm-job", default=os.environ.get("SLURM_JOB_ID"),
                        help="the SLURM job id (default: $SLURM_JOB_ID)")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds a task may take to its first heartbeat and first step (launch's default)")
    parser.add_argument("--restarts", type=int, default=0, help="the restarts before this step (for the event)")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between two reads of the heartbeats")
    parser.add_argument("overrides", nargs="*", help="the tasks' dotted overrides")
    return cli.parse(parser, argv)


def main(argv=None) -> int:
    """Watch until a fault, end the step and return 0 (the script ends the watcher when the step
    ends without one); 2 on bad arguments."""
    args = parse_args(argv)
    cli.setup_logging()
    try:
        if not args.slurm_job:
            raise ConfigError("no SLURM job: run inside one (SLURM_JOB_ID) or pass --slurm-job")
        sv = load_config(args.config, args.overrides).supervisor
        client = redis_auth.connect(args.redis, timeout_s=1.0)
    except (ConfigError, redis_auth.RedisAuthError) as e:
        return cli.user_error(e)
    name = args.step_name or args.job
    monitor = HeartbeatMonitor(client, args.job, args.nprocs, sv.hang_timeout_s, args.startup_timeout, time.time(),
                               sv.stall_steps, sv.stall_floor_s)
    watch = StepWatch(monitor, EventLog(args.run_dir))
    while (fault := watch.judge(now := time.time())) is None:
        time.sleep(args.poll)
    steps = end_step(args.slurm_job, name)
    watch.record(fault, now, job=args.job, restarts=args.restarts, slurm_steps=steps)
    if steps:
        log.info(f"ended step {', '.join(steps)} ({name}) with SIGKILL")
    else:
        log.warning(f"warning: no running step named {name} in SLURM job {args.slurm_job} to end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
