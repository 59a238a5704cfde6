"""What `train.eval_tasks` costs: seconds to score 1,000 items on the training mesh.

    python -m bench.training.downstream_cost [--items 1000] [key=value ...]

Builds the trainer of configs/tiny_cpu.yaml (`key=value` overrides change it: model size, mesh)
and scores two synthetic tasks with its parameters through the path the training loop takes
(`training.downstream.Downstream`: lm-eval's requests, rows of model.seq_len + 1 tokens in batches
of train.global_batch, `Trainer.score_rows` on the mesh): a 4-way multiple-choice task and a
LAMBADA-style one, contexts of 40-120 characters, seeded. Each task is scored three times; the
first includes compiling the scoring function (once per run), the median of the other two is the
cost. JSON to bench/results/downstream_cost_<platform>.json.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import numpy as np

from bench.common import REPO, Bench

CONFIG = os.path.join(REPO, "configs", "tiny_cpu.yaml")


def synthetic_tasks(directory: str, items: int, seed: int = 0) -> list[str]:
    """A multiple-choice (4 choices) and a LAMBADA-style task file of `items` items each."""
    rng = np.random.default_rng(seed)
    words = ["def", "self", "return", "import", "class", "value", "for", "in", "if", "else", "None", "list"]

    def text(low: int, high: int) -> str:
        out = ""
        while len(out) < rng.integers(low, high):
            out += str(rng.choice(words)) + " "
        return out.strip()

    mc, lambada = os.path.join(directory, "mc.jsonl"), os.path.join(directory, "lambada.jsonl")
    with open(mc, "w") as f:
        for _ in range(items):
            f.write(json.dumps({"context": text(40, 120), "choices": [text(5, 20) for _ in range(4)],
                                "gold": int(rng.integers(4))}) + "\n")
    with open(lambada, "w") as f:
        for _ in range(items):
            f.write(json.dumps({"context": text(40, 120), "target": " " + str(rng.choice(words))}) + "\n")
    return [mc, lambada]


def main(argv=None) -> None:
    bench = Bench(__doc__, "downstream_cost")
    bench.add_argument("--items", type=int, default=1000, help="items per task (default 1000)")
    bench.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = bench.parse_args(argv)
    import jax

    from megascale_jax.config import load_config
    from megascale_jax.parallel.mesh import make_mesh, use_cpu_devices
    from megascale_jax.training import downstream
    from megascale_jax.training.trainer import build_trainer

    use_cpu_devices(load_config(CONFIG, args.overrides).mesh.cpu_devices_per_process(1))  # before the backend starts
    bench.refuse_existing(f"downstream_cost_{jax.default_backend()}")
    with tempfile.TemporaryDirectory() as work:
        paths = synthetic_tasks(work, args.items)
        rows = []
        for path in paths:
            cfg = load_config(CONFIG, [*args.overrides, f"train.eval_tasks=[{path}]"])
            mesh = make_mesh(cfg.mesh)
            trainer = build_trainer(cfg, mesh)
            params = trainer.init().params
            (prepared,) = downstream.prepare(cfg, None)
            scorer = downstream.Downstream(cfg, [prepared], trainer.score_rows, trainer.batch_sharding)
            seconds = []
            for _ in range(3):
                start = time.perf_counter()
                scorer.scores(params)
                seconds.append(time.perf_counter() - start)
            steady = statistics.median(seconds[1:])
            rows.append({"task": prepared.task.name, "output_type": prepared.task.output_type,
                         "items": len(prepared.task.items), "requests": len(prepared.requests),
                         "first_s_with_compile": round(seconds[0], 3), "seconds": round(steady, 3),
                         "seconds_per_1000_items": round(steady * 1000 / len(prepared.task.items), 3)})
            print(f"{rows[-1]['task']}: {rows[-1]['items']:,} items, {rows[-1]['requests']:,} requests: "
                  f"{steady:.2f} s ({rows[-1]['seconds_per_1000_items']:.2f} s per 1,000 items; first "
                  f"{seconds[0]:.2f} s with the compile)")
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    bench.write({"config": os.path.relpath(CONFIG, REPO), "overrides": args.overrides, "parameters": n_params,
                 "mesh": dict(mesh.shape), "global_batch": cfg.train.global_batch, "seq_len": cfg.model.seq_len,
                 "rows": rows})


if __name__ == "__main__":
    main()
