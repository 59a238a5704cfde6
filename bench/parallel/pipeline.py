"""Pipeline schedules on the local devices: compile time, temp memory and step time vs. m.

    python -m bench.parallel.pipeline [--pp 4] [--tp 2] [--microbatches 4 8 16 32] [--steps 5]

For every schedule, stash mode (`parallel.pp_stash`: chunk inputs, recomputed in the backward, or
vjp residuals) and microbatch count m (one sequence per microbatch per dp replica) it compiles one
full train step, reads `memory_analysis()` temp bytes and `cost_analysis()` FLOPs (XLA counts the
tick loop's body once, so they compare stash modes, not m), times `--steps` steps (median) and
prints them next to the table's bubble fraction; JSON goes to
bench/results/pipeline_<platform>.json. On simulated CPU devices the stages share the host's
cores, so step times there show compile/memory behaviour, not pipeline overlap.
"""

import sys

import jax

from bench.common import Bench
from bench.parallel.compiled_step import compile_train_step

VARIANTS = (("gpipe", 1, "inputs"), ("1f1b", 1, "inputs"), ("1f1b", 1, "residuals"),
            ("interleaved_1f1b", 2, "inputs"), ("interleaved_1f1b", 2, "residuals"))


def configurations(pp: int, microbatches: list[int], variants=VARIANTS):
    """(schedule, virtual, stash, m) for every variant and every m the schedule accepts."""
    for schedule, virtual, stash in variants:
        for m in microbatches:
            if m >= pp and not (schedule == "interleaved_1f1b" and m % pp):
                yield schedule, virtual, stash, m


def measure(schedule: str, virtual: int, stash: str, m: int, args) -> dict:
    from megascale_jax.parallel.pipeline import schedule_for

    compiled = compile_train_step([
        "mesh.dp=1", f"mesh.pp={args.pp}", f"mesh.tp={args.tp}", f"mesh.cpu_devices={args.pp * args.tp}",
        f"model.layers={args.pp * 2}", "model.d_model=128", "model.seq_len=128", f"train.global_batch={m}",
        f"parallel.microbatches={m}", f"parallel.pp_schedule={schedule}", f"parallel.pp_virtual={virtual}",
        f"parallel.pp_stash={stash}"])
    table = schedule_for(compiled.cfg)
    return {"schedule": schedule, "virtual": virtual, "stash": stash, "microbatches": m,
            "compile_s": compiled.compile_s, "temp_bytes": compiled.step.memory_analysis().temp_size_in_bytes,
            "flops": compiled.cost()["flops"], "step_time_s": compiled.median_time_s(args.steps),
            "stash_slots": table.slots, "ticks": table.ticks, "bubble_table": table.bubble_fraction()}


def main(argv=None) -> int:
    bench = Bench(__doc__, "pipeline_<platform>")
    bench.add_argument("--pp", type=int, default=4)
    bench.add_argument("--tp", type=int, default=2)
    bench.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    bench.add_argument("--steps", type=int, default=5)
    args = bench.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", args.pp * args.tp)  # simulated devices if on CPU; before JAX starts
    bench.refuse_existing(f"pipeline_{jax.default_backend()}")

    rows = []
    print(f"{'schedule':<18}{'v':>3}{'stash':>11}{'m':>5}{'compile s':>11}{'temp MiB':>10}{'GFLOP':>8}{'step s':>9}"
          f"{'slots':>7}{'bubble':>8}")
    for schedule, virtual, stash, m in configurations(args.pp, args.microbatches):
        r = measure(schedule, virtual, stash, m, args)
        rows.append(r)
        print(f"{schedule:<18}{virtual:>3}{stash:>11}{m:>5}{r['compile_s']:>11.1f}{r['temp_bytes'] / 2**20:>10.2f}"
              f"{r['flops'] / 1e9:>8.2f}{r['step_time_s']:>9.3f}{r['stash_slots']:>7}{r['bubble_table']:>8.1%}",
              flush=True)
    bench.write({"pp": args.pp, "tp": args.tp, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
