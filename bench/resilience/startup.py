"""A fault-free start of the ETTR drill's job: where the cold start goes and what each save blocks.

    python -m bench.resilience.startup [--nprocs 4] [--steps 60] [--checkpoint-every 5] [--repeats 2]

Runs the drill's model (`bench/resilience/ettr.py`'s MODEL, dp = N processes on this machine)
under `python -m megascale_jax.launch`, without faults, `--repeats` times, each in a fresh run
directory (so every compilation is cold). Per run: the slowest process's start-up phases (each
process's `start-up phases:` line), their compilation part (checkpoint checksums, initial state,
train step, evaluation), how many executables each process loaded from process 0 instead of
compiling, the wall from the launch to training (the supervisor's `started` event), and each
checkpoint's blocking time with its parts (previous save, checksums, orbax), as medians. The git
commit is recorded, so that a run on an older checkout (copy bench/__init__.py, bench/common.py
and bench/resilience/ there) is the baseline.
Writes bench/results/startup_cpu.json.
"""

import os
import re
import statistics
import subprocess
import sys
import tempfile

from bench.common import REPO, Bench
from bench.resilience.ettr import MODEL, launch, read_jsonl, startup_phases

COMPILATION = ("checkpoint_compile", "state", "train_step", "eval_loss")
FROM_PROCESS_0 = re.compile(r"compilation cache: \d+ hits, \d+ misses \((\d+) loaded from process 0\)")


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True)
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def one_run(work: str, nprocs: int, steps: int, every: int) -> dict:
    run_dir = tempfile.mkdtemp(prefix="run-", dir=work)
    start, wall = launch(run_dir, nprocs, [f"train.steps={steps}", f"checkpoint.every={every}", "checkpoint.keep=3"])
    [phases] = startup_phases(run_dir)  # one attempt
    started = next(e for e in read_jsonl(os.path.join(run_dir, "events.jsonl")) if e["kind"] == "started")
    loaded = []
    for rank in range(nprocs):
        with open(os.path.join(run_dir, "logs", f"worker{rank}.log")) as f:
            found = FROM_PROCESS_0.search(f.read())
        loaded.append(int(found.group(1)) if found else None)  # None: a checkout without sharing
    saves = read_jsonl(os.path.join(run_dir, "checkpoints.jsonl"))
    steps_s = [r["step_time_s"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]

    def median(values):
        return round(statistics.median(values), 4)

    return {"wall_s": round(wall, 2), "launch_to_training_s": round(started["time"] - start, 2),
            "startup_phases_s": phases, "compilation_s": round(sum(phases.get(p, 0.0) for p in COMPILATION), 2),
            "loaded_from_process_0": loaded, "step_s_median": median(steps_s), "saves": len(saves),
            "checkpoint_block_s_median": median([s["block_s"] for s in saves]),
            "checkpoint_block_parts_s_median": {part: median([s["block_parts_s"][part] for s in saves])
                                                for part in saves[0]["block_parts_s"]},
            "checkpoint_total_s_median": median([s["total_s"] for s in saves if "total_s" in s])}


def main(argv=None) -> int:
    bench = Bench(__doc__, "startup_cpu")
    bench.add_argument("--nprocs", type=int, default=4)
    bench.add_argument("--steps", type=int, default=60)
    bench.add_argument("--checkpoint-every", type=int, default=5)
    bench.add_argument("--repeats", type=int, default=2)
    args = bench.parse_args(argv)
    bench.refuse_existing()
    work = tempfile.mkdtemp(prefix="bench-startup-")
    runs = [one_run(work, args.nprocs, args.steps, args.checkpoint_every) for _ in range(args.repeats)]
    for run in runs:
        print(f"compilation {run['compilation_s']} s, launch to training {run['launch_to_training_s']} s, "
              f"checkpoint blocking {run['checkpoint_block_s_median']} s {run['checkpoint_block_parts_s_median']}")
    bench.write({"commit": commit(), "nprocs": args.nprocs, "steps": args.steps,
                 "checkpoint_every": args.checkpoint_every, "config": MODEL, "cpu_cores": os.cpu_count(), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
