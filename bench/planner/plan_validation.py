"""The planner against published runs it was not fitted to: Megatron-LM's SC'21 weak-scaling table
and Korthikanti et al. 2022's Table 5 (`megascale_jax/planner/published.py`, sources there);
and, second, against this project's own H200 MFU ladder, one row of which the H200 calibration
was fitted to (`megascale_jax/planner/measured.py`).

    python -m bench.planner.plan_validation [--out FILE] [--overwrite]

Prints published (or measured) vs predicted with the relative error, and writes
bench/results/plan_validation_a100.json. No devices are used: the prediction is arithmetic.
"""

import os
import sys

from bench.common import REPO, Bench
from megascale_jax.planner import measured
from megascale_jax.planner.published import validation_table

H200_RUN = "bench/results/gpu_nvidia_h200_2026-11-23.json"


def main(argv=None) -> int:
    bench = Bench(__doc__, "plan_validation_a100")
    bench.parse_args(argv)
    bench.refuse_existing()
    rows = validation_table("a100-80g")
    print(f"{'source':<32}{'model':>6}{'GPUs':>6}  {'metric':<40}{'published':>10}{'predicted':>10}{'error':>8}")
    for r in rows:
        print(f"{r['source']:<32}{r['model']:>6}{r['gpus']:>6}  {r['metric']:<40}{r['published']:>10}"
              f"{r['predicted']:>10}{r['error']:>+8.1%}")
    errors = [abs(r["error"]) for r in rows]
    summary = {"mean_abs_error": sum(errors) / len(errors), "max_abs_error": max(errors), "points": len(rows)}
    print(f"mean |error| {summary['mean_abs_error']:.1%}, max {summary['max_abs_error']:.1%} over {len(rows)} points")
    own = measured.validation_table(os.path.join(REPO, H200_RUN), "h200")
    print(f"\nthis project's H200 ladder ({H200_RUN}; the h200 entry is fitted to xla_flags)")
    print(f"{'row':<20}{'measured s':>11}{'predicted s':>12}{'error':>8}")
    for r in own:
        print(f"{r['row']:<20}{r['measured_s']:>11.3f}{r['predicted_s']:>12.3f}{r['error']:>+8.1%}")
    bench.write({**summary, "rows": rows, "calibration": "configs/calibration.yaml, a100-80g entry",
                 "h200_own_runs": {"result": H200_RUN, "rows": own}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
