"""What a GPU campaign's result says the planner's constants are (issue 40: the campaign's
measured GEMM and attention timings feed the H100/H200 calibration):

    python -m bench.planner.calibrate bench/results/gpu_nvidia_h200_2026-11-23.json --gpu h200

prints, from whichever sections the result holds, each fit beside the value in
configs/calibration.yaml:
* kernels: the fused attention's efficiency and cost per query row (`measured.attention_fit`);
* rates: the GEMM size curve's asymptote and half-size (`measured.gemm_fit`), and the streaming
  HBM rate against the datasheet's;
* mfu_ladder: the elementwise passes that predict its `xla_flags` row (`measured.fit_elementwise_passes`);
* profiled_steps: each model part's seconds a step and a sequence (the op table at two batches),
  and the rate the step's matrix products ran at (their FLOPs from the module's shapes).
Writes nothing: a value goes into configs/calibration.yaml by hand, with its source beside it.
Exit 2, with one line, for a file that is not a campaign result or an unknown --gpu.
"""

from __future__ import annotations

import argparse
import json
import sys

from megascale_jax.planner import calibration, measured


def report(path: str, gpu_key: str) -> list[str]:
    with open(path) as f:
        sections = json.load(f)["sections"]
    yaml = calibration.load()[gpu_key]
    lines = [f"{path} against configs/calibration.yaml's {gpu_key}"]

    def beside(name: str, value: float, digits: int = 2) -> str:
        return f"  {name:<24}{value:>10.{digits}f}   (calibration.yaml: {yaml.get(name, 'absent')})"

    if "attention" in sections.get("kernels", {}):
        fit = measured.attention_fit(path, gpu_key)
        worst = max(abs(r["error"]) for r in fit["rows"])
        lines += [f"kernels: cuDNN attention, {len(fit['rows'])} shapes, worst row {worst:.0%}",
                  beside("attention_efficiency", fit["attention_efficiency"]),
                  beside("attention_query_ns", fit["attention_query_ns"])]
    else:
        lines.append("kernels: not in this result")
    rates = sections.get("rates", {})
    if rates.get("gemms"):
        fit = measured.gemm_fit(path, gpu_key)
        worst = max(abs(r["error"]) for r in fit["rows"])
        lines += [f"rates: {len(fit['rows'])} GEMM shapes, worst row {worst:.0%} (matmul_max_efficiency here is "
                  f"the asymptote, wave quantization out; the yaml's is the {yaml.get('matmul_measured_at')}^3 rate)",
                  beside("matmul_max_efficiency", fit["matmul_max_efficiency"]),
                  beside("matmul_half_gflop", fit["matmul_half_gflop"])]
        timed = [r for r in rates.get("stream", []) if "tb_per_s" in r]
        if timed:
            best = max(r["tb_per_s"] for r in timed)
            lines.append(f"  stream: {best:.2f} TB/s at best, {best / yaml['hbm_tbps']:.0%} of the datasheet's "
                         f"{yaml['hbm_tbps']} TB/s")
    else:
        lines.append("rates: not in this result")
    ladder = sections.get("mfu_ladder", {})
    if any(r.get("name") == "xla_flags" and r.get("step_time_s") for r in ladder.get("rows", [])):
        lines.append(beside("elementwise_passes", measured.fit_elementwise_passes(path, "xla_flags", gpu_key), 1)
                     + "  <- its xla_flags row")
    products = sections.get("profiled_steps", {}).get("products") or {}
    if products.get("tflop_per_s"):
        rate = products["tflop_per_s"]
        lines.append(f"profiled_steps: the step's matrix products ran at {rate:.0f} TFLOP/s, {rate / yaml['peak_tflops']:.0%} "
                     f"of peak ({products['flops'] / 1e12:.1f} TFLOP in {products['seconds'] * 1e3:.1f} ms; "
                     f"against the rates section's same shapes alone: the in-step derate)")
    split = sections.get("profiled_steps", {}).get("batch_split")
    if isinstance(split, dict):
        lines.append("profiled_steps: ms a step + ms a sequence, by model part")
        lines += [f"  {part:<24}{s['per_step_s'] * 1e3:>9.2f} +{s['per_sequence_s'] * 1e3:>8.2f}"
                  for part, s in split.items() if part != "total"]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.planner.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("result", help="a GPU campaign's result (bench/results/gpu_<device>_<date>.json)")
    parser.add_argument("--gpu", default="h200", help="the calibration.yaml entry to set it beside (default h200)")
    args = parser.parse_args(argv)
    try:
        if args.gpu not in calibration.load():
            raise ValueError(f"--gpu {args.gpu!r} is not one of {', '.join(calibration.load())} (configs/calibration.yaml)")
        lines = report(args.result, args.gpu)
    except (OSError, ValueError, KeyError) as e:
        what = ("not JSON: not a campaign result" if isinstance(e, json.JSONDecodeError)
                else "no 'sections' in it: not a campaign result" if isinstance(e, KeyError) else e)
        print(f"error: {args.result}: {what}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
