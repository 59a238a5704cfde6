"""The pipeline bubble measured from per-stage busy time, next to the table's.

    python -m bench.parallel.pipeline_bubble [--pp 4] [--microbatches 4 8 16] [--steps 3]

For every schedule it compiles the full train step (pp stages, tp=1, dp=1), profiles `--steps`
steps with `jax.profiler.trace` and cuts each device's HLO ops into the table's ticks at the
pipeline's ppermutes (`megascale_jax.observe.device_profile`). Per (stage, tick) the busy time is the
union of the compute ops (median over steps). From it:

* `bubble_measured`: the lockstep bubble with these busy times (a tick lasts as long as its
  busiest stage), split into `bubble_idle_cells` (ticks the table leaves a stage idle; what it
  computes there — masked junk, zero-filled gradient accumulation — counts as bubble) and
  `bubble_imbalance` (waiting, in a tick with work, for a slower stage);
* `bubble_table`: the table's bubble, = `bubble_closed_form` (p-1)/(m·v+p-1) for these
  schedules whatever the F:B cost ratio;
* `idle_tick_us`: what a stage computes in a tick where it has no work; `outside_loop_ms`: a
  stage's busy time outside the tick loop (the v > 1 weight re-layout, gradient reductions and
  the optimizer step), not counted in the bubble.

On simulated CPU devices the p stages share the host's cores, so a busy tick's ops are slower
when other stages are busy too: the pattern is exact, the absolute times are contended. JSON goes
to bench/results/pipeline_bubble_<platform>.json.
"""

import statistics
import sys
import tempfile
import time

import jax

from bench.common import Bench
from bench.parallel.compiled_step import compile_train_step
from bench.parallel.pipeline import VARIANTS, configurations


def profile_busy(compiled, ticks: int, stages: int, steps: int) -> tuple[list[list[float]], list[float], float]:
    """busy[stage][tick] in µs (median over steps), each stage's busy µs outside the tick loop
    (median over steps) and the median step wall time in s."""
    from megascale_jax.observe import device_profile

    compiled.median_time_s(1)  # warm
    walls = []
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                start = time.perf_counter()
                compiled.state, metrics = compiled.step(compiled.state, compiled.batch)
                metrics["loss"].block_until_ready()
                walls.append(time.perf_counter() - start)
        ops = device_profile.read_ops(device_profile.latest_trace(trace_dir))
    busy, outside = [], []
    for stage in range(stages):
        cut = device_profile.per_tick(ops[stage], ticks, steps)
        busy.append([statistics.median(device_profile.busy_ns(cut[k * ticks + t]) / 1e3 for k in range(steps))
                     for t in range(ticks)])
        outside.append(device_profile.outside_ticks_ns(ops[stage], cut) / 1e3 / steps)
    return busy, outside, statistics.median(walls)


def measure(schedule: str, virtual: int, stash: str, m: int, args) -> dict:
    from megascale_jax.observe import device_profile
    from megascale_jax.parallel.pipeline import schedule_for
    from megascale_jax.pipeline_schedule import bubble_closed_form

    compiled = compile_train_step([
        "mesh.dp=1", f"mesh.pp={args.pp}", "mesh.tp=1", f"mesh.cpu_devices={args.pp}", "train.eval_every=0",
        f"model.layers={args.pp * 2}", "model.d_model=128", "model.seq_len=128", f"train.global_batch={m}",
        f"parallel.microbatches={m}", f"parallel.pp_schedule={schedule}", f"parallel.pp_virtual={virtual}",
        f"parallel.pp_stash={stash}"])
    table = schedule_for(compiled.cfg)
    busy, outside, wall = profile_busy(compiled, table.ticks, args.pp, args.steps)
    fwd = lambda s, t: table.forward[t][s] is not None
    bwd = lambda s, t: table.backward[t][s] is not None
    working = [[fwd(s, t) or bwd(s, t) for t in range(table.ticks)] for s in range(args.pp)]
    cells = lambda keep: [busy[s][t] for s in range(args.pp) for t in range(table.ticks) if keep(s, t)]
    f_cost = statistics.median(cells(lambda s, t: fwd(s, t) and not bwd(s, t)) or [float("nan")])
    b_cost = statistics.median(cells(lambda s, t: bwd(s, t) and not fwd(s, t)) or [float("nan")])
    idle = cells(lambda s, t: not working[s][t])
    bubble = device_profile.lockstep_bubble(busy, working)
    return {"schedule": schedule, "virtual": virtual, "stash": stash, "microbatches": m, "ticks": table.ticks,
            "bubble_measured": bubble["total"], "bubble_idle_cells": bubble["idle"],
            "bubble_imbalance": bubble["imbalance"], "bubble_table": table.bubble_fraction(),
            "bubble_closed_form": bubble_closed_form(args.pp, virtual, m),
            "outside_loop_ms": statistics.median(outside) / 1e3,
            "forward_tick_us": f_cost, "backward_tick_us": b_cost,
            "idle_tick_us": statistics.median(idle) if idle else 0.0,
            "lockstep_step_s": sum(max(busy[s][t] for s in range(args.pp)) for t in range(table.ticks)) / 1e6,
            "step_wall_s": wall, "busy_us": [[round(x) for x in row] for row in busy]}


def main(argv=None) -> int:
    bench = Bench(__doc__, "pipeline_bubble_<platform>")
    bench.add_argument("--pp", type=int, default=4)
    bench.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    bench.add_argument("--steps", type=int, default=3)
    args = bench.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", args.pp)  # simulated devices if on CPU; before JAX starts
    bench.refuse_existing(f"pipeline_bubble_{jax.default_backend()}")

    rows = []
    print(f"{'schedule':<18}{'v':>3}{'stash':>11}{'m':>4}{'measured':>10}{'=idle':>7}{'+wait':>7}{'table':>7}"
          f"{'F us':>8}{'B us':>8}{'idle us':>9}{'outside ms':>11}{'lockstep s':>12}{'wall s':>8}")
    for schedule, virtual, stash, m in configurations(args.pp, args.microbatches, VARIANTS[:4]):
        r = measure(schedule, virtual, stash, m, args)
        rows.append(r)
        print(f"{schedule:<18}{virtual:>3}{stash:>11}{m:>4}{r['bubble_measured']:>10.1%}"
              f"{r['bubble_idle_cells']:>7.1%}{r['bubble_imbalance']:>7.1%}{r['bubble_table']:>7.1%}"
              f"{r['forward_tick_us']:>8.0f}{r['backward_tick_us']:>8.0f}{r['idle_tick_us']:>9.0f}"
              f"{r['outside_loop_ms']:>11.1f}{r['lockstep_step_s']:>12.3f}{r['step_wall_s']:>8.3f}", flush=True)
    bench.write({"pp": args.pp, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
