"""The pre-compile memory estimate (`model.flops.memory_estimate`, which the train command's
start-up check uses and `plan` adds its workspace to) against the compiled step's peak, on
layouts from one GPU to two hosts: tp, pp, dp, ZeRO-1, remat policies, the loss in slices, a long
sequence, LAMB and AdamW. Each layout is compiled without a GPU (`plan --compile`'s own path,
`aot.environment.compile_report`).

    python -m bench.aot.memory_estimate [--out FILE] [--overwrite] [--only NAME ...] [--reestimate]

Needs the compile-only environment (configs/aot/setup_env.sh). ~20 s a layout on 2 cores (an
unrolled layer scan ~30 s, several GPUs longer). Writes bench/results/memory_estimate_aot.json;
`--only NAME` (repeatable) compiles those layouts and replaces their rows in the existing file,
keeping the others as they were measured. `--reestimate` compiles nothing: it keeps every row's
compile and recomputes the estimate (a change to the estimate changes no compiled program; needs
no compile-only environment).

Since configs/gpt_1b.yaml unrolls its layer scan (2026-11-28) the layouts name the scan: the
rolled ones as measured before that (`model.scan_unroll=1`), and the unrolled rows beside them.
"""

import dataclasses
import json
import os
import sys

from bench.common import REPO, Bench, result_path
from megascale_jax.aot import environment, targets
from megascale_jax.config import load_config
from megascale_jax.model import flops
from megascale_jax.planner.search import WORKSPACE_BYTES

CONFIG = os.path.join(REPO, "configs", "gpt_1b.yaml")
SAME_WORK = ["model.window=512", "parallel.microbatches=1", "optim.name=adamw", "train.global_batch=8"]
ROLLED = ["model.scan_unroll=1"]
# name: (GPU, GPUs, overrides of configs/gpt_1b.yaml)
LAYOUTS = {
    "gpt_1b as shipped (LAMB, 2 x 4 sequences)": ("h100-sxm", 1, ROLLED),
    "same-work row (AdamW, window 512, 8 sequences)": ("h200", 1, [*SAME_WORK, *ROLLED]),
    "same-work row, remat elementwise, 19 sequences": ("h200", 1, [*SAME_WORK[:-1], "train.global_batch=19",
                                                                   "model.remat=elementwise", *ROLLED]),
    "same-work row, the loss in 8 slices": ("h200", 1, [*SAME_WORK, "model.loss_chunks=8", *ROLLED]),
    "remat full, 16 sequences": ("h100-sxm", 1, ["model.remat=full", "train.global_batch=16",
                                                 "parallel.microbatches=1", *ROLLED]),
    "remat dots, 8 sequences": ("h100-sxm", 1, ["model.remat=dots", "parallel.microbatches=1", *ROLLED]),
    "long sequence: 16k tokens, window 512": ("h200", 1, ["model.seq_len=16384", "model.window=512",
                                                          "train.global_batch=1", "parallel.microbatches=1", *ROLLED]),
    "tp 8, SP + collective matmul": ("h100-sxm", 8, ["mesh.tp=8", "parallel.sequence_parallel=true",
                                                     "parallel.tp_overlap=collective_matmul", *ROLLED]),
    "dp 8, ZeRO-1, 32 sequences": ("h100-sxm", 8, ["parallel.zero1=true", "train.global_batch=32", *ROLLED]),
    "dp 2 x tp 4, ZeRO-1": ("h100-sxm", 8, ["mesh.tp=4", "parallel.zero1=true", *ROLLED]),
    "pp 2 x tp 4, 1F1B, 4 microbatches": ("h100-sxm", 8, ["mesh.pp=2", "mesh.tp=4", "parallel.microbatches=4",
                                                         "train.global_batch=8", *ROLLED]),
    "pp 4 x tp 2, interleaved v2, 8 microbatches": ("h100-sxm", 8, [
        "mesh.pp=4", "mesh.tp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2",
        "parallel.microbatches=8", "train.global_batch=8", *ROLLED]),
    "dp 2 x tp 8 over two hosts, ZeRO-1": ("h100-sxm", 16, ["mesh.tp=8", "parallel.zero1=true",
                                                            "train.global_batch=16", *ROLLED]),
    # configs/gpt_1b.yaml's own scan since 2026-11-28: unrolled
    "unrolled: gpt_1b as shipped": ("h100-sxm", 1, []),
    "unrolled: same-work row": ("h200", 1, SAME_WORK),
    "unrolled: remat full, 16 sequences": ("h100-sxm", 1, ["model.remat=full", "train.global_batch=16",
                                                           "parallel.microbatches=1"]),
    "unrolled: remat dots, 8 sequences": ("h100-sxm", 1, ["model.remat=dots", "parallel.microbatches=1"]),
}


def layout_config(gpus: int, overrides: list[str]):
    """configs/gpt_1b.yaml with `overrides`, its dp filling `gpus`."""
    cfg = load_config(CONFIG, overrides, planning=True)
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp=gpus // (cfg.mesh.tp * cfg.mesh.pp)))


def estimate_bytes(gpus: int, overrides: list[str]) -> float:
    return flops.memory_estimate(layout_config(gpus, overrides))["total"]  # the compile has no cuBLAS/NCCL workspace either


def reestimate(row: dict, gpus: int, overrides: list[str]) -> dict:
    """A row with its estimate recomputed by today's `memory_estimate` for the layout's overrides
    (rows compiled before configs/gpt_1b.yaml unrolled its scan recorded none for the rolled scan),
    its compile kept."""
    estimate = estimate_bytes(gpus, overrides)
    return {**row, "overrides": overrides, "estimate_bytes": estimate, "estimate_over_compiled": estimate / row["compiled_bytes"]}


def measure(gpu: str, gpus: int, overrides: list[str]) -> dict:
    cfg = layout_config(gpus, overrides)
    estimate = flops.memory_estimate(cfg)["total"]
    report = environment.compile_report(gpu, targets.topology(gpus), CONFIG, [*overrides, f"mesh.dp={cfg.mesh.dp}"])
    peak = report["memory"]["peak"]
    return {"gpu": gpu, "gpus": gpus, "overrides": overrides, "estimate_bytes": estimate,
            "planner_workspace_bytes": WORKSPACE_BYTES, "compiled_bytes": peak,
            "live_peak_bytes": report["live_peak_bytes"], "estimate_over_compiled": estimate / peak,
            "compile_s": report["compile_s"]}


def main(argv=None) -> int:
    bench = Bench(__doc__, "memory_estimate_aot")
    bench.add_argument("--only", action="append", default=None, choices=list(LAYOUTS), metavar="NAME",
                       help="compile this layout only (repeatable) and replace its row in the existing file")
    bench.add_argument("--reestimate", action="store_true",
                       help="compile nothing: recompute every row's estimate against its recorded compile")
    args = bench.parse_args(argv)
    rows = {}
    if args.only or args.reestimate:
        with open(result_path("memory_estimate_aot", args.out, overwrite=True)) as f:
            rows = json.load(f)["rows"]
    else:
        bench.refuse_existing()
    print(f"{'layout':<52}{'GPUs':>5}{'estimate GiB':>14}{'compiled GiB':>14}{'ratio':>8}")
    for name, (gpu, gpus, overrides) in LAYOUTS.items():
        if args.only and name not in args.only:
            continue
        r = rows[name] = reestimate(rows[name], gpus, overrides) if args.reestimate else measure(gpu, gpus, overrides)
        print(f"{name:<52}{gpus:>5}{r['estimate_bytes'] / 2**30:>14.2f}{r['compiled_bytes'] / 2**30:>14.2f}"
              f"{r['estimate_over_compiled']:>8.2f}", flush=True)
    rows = {name: rows[name] for name in LAYOUTS if name in rows}  # in LAYOUTS' order
    bench.args.overwrite = bench.args.overwrite or bool(args.only) or args.reestimate
    bench.write({"device": "compiled without a GPU (jax 0.11.2, the compile-only environment)", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
