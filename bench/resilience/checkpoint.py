"""Two-stage checkpoint cost: blocking vs total save time and restore time per state size, and
the data loader's throughput against the train step's consumption; prints tables, writes JSON.

    python -m bench.resilience.checkpoint [--sizes-gb 0.1 1 4] [--repeats 3] [--dir /tmp/ckpt-bench]

The state is a dict of float32 arrays sharded over 8 simulated CPU devices (dp=8 on the first
axis, like ZeRO-1 moments), saved through `megascale_jax.training.checkpoint.Checkpointer` exactly as
training does. The figure we track is blocking/total: the share of a save that stalls
training (target <= 5%). The blocking part is orbax's device->host stage plus the per-array
checksums computed on the device; the checksum is timed alone too, because on the CPU the
"device" is the host's two cores (~1 s/GB here), while on a GPU it runs at memory bandwidth.
"""

import os
import shutil
import statistics
import sys
import time

from bench.common import Bench

ARRAY_MB = 64  # the state is split into arrays of this size, like a model's layers


def make_state(size_gb: float, mesh):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    rows = ARRAY_MB * 2 ** 20 // 4 // 1024
    count = max(1, round(size_gb * 1024 / ARRAY_MB))
    sharding = NamedSharding(mesh, P("dp", None))
    init = jax.jit(lambda k: jax.random.normal(k, (rows, 1024), jnp.float32), out_shardings=sharding)
    return {f"layer_{i:03d}": init(jax.random.key(i)) for i in range(count)}


def measure_saves(cfg, directory, state, repeats):
    import jax
    from megascale_jax.training import checkpoint

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    ckpt = checkpoint.Checkpointer(cfg, directory, warn=print)
    ckpt.compile(abstract)
    checksum_s = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(ckpt._checksums(state))
        checksum_s.append(time.perf_counter() - start)
    saves = []
    for step in range(1, repeats + 1):
        ckpt.save(step, state, {"next_index": step})
        saves += ckpt.poll(wait=True)  # one save at a time: total = until committed
    ckpt.close()
    restores = []
    for _ in range(repeats):
        start = time.perf_counter()
        restored, _ = checkpoint.Checkpointer(cfg, directory, warn=print).restore_latest(abstract)
        jax.block_until_ready(restored)
        restores.append(time.perf_counter() - start)
        del restored
    return saves, restores, statistics.median(checksum_s)


class SaveFailed(RuntimeError):
    """A save of the bench's state did not commit."""


TABLE_HEADER = (f"{'state GB':>9}{'block s':>10}{'checksum s':>12}{'total s':>10}{'block/total':>13}"
                f"{'excl. checksum':>16}{'GB/s':>7}{'restore s':>11}")


def measure_size(cfg, mesh, directory: str, size_gb: float, repeats: int) -> dict:
    """One table row: a fresh state of `size_gb` saved `repeats` times into `directory` (emptied
    first and after) and restored as often; medians, plus every save and restore."""
    shutil.rmtree(directory, ignore_errors=True)
    state = make_state(size_gb, mesh)
    gb = sum(x.nbytes for x in state.values()) / 2 ** 30
    saves, restores, checksum = measure_saves(cfg, directory, state, repeats)
    del state
    shutil.rmtree(directory, ignore_errors=True)
    failed = [s for s in saves if "error" in s]
    if failed:
        raise SaveFailed(f"save failed: {failed[0]['error']}")
    block = statistics.median(s["block_s"] for s in saves)
    # With checkpoint.background_host_copy the host blocks only to dispatch a copy on the device;
    # that copy's device time (until it was ready) stalls the next step too, so it is counted.
    device_copy = statistics.median(s.get("background_parts_s", {}).get("device_copy", 0.0) for s in saves)
    stall = block + device_copy
    total = statistics.median(s["total_s"] for s in saves)
    restore = statistics.median(restores)
    orbax_block = max(stall - checksum, 0.0)
    print(f"{gb:>9.2f}{stall:>10.3f}{checksum:>12.3f}{total:>10.3f}{stall / total:>13.1%}"
          f"{orbax_block / total:>16.1%}{gb / total:>7.2f}{restore:>11.3f}", flush=True)
    return {"state_gb": gb, "background_host_copy": cfg.checkpoint.background_host_copy, "block_s": stall,
            "host_block_s": block, "device_copy_s": device_copy, "checksum_s": checksum, "total_s": total,
            "block_fraction": stall / total, "block_fraction_excluding_checksum": orbax_block / total,
            "write_gb_per_s": gb / total, "restore_s": restore, "saves": saves, "restores_s": restores}


def measure_loader(cfg, steps):
    """Batches/s the grain loader delivers alone, vs the steps/s training consumes."""
    from megascale_jax.training import data
    from megascale_jax.parallel import sharding
    from megascale_jax.parallel.mesh import make_mesh

    mesh = make_mesh(cfg.mesh)
    batches = data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train")
    loader = data.Prefetcher(batches, sharding.batch_sharding(mesh), 0, cfg.data.prefetch)
    try:
        loader.get()  # start-up
        start = time.perf_counter()
        for _ in range(steps):
            loader.get()
        return steps / (time.perf_counter() - start)
    finally:
        loader.close()


def main(argv=None) -> int:
    bench = Bench(__doc__, "checkpoint_cpu")
    bench.add_argument("--sizes-gb", type=float, nargs="+", default=[0.1, 1.0, 4.0])
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--dir", default="/tmp/megascale-ckpt-bench")
    args = bench.parse_args(argv)
    bench.refuse_existing()

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this CLI measures the CPU (before JAX starts)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from megascale_jax.config import load_config
    from megascale_jax.parallel.mesh import make_mesh

    cfg = load_config(None, ["mesh.dp=8", "mesh.tp=1", "checkpoint.keep=1", f"train.steps={args.repeats}"])
    mesh = make_mesh(cfg.mesh)
    rows = []
    print(TABLE_HEADER)
    for size in args.sizes_gb:
        try:
            rows.append(measure_size(cfg, mesh, args.dir, size, args.repeats))
        except SaveFailed as e:
            print(f"error: {e}", file=sys.stderr)
            return 1

    tiny = load_config(None, [])
    loader_steps_per_s = measure_loader(tiny, 200)
    print(f"loader (tiny_cpu, grain, prefetch={tiny.data.prefetch}): {loader_steps_per_s:.0f} batches/s")
    bench.write({
        "state": f"float32 arrays of {ARRAY_MB} MB sharded dp=8 over 8 simulated CPU devices",
        "repeats": args.repeats, "sizes": rows,
        "loader": {"config": "configs/tiny_cpu.yaml", "batches_per_s": loader_steps_per_s,
                   "note": "compare with 1/step_time_s of bench/results/tiny_cpu.json"},
        "cpu_count": os.cpu_count()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
