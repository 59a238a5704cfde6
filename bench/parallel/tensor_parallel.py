"""Tensor-parallel modes on the local devices: FLOPs and bytes from `cost_analysis()`, collective
counts from the HLO, and step time per (block, tp_overlap, sequence_parallel).

    python -m bench.parallel.tensor_parallel [--tp 8] [--steps 5]

On simulated CPU devices the "devices" share the host's cores, so step times show the cost of
each mode, not communication overlap. JSON goes to bench/results/tensor_parallel_<platform>.json.
"""

import re
import sys

import jax

from bench.common import Bench
from bench.parallel.compiled_step import compile_train_step

# (tp_overlap, sequence_parallel, collective-matmul pieces per device shard)
MODES = [("none", False, 2), ("none", True, 2), ("collective_matmul", True, 1), ("collective_matmul", True, 2),
         ("collective_matmul", True, 4), ("xla", False, 2)]


def measure(block: str, overlap: str, sp: bool, pieces: int, args) -> dict:
    compiled = compile_train_step(["mesh.dp=1", f"mesh.tp={args.tp}", f"mesh.cpu_devices={args.tp}",
                             "model.layers=4", "model.d_model=256", "model.heads=8", "model.kv_heads=8",
                             "model.seq_len=256", "train.global_batch=8", f"model.block={block}",
                             f"parallel.tp_overlap={overlap}", f"parallel.sequence_parallel={str(sp).lower()}",
                             f"parallel.tp_chunks={pieces}", f"parallel.tp_bidirectional={str(pieces % 2 == 0).lower()}"])
    cost, layers, text = compiled.cost(), compiled.cfg.model.layers, compiled.step.as_text()
    collectives = {op: len(re.findall(rf"= [^=]*? {op}(?:-start)?\(", text))
                   for op in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")}
    return {"block": block, "tp_overlap": overlap, "sequence_parallel": sp, "tp_chunks": pieces,
            "flops_per_layer": cost.get("flops", 0.0) / layers,
            "bytes_per_layer": cost.get("bytes accessed", 0.0) / layers,
            "collectives_in_program": collectives, "step_time_s": compiled.median_time_s(args.steps)}


def main(argv=None) -> int:
    bench = Bench(__doc__, "tensor_parallel_<platform>")
    bench.add_argument("--tp", type=int, default=8)
    bench.add_argument("--steps", type=int, default=5)
    args = bench.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", args.tp)  # simulated devices if on CPU; before JAX starts
    bench.refuse_existing(f"tensor_parallel_{jax.default_backend()}")
    rows = []
    print(f"{'block':<10}{'tp_overlap':<19}{'SP':<4}{'pieces':>7}{'GFLOP/layer':>12}{'MB/layer':>10}{'step s':>9}  collectives")
    for block in ("parallel", "serial"):
        for overlap, sp, pieces in MODES:
            r = measure(block, overlap, sp, pieces, args)
            rows.append(r)
            c = r["collectives_in_program"]
            print(f"{block:<10}{overlap:<19}{'y' if sp else 'n':<4}{pieces if overlap == 'collective_matmul' else '':>7}"
                  f"{r['flops_per_layer'] / 1e9:>12.3f}"
                  f"{r['bytes_per_layer'] / 1e6:>10.1f}{r['step_time_s']:>9.3f}  "
                  f"AR {c['all-reduce']} AG {c['all-gather']} RS {c['reduce-scatter']} CP {c['collective-permute']}",
                  flush=True)
    bench.write({"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
