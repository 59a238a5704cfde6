"""Bytes per mesh axis and step: the planner's (`planner/traffic.py`) against every collective of
the compiled train step (`observe/collectives.py`), on 8 simulated CPU devices.

    python -m bench.parallel.collective_bytes [--out FILE] [--overwrite]
    python -m bench.parallel.collective_bytes --layout "mesh.dp=2 mesh.tp=4 parallel.zero1=true"

With `--layout` (repeatable; any `section.key=value` overrides on the bench's model shape) it
measures only those layouts and prints one JSON row each — measured, planned and ideal bytes per
axis and measured/ideal — writing a result file only with `--out`. A layout that is not a valid
config for the 8 devices is the trainer's own one-line error, exit 2.

The first four layouts (`CHECKED`) are those `tests/planner -k planned_bytes` holds to 5%; the
rest are the layouts issue 38 names. `ideal` is the planner's formula per axis with one gradient
reduction per step (`planner/traffic.py`): dp, ring all-reduce of the gradient bytes P once per
step (P: every parameter one device holds, counted from the compiled state), 2(dp-1)/dp x P (with ZeRO-1 a reduce-scatter of the gradients plus an all-gather of the
parameters, the same bytes); tp and pp as `traffic.tp_bytes` / `traffic.pp_bytes` state them
(for a cp rank's seq_len/cp tokens a row); cp (context parallelism): per layer run of the
device's stage and direction (and for a recomputed forward: remat=full, a pipeline's input stash;
with a pipeline its masked idle ticks are layer runs too, as for tp) the halo's keys and values (`context_parallel.halo_bytes`; window=null: their all-gather and their
gradients' reduce-scatter), plus the gradients' all-reduce, 2(cp-1)/cp x P, since the weights
are replicated over cp, written here apart from the planner's `traffic.cp_bytes` (tests/planner
holds the two equal).
Writes bench/results/collective_bytes_cpu.json.
"""

import json
import shlex
import sys

import jax
import numpy as np

from bench.common import Bench
from bench.parallel.compiled_step import compile_train_step

SHAPE = ["model.layers=4", "model.d_model=64", "model.heads=4", "model.kv_heads=4", "train.global_batch=8",
         "mesh.cpu_devices=8"]
# The layouts tests/planner holds to 5% (the test imports them from here).
CHECKED = {
    "dp4 tp2, 2 accumulation steps": ["mesh.dp=4", "mesh.tp=2", "parallel.microbatches=2", "parallel.zero1=false"],
    "dp2 pp2 tp2, 1F1B, ZeRO-1, tied embedding": ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "parallel.microbatches=2",
                                                  "parallel.zero1=true", "model.tied_embeddings=true"],
    "dp2 pp2 tp2, interleaved, serial": ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "parallel.microbatches=2",
                                         "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2",
                                         "model.block=serial", "parallel.zero1=false"],
    "dp2 pp2 tp2, SP + collective matmul": ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "parallel.microbatches=2",
                                            "parallel.sequence_parallel=true",
                                            "parallel.tp_overlap=collective_matmul"],
}
LAYOUTS = {
    **CHECKED,
    "dp4 tp2, 2 accumulation steps, ZeRO-1": ["mesh.dp=4", "mesh.tp=2", "parallel.microbatches=2",
                                              "parallel.zero1=true"],
    "dp2 tp4, SP + collective matmul, serial": ["mesh.dp=2", "mesh.tp=4", "parallel.sequence_parallel=true",
                                                "parallel.tp_overlap=collective_matmul", "model.block=serial",
                                                "parallel.zero1=false"],
    "dp1 pp4 tp2, SP": ["mesh.dp=1", "mesh.pp=4", "mesh.tp=2", "parallel.microbatches=4",
                        "parallel.sequence_parallel=true"],
    "dp8, ZeRO-1": ["mesh.dp=8", "mesh.tp=1", "parallel.zero1=true"],
    "pp4 tp2, interleaved v2, 4 microbatches": ["mesh.dp=1", "mesh.pp=4", "mesh.tp=2", "parallel.microbatches=4",
                                                "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2",
                                                "model.layers=8"],
    "tp8, SP + collective matmul": ["mesh.dp=1", "mesh.tp=8", "model.heads=8", "model.kv_heads=8",
                                    "parallel.sequence_parallel=true", "parallel.tp_overlap=collective_matmul"],
    "dp2 pp2 tp2, interleaved, SP + collective matmul, ZeRO-1": [
        "mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "parallel.microbatches=2", "parallel.pp_schedule=interleaved_1f1b",
        "parallel.pp_virtual=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=collective_matmul",
        "parallel.zero1=true"],
    "Llama-style dp2 tp4 (serial, RMSNorm, SwiGLU, GQA kv_heads=2)": [
        "mesh.dp=2", "mesh.tp=4", "model.block=serial", "model.norm=rmsnorm", "model.activation=swiglu",
        "model.kv_heads=2"],
    "dp2 cp2 tp2, window 64": ["mesh.dp=2", "mesh.cp=2", "mesh.tp=2", "parallel.zero1=false"],
    "cp8, window 24 (two hops)": ["mesh.dp=1", "mesh.cp=8", "mesh.tp=1", "model.window=24", "parallel.zero1=false"],
    # the accumulation and the pipeline manual over cp: the gradients cross cp once a step
    "dp2 cp2 tp2, 2 microbatches, ZeRO-1": ["mesh.dp=2", "mesh.cp=2", "mesh.tp=2", "parallel.microbatches=2",
                                            "parallel.zero1=true"],
    "pp2 cp2 tp2, 1F1B, SP + collective matmul": [
        "mesh.dp=1", "mesh.pp=2", "mesh.cp=2", "mesh.tp=2", "parallel.microbatches=2", "parallel.zero1=false",
        "parallel.sequence_parallel=true", "parallel.tp_overlap=collective_matmul"],
}
AXES = ("tp", "pp", "cp", "dp")


def measure(overrides: list[str]) -> dict:
    from megascale_jax.observe import collectives
    from megascale_jax.training import trainer as trainer_module
    from megascale_jax.parallel.mesh import make_mesh
    from megascale_jax.planner import traffic
    from megascale_jax.planner.workload import from_config

    compiled = compile_train_step(SHAPE + overrides)
    cfg = compiled.cfg
    runs = trainer_module.branch_runs(cfg, stage=cfg.mesh.pp - 1)
    measured = collectives.bytes_per_axis(compiled.step.as_text(), make_mesh(cfg.mesh), runs)
    planned = traffic.bytes_per_axis(from_config(cfg, gpus=8))
    # the ideal's gradient bytes: exactly the parameters one device holds (norms and biases too)
    held = sum(int(np.prod(x.sharding.shard_shape(x.shape))) for x in jax.tree.leaves(compiled.state.params))
    ideal = {**traffic.ideal_bytes_per_axis(cfg, 8, held), "cp": cp_ideal_bytes(cfg, held)}
    ratio = {axis: measured[axis] / ideal[axis] for axis in AXES if measured.get(axis) and ideal.get(axis)}
    return {"overrides": overrides, "measured": measured, "planned": planned, "ideal": ideal, "measured_over_ideal": ratio}


def cp_ideal_bytes(cfg, held: int) -> float:
    """Bytes one device sends over cp per step (the module docstring): 0 at cp = 1. Per layer run;
    with a pipeline every stage runs a chunk every tick, its idle ticks masked
    (`pipeline.explicit_collectives`), and those are layer runs too — as the tp ideal counts them
    for tp's explicit collectives (`traffic.layer_runs`)."""
    from megascale_jax.parallel.context_parallel import halo_bytes
    from megascale_jax.pipeline_schedule import build

    m, mo, par = cfg.mesh, cfg.model, cfg.parallel
    if m.cp == 1:
        return 0.0
    rows, itemsize = cfg.train.global_batch // (m.dp * par.microbatches), np.dtype(mo.dtype).itemsize  # a microbatch's
    kv_width = mo.kv_heads * mo.head_dim // m.tp if mo.kv_heads % m.tp == 0 else mo.head_dim
    if mo.window is None:  # k and v gathered, their gradients reduce-scattered: (cp-1)/cp of the whole each
        per_layer = 2 * (m.cp - 1) / m.cp * rows * mo.seq_len * kv_width * itemsize
    else:
        per_layer = halo_bytes(mo.window, mo.seq_len, m.cp, rows, kv_width, itemsize)
    if m.pp > 1:
        runs = build(par.pp_schedule, m.pp, par.pp_virtual, par.microbatches).ticks * mo.layers // (m.pp * par.pp_virtual)
    else:
        runs = par.microbatches * mo.layers
    # forward and backward, and the forward again where it is recomputed (remat=full, or the
    # pipeline's input stash); float32 gradients
    recomputed = mo.remat == "full" or (m.pp > 1 and par.pp_stash == "inputs")
    return (3 if recomputed else 2) * runs * per_layer + 2 * (m.cp - 1) / m.cp * held * 4


def measure_given(layouts: list[str], bench: Bench) -> int:
    """`--layout`: one JSON row per layout on stdout (and a result file only with --out)."""
    from megascale_jax import cli
    from megascale_jax.config import ConfigError

    rows = {}
    for layout in layouts:
        try:
            rows[layout] = measure(shlex.split(layout))
        except ConfigError as e:
            return cli.user_error(e)
        print(json.dumps({"layout": layout, **rows[layout]}), flush=True)
    if bench.args.out:
        bench.write({"devices": "8 simulated CPU devices", "rows": rows})
    return 0


def main(argv=None) -> int:
    bench = Bench(__doc__, "collective_bytes_cpu")
    bench.add_argument("--layout", action="append", default=[], metavar="OVERRIDES",
                       help='measure this layout only (repeatable), e.g. "mesh.dp=2 mesh.tp=4 parallel.zero1=true"')
    args = bench.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts
    if args.layout:
        return measure_given(args.layout, bench)
    bench.refuse_existing()
    rows = {}
    print(f"{'layout':<42}{'axis':>5}{'measured B':>12}{'planned B':>12}{'error':>8}{'ideal B':>12}{'measured/ideal':>16}")
    for name, overrides in LAYOUTS.items():
        r = rows[name] = measure(overrides)
        for axis in AXES:
            got, planned, ideal = r["measured"].get(axis, 0.0), r["planned"].get(axis, 0.0), r["ideal"][axis]
            if got or planned:
                plan = f"{planned:>12.0f}{planned / got - 1:>+8.1%}" if axis in r["planned"] else f"{'-':>12}{'-':>8}"
                print(f"{name:<42}{axis:>5}{got:>12.0f}{plan}{ideal:>12.0f}{got / ideal:>15.2f}x", flush=True)
    bench.write({"devices": "8 simulated CPU devices", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
