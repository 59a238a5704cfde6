"""What a restart costs the steps after it: the supervised 4-process job with two kills, the 20
steps after each restart against the steps before the first, and the CPU the job used meanwhile.

    python -m bench.resilience.restart_aftermath [--checkout PATH ...] [--repeats 1]

Why: after a restart the supervisor refills the warm standby processes it used (cluster/standby.py),
and on this 2-core VM their start-up shares the cores with the steps that follow; ETTR counts those
slower steps as productive, goodput does not. `--checkout` runs the job from other checkouts of
this repository too (e.g. `git worktree add /tmp/before REV`), each in turn, the same drills and
model (bench/resilience/ettr.py's): before and after a change to the restart path, measured
side by side. Per run: the launch to the first step, fault to first good step, the 20 steps after
each restart (sum and median) and the median step before the first fault, and the job's CPU
(bench/resilience/cpu_load.py) in the 15 s after each restart.
Writes bench/results/restart_aftermath_cpu.json.
"""

import os
import statistics
import subprocess
import tempfile

from bench.common import REPO, Bench
from bench.resilience import ettr

DRILLS = ["kill:1@60", "kill:2@120"]
STEPS = 200


def run(checkout: str, run_dir: str) -> dict:
    start, wall, load = ettr.launch(run_dir, 4, ettr.job_overrides(STEPS, 5, 5), DRILLS, spares=2,
                                    checkout=checkout, sample_s=0.1)
    events = ettr.read_jsonl(os.path.join(run_dir, "events.jsonl"))
    times = {r["step"]: r["step_time_s"] for r in ettr.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}
    started = next(e for e in events if e["kind"] == "started")
    restarts = []
    for event in (e for e in events if e["kind"] == "resumed"):
        after = [times[s] for s in range(event["step"] + 1, event["step"] + 21)]
        at = event["time"] - start
        restarts.append({"fault_to_first_step_s": round(event["since_fault_s"], 2),
                         "next_20_steps_s": round(sum(after), 2), "next_20_median_s": round(statistics.median(after), 3),
                         "job_core_s_next_15s": round(sum(s["job_cores"] * s["dt"] for s in load.samples
                                                          if at <= s["t"] < at + 15), 1)})
    return {"checkout": checkout, "wall_s": round(wall, 1),
            "launch_to_first_step_s": round(started["time"] - start, 2),
            "median_step_before_s": round(statistics.median(times[s] for s in range(30, 56)), 3),
            "restarts": restarts, "other_processes_core_s": load.summary()["foreign_core_s"]}


def main(argv=None) -> int:
    bench = Bench(__doc__, "restart_aftermath_cpu")
    bench.add_argument("--checkout", action="append", default=[], metavar="PATH",
                       help="another checkout to run too (repeatable); this one always runs last")
    bench.add_argument("--repeats", type=int, default=1)
    args = bench.parse_args(argv)
    bench.refuse_existing()
    checkouts = [os.path.abspath(c) for c in args.checkout] + [REPO]
    work, runs = tempfile.mkdtemp(prefix="bench-aftermath-"), []
    for repeat in range(args.repeats):
        for n, checkout in enumerate(checkouts):
            runs.append({"commit": subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"],
                                                  capture_output=True, text=True).stdout.strip(),
                         **run(checkout, os.path.join(work, f"run{repeat}-{n}"))})
            print(runs[-1], flush=True)
    bench.write({"nprocs": 4, "drills": DRILLS, "steps": STEPS, "model": ettr.MODEL, "cpu_cores": os.cpu_count(),
                 "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
