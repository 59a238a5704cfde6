"""Compile a train step for a described GPU with the megascale_jax on PYTHONPATH, keeping XLA's
dump: the child of `bench.aot.roofline_rows`, run in the compile-only environment against the code
a measured row ran (a worktree of its commit), so it uses nothing newer than that code had:
`load_config`, `make_mesh`, `build_trainer` (in `training.trainer`, or `train` before that).

    PYTHONPATH=TREE python bench/aot/compile_dump.py --gpu h200 --dump DIR [key=value ...]
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="a file holding the GpuTargetConfig text proto")
    parser.add_argument("--dump", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    from megascale_jax.config import load_config
    from megascale_jax.parallel.mesh import make_mesh
    try:
        from megascale_jax.training.trainer import build_trainer
    except ImportError:  # the code of 2026-11-23 kept it in train.py
        from megascale_jax.train import build_trainer

    with open(args.target) as f:
        topo = topologies.get_topology_desc(platform="cuda", target_config=f.read(), topology="1x1x1")
    cfg = load_config(os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0], "configs", "gpt_1b.yaml"),
                      args.overrides)
    trainer = build_trainer(cfg, make_mesh(cfg.mesh, devices=topo.devices))
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         jax.eval_shape(trainer.init), trainer.state_shardings)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32,
                                 sharding=trainer.batch_sharding)
    trainer.train_step.lower(state, batch).compile(compiler_options={"xla_dump_to": args.dump})
    return 0


if __name__ == "__main__":
    sys.exit(main())
