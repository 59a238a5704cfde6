"""Diagnostics after a fault, in cold processes and in warm standby ones, on this machine.

    python -m bench.resilience.diagnose [--nprocs 4] [--repeats 5]

The supervisor runs `megascale_jax.supervise.diagnose` on every fault's ranks before it restarts.
Cold: N fresh `python -m megascale_jax.diagnose --worker` processes, each importing jax first.
Warm: N processes of a `StandbyPool` that imported it while standing by (as the supervisor keeps
one per active slot), given their command line on stdin. Both are timed by `diagnose.run` (its
`duration_s`: spawn or hand-over to every rank's result read back from Redis), on a dp=N mesh of
one CPU device per process, the cold and warm runs alternating. The pool is given time to finish
its imports before a warm run, as it has during training.
Writes bench/results/diagnose_cpu.json.
"""

import os
import statistics
import sys
import tempfile
import time

from bench.common import Bench
from megascale_jax.config import load_config
from megascale_jax.supervise import diagnose
from megascale_jax.supervise.redis_server import EmbeddedRedis
from megascale_jax.supervise.workers import StandbyPool, per_process_overrides, worker_env

POOL_SETTLE_S = 10.0  # a standby's imports take ~1-2 s of CPU each; N of them share the cores


def main(argv=None) -> int:
    bench = Bench(__doc__, "diagnose_cpu")
    bench.add_argument("--nprocs", type=int, default=4)
    bench.add_argument("--repeats", type=int, default=5)
    args = bench.parse_args(argv)
    bench.refuse_existing()
    overrides = [f"mesh.dp={args.nprocs}", "mesh.tp=1", "mesh.pp=1"]
    worker_args = per_process_overrides(load_config(None, overrides), overrides, args.nprocs)
    env, work = worker_env(), tempfile.mkdtemp(prefix="bench-diagnose-")
    server = EmbeddedRedis(os.path.join(work, "redis"))
    times = {"cold": [], "warm": []}
    try:
        for r in range(args.repeats):
            report = diagnose.run(worker_args, args.nprocs, server.url, f"cold{r}", env, os.path.join(work, "logs"))
            assert not report.faulty(), report.table()
            times["cold"].append(report.duration_s)
            pool = StandbyPool(diagnose.__name__, env, args.nprocs)
            time.sleep(POOL_SETTLE_S)
            try:
                report = diagnose.run(worker_args, args.nprocs, server.url, f"warm{r}", env,
                                      os.path.join(work, "logs"), pool=pool, slots=list(range(args.nprocs)))
            finally:
                pool.close()
            assert not report.faulty(), report.table()
            times["warm"].append(report.duration_s)
            print(f"repeat {r}: cold {times['cold'][-1]:.2f}s, warm {times['warm'][-1]:.2f}s", flush=True)
    finally:
        server.stop()
    summary = {mode: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)} for mode, t in times.items()}
    print(f"diagnostics at {args.nprocs} processes: cold median {summary['cold']['median_s']:.2f}s, "
          f"warm median {summary['warm']['median_s']:.2f}s")
    bench.write({
        "nprocs": args.nprocs, "repeats": args.repeats, "mesh": overrides, "summary": summary, "runs_s": times,
        "cpu_cores": os.cpu_count(), "load_average_at_end": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
