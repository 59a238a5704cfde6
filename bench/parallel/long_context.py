"""A 64k-token sequence trained on 8 simulated CPU devices with context parallelism (cp = 8), set
beside the same step on one device (cp = 1): the compiled step's memory per device (XLA's
`memory_analysis()`), the pre-compile estimate (`flops.memory_estimate`), step time and loss.

    python -m bench.parallel.long_context                      # 65,536 tokens, window 512, cp 8 vs 1
    python -m bench.parallel.long_context --seq-len 16384 --cp 4

A small model (2 layers, d_model 64, 4 heads over 2 kv heads, XLA attention, one sequence a
step): the activations, not the weights, are what cp divides. A cp rank holds seq_len/cp positions
and attends them in bands (`attention.banded_attention`: blocks of >= window - 1 queries, each
scored against the keys its window reaches), receiving the window's halo from the rank before it
(`parallel/context_parallel.py`); one device attends all seq_len positions in the same bands. The
losses of the two are the same computation split differently (float32: equal within rounding).
Writes bench/results/long_context_<platform>.json.
"""

from __future__ import annotations

import sys

from bench.common import Bench

MODEL = ["model.layers=2", "model.d_model=64", "model.heads=4", "model.kv_heads=2", "model.attention=xla",
         "model.dtype=float32", "train.global_batch=1", "parallel.microbatches=1", "mesh.dp=1", "mesh.tp=1",
         "train.eval_every=0"]


def measure(seq_len: int, window: int, cp: int, steps: int) -> dict:
    from bench.parallel.compiled_step import compile_train_step
    from megascale_jax.config import load_config
    from megascale_jax.model import flops

    overrides = [*MODEL, f"model.seq_len={seq_len}", f"model.window={window}", f"mesh.cp={cp}",
                 f"mesh.cpu_devices={cp}"]
    estimate = flops.memory_estimate(load_config(None, overrides))
    compiled = compile_train_step(overrides)
    analysis = compiled.step.memory_analysis()
    losses = []
    step_s = compiled.median_time_s(steps)  # one warm-up step, then `steps`
    state, metrics = compiled.step(compiled.state, compiled.batch)  # one more, for its loss
    losses.append(float(metrics["loss"]))
    return {"cp": cp, "devices": cp, "positions_per_device": seq_len // cp,
            "compiled_temp_bytes": analysis.temp_size_in_bytes,
            "compiled_peak_bytes": flops.compiled_bytes(analysis),
            "estimated_activation_bytes": estimate["activations"], "estimated_total_bytes": estimate["total"],
            "compile_s": compiled.compile_s, "step_time_s": step_s, "loss_after_warm_up": losses[-1]}


def main(argv=None) -> int:
    bench = Bench(__doc__, "long_context_<platform>")
    bench.add_argument("--seq-len", type=int, default=65536)
    bench.add_argument("--window", type=int, default=512)
    bench.add_argument("--cp", type=int, default=8)
    bench.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    args = bench.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", max(8, args.cp))
    bench.refuse_existing(f"long_context_{jax.default_backend()}")
    rows = [measure(args.seq_len, args.window, cp, args.steps) for cp in (args.cp, 1)]
    split, whole = rows
    ratio = split["compiled_temp_bytes"] / whole["compiled_temp_bytes"]
    print(f"{'cp':>4}{'positions/device':>18}{'compiled temp MiB':>19}{'estimated act. MiB':>20}{'step s':>9}{'loss':>10}")
    for r in rows:
        print(f"{r['cp']:>4}{r['positions_per_device']:>18,}{r['compiled_temp_bytes'] / 2**20:>19.1f}"
              f"{r['estimated_activation_bytes'] / 2**20:>20.1f}{r['step_time_s']:>9.2f}{r['loss_after_warm_up']:>10.5f}")
    print(f"cp={args.cp}: {ratio:.3f} of one device's temporaries per device (1/{args.cp} = {1 / args.cp:.3f}); "
          f"losses differ by {abs(split['loss_after_warm_up'] / whole['loss_after_warm_up'] - 1):.1e} relative")
    bench.write({"seq_len": args.seq_len, "window": args.window, "model": MODEL, "rows": rows,
                 "temp_ratio": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
