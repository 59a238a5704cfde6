"""What refilling the supervisor's warm standby processes costs in CPU: cold interpreters that
import megascale_jax.train each, against forks of one zygote that imported it once.

    python -m bench.resilience.standby_refill [--standbys 8] [--repeats 3]

After a restart the supervisor refills one standby for each worker and diagnostics process it
used (8 at 4 processes); once training runs again they share the cores with it. Each round
starts `--standbys` standbys one way (a `StandbyPool` of N, with or without a zygote), waits
until every one is warm (its CPU time has stopped growing: it waits on its stdin), and counts the
CPU time (user + system, /proc) of the standbys and of the zygote — the zygote's import apart,
paid once per job. The ways alternate. Writes bench/results/standby_refill_cpu.json.
"""

import os
import statistics
import time

from bench.common import Bench
from bench.resilience.cpu_load import own_cpu_s
from megascale_jax.supervise.workers import StandbyPool, worker_env
from megascale_jax.supervise.zygote import Zygote

MODULE = "megascale_jax.train"


def settled(pids: list[int], quiet_s: float = 0.5) -> float:
    """Wait until none of `pids` has used CPU for `quiet_s`; their CPU seconds then, summed."""
    last, since = None, time.monotonic()
    while True:
        now = sum(own_cpu_s(pid) for pid in pids)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
        time.sleep(0.1)


def round_of(standbys: int, env: dict, forked: bool) -> dict:
    start = time.monotonic()
    zygote = Zygote(MODULE, env) if forked else None
    zygote_pid = zygote.process.pid if zygote else None
    zygote_cpu = settled([zygote_pid]) if zygote else 0.0  # its import: once per job
    forked_at = time.monotonic()
    pool = StandbyPool(MODULE, env, standbys, zygote)
    try:
        pids = [p.pid for p in pool.warm.values()]
        cpu = settled(pids + ([zygote_pid] if zygote else [])) - zygote_cpu
        return {"standbys_cpu_s": round(cpu, 3), "per_standby_cpu_s": round(cpu / standbys, 4),
                "zygote_import_cpu_s": round(zygote_cpu, 3), "wall_s": round(time.monotonic() - forked_at, 2),
                "zygote_start_wall_s": round(forked_at - start, 2) if zygote else None}
    finally:
        pool.close()
        if zygote:
            zygote.close()


def main(argv=None) -> int:
    bench = Bench(__doc__, "standby_refill_cpu")
    bench.add_argument("--standbys", type=int, default=8)
    bench.add_argument("--repeats", type=int, default=3)
    args = bench.parse_args(argv)
    bench.refuse_existing()
    env = worker_env()
    rounds = {"cold": [], "forked": []}
    for _ in range(args.repeats):
        for way in rounds:
            rounds[way].append(round_of(args.standbys, env, way == "forked"))
            print(way, rounds[way][-1], flush=True)
    summary = {way: {"per_standby_cpu_s": statistics.median(r["per_standby_cpu_s"] for r in rows),
                     "refill_cpu_s": statistics.median(r["standbys_cpu_s"] for r in rows)}
               for way, rows in rounds.items()}
    summary["forked"]["zygote_import_cpu_s"] = statistics.median(r["zygote_import_cpu_s"] for r in rounds["forked"])
    print(f"{args.standbys} standbys: cold {summary['cold']['refill_cpu_s']:.2f} s of CPU, forked "
          f"{summary['forked']['refill_cpu_s']:.3f} s (+ the zygote's import once, "
          f"{summary['forked']['zygote_import_cpu_s']:.2f} s)", flush=True)
    bench.write({"module": MODULE, "standbys": args.standbys, "repeats": args.repeats, "cpu_cores": os.cpu_count(),
                 "summary": summary, "rounds": rounds})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
