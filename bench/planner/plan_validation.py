"""The planner against published runs, each source held out: Megatron-LM SC'21 Table 1,
Korthikanti et al. 2022 Table 5, MegaScale NSDI '24 Table 2 (A100) and Llama 3 Table 4 (H100),
every one predicted with a calibration not fitted to it (`megascale_jax/planner/validation.py`);
MegaScale's Table 3 ablation beside the gain the planner prices for each optimization; and this
project's own H200 MFU ladders: 2026-11-23's, one row of which the H200 calibration was fitted
to, and 2026-11-27's, held out, with its profiled step's device time by kind beside the planner's
(`megascale_jax/planner/measured.py`).

    python -m bench.planner.plan_validation [--out FILE] [--overwrite]

Writes bench/results/plan_validation.json. No devices are used: the prediction is arithmetic.
"""

import os
import sys

from bench.common import REPO, Bench
from megascale_jax.planner import calibration, measured, published, validation

H200_RUN = "bench/results/gpu_nvidia_h200_2026-11-23.json"  # the H200 entry's elementwise passes were fitted to it
H200_HELD_OUT = "bench/results/gpu_nvidia_h200_2026-11-27.json"  # run after the fit: other batches, remat


def main(argv=None) -> int:
    bench = Bench(__doc__, "plan_validation")
    bench.parse_args(argv)
    bench.refuse_existing()
    held_out = validation.held_out_table()
    for source in held_out.values():
        print(f"\n{source['title']} ({source['gpu']}), held out")
        print(f"  {'model':>6}{'GPUs':>7}  {'metric':<40}{'published':>10}{'predicted':>10}{'error':>8}")
        for r in source["rows"]:
            print(f"  {r['model']:>6}{r['gpus']:>7}  {r['metric']:<40}{r['published']:>10}{r['predicted']:>10}"
                  f"{r['error']:>+8.1%}")
        print(f"  mean |error| {source['mean_abs_error']:.1%}, max {source['max_abs_error']:.1%} "
              f"over {source['points']} points")
    all_errors = [abs(r["error"]) for s in held_out.values() for r in s["rows"]]
    summary = {"mean_abs_error": sum(all_errors) / len(all_errors), "max_abs_error": max(all_errors),
               "points": len(all_errors), "target": {"max": validation.TARGET_MAX, "mean": validation.TARGET_MEAN},
               "within_target": sum(e <= validation.TARGET_MAX for e in all_errors)}
    print(f"\nall sources: mean |error| {summary['mean_abs_error']:.1%}, max {summary['max_abs_error']:.1%}; "
          f"{summary['within_target']} of {len(all_errors)} points within {validation.TARGET_MAX:.0%}")

    ablation = published.megascale_ablation(calibration.gpu("a100-80g", held_out="megascale2024"))
    print("\nMegaScale Table 3 (175B, 256 A100s, batch 256; MFU %, each row's own model FLOPs: the window's from (2) on, as Table 2 counts them)")
    print(f"  {'step':<46}{'paper':>7}{'planner':>9}{'paper +':>9}{'planner +':>11}")
    for r in ablation:
        print(f"  {r['step']:<46}{r['published_mfu']:>7.1f}{r['predicted_mfu']:>9.1f}"
              f"{r.get('published_gain', float('nan')):>9.1f}{r.get('predicted_gain', float('nan')):>11.1f}")

    split = published.llama3_split(calibration.gpu("h100-sxm", held_out="llama3_2024"))
    print("\nLlama 3's two 8K rows as t·(M + (PP-1)/V) + C (the paper's bubble): t one microbatch, C once per iteration")
    print(f"  published: t {split['published_microbatch_s']:.3f} s, C {split['published_per_iteration_s']:.3f} s; "
          f"planner's compute: t {split['planner_microbatch_s']:.3f} s")
    print("  the planner's dp link (FSDP's sharded gradients: an fp32 reduce-scatter every microbatch, from the first gradient on)")
    for r in split["planner_dp_link"]:
        print(f"  {r['gpus']:>6} GPUs: first gradient {r['first_gradient_s']:.2f} s + reduce-scatters {r['reduce_scatter_s']:.2f} s"
              f" + pipeline sends {r['pp_sends_s']:.2f} s = link ends {r['end_s']:.2f} s; compute ends {r['compute_end_s']:.2f} s;"
              f" iteration {r['iteration_s']:.2f} s")
    pairs = published.megascale_equal_work_pairs()
    print("\nMegaScale Table 2 rows with the same work per GPU at 8x the dp (the planner prices each pair alike)")
    for r in pairs:
        print(f"  {r['system']:<12} GPUs {r['gpus']} dp {r['dp']} m {r['microbatches']}: {r['published_s']} s, "
              f"{r['slowdown']:+.1%} at the larger dp")

    own = measured.validation_table(os.path.join(REPO, H200_RUN), "h200")
    later = measured.validation_table(os.path.join(REPO, H200_HELD_OUT), "h200")
    for title, rows in ((f"{H200_RUN}; the h200 entry's elementwise passes are fitted to xla_flags", own),
                        (f"{H200_HELD_OUT}; held out: run after the fit", later)):
        print(f"\nthis project's H200 ladder ({title})")
        print(f"  {'row':<20}{'batch':>6}{'measured s':>11}{'predicted s':>12}{'error':>8}")
        for r in rows:
            print(f"  {r['row']:<20}{r['batch']:>6}{r['measured_s']:>11.3f}{r['predicted_s']:>12.3f}{r['error']:>+8.1%}")
    parts = measured.part_table(os.path.join(REPO, H200_HELD_OUT), "h200")
    print(f"\nthe profiled step of {H200_HELD_OUT} (its op table) by kind, against the planner")
    print(f"  {'kind':<14}{'measured ms':>12}{'predicted ms':>13}")
    for r in parts:
        print(f"  {r['kind']:<14}{r['measured_s'] * 1e3:>12.1f}{r['predicted_s'] * 1e3:>13.1f}")
    bench.write({**summary, "held_out": held_out, "megascale_table3": ablation, "llama3_split": split,
                 "megascale_equal_work_pairs": pairs,
                 "calibration": "configs/calibration.yaml (a100-80g, h100-sxm entries; fitted_to: [])",
                 "h200_own_runs": {"result": H200_RUN, "rows": own},
                 "h200_held_out_run": {"result": H200_HELD_OUT, "rows": later, "profiled_step_by_kind": parts}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
