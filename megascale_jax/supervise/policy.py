"""What the driver does about a fault: the recovery decision, as one pure function.

`decide` looks at the fault, the fault before it, the restarts so far, the config and a count
of the slots (`Slots`) — no processes, no Redis, no files — so every rule can be checked on a
table of cases (tests/supervise/test_policy.py). The supervisor carries the decision out
(diagnostics, eviction, the restart itself). The rules, in the order they apply:

1. No fault: training finished → `Done`.
2. config_error (exit code 2): a user mistake, reported and never retried → `GiveUp`.
3. unreadable_checkpoint (exit code 4): a process found the newest checkpoint damaged and moved it
   aside; the data is at fault, not a machine → `Restart` at once, no diagnostics (each such
   restart sets one checkpoint aside; `supervisor.max_restarts` still bounds them).
4. The same worker exit as the fault before it, at the same step with the same error line: a
   deterministic crash (a compiler abort, a bad op), which a restart from the same checkpoint
   replays → `GiveUp`. A drill or a kill has no error line and is always retried.
5. Otherwise diagnostics run first (`Diagnose`, then `decide` again with their verdict, `faulty`:
   rank -> why). A failed device self-test, or a straggler with `supervisor.evict_stragglers`,
   blames its own rank whatever diagnostics say.
6. diverged (non-finite loss, again when the workers replayed the step) with no rank blamed:
   restarting replays the same data bitwise, so it only helps when a device is to blame → `GiveUp`
   with the fix.
7. `supervisor.max_restarts` restarts done → `GiveUp`.
8. Ranks blamed: their slots are excluded for the rest of the job (placement.py). Enough spares:
   they take the ranks → `Spare`. Too few: `supervisor.on_no_spare=shrink` resumes on fewer
   data-parallel replicas → `Shrink` (placement.shrunk; spares still take what ranks they can),
   unless no smaller shape fits; that, or `on_no_spare=stop` → `GiveUp`, the slots excluded even
   so (a requeued job must avoid them too).
9. Otherwise → `Restart` on the same slots.

A restart resumes from the newest checkpoint or memory snapshot; when that is already the final
step there is nothing to redo and the supervisor ends with `done` (it reads the checkpoints;
this module does not).
"""

from __future__ import annotations

import dataclasses

from megascale_jax.config import Config, ConfigError
from megascale_jax.supervise.detect import Fault
from megascale_jax.supervise.placement import Shape, shrunk
from megascale_jax.supervise.workers import error_key


@dataclasses.dataclass(frozen=True)
class Slots:
    """What the decision needs to know of the job's slots (placement.Placement)."""

    spares: int  # healthy slots standing by
    healthy: int  # slots not excluded: running a rank or standing by
    shape: Shape  # the data-parallel shape of the attempt that failed
    devices_per_process: int


@dataclasses.dataclass(frozen=True)
class Done:
    """Training finished: exit 0."""

    reason: str


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """Stop with the fault report: exit 1. `evict` (rank -> why): slots to exclude even so."""

    reason: str
    evict: dict[int, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Diagnose:
    """Run diagnostics on the attempt's slots, then decide again with their verdict."""


@dataclasses.dataclass(frozen=True)
class Restart:
    """Restart on the same slots."""


@dataclasses.dataclass(frozen=True)
class Spare:
    """Exclude the slots of the `evict` ranks (rank -> why); spares take the ranks; restart."""

    evict: dict[int, str]


@dataclasses.dataclass(frozen=True)
class Shrink:
    """Exclude the slots of the `evict` ranks; spares take what ranks they can; restart on `shape`."""

    evict: dict[int, str]
    shape: Shape


Action = Done | GiveUp | Diagnose | Restart | Spare | Shrink


def decide(fault: Fault | None, previous: Fault | None, restarts: int, cfg: Config, slots: Slots,
           faulty: dict[int, str] | None = None) -> Action:
    """What to do after an attempt ended with `fault` (None: it finished), `previous` the job's
    fault before it, `restarts` done so far, `faulty` the diagnostics' verdict (None: not run)."""
    sv = cfg.supervisor
    if fault is None:
        return Done(f"training finished after {restarts} restart(s)")
    if fault.cause == "config_error":
        return GiveUp("a worker rejected the config or data (see its log); not retried")
    if fault.cause == "not_saved":
        return GiveUp("the final checkpoint could not be written (see the worker's last line); free space on "
                      "the checkpoint disk and run the same command again: it resumes from the newest good one")
    if fault.cause == "unreadable_checkpoint":
        if restarts >= sv.max_restarts:
            return GiveUp(f"supervisor.max_restarts={sv.max_restarts} exhausted")
        return Restart()
    if repeated_crash(previous, fault):
        return GiveUp(f"the same {fault.cause} twice at step {fault.step} ({fault.error}); "
                      "it is deterministic, a restart would repeat it")
    if faulty is None:
        return Diagnose()
    blamed = dict(faulty)
    if fault.cause == "device" or (fault.cause == "straggler" and sv.evict_stragglers):
        blamed.setdefault(fault.rank, fault.detail)  # its own evidence, whatever diagnostics say
    if fault.cause == "diverged" and not blamed:
        return GiveUp("non-finite loss, again when the worker replayed the step, with healthy "
                      "devices: a restart would replay it; lower optim.lr or tighten optim.clip")
    if restarts >= sv.max_restarts:
        return GiveUp(f"supervisor.max_restarts={sv.max_restarts} exhausted")
    return replace_slots(blamed, cfg, slots) if blamed else Restart()


def repeated_crash(previous: Fault | None, fault: Fault) -> bool:
    """`fault` is the same worker exit as `previous` at the same step with the same error line:
    a deterministic crash. A drill or a kill has no error line and is always retried."""
    a, b = previous, fault
    return (a is not None and a.exit_code is not None and b.exit_code is not None and bool(b.error)
            and a.cause == b.cause and a.step == b.step and error_key(a.error) == error_key(b.error))


def replace_slots(evict: dict[int, str], cfg: Config, slots: Slots) -> Spare | Shrink | GiveUp:
    """The `evict` ranks' slots excluded: spares for them, else a smaller shape, else why not."""
    if len(evict) <= slots.spares:
        return Spare(evict)
    if cfg.supervisor.on_no_spare == "stop":
        return GiveUp("a faulty rank was excluded and no spare is left (supervisor.on_no_spare=stop)", evict)
    try:
        shape = shrunk(cfg, slots.shape, slots.healthy - len(evict), slots.devices_per_process)
    except ConfigError as e:
        return GiveUp(str(e), evict)
    return Shrink(evict, shape)
