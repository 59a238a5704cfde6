"""Where a training step's device time goes: the top HLO ops of a profiled step, each named as
a part of the model (issue 36, item 6).

    python -m bench.campaign.op_table --config configs/gpt_1b.yaml --out table.json [key=value ...]

compiles the config's train step (one device), runs it once, traces STEPS more with
`jax.profiler` and writes `table(...)` as JSON. The trace is read with megascale_jax's own reader
(`observe.device_profile.read_ops`: every executed HLO op's `hlo_op` name and interval — a thunk
on XLA:CPU, a kernel on a GPU), so both backends are read the same way. An op's model part comes
from its HLO metadata in the compiled module's text (`observe.hlo_parts`), not from the trace:
XLA:CPU's trace events carry no metadata, and on a GPU the kernel's annotation is built from the
same text.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile

from megascale_jax.observe.hlo_parts import PARTS, Instruction, evidence, instructions, part_of, short_op_name

STEPS = 2  # traced, after one untraced step
TOP = 15
PER_PART = 5  # each part's own top ops: what "other" and "copies" hold is where a next lever is

# ============================================================================ the table


def table(ops: list, hlo: dict[str, Instruction], steps: int, top: int = TOP) -> dict:
    """One device's ops (`device_profile.Op`s over `steps` traced steps) -> per step: the `top` ops by
    device time (name, part, seconds, share of the step's op time, calls, the op_name path that
    named its part, and a matrix product's achieved TFLOP/s), every matrix product's FLOPs and
    seconds together (`products`), each part's PER_PART top ops (`top_by_part`),
    seconds `by_part` (with their "total") and the device's busy time.

    The total is the sum of every compute and collective op's duration; containers (while,
    conditional: their time is their ops') count no time of their own. XLA:CPU runs independent
    thunks on several threads at once, so there the total exceeds the busy time (their union); on
    a GPU's one stream they agree."""
    from megascale_jax.observe import device_profile

    timed = sorted((o for o in ops if o.is_compute or o.is_collective), key=lambda o: o.start_ns)
    seconds, calls, collective = collections.Counter(), collections.Counter(), {}
    previous = None
    for o in timed:
        seconds[o.name] += (o.end_ns - o.start_ns) / 1e9 / steps
        # One launch of an instruction can be several kernels back to back (cuBLAS's GEMM and its
        # split-K reduction, cuDNN attention's 8 backward kernels): a call is a run of one name, so
        # that a product's FLOPs count once a launch (on the H200, 2026-11-28, counting kernels put
        # every GEMM at ~1,560 TFLOP/s, past the chip's 989).
        calls[o.name] += o.name != previous
        previous = o.name
        collective[o.name] = o.is_collective
    total = sum(seconds.values())
    parts = {name: part_of(hlo.get(name, Instruction("")), collective[name]) for name in seconds}
    by_part = collections.Counter()
    for name, s in seconds.items():
        by_part[parts[name]] += s

    def flops(name: str) -> float:  # per step
        return hlo.get(name, Instruction("")).flops * calls[name] / steps

    def row(name: str, s: float) -> dict:
        out = {"op": name, "part": parts[name], "seconds": s, "share": s / total if total else 0.0,
               "calls": calls[name] / steps, "op_name": short_op_name(evidence(hlo.get(name, Instruction("")), parts[name]))}
        if flops(name):
            out["tflop_per_s"] = flops(name) / s / 1e12
        return out

    products = [name for name in seconds if flops(name)]
    product_s = sum(seconds[name] for name in products)
    ranked = seconds.most_common()
    return {"top_ops": [row(name, s) for name, s in ranked[:top]],
            # every matrix product's FLOPs (from the module's shapes) over its kernels' time: what the
            # step's GEMMs ran at, beside what the same shapes run at alone (the rates section)
            "products": {"flops": sum(flops(n) for n in products), "seconds": product_s, "ops": len(products),
                         "tflop_per_s": sum(flops(n) for n in products) / product_s / 1e12 if product_s else None},
            "top_by_part": {p: [row(name, s) for name, s in ranked if parts[name] == p][:PER_PART]
                            for p in PARTS if by_part[p] > 0},
            "by_part": {**{p: by_part[p] for p in PARTS if by_part[p] > 0}, "total": total},
            "busy_s": device_profile.busy_ns(ops) / 1e9 / steps, "steps_traced": steps}


# ============================================================================ tracing a train step


def trace_train_step(config: str | None, overrides: list[str], trace_dir: str, steps: int = STEPS):
    """Compile the config's train step, run it once, trace `steps` more into `trace_dir`: (the
    compiled module's text, its name, the trace file)."""
    import jax
    import numpy as np

    from megascale_jax.config import load_config
    from megascale_jax.observe import device_profile
    from megascale_jax.parallel.mesh import make_mesh
    from megascale_jax.training.trainer import build_trainer

    cfg = load_config(config, overrides)
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    state = trainer.init()
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab, (cfg.train.global_batch, cfg.model.seq_len + 1))
    batch = jax.device_put(tokens.astype(np.int32), trainer.batch_sharding)
    compiled = trainer.train_step.lower(state, batch).compile()
    state, _ = compiled(state, batch)
    jax.block_until_ready(state)
    with jax.profiler.trace(trace_dir):
        for _ in range(steps):
            state, _ = compiled(state, batch)
            jax.block_until_ready(state)
    return compiled.as_text(), device_profile.hlo_module_name(compiled), device_profile.latest_trace(trace_dir)


def profile_table(config: str | None, overrides: list[str], steps: int = STEPS, top: int = TOP) -> dict:
    """`table` of the config's train step, traced here (device 0)."""
    from megascale_jax.observe import device_profile

    with tempfile.TemporaryDirectory(prefix="op-table-") as trace_dir:
        hlo_text, module, path = trace_train_step(config, overrides, trace_dir, steps)
        ops = device_profile.read_ops(path, module)
    if not ops:
        raise RuntimeError(f"the trace holds no op of HLO module {module}")
    device = min(ops)
    return {"device": device, **table(ops[device], instructions(hlo_text), steps, top)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.campaign.op_table", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None)
    parser.add_argument("--out", required=True, help="where the table goes (JSON)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args(argv)
    result = profile_table(args.config, args.overrides)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for row in result["top_ops"]:
        print(f"{row['op']:<40}{row['part']:<20}{row['seconds'] * 1e3:>9.3f} ms{row['share']:>7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
