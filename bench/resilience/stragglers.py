"""Straggler sensitivity on this machine: the smallest slowdown flagged reliably, and no other rank.

    python -m bench.resilience.stragglers [--nprocs-list 4 8] [--slow 0 0.02 0.05 0.1 0.2] [--trials 10] [--window 10]

For each (N, slowdown) it launches `python -m megascale_jax.launch --nprocs N` (one CPU device per
worker, dp=N, a small model) with the last rank sleeping `slowdown` × its recent step time before
every dispatch (`MEGASCALE_FAULT_SLOW`), for 1 + `--trials` windows of `--window` steps, then runs
the report's statistic (`stragglers.window_lateness`) on the run's timings. Each window after the
first (warm-up, which the supervisor does not judge either) is one trial: the slow rank is
detected in it when its lateness reaches `--threshold`; a healthy rank reaching it is a false
positive. A slowdown is flagged reliably when the slow rank is detected in >= 90% of the trials
(9 of 10) with no false positive in the run; slowdown 0 is the healthy baseline (any flag is a
false positive). Reports the slow rank's median measured lateness against the injected fraction,
the largest healthy lateness (the margin to a false positive) and, per N, the smallest reliably
flagged slowdown. Writes bench/results/stragglers_cpu.json.
"""

import os
import statistics
import subprocess
import sys
import tempfile

from bench.common import Bench
from megascale_jax.observe import stragglers
from megascale_jax.observe.timings import read_timings

# A small model, one CPU device per worker (mesh and batch are set per run, below), no
# checkpoints, no supervisor straggler check (the bench judges the timings itself).
MODEL = ["train.eval_every=0", "model.layers=2", "model.d_model=64", "model.seq_len=64", "optim.warmup=1",
         "mesh.tp=1", "mesh.pp=1", "checkpoint.every=0", "supervisor.heartbeat_s=0.5",
         "supervisor.straggler_check_s=0"]


def run(nprocs: int, slow: float, args) -> dict:
    run_dir = tempfile.mkdtemp(prefix=f"stragglers-{nprocs}-{slow}-")
    slow_rank = nprocs - 1
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if slow:
        env["MEGASCALE_FAULT_SLOW"] = f"{slow_rank}:{slow}"
    done = subprocess.run([sys.executable, "-m", "megascale_jax.launch", "--nprocs", str(nprocs), "--run-dir",
                           run_dir, "--no-diagnose", *MODEL, f"mesh.dp={nprocs}", f"mesh.cpu_devices={nprocs}",
                           f"train.global_batch={4 * nprocs}", f"train.steps={(args.trials + 1) * args.window}"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    t = read_timings(run_dir)
    windows = stragglers.window_lateness(t, stragglers.clock_offsets(t), args.window)
    # complete windows after the first (warm-up): the trials
    windows = [w for w in windows if w["last_step"] - w["first_step"] + 1 == args.window and w["first_step"] > 1]
    late = [float(w["lateness"][t.processes.index(slow_rank)]) for w in windows]
    healthy = [float(x) for w in windows for p, x in zip(t.processes, w["lateness"]) if p != slow_rank or not slow]
    detected = sum(x >= args.threshold for x in late) if slow else None
    false_positives = sum(x >= args.threshold for x in healthy)
    return {"nprocs": nprocs, "injected": slow, "trials": len(windows),
            "slow_rank_lateness": statistics.median(late) if slow else None,
            "detected": detected, "slow_rank_flagged": detected / len(late) if slow else None,
            "healthy_max_lateness": max(healthy), "healthy_flagged": false_positives,
            "reliable": bool(slow) and detected >= 0.9 * len(windows) and false_positives == 0,
            "step_time_s": float(statistics.median(t.duration[t.select("step")]))}


def main(argv=None) -> int:
    bench = Bench(__doc__, "stragglers_cpu")
    bench.add_argument("--nprocs-list", type=int, nargs="+", default=[4, 8])
    bench.add_argument("--slow", type=float, nargs="+", default=[0.0, 0.02, 0.05, 0.1, 0.2])
    bench.add_argument("--trials", type=int, default=10, help="judged windows per run")
    bench.add_argument("--window", type=int, default=10)
    bench.add_argument("--threshold", type=float, default=0.05)
    args = bench.parse_args(argv)
    bench.refuse_existing()
    rows = []
    print(f"{'N':>3}{'injected':>10}{'measured':>10}{'flagged':>9}{'healthy max':>13}{'healthy flags':>15}"
          f"{'step s':>8}")
    for nprocs in args.nprocs_list:
        for slow in args.slow:
            r = run(nprocs, slow, args)
            rows.append(r)
            measured = "-" if r["slow_rank_lateness"] is None else f"{r['slow_rank_lateness']:.1%}"
            flagged = "-" if r["slow_rank_flagged"] is None else f"{r['slow_rank_flagged']:.0%}"
            print(f"{nprocs:>3}{slow:>10.0%}{measured:>10}{flagged:>9}{r['healthy_max_lateness']:>13.1%}"
                  f"{r['healthy_flagged']:>15}{r['step_time_s']:>8.3f}", flush=True)
    smallest = {}
    for nprocs in args.nprocs_list:
        reliable = [r["injected"] for r in rows if r["nprocs"] == nprocs and r["reliable"]]
        baseline = [r for r in rows if r["nprocs"] == nprocs and not r["injected"]]
        smallest[str(nprocs)] = {"smallest_reliable_slowdown": min(reliable) if reliable else None,
                                 "baseline_false_positives": sum(r["healthy_flagged"] for r in baseline)}
        print(f"N={nprocs}: smallest slowdown flagged in >= 90% of {args.trials} trials with no false positive: "
              f"{smallest[str(nprocs)]['smallest_reliable_slowdown']}", flush=True)
    bench.write({"threshold": args.threshold, "window": args.window, "trials": args.trials,
                 "smallest": smallest, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
