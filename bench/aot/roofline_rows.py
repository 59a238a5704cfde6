"""The roofline of the compiled program (`megascale_jax.aot.roofline`) against the H200's
measured steps: each MFU-ladder row of the 2026-11-23 and 2026-11-27 campaigns and each lever row
of 2026-11-28's (measured after the roofline was written) compiled, without a GPU, from the code
that ran it (a worktree of its commit), its kernels' FLOPs and bytes priced at the H200's
calibration, the predicted step set beside the measured one. Nothing is fitted to these rows. Then this checkout's same-work row (cuDNN, window 512, AdamW, 8 sequences), its kernels
ranked by predicted time: the lever list for the next GPU run. Beside each row, the planner's own
prediction (`planner.predict`, its formulas for this checkout's model; its H200 elementwise
passes were fitted to the 2026-11-23 xla_flags row).

    python -m bench.aot.roofline_rows [--out FILE] [--overwrite] [--only NAME ...] [--date DATE ...]

`--date` runs that campaign's rows only (with `--only`, those of them) and replaces them in the
existing file, keeping the others.

Needs the compile-only environment (configs/aot/setup_env.sh) and git. ~15 s a row on 2 cores.
Writes bench/results/roofline_h200.json.
"""

import glob
import json
import os
import subprocess
import sys
import tempfile

from bench.common import REPO, Bench, result_path
from megascale_jax.aot import environment, roofline, targets
from megascale_jax.observe.hlo_parts import instructions
from megascale_jax.config import load_config
from megascale_jax.planner import calibration
from megascale_jax.planner.predict import predict as planner_predict
from megascale_jax.planner.workload import from_config

# The code each campaign ran (the commit its results were measured at), and the section whose rows it times.
RUNS = {"2026-11-23": ("85dcec4", "bench/results/gpu_nvidia_h200_2026-11-23.json", "mfu_ladder"),
        "2026-11-27": ("5d710b0", "bench/results/gpu_nvidia_h200_2026-11-27.json", "mfu_ladder"),
        "2026-11-28": ("4ee3002", "bench/results/gpu_nvidia_h200_2026-11-28.json", "levers")}
HEAD_ROW = {"model.block": "parallel", "model.window": 512, "model.attention": "cudnn", "optim.name": "adamw",
            "model.fused_norm": "false", "model.fused_mlp": "false"}


def measured_rows(path: str, section: str) -> list[dict]:
    """The section's rows with a measured step: name, config changes, microbatches, batch, flags."""
    with open(os.path.join(REPO, path)) as f:
        found = json.load(f)["sections"][section]
    rows = [found["base"], *found["rows"]] if "base" in found else found["rows"]  # levers: the base row too
    return [r for r in rows if r.get("step_time_s")]


def overrides(row: dict) -> list[str]:
    # (the campaign's other overrides, checkpoints and logging, do not change the train step)
    return [f"{k}={v}" for k, v in row["config"].items()] + [
        f"parallel.microbatches={row['microbatches']}", f"train.global_batch={row['batch'] * row['microbatches']}"]


def predict(tree: str, row_overrides: list[str], xla_flags: list[str], window) -> dict:
    """Compile in the compile-only environment against `tree`'s code; the roofline of the dump."""
    gpu = calibration.gpu("h200")
    with tempfile.TemporaryDirectory(prefix="roofline-") as scratch:
        target = os.path.join(scratch, "target.pbtxt")
        with open(target, "w") as f:
            f.write(targets.TARGETS["h200"].proto())
        env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "",
               "XLA_FLAGS": " ".join(xla_flags)}
        done = subprocess.run([environment.python(), os.path.join(REPO, "bench", "aot", "compile_dump.py"),
                               "--target", target, "--dump", scratch, *row_overrides],
                              env=env, capture_output=True, text=True, timeout=900)
        if done.returncode:
            return {"error": done.stderr.strip().splitlines()[-1][:300]}
        (hlo_file,) = glob.glob(os.path.join(scratch, "*train_step*after_optimizations.txt"))
        with open(hlo_file) as f:
            text = f.read()
    return roofline.summary(roofline.kernel_costs(text, instructions(text), gpu, window))


def planner_s(row_overrides: list[str]) -> float:
    """The planner's own prediction of the row (its formulas; this checkout's model of the work)."""
    cfg = load_config(os.path.join(REPO, "configs", "gpt_1b.yaml"), row_overrides, planning=True)
    return planner_predict(from_config(cfg, 1), calibration.gpu("h200")).iteration_s


def worktree(commit: str, into: str) -> str:
    path = os.path.join(into, commit)
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-f", path, commit], check=True,
                   capture_output=True)
    return path


def main(argv=None) -> int:
    bench = Bench(__doc__, "roofline_h200")
    bench.add_argument("--only", nargs="*", default=None, help="row names to run (default: all)")
    bench.add_argument("--date", nargs="*", default=None, choices=list(RUNS),
                       help="these campaigns' rows only, replacing theirs in the existing file")
    args = bench.parse_args(argv)
    rows = []
    if args.date:
        with open(result_path("roofline_h200", args.out, overwrite=True)) as f:
            rows = [r for r in json.load(f)["rows"] if r["date"] not in args.date or (args.only and r["row"] not in args.only)]
        bench.args.overwrite = True
    else:
        bench.refuse_existing()
    with tempfile.TemporaryDirectory(prefix="roofline-trees-") as trees:
        try:
            for date, (commit, path, section) in RUNS.items():
                if args.date and date not in args.date:
                    continue
                tree = worktree(commit, trees)
                for row in measured_rows(path, section):
                    if args.only and row["name"] not in args.only:
                        continue
                    window = None if row["config"].get("model.window") in (None, "null") else int(row["config"]["model.window"])
                    got = predict(tree, overrides(row), row.get("xla_flags") or [], window)
                    out = {"date": date, "commit": commit, "row": row["name"], "batch": row["batch"],
                           "microbatches": row["microbatches"], "measured_s": row["step_time_s"],
                           "predicted_s": got.get("step_s"), "planner_s": planner_s(overrides(row)),
                           "error": got.get("error")}
                    if out["predicted_s"]:
                        out["predicted_over_measured"] = out["predicted_s"] / out["measured_s"]
                        out["by_part_s"] = got["by_part_s"]
                    rows.append(out)
                    print(json.dumps({k: v for k, v in out.items() if k != "by_part_s"}), flush=True)
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "prune"], capture_output=True)
    head = predict(REPO, overrides({"config": HEAD_ROW, "microbatches": 1, "batch": 8}), [], 512)
    print(f"this checkout's same-work row: predicted {head['step_s'] * 1e3:.1f} ms", flush=True)
    rows.sort(key=lambda r: r["date"])
    bench.write({"device": "NVIDIA H200 (compiled without a GPU; measured rows from the campaigns)",
                 "rows": rows, "head_same_work_row": head})
    return 0


if __name__ == "__main__":
    sys.exit(main())
