"""Straggler sensitivity on this machine: is a rank slowed by a given fraction of a step flagged,
and no other?

    python bench/stragglers.py [--nprocs-list 2 4] [--slow 0 0.05 0.1 0.3] [--steps 60] [--window 10]

For each (N, slowdown) it launches `python -m megascale_jax.launch --nprocs N` (one CPU device per
worker, dp=N, a small model) with the last rank sleeping `slowdown` × its recent step time before
every dispatch (`MEGASCALE_FAULT_SLOW`), then runs the report's statistic
(`stragglers.window_lateness` over `--window`-step windows) on the run's timings: the slow rank's
median measured lateness against the injected fraction, the share of windows in which it is
flagged at `--threshold`, and the largest lateness of any healthy rank in any window (the margin
to a false positive). Slowdown 0 is the healthy baseline. Writes bench/results/stragglers_cpu.json.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from provenance import add_output_flags, result_path, write_result  # noqa: E402
from supervisor import DRILL_MODEL  # noqa: E402  (bench/supervisor.py)

from megascale_jax.observe import stragglers  # noqa: E402
from megascale_jax.observe.timings import read_timings  # noqa: E402

# The drill model, one CPU device per worker (mesh and batch are set per run, below), no
# checkpoints, no supervisor straggler check (the bench judges the timings itself).
MODEL = [*DRILL_MODEL, "mesh.pp=1", "checkpoint.every=0", "supervisor.straggler_check_s=0"]


def run(nprocs: int, slow: float, args) -> dict:
    run_dir = tempfile.mkdtemp(prefix=f"stragglers-{nprocs}-{slow}-")
    slow_rank = nprocs - 1
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if slow:
        env["MEGASCALE_FAULT_SLOW"] = f"{slow_rank}:{slow}"
    done = subprocess.run([sys.executable, "-m", "megascale_jax.launch", "--nprocs", str(nprocs), "--run-dir",
                           run_dir, "--no-diagnose", *MODEL, f"mesh.dp={nprocs}", f"mesh.cpu_devices={nprocs}",
                           f"train.global_batch={4 * nprocs}", f"train.steps={args.steps}"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    t = read_timings(run_dir)
    windows = stragglers.window_lateness(t, stragglers.clock_offsets(t), args.window)
    windows = [w for w in windows if w["last_step"] - w["first_step"] + 1 == args.window]  # complete only
    late = [float(w["lateness"][t.processes.index(slow_rank)]) for w in windows]
    healthy = [float(x) for w in windows for p, x in zip(t.processes, w["lateness"]) if p != slow_rank or not slow]
    return {"nprocs": nprocs, "injected": slow, "windows": len(windows),
            "slow_rank_lateness": statistics.median(late) if slow else None,
            "slow_rank_flagged": sum(x >= args.threshold for x in late) / len(late) if slow else None,
            "healthy_max_lateness": max(healthy), "healthy_flagged": sum(x >= args.threshold for x in healthy),
            "step_time_s": float(statistics.median(t.duration[t.select("step")]))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs-list", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--slow", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.3])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=0.05)
    add_output_flags(parser, "stragglers_cpu")
    args = parser.parse_args()
    result_path("stragglers_cpu", args.out, args.overwrite)  # refuse before the run, not after it
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
    write_result("stragglers_cpu", {"threshold": args.threshold, "window": args.window, "steps": args.steps,
                                    "rows": rows}, args.out, args.overwrite)
    return 0


if __name__ == "__main__":
    sys.exit(main())
