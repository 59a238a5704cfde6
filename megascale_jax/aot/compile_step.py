"""Compile the trainer's own train step for a described GPU and topology, with no GPU present, and
report what XLA made of it. Runs inside the compile-only environment (`configs/aot/setup_env.sh`);
`python -m megascale_jax.plan --compile` starts it there (`aot.environment`):

    python -m megascale_jax.aot.compile_step --gpu h200 --gpus 8 --out REPORT.json --config C [k=v ...]

The config is the one `plan` validated (its mesh.dp already N / (tp·pp)). The step is
`training.trainer.build_trainer(cfg, mesh).train_step` on a mesh of the topology's devices,
lowered with abstract arguments (nothing is allocated) and compiled with XLA's dump on, whose
memory files (`-live-range.txt`, `-buffer-assignment.txt`) name the buffers live at the peak.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only: the CUDA plugin must not look for a GPU
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

TOP_BUFFERS = 12


def compile_report(cfg, target, topology: str, xla_options: dict | None = None, dump_dir: str | None = None) -> dict:
    """The report `plan --compile` prints (docs/compile.md); XLA's dump (the optimized HLO, its buffer
    assignment, live ranges, thunks) is kept in `dump_dir` where one is given."""
    import jax
    import jax.numpy as jnp
    import jaxlib
    from jax.experimental import topologies

    from megascale_jax.aot import compiled_hlo, roofline
    from megascale_jax.model import flops
    from megascale_jax.observe import collectives
    from megascale_jax.observe.hlo_parts import instructions
    from megascale_jax.parallel.mesh import make_mesh
    from megascale_jax.planner import calibration
    from megascale_jax.training import trainer as trainer_module

    started = time.perf_counter()
    topo = topologies.get_topology_desc(platform="cuda", target_config=target.proto(), topology=topology)
    devices = sorted(topo.devices, key=lambda d: (d.process_index, d.id))  # host-major, as on a cluster
    mesh = make_mesh(cfg.mesh, devices=devices)
    trainer = trainer_module.build_trainer(cfg, mesh)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         jax.eval_shape(trainer.init), trainer.state_shardings)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32,
                                 sharding=trainer.batch_sharding)
    lowered = trainer.train_step.lower(state, batch)
    with tempfile.TemporaryDirectory(prefix="aot-dump-") as scratch:
        dump = dump_dir or scratch
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump, **(xla_options or {})})
        compile_s = time.perf_counter() - started
        # The dump's module, not compiled.as_text(): that leaves out the computations XLA wraps
        # around asynchronous work, whose values the live ranges name.
        hlo_text = _read_one(dump, "*train_step*after_optimizations.txt")
        live_range = _read_one(dump, "*train_step*after_optimizations-live-range.txt")
        assignment = _read_one(dump, "*train_step*after_optimizations-buffer-assignment.txt")
        usage = _read_one(dump, "*train_step*after_optimizations-memory-usage-report.txt")
    hlo = instructions(hlo_text)
    analysis = compiled.memory_analysis()
    memory = {"argument": analysis.argument_size_in_bytes, "output": analysis.output_size_in_bytes,
              "alias": analysis.alias_size_in_bytes, "temp": analysis.temp_size_in_bytes,
              "code": analysis.generated_code_size_in_bytes, "peak": flops.compiled_bytes(analysis)}
    # What a run holds outside the step: the input batch (its next one prefetched beside it) and
    # the checkpoint's background copy of the state (this device's shards of it), capped as the
    # train command caps it to what fits beside the step (the rest goes to host memory while the
    # step waits: `checkpoint_to_host`).
    state_bytes = sum(_shard_bytes(x) for x in jax.tree.leaves(state))
    batches = 2 * _shard_bytes(batch)
    copies = cfg.checkpoint.background_host_copy and trainer_module.saves_state(cfg)
    on_device = flops.device_copy_bytes(state_bytes, memory["peak"] + batches, target.limit_bytes(),
                                        cfg.checkpoint.device_copy_gib) if copies else 0
    outside = {"checkpoint_copy": on_device, "input_batches": batches}
    buffers = compiled_hlo.peak_buffers(live_range, assignment, hlo)
    runs = trainer_module.branch_runs(cfg, stage=cfg.mesh.pp - 1)
    shape, names = tuple(mesh.devices.shape), tuple(mesh.axis_names)
    overlap_rows = compiled_hlo.overlap(hlo_text, hlo, shape, names)
    return {
        "target": target.key, "device": target.description, "topology": topology, "gpus": len(devices),
        "mesh": dict(zip(names, shape)), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "compile_s": compile_s, "memory": memory, "state_bytes": state_bytes, "outside_step": outside,
        "checkpoint_to_host": state_bytes - on_device if copies else 0,
        "limit_bytes": target.limit_bytes(), "live_peak_bytes": sum(b["bytes"] for b in buffers),
        "peak_buffers": buffers[:TOP_BUFFERS], "peak_bytes_by_part": compiled_hlo.bytes_by_part(buffers),
        "heap_chunks": compiled_hlo.heap_chunks(usage, assignment, hlo),
        "kernels": compiled_hlo.kernel_inventory(hlo_text, hlo),
        "collective_bytes": collectives.bytes_per_axis(hlo_text, mesh, runs),
        "ideal_collective_bytes": _ideal_bytes(cfg, state, len(devices)),
        "overlap": compiled_hlo.overlap_by_axis(overlap_rows),
        "roofline": roofline.summary(roofline.kernel_costs(hlo_text, hlo, calibration.gpu(target.key),
                                                           cfg.model.window)),
    }


def _shard_bytes(x) -> int:
    import numpy as np
    return int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize


def _ideal_bytes(cfg, state, gpus: int) -> dict[str, float]:
    """The planner's ideal bytes per axis (bench.parallel.collective_bytes' `ideal`): its formulas
    with one gradient reduction per step, over the parameters one device holds."""
    import jax

    from megascale_jax.planner import traffic
    held = sum(_shard_bytes(x) // x.dtype.itemsize for x in jax.tree.leaves(state.params))
    return traffic.ideal_bytes_per_axis(cfg, gpus, held)


def _option_value(text: str):
    """An XLA option's value as XLA takes it: a bool, an int, a float, else the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _read_one(directory: str, pattern: str) -> str:
    found = sorted(glob.glob(os.path.join(directory, pattern)))
    if not found:
        raise RuntimeError(f"XLA's dump has no {pattern} in {directory}")
    with open(found[-1]) as f:
        return f.read()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megascale_jax.aot.compile_step", description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", required=True)
    parser.add_argument("--topology", required=True, help="slices x hosts x GPUs a host, e.g. 1x2x8")
    parser.add_argument("--config", default=None)
    parser.add_argument("--out", required=True, help="where the report goes (JSON)")
    parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an XLA debug option for this compile, e.g. xla_gpu_enable_triton_gemm=false")
    parser.add_argument("--dump", default=None, metavar="DIR", help="keep XLA's dump (optimized HLO, buffers) here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    from megascale_jax.aot.targets import target
    from megascale_jax.config import load_config, with_device_defaults

    # the defaults a GPU run decides by its devices (the checkpoint's background copy: on)
    cfg = with_device_defaults(load_config(args.config, args.overrides, planning=True), "gpu")
    options = {name: _option_value(value) for name, value in (o.split("=", 1) for o in args.xla_option)}
    report = compile_report(cfg, target(args.gpu), args.topology, options, args.dump)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
