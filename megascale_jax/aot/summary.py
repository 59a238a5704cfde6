"""`plan --compile`'s report as a person reads it, and its verdict on memory. jax-free.

Fits means: the compiled step's peak (XLA's buffer assignment: arguments + outputs − aliased +
temporaries) plus what a run holds outside the step (the input batch and the next one, a
background checkpoint's device copy of the state, which the run caps to what fits beside the step)
within what jax's allocator lets a program use on the GPU (`targets.Target.limit_bytes`). cuDNN's workspace shows as u8[0] in a compile without a device:
tens of MiB on the H200, inside the margin this leaves.
"""

from __future__ import annotations

from megascale_jax.model.flops import format_bytes

GIB = 2**30
TOP_LINES = 8


def needed_bytes(report: dict) -> int:
    """The step's peak with what the run holds beside it."""
    return report["memory"]["peak"] + sum(report["outside_step"].values())


def fits(report: dict) -> bool:
    return needed_bytes(report) <= report["limit_bytes"]


def shrink_options(report: dict) -> str:
    """What lowers a step's memory (the checkpoint's copy never tips it: the run caps it)."""
    options = ["a smaller train.global_batch or more parallel.microbatches", "model.remat=dots or full",
                "model.loss_chunks=8 (the logits in slices)", "parallel.zero1=true with mesh.dp > 1",
                "more mesh.tp or mesh.pp"]
    return "; ".join(options)


def does_not_fit(report: dict) -> str:
    """The one line `plan --compile` exits 2 with."""
    return (f"the compiled step needs {format_bytes(needed_bytes(report))} per GPU (peak "
            f"{format_bytes(report['memory']['peak'])} + {format_bytes(sum(report['outside_step'].values()))} "
            f"outside the step), more than the {format_bytes(report['limit_bytes'])} jax may use on an "
            f"{report['device']}; try {shrink_options(report)}")


def _counts(counts: dict) -> str:
    return ", ".join(f"{name} {n:,}" for name, n in counts.items()) or "none"


def text(report: dict, estimate_bytes: float | None) -> str:
    m, out = report["memory"], report["outside_step"]
    lines = [f"compiled for {report['gpus']} x {report['device']} (topology {report['topology']}, mesh "
             + " ".join(f"{a}={n}" for a, n in report["mesh"].items())
             + f") with jax {report['jax']} in {report['compile_s']:.0f} s, no GPU",
             f"memory per GPU: peak {format_bytes(m['peak'])} = arguments {format_bytes(m['argument'])} + outputs "
             f"{format_bytes(m['output'])} - aliased {format_bytes(m['alias'])} + temporaries {format_bytes(m['temp'])}",
             f"  outside the step: checkpoint copy of the state {format_bytes(out['checkpoint_copy'])}"
             + (f" on the device, capped to what fits (the other {format_bytes(report['checkpoint_to_host'])} go to host "
                "memory while the step waits)" if report.get("checkpoint_to_host") else "")
             + f", input batches {format_bytes(out['input_batches'])}",
             f"  fits: {'yes' if fits(report) else 'NO'} ({format_bytes(needed_bytes(report))} of the "
             f"{format_bytes(report['limit_bytes'])} jax may use on this GPU)",
             f"  live at once at the peak: {format_bytes(report['live_peak_bytes'])}; XLA's packing of the "
             f"temporaries adds {format_bytes(max(0, m['peak'] - report['live_peak_bytes']))}"]
    if estimate_bytes:
        lines.append(f"  the planner's estimate before compiling: {format_bytes(estimate_bytes)} "
                     f"({estimate_bytes / m['peak'] - 1:+.1%} against the compile)")
    lines.append("largest buffers live at the peak:")
    lines += [f"  {format_bytes(b['bytes']):>10}  {b['shape'][:36]:<36} {b['part']}"
              for b in report["peak_buffers"][:TOP_LINES]]
    lines.append("live at the peak by part: " + ", ".join(
        f"{part} {v / GIB:.2f}" for part, v in list(report["peak_bytes_by_part"].items())[:TOP_LINES]) + " GiB")
    lines.append("largest ranges of the temporaries (values never live together share one):")
    lines += [f"  {format_bytes(c['bytes']):>10}  {c['shapes'][:60]:<60} {', '.join(c['parts'])[:80]}"
              for c in report["heap_chunks"][:4]]
    k = report["kernels"]["per_step"]
    lines += [f"kernels per step: {k['kernels']:,} ({report['kernels']['static']['kernels']:,} in the program)",
              f"  GEMMs by backend: {_counts(k.get('gemms', {}))}",
              f"  fusions by kind: {_counts(k.get('fusions', {}))}",
              f"  custom calls: {_counts(k.get('custom_calls', {}))}"]
    if k.get("collectives"):
        lines.append(f"  collectives: {_counts(k['collectives'])}")
    for axis, sent in sorted(report["collective_bytes"].items()):
        ideal = report["ideal_collective_bytes"].get(axis)
        against = f", ideal {format_bytes(ideal)} ({sent / ideal:.2f}x)" if ideal else ""
        lines.append(f"collectives over {axis}: {format_bytes(sent)} a step{against}; per step, asynchronous / "
                     "with compute scheduled inside / all:")
        lines += [f"  {op:<20} {o['async']:>6,} / {o['overlapped']:>6,} / {o['collectives']:>6,}"
                  for op, o in report["overlap"].get(axis, {}).items() if op != "all"]
    r = report["roofline"]
    lines.append(f"roofline (no profile; the GPU's calibrated GEMM and copy rates): {r['step_s'] * 1e3:.1f} ms a step "
                 f"of compute, {r['flops'] / 1e12:.1f} TFLOP and {r['bytes'] / 1e9:.1f} GB; by part: " + ", ".join(
                     f"{part} {s * 1e3:.1f}" for part, s in list(r["by_part_s"].items())[:6]) + " ms")
    lines += [f"  {k['seconds'] * 1e3:7.2f} ms  {k['kind'][:28]:<28} {k['part']:<24} {k['bound']}-bound, "
              f"{k['runs']} a step  {k['op_name'][:50]}" for k in r["top"][:5]]
    lines.append("note: without a GPU XLA cannot autotune its GEMMs: each is a Triton GEMM fusion with default "
                 "tiles (a device picks cuBLAS for most); memory is exact, the kernel mix an approximation")
    return "\n".join(lines)
