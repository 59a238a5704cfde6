"""Where the ranks of the next attempt run: worker slots, spares, evictions and shrinking.

A slot is one place a worker process can run — on a cluster a node, on this machine a numbered
share of it (`<hostname>/slot<i>`, so that eviction and exclusion mean the same thing locally as
on a cluster). `launch --nprocs N --spares K` has N + K slots; each attempt runs its ranks on the
first healthy slots, and the others stand by as spares (warm processes: workers.StandbyPool).

A slot found faulty (diagnostics, a failed device self-test, an evicted straggler) is excluded
for the rest of the job: its host goes into `RUN_DIR/excluded_hosts.txt`, which the cluster
recipes hand to the scheduler on requeue (configs/cluster/). A spare takes its rank. With no
spare left, `supervisor.on_no_spare=shrink` resumes on fewer data-parallel replicas:

* the rows each replica computes per microbatch stay the same (so does its memory), and the
  global batch stays the same, so `parallel.microbatches` grows by the factor dp shrinks by:
  every step still sees the same tokens and the loss curve continues;
* the new dp is the largest that the remaining processes hold and the global batch divides;
  healthy processes left over become spares;
* the restore reshards the checkpoint onto the smaller mesh (checkpoints are mesh-independent).

`on_no_spare=stop` gives up with the report instead.

A slot comes back when its host is repaired or replaced: a line naming it in
`RUN_DIR/returned_hosts.txt` (an operator's, a scheduler hook's, or the `return` drill's).
It stands by as a spare; a job running shrunk grows back onto it (`grown`: the largest dp up to
the configured one that the healthy slots hold), at its next memory snapshot or checkpoint,
resharded the other way.
"""

from __future__ import annotations

import dataclasses
import socket

from megascale_jax.config import Config, ConfigError


@dataclasses.dataclass(frozen=True)
class Shape:
    """The data-parallel shape of an attempt: processes, replicas, microbatches."""

    nprocs: int
    dp: int
    microbatches: int

    def overrides(self) -> list[str]:
        return [f"mesh.dp={self.dp}", f"parallel.microbatches={self.microbatches}"]


def shrunk(cfg: Config, shape: Shape, healthy: int, devices_per_process: int) -> Shape:
    """The largest shape that fits `healthy` processes, with the same global batch and rows per
    microbatch per replica; ConfigError (naming the fix) when there is none."""
    if healthy == 0:
        raise ConfigError("no healthy slot is left to run on: every slot of the job is excluded; give the job hosts "
                          "(supervisor spares, or a line in RUN_DIR/returned_hosts.txt) and resume")
    if shape.dp == 1:
        raise ConfigError("mesh.dp=1 cannot shrink: there is no data-parallel replica to drop; set "
                          "supervisor.on_no_spare=stop to stop when no spare is left")
    rows = cfg.train.global_batch // (shape.dp * shape.microbatches)  # per microbatch per replica
    smaller = _largest(cfg, range(shape.dp - 1, 0, -1), rows, healthy, devices_per_process)
    if smaller is not None:
        return smaller
    raise ConfigError(
        f"cannot shrink mesh.dp={shape.dp} onto {healthy} healthy process(es): no smaller dp holds whole processes "
        f"of {devices_per_process} device(s) and divides train.global_batch={cfg.train.global_batch} into "
        f"{rows}-row microbatches; set supervisor.on_no_spare=stop, or choose a global batch with more divisors")


def grown(cfg: Config, shape: Shape, healthy: int, devices_per_process: int) -> Shape | None:
    """The largest shape, up to the configured mesh.dp, that `healthy` processes hold with the same
    global batch and rows per microbatch per replica as `shape`; None when none is larger."""
    rows = cfg.train.global_batch // (shape.dp * shape.microbatches)
    return _largest(cfg, range(cfg.mesh.dp, shape.dp, -1), rows, healthy, devices_per_process)


def _largest(cfg: Config, dps, rows: int, healthy: int, devices_per_process: int) -> Shape | None:
    """The first dp of `dps` (largest first) whose replicas are whole processes, no more than
    `healthy`, and whose microbatches of `rows` rows per replica make up the global batch."""
    replica = cfg.mesh.size // cfg.mesh.dp  # devices of one data-parallel replica: pp x cp x tp
    for dp in dps:
        if (dp * replica) % devices_per_process or dp * replica // devices_per_process > healthy:
            continue  # whole processes only, and no more than are left
        if cfg.train.global_batch % (dp * rows) == 0:
            return Shape(dp * replica // devices_per_process, dp, cfg.train.global_batch // (dp * rows))
    return None


def check_spares(cfg: Config, nprocs: int, spares: int) -> None:
    """`launch --spares` asks for elasticity: refuse (ConfigError) a job whose first shrink,
    once the spares are used up, could not happen."""
    if spares < 0:
        raise ConfigError(f"--spares={spares} must be >= 0")
    if spares and cfg.supervisor.on_no_spare == "shrink":
        shrunk(cfg, Shape(nprocs, cfg.mesh.dp, cfg.parallel.microbatches), nprocs - 1, cfg.mesh.size // nprocs)


class Placement:
    """The job's slots and which of them run, stand by, or are excluded."""

    def __init__(self, nprocs: int, spares: int, host: str | None = None):
        host = host or socket.gethostname()
        self.hosts = [f"{host}/slot{i}" for i in range(nprocs + spares)]
        self.active = list(range(nprocs))  # slot of each rank
        self.excluded: dict[int, str] = {}  # slot -> why

    @property
    def spares(self) -> list[int]:
        return [s for s in range(len(self.hosts)) if s not in self.active and s not in self.excluded]

    def evict(self, rank: int, reason: str) -> int:
        """Exclude `rank`'s slot; returns the slot. The rank has no slot until `replace` or `shrink`."""
        slot = self.active[rank]
        self.excluded[slot] = reason
        self.active[rank] = -1
        return slot

    def replace(self) -> list[tuple[int, int]]:
        """Give every rank without a slot a spare, while spares last: (rank, slot) promoted."""
        promoted = []
        for rank, slot in enumerate(self.active):
            if slot == -1 and self.spares:
                self.active[rank] = self.spares[0]
                promoted.append((rank, self.active[rank]))
        return promoted

    @property
    def complete(self) -> bool:
        return -1 not in self.active

    def healthy(self) -> int:
        """Slots not excluded (active or spare)."""
        return len(self.hosts) - len(self.excluded)

    def readmit(self, host: str) -> int | None:
        """`host` is back (repaired or replaced): its slot, if excluded, stands by again as a
        spare; returns the slot (None: not an excluded slot of this job)."""
        slot = self.hosts.index(host) if host in self.hosts else None
        if slot is None or slot not in self.excluded:
            return None
        del self.excluded[slot]
        return slot

    def grow(self, nprocs: int) -> None:
        """Run the next attempts on `nprocs` ranks: the ranks keep their slots (and the memory
        snapshots there), the new ranks take spares."""
        self.active = self.active + self.spares[:nprocs - len(self.active)]

    def shrink(self, nprocs: int) -> None:
        """Run the next attempts on `nprocs` ranks: the surviving ranks' slots first, in rank
        order, then spares; the rest stand by."""
        slots = [s for s in self.active if s != -1] + self.spares
        self.active = sorted(slots[:nprocs])
