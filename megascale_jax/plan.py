"""`python -m megascale_jax.plan --config CONFIG --gpus N --gpu {a100-80g,h100-sxm,h200}
[--nic-gbps 8x200] [--json] [--explain] [--search] [--plot OUT.png] [section.key=value ...]`

Predicts the iteration time of the config's layout on N GPUs before a GPU-hour is spent: its
breakdown (compute, pipeline bubble, exposed tp/pp/dp communication, optimizer, data), MFU,
tokens/s and memory per device (`megascale_jax.planner`). dp is N / (tp·pp·cp); a `mesh.dp=`
override must agree with it (a config file's own mesh.dp is replaced). `--search` ranks every
valid layout for N GPUs; `--plot` draws MFU and iteration time against GPU count for the layout's
family (the same tp, pp, v and microbatch size, dp varied). `--explain` prints one prediction's
parts: compute by kind, exposed communication per axis, bubble, optimizer, data. A layout that
does not fit in memory, or a model the planner cannot price (float32 math; an option its GPU has
no measured rate for), is refused with one line and exit 2; options priced as their default are
named in a `note:` line (`notes` in --json) (`--search` still ranks the layouts that do fit). Validated against published runs,
each source held out: `python -m bench.planner.plan_validation`.

`--compile` compiles the trainer's own step for the layout on N described GPUs (h100-sxm, h200),
with no GPU present, in the compile-only environment (`configs/aot/setup_env.sh`; `megascale_jax.aot`),
and prints what XLA made of it instead of the prediction: peak memory per GPU and whether it fits,
the buffers live at the peak by model part, the kernels by kind and GEMM backend, and the
collectives per mesh axis beside their ideal bytes and their overlap with compute (docs/compile.md).
A step that does not fit exits 2 with its peak, the limit and what shrinks it.
"""

from __future__ import annotations

import dataclasses
import os
import json
import sys
from typing import Optional, Sequence

from megascale_jax import cli
from megascale_jax.aot import environment, summary, targets
from megascale_jax.config import ConfigError, load_config, validate
from megascale_jax.model.flops import format_bytes
from megascale_jax.planner import calibration
from megascale_jax.planner.predict import require_priced
from megascale_jax.planner.search import Plan, family, plan, search
from megascale_jax.planner.workload import from_config, notes

GIB = 2**30


def layout_name(p: Plan) -> str:
    c, par = p.cfg.mesh, p.cfg.parallel
    name = f"dp={c.dp} pp={c.pp}" + (f" cp={c.cp}" if c.cp > 1 else "") + f" tp={c.tp}"  # the mesh's order
    if c.pp > 1:
        name += f" {par.pp_schedule} v={par.pp_virtual}"
    name += f" m={par.microbatches}"
    name += " zero1" if par.zero1 else ""
    name += " sp+cm" if par.sequence_parallel else ""
    return name


def as_json(p: Plan) -> dict:
    pr = p.prediction
    return {"layout": layout_name(p), "iteration_s": pr.iteration_s, "mfu": pr.mfu, "tokens_per_s": pr.tokens_per_s,
            "breakdown": pr.breakdown, "memory_gib": {k: v / GIB for k, v in p.memory.items()},
            "stash_slots": p.stash_slots, "stash_slot_gib": p.stash_slot_bytes / GIB, "fits": p.fits}


def report(p: Plan, gpus: int, gpu: calibration.Gpu) -> str:
    pr = p.prediction
    lines = [f"{p.cfg.model.layers}-layer d_model {p.cfg.model.d_model} model, global batch "
             f"{p.cfg.train.global_batch} x {p.cfg.model.seq_len} tokens, on {gpus} x {gpu.name}",
             f"layout: {layout_name(p)}",
             f"iteration: {pr.iteration_s:.3f} s   MFU {pr.mfu:.1%}   {pr.tokens_per_s:,.0f} tokens/s",
             "breakdown:"]
    lines += [f"  {k:<10} {v:9.3f} s  {v / pr.iteration_s:6.1%}" for k, v in pr.breakdown.items()]
    lines.append("memory per device:" + (f" (pipeline stash: {p.stash_slots} slots per stage of "
                                         f"{format_bytes(p.stash_slot_bytes)} each)" if p.stash_slots else ""))
    lines += [f"  {k:<12} {format_bytes(v):>10}" for k, v in p.memory.items()]
    limit = 0.75 * gpu.hbm_bytes
    lines.append(f"fits: {'yes' if p.fits else 'NO'} ({format_bytes(p.memory['total'])} of the "
                 f"{format_bytes(limit)} XLA may use on a {format_bytes(gpu.hbm_bytes)} GPU)")
    return "\n".join(lines)


def explain(p: Plan) -> str:
    """One prediction's seconds, finer than the breakdown (`Prediction.parts`), with what each is."""
    pr = p.prediction
    what = {"compute gemm": "the layers' matmuls (forward, backward, recompute) at full waves",
            "compute gemm wave quantization": "SMs idle in each GEMM's last wave of tiles (layers and LM head)",
            "compute attention": "attention scores and weighted sums (kernel or batched GEMMs + score passes)",
            "compute elementwise": "norms, GeLU, dropout, residual adds: HBM passes",
            "compute lm head": "the logits GEMMs (full waves) and the loss on the last stage",
            "compute gradient accumulation": "each microbatch's weight gradients added into the fp32 accumulator",
            "tp layers": "tp collectives of the layers not hidden (collective matmul, Megatron's async backward)",
            "tp embedding+head": "tp collectives of the embedding lookup and the LM head",
            "cp keys+values": "attention's keys and values from the other cp ranks (halo or all-gather), both ways",
            "bubble": "pipeline warm-up and cool-down",
            "pp sends": "pipeline sends not hidden behind a tick's compute",
            "pp edge gradients": "the embedding's and head's gradients summed over pp after the backward",
            "dp gradients+parameters": "dp reduction (and ZeRO-1 gather) not hidden behind compute; cp's too",
            "optimizer": "the update's HBM passes and the gradients' global norm (and Megatron's over its buffers)",
            "data": "loader time on the critical path (charged 0: prefetched)"}
    lines = [f"explain: {layout_name(p)}, iteration {pr.iteration_s:.3f} s"]
    lines += [f"  {k:<30} {v:9.3f} s {v / pr.iteration_s:6.1%}  {what[k]}" for k, v in pr.parts.items()]
    return "\n".join(lines)


def draw(plans: list[Plan], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [p.cfg.mesh.size for p in plans]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(gpus, [100 * p.prediction.mfu for p in plans], marker="o")
    a.set(xscale="log", xlabel="GPUs", ylabel="predicted MFU (%)", ylim=(0, None))
    b.plot(gpus, [p.prediction.iteration_s for p in plans], marker="o")
    b.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="predicted iteration (s)")
    c = plans[-1].cfg
    cp = f" cp={c.mesh.cp}" if c.mesh.cp > 1 else ""
    fig.suptitle(f"pp={c.mesh.pp}{cp} tp={c.mesh.tp} v={c.parallel.pp_virtual}, global batch {c.train.global_batch}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def compile_step(args, cfg, gpu: calibration.Gpu, topology: str, overrides: list[str]) -> int:
    """`--compile`: the step compiled in the compile-only environment, its report printed (or as
    JSON); exit 2 where it does not fit or cannot be compiled."""
    try:
        report = environment.compile_report(args.gpu, topology, args.config, overrides, args.xla_option, args.dump)
    except environment.MissingEnvironment as e:
        return cli.user_error(e)
    except RuntimeError as e:
        if "While setting option" in str(e) or "No such compile option" in str(e):
            return cli.user_error(f"an --xla-option XLA refuses: {e}")
        return cli.user_error(f"the step does not compile for {gpu.name} ({e}); {kernel_options(cfg)}")
    try:  # the planner's own memory estimate, beside the compile, where the planner prices the model
        require_priced(from_config(cfg, args.gpus), gpu)
        estimate = plan(cfg, args.gpus, gpu).memory["total"]
    except ValueError:
        estimate = None
    report["planner_estimate_bytes"] = estimate
    print(json.dumps(report, indent=1) if args.json else summary.text(report, estimate))
    if not summary.fits(report):
        return cli.user_error(summary.does_not_fit(report))
    return 0


def kernel_options(cfg) -> str:
    """The options that chose the step's own kernels, and what to try instead."""
    m = cfg.model
    chosen = [f"model.attention={m.attention}"] + [f"model.{k}=true" for k in ("fused_norm", "fused_mlp") if getattr(m, k)]
    return (f"its kernels come from {' '.join(chosen)}: try model.attention=xla or cudnn and the fused kernels off "
            "to find the one that does not lower for sm_90")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = cli.ArgumentParser(prog="python -m megascale_jax.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/gpt_175b.yaml")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs, e.g. 12288")
    parser.add_argument("--gpu", required=True, help="a100-80g, h100-sxm or h200 (configs/calibration.yaml)")
    parser.add_argument("--nic-gbps", default=None, help="NICs per node x Gb/s, e.g. 8x400 (default: the GPU's system)")
    parser.add_argument("--json", action="store_true", help="print the prediction as JSON")
    parser.add_argument("--explain", action="store_true", help="print the prediction's parts and what each is")
    parser.add_argument("--search", action="store_true", help="rank every valid layout for --gpus")
    parser.add_argument("--plot", default=None, help="draw MFU and iteration time against GPU count to this PNG")
    parser.add_argument("--compile", action="store_true",
                        help="compile the step for --gpu without a GPU and report its memory, kernels and collectives")
    parser.add_argument("--gpus-per-host", type=int, default=8, help="with --compile: GPUs a host (default 8)")
    parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="with --compile: an XLA option, e.g. xla_gpu_enable_triton_gemm=false (repeatable)")
    parser.add_argument("--dump", default=None, metavar="DIR", help="with --compile: keep XLA's dump (optimized HLO) here")
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. mesh.tp=8 mesh.pp=8")
    args = cli.parse(parser, argv)
    try:
        if args.compile:
            topology = targets.topology(args.gpus, args.gpus_per_host)
            targets.target(args.gpu)
        gpu = calibration.gpu(args.gpu, args.nic_gbps)
    except ValueError as e:
        return cli.user_error(e)
    if args.gpus < 1:
        return cli.user_error(f"--gpus={args.gpus} must be >= 1")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        return cli.user_error(f"--plot {args.plot}: {os.path.dirname(args.plot) or '.'} is not a directory; "
                              "pass a PNG path in one")
    try:
        cfg = load_config(args.config, [o for o in args.overrides if not o.startswith("mesh.dp=")], planning=True)
    except ConfigError as e:
        return cli.user_error(e)
    tp, pp, cp = cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.cp
    # the axes dp multiplies, as the errors name them (cp only where it is set)
    axes, sizes = ("mesh.tp x mesh.pp", f"{tp} x {pp}")
    if cp > 1:
        axes, sizes = f"{axes} x mesh.cp", f"{sizes} x {cp}"
    if args.gpus % (tp * pp * cp):
        return cli.user_error(f"--gpus={args.gpus} is not divisible by {axes} = {sizes}; "
                              f"use a multiple of {tp * pp * cp} GPUs or change the layout")
    dp = args.gpus // (tp * pp * cp)
    given = [o for o in args.overrides if o.startswith("mesh.dp=")]
    if given and given[-1] != f"mesh.dp={dp}":
        return cli.user_error(f"{given[-1]} disagrees with --gpus={args.gpus} / ({axes} = {tp * pp * cp}) = "
                              f"{dp}; drop mesh.dp or make it {dp}")
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, dp=dp))
    try:
        validate(cfg, planning=True)  # the layout on this many GPUs (batch split over dp, ...)
    except ConfigError as e:
        return cli.user_error(e)
    if args.compile:
        return compile_step(args, cfg, gpu, topology, [*(o for o in args.overrides if not o.startswith("mesh.dp=")),
                                                        f"mesh.dp={dp}"])
    if cfg.model.dtype != "bfloat16":  # the calibration is bf16 tensor-core math; fp32 would be priced wrongly
        return cli.user_error(f"model.dtype={cfg.model.dtype} is not priced by the planner (bf16 tensor-core "
                              f"rates only); set model.dtype=bfloat16")
    try:
        require_priced(from_config(cfg, args.gpus), gpu)
    except ValueError as e:
        return cli.user_error(e)

    chosen = plan(cfg, args.gpus, gpu)
    ranked = search(cfg, args.gpus, gpu) if args.search else []
    if not chosen.fits and not args.search:
        return cli.user_error(f"layout {layout_name(chosen)} needs {chosen.memory['total'] / GIB:.1f} GiB per GPU, more "
                              f"than the {0.75 * gpu.hbm_bytes / GIB:.1f} GiB XLA may use on a {gpu.name}; "
                              f"raise mesh.pp or mesh.tp (mesh.cp for long sequences), or try --search")
    if args.json:
        out = {**as_json(chosen), "notes": notes(cfg)}
        if args.explain:
            out["parts"] = chosen.prediction.parts
        if args.search:
            out["search"] = [as_json(p) for p in ranked[:10]]
        print(json.dumps(out, indent=1))
    else:
        print(report(chosen, args.gpus, gpu))
        for note in notes(cfg):
            print(f"note: {note}")
        if args.explain:
            print(explain(chosen))
        if args.search:
            print(f"\nbest layouts for {args.gpus} GPUs ({len(ranked)} valid, by predicted tokens/s):")
            print(f"  {'layout':<52}{'tokens/s':>12}{'MFU':>7}{'iter s':>9}{'GiB':>7}  fits")
            for p in ranked[:10]:
                print(f"  {layout_name(p):<52}{p.prediction.tokens_per_s:>12,.0f}{p.prediction.mfu:>7.1%}"
                      f"{p.prediction.iteration_s:>9.3f}{p.memory['total'] / GIB:>7.1f}  {'yes' if p.fits else 'NO'}")
    if args.plot:
        draw(family(chosen, gpu, max(args.gpus, 12288)), args.plot)
        best = next((p for p in ranked if p.fits), None)
        other = (f"; the best layout --search found, {layout_name(best)}, is not drawn"
                 if best and layout_name(best) != layout_name(chosen) else "")
        print(f"plot: {args.plot} draws the config's layout, {layout_name(chosen)}, as dp grows{other}",
              file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
