"""Supervisor drills on this machine: job start time vs N, and detection latency, fault-to-resumed
time and steps lost for crashes (kill -9), hangs (SIGSTOP) and a dead Redis, from events.jsonl.

    python -m bench.resilience.supervisor [--nprocs-list 1 2 4 8] [--repeats 2] [--drill-rounds 2]

Start time = spawning N bare workers (1 CPU device each) until every one has finished the Redis
rendezvous and `jax.distributed.initialize`; the rendezvous alone is reported beside it. Drills
run the supervised job of docs/supervision.md (`python -m megascale_jax.launch --nprocs 2 --spares 1 --config
configs/tiny_cpu.yaml`, checkpoints every 5 steps) with a kill, a stop and a Redis kill per
round, once with the diagnostics every fault runs and once `--no-diagnose`.
Writes bench/results/supervisor_cpu.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import REPO, Bench, python_module, with_repo_on_path
from megascale_jax.cluster import rendezvous
from megascale_jax.supervise.redis_server import EmbeddedRedis

DRILL_JOB = ["--nprocs", "2", "--spares", "1", "--config", "configs/tiny_cpu.yaml", "train.steps=60",
             "checkpoint.every=5", "supervisor.hang_timeout_s=6"]
DRILLS = ["kill:1@12", "stop:0@30", "redis@45"]


def probe(args) -> None:
    """One bare worker: join through Redis, start jax.distributed, report the times."""
    t0 = time.time()
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    imported = time.time()
    member = rendezvous.join(args.redis, args.job, args.nprocs, args.process_id)
    joined = time.time()
    if args.nprocs > 1:  # as train.py and the diagnostics do
        rendezvous.start_distributed(member.coordinator, args.nprocs, member.rank)
    assert jax.device_count() == args.nprocs
    ready = time.time()
    rendezvous.connect(args.redis).hset(rendezvous.key(args.job, "probe"), str(member.rank), json.dumps(
        {"import_s": imported - t0, "rendezvous_s": joined - imported, "wait_s": member.wait_s,
         "initialize_s": ready - joined, "ready": ready}))


def start_time(url: str, nprocs: int, job: str) -> dict:
    env = with_repo_on_path({**os.environ, "JAX_PLATFORMS": "cpu"})
    start = time.time()
    # this bench again, as a bare worker: `python -m bench.resilience.supervisor --probe ...`
    procs = [subprocess.Popen(python_module(__spec__.name, "--probe", "--redis", url, "--job", job, "--nprocs",
                                            str(nprocs), "--process-id", str(i)), env=env) for i in range(nprocs)]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0] * nprocs, codes
    rows = [json.loads(v) for v in rendezvous.connect(url).hgetall(rendezvous.key(job, "probe")).values()]
    return {"nprocs": nprocs, "start_s": max(r["ready"] for r in rows) - start,
            "import_s": max(r["import_s"] for r in rows), "rendezvous_s": max(r["rendezvous_s"] for r in rows),
            "initialize_s": max(r["initialize_s"] for r in rows)}


def drill_round(run_dir: str, diagnose: bool) -> dict:
    cmd = [sys.executable, "-m", "megascale_jax.launch", "--run-dir", run_dir, *([] if diagnose else ["--no-diagnose"]),
           *[a for d in DRILLS for a in ("--drill", d)], *DRILL_JOB]
    done = subprocess.run(cmd, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=1200,
                          cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:]
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    out = {"crash": {}, "hang": {}, "redis": {}}
    for i, e in enumerate(events):
        if e["kind"] == "fault":
            restart = next(x for x in events[i:] if x["kind"] == "restart")
            resumed = next((x for x in events[i:] if x["kind"] == "resumed"), None)
            out[e["cause"]] = {"detection_s": e["latency_s"], "steps_lost": restart["steps_lost"],
                               "fault_to_resumed_s": resumed and resumed["since_fault_s"]}
        elif e["kind"] == "redis_restart":
            out["redis"] = {"detection_s": e["latency_s"], "restart_s": e["restart_s"]}
    return out


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main(argv=None) -> int:
    bench = Bench(__doc__, "supervisor_cpu")
    bench.add_argument("--nprocs-list", type=int, nargs="+", default=[1, 2, 4, 8])
    bench.add_argument("--repeats", type=int, default=2)
    bench.add_argument("--drill-rounds", type=int, default=2)
    bench.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    bench.add_argument("--redis", help=argparse.SUPPRESS)
    bench.add_argument("--job", help=argparse.SUPPRESS)
    bench.add_argument("--nprocs", type=int, help=argparse.SUPPRESS)
    bench.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    args = bench.parse_args(argv)
    if args.probe:
        probe(args)
        return 0
    bench.refuse_existing()
    work = tempfile.mkdtemp(prefix="bench-supervisor-")
    server = EmbeddedRedis(os.path.join(work, "redis"))
    try:
        starts = [start_time(server.url, n, f"start-{n}-{r}") for n in args.nprocs_list for r in range(args.repeats)]
    finally:
        server.stop()
    print(f"{'N':>3} {'start s':>8} {'import s':>9} {'rendezvous s':>13} {'jax init s':>11}")
    start_table = []
    for n in args.nprocs_list:
        rows = [s for s in starts if s["nprocs"] == n]
        row = {"nprocs": n, **{k: statistics.median(r[k] for r in rows)
                                for k in ("start_s", "import_s", "rendezvous_s", "initialize_s")}}
        start_table.append(row)
        print(f"{n:>3} {row['start_s']:>8.2f} {row['import_s']:>9.2f} {row['rendezvous_s']:>13.3f} "
              f"{row['initialize_s']:>11.2f}")
    rounds, drills = {}, {}
    for mode in ("diagnose", "no_diagnose"):
        rounds[mode] = [drill_round(os.path.join(work, f"{mode}{r}"), mode == "diagnose")
                        for r in range(args.drill_rounds)]
        drills[mode] = {}
        for kind in ("crash", "hang", "redis"):
            keys = {k for r in rounds[mode] for k, v in r[kind].items() if v is not None}
            drills[mode][kind] = {k: summary([r[kind][k] for r in rounds[mode] if r[kind].get(k) is not None])
                                  for k in sorted(keys)}
            print(mode, kind, {k: round(v["median"], 2) for k, v in drills[mode][kind].items()})
    bench.write({
        "start_time_vs_nprocs": start_table, "start_time_runs": starts, "drills": drills, "drill_rounds": rounds,
        "drill_job": DRILL_JOB, "drills_fired": DRILLS,
        "cpu_cores": os.cpu_count(), "load_average_at_end": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
