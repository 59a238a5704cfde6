"""Faults the driver injects on purpose (`launch --drill`, tests, bench/resilience/ettr.py), and the state
they leave behind: slots a `faulty` drill broke (they fail diagnostics from then on) and slots a
`slow` drill made stragglers (whichever worker runs there is slowed, attempt after attempt).

Worker-side injections (a corrupted batch, a late arrival) are armed through the environment of
every attempt (cluster/faults.py) and triggered by a signal once the worker trains: its handlers
are installed by then, and before, SIGUSR1/SIGUSR2 would end it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time

from megascale_jax import run_dir as run_dirs
from megascale_jax.config import Config


@dataclasses.dataclass(frozen=True)
class Drill:
    """A fault the driver injects on purpose (tests, bench/resilience/ettr.py), `KIND[:RANK]@WHEN`: WHEN is a
    step (fires when a heartbeat first reports it) or `t` + seconds since the launch; drills fire
    once, in the order given, one a poll of the driver (0.1 s apart: a second drill at the same
    step lands in the recovery from the first), except that `KIND:R1,R2@WHEN` hits several ranks
    in one poll (`together`: two faults at once).
    * `kill:RANK` SIGKILL; `stop:RANK` SIGSTOP (a hang); `redis` kills the embedded Redis server;
    * `faulty:RANK` breaks the rank's slot like a broken GPU: SIGKILL now, and diagnostics name it
      every time they run there;
    * `host:RANK` loses the rank's whole host: SIGKILL now, the host's memory snapshots wiped (a
      machine's RAM goes with it: its state must come from a peer's copy or disk), and the slot
      unreachable from then on (`lost_hosts`: no diagnostics run there);
    * `slow:RANK` makes the rank's slot a straggler: from now on whichever worker runs there
      arrives late at every step (it sleeps half a step before each, `MEGASCALE_FAULT_SLOW`);
    * `corrupt` damages the newest committed checkpoint, wipes every host's memory snapshots (the
      whole job rescheduled on fresh machines: else a newer snapshot would be restored and the
      damage never read), then SIGKILLs rank 0: the restart must find the damage and fall back to
      the previous checkpoint;
    * `return` gives the job back the slot it excluded first (its host repaired or replaced), as an
      operator would: a line in RUN_DIR/returned_hosts.txt (placement.py); waits for an excluded slot;
    * `nan:RANK` makes the rank corrupt one batch (a one-off NaN, `MEGASCALE_FAULT_NAN`): at a step,
      that step's batch (armed in the workers' environment); at a time, the next batch (SIGUSR1)."""

    kind: str
    rank: int | None
    step: int | None = None
    at_s: float | None = None
    together: bool = False  # fires in the same poll as the drill before it (KIND:R1,R2@WHEN)

    KINDS = ("kill", "stop", "faulty", "host", "slow", "nan", "redis", "corrupt", "return")
    RANKLESS = ("redis", "corrupt", "return")

    @classmethod
    def parse(cls, spec: str) -> "Drill":
        target, _, when = spec.partition("@")
        kind, _, rank = target.partition(":")
        timed = when.startswith("t")
        try:
            at = float(when[1:]) if timed else int(when)
        except ValueError:
            at = None
        if kind not in cls.KINDS or at is None or at < 0 or (kind not in cls.RANKLESS) != rank.isdigit():
            raise ValueError(f"--drill {spec!r} must be KIND:RANK@STEP or KIND:RANK@tSECONDS with KIND one of "
                             "kill, stop, faulty, host, slow, nan; or redis@STEP, corrupt@STEP, return@STEP (or @tSECONDS)")
        return cls(kind, int(rank) if rank else None, None if timed else at, at if timed else None)

    @classmethod
    def parse_all(cls, spec: str) -> list["Drill"]:
        """`KIND:R1,R2,...@WHEN`: one drill a rank, fired together; otherwise `parse`'s one."""
        target, _, when = spec.partition("@")
        kind, _, ranks = target.partition(":")
        if "," not in ranks:
            return [cls.parse(spec)]
        drills = [cls.parse(f"{kind}:{rank}@{when}") for rank in ranks.split(",")]
        return [drills[0]] + [dataclasses.replace(d, together=True) for d in drills[1:]]

    def due(self, step: int, elapsed_s: float) -> bool:
        return step >= self.step if self.step is not None else elapsed_s >= self.at_s


SLOW_FRACTION = 0.5  # the `slow` drill: of a step, slept before each dispatch


def damage_newest_checkpoint(cfg: Config, run_dir: str) -> str:
    """The `corrupt` drill: overwrite 4 KiB in the middle of the largest file of the newest
    committed checkpoint's state with random bytes (a torn write, a bad disk); returns what."""
    steps = run_dirs.committed_steps(run_dirs.checkpoint_dir(cfg, run_dir))
    if not steps:
        return "no checkpoint (none committed yet)"
    state = os.path.join(run_dirs.checkpoint_dir(cfg, run_dir), str(steps[-1]), "state")
    files = [os.path.join(d, f) for d, _, names in os.walk(state) for f in names]
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) // 2)
        f.write(os.urandom(4096))
    return f"checkpoint step {steps[-1]} ({os.path.relpath(target, run_dir)})"


HELD_KINDS = ("kill", "stop", "faulty", "host")  # drills the driver fires on a process at a step


class Drills:
    """The drills still to fire, in order, and what the fired ones broke."""

    def __init__(self, drills: list[Drill], cfg: Config, run_dir: str):
        self.pending = list(drills)
        self.cfg, self.run_dir = cfg, run_dir
        self.broken_slots: set[int] = set()  # `faulty`: they fail diagnostics
        self.lost_slots: set[int] = set()  # `host`: unreachable, no process runs there any more
        self.slow_slots: set[int] = set()  # `slow`: their workers arrive late
        self.slowed: set[int] = set()  # ranks on slow slots signalled in this attempt
        self.started = time.time()  # drills at a time count from here

    def attempt_env(self, shrunk: bool = False) -> dict:
        """The environment that arms this attempt's workers (and forgets the last attempt's ranks);
        `shrunk`: the attempt runs on fewer replicas than configured (a `return` drill grows it)."""
        self.slowed = set()
        env = {}
        nan = next((d for d in self.pending if d.kind == "nan"), None)
        if nan:  # armed until it fired: an attempt that dies before passes it on to the next
            env["MEGASCALE_FAULT_NAN"] = f"{nan.rank}:{nan.step}" if nan.step is not None else "usr1"
        if self.slow_slots or any(d.kind == "slow" for d in self.pending):
            env["MEGASCALE_FAULT_SLOW"] = f"usr2:{SLOW_FRACTION}"
        # The next drill that ends a process at a step: that process waits before step + 2 (the
        # heartbeats report a step one step late), so the drill fires at its step, however late
        # this driver's poll of a fast run comes on a loaded machine (cluster/faults.py).
        held = next((d for d in self.pending if (d.kind in HELD_KINDS or d.kind == "return" and shrunk)
                     and d.step is not None), None)
        if held and held.kind == "return":
            # The grow it brings waits for the next snapshot: rank 0 waits right after the first
            # one at or past step + 2, so a fast run cannot end before the driver grows it.
            every = self.cfg.checkpoint.memory_every or self.cfg.checkpoint.every
            env["MEGASCALE_FAULT_HOLD"] = f"0:{-(-(held.step + 2) // every) * every + 1}"
        elif held:
            env["MEGASCALE_FAULT_HOLD"] = f"{held.rank}:{held.step + 2}"
        return env

    def diagnosis_env(self, placement) -> dict:
        """A broken slot's rank contributes wrong values to the diagnostics' collectives (every
        broken rank's: two faults at once are two ranks blamed)."""
        from megascale_jax.supervise.diagnose import FAULT_ENV

        broken = [str(rank) for rank, slot in enumerate(placement.active) if slot in self.broken_slots]
        return {FAULT_ENV: ",".join(broken)} if broken else {}

    def lost_hosts(self, placement) -> dict[int, str]:
        """Rank -> host, of the active slots whose host a `host` drill took: unreachable, as a
        lost machine is to the driver's probe — no diagnostics process can run there, so the
        diagnostics never speak for it (before, the lost slot ran them as a broken one and read as
        "wrong values in collectives": a silent-data-corruption verdict for a machine that died)."""
        return {rank: placement.hosts[slot] for rank, slot in enumerate(placement.active) if slot in self.lost_slots}

    def fire(self, group, records: dict, step: int, placement, nprocs: int, server, now: float) -> dict | None:
        """Fire the next drill if it is due: the `drill` event's fields (with its `summary`)."""
        if not self.pending or not self.pending[0].due(step, now - self.started):
            return None
        drill = self.pending[0]
        rank = drill.rank if drill.rank is None or drill.rank < nprocs else 0  # after a shrink
        if drill.kind == "nan" and drill.step is None and records.get(rank, {}).get("state") != "training":
            return None  # not before its SIGUSR1 handler is installed
        if drill.kind == "return" and not placement.excluded:
            return None  # nothing to give back yet
        self.pending.pop(0)
        host = placement.hosts[placement.active[rank if rank is not None else 0]]
        if drill.kind == "return":
            host = placement.hosts[min(placement.excluded)]
            run_dirs.append_lines(run_dirs.returned_hosts_path(self.run_dir), [host])
            what = f"gave back {host} (repaired)"
        elif drill.kind == "redis":
            server.process.kill()
            what = "killed the Redis server"
        elif drill.kind == "faulty":  # a broken machine: it crashes now and fails every diagnosis
            self.broken_slots.add(placement.active[rank])
            group.signal(rank, signal.SIGKILL)
            what = f"broke the slot of rank {rank} ({host}): killed, and it fails diagnostics from now on"
        elif drill.kind == "host":  # a lost machine: its processes and its RAM
            self.lost_slots.add(placement.active[rank])
            group.signal(rank, signal.SIGKILL)
            ram = run_dirs.host_snapshot_dir(run_dirs.snapshot_dir(self.cfg, self.run_dir), host)
            shutil.rmtree(ram, ignore_errors=True)
            what = f"lost the host of rank {rank} ({host}): killed, its memory snapshots wiped ({ram})"
        elif drill.kind == "slow":  # signalled by slow_down, armed in every attempt's environment
            self.slow_slots.add(placement.active[rank])
            what = f"made the slot of rank {rank} ({host}) a straggler: {SLOW_FRACTION:.0%} of a step late"
        elif drill.kind == "corrupt":
            shutil.rmtree(run_dirs.snapshot_dir(self.cfg, self.run_dir), ignore_errors=True)
            what = f"damaged {damage_newest_checkpoint(self.cfg, self.run_dir)}, wiped the memory snapshots and killed rank 0"
            group.signal(0, signal.SIGKILL)
        elif drill.kind == "nan":  # armed in the worker's environment at the attempt's start
            if drill.step is None:
                group.signal(rank, signal.SIGUSR1)
            what = f"rank {rank} corrupts its share of " + \
                (f"step {drill.step}'s batch" if drill.step is not None else "its next batch")
        else:
            group.signal(rank, signal.SIGKILL if drill.kind == "kill" else signal.SIGSTOP)
            what = f"sent SIG{drill.kind.upper()} to rank {rank}"
        return {"summary": f"{what} at step {step}", "drill": drill.kind, "rank": rank, "step": step, "host": host}

    def repaired(self, slot: int) -> None:
        """The slot's host is back, repaired or replaced: what the drills broke there is gone."""
        for broken in (self.broken_slots, self.lost_slots, self.slow_slots):
            broken.discard(slot)

    def slow_down(self, group, records: dict, placement) -> None:
        """SIGUSR2 to each rank on a slow slot, once per attempt, once it trains."""
        for rank, slot in enumerate(placement.active):
            if slot in self.slow_slots and rank not in self.slowed and records.get(rank, {}).get("state") == "training":
                group.signal(rank, signal.SIGUSR2)
                self.slowed.add(rank)
