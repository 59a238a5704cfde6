"""What keeping packed documents apart costs a training step (`model.document_eos`).

    python -m bench.training.documents_cost [--steps 20] [--mean-document 200] [key=value ...]

Builds the trainer of configs/tiny_cpu.yaml twice (`key=value` overrides change both: model
size, mesh, window, attention), once plain and once with `model.document_eos` (attention masked
at each document's boundary, the boundary targets not trained on, rotary positions restarted),
and times its train step on the same seeded batch: packed documents of exponentially distributed
lengths (mean `--mean-document` tokens), each ended by the end-of-document token. The two steps
alternate (A, B, A, B, ...) so that a load on the machine falls on both alike; the first call of
each (the compile) is left out and the median of the rest is each one's step time. JSON to
bench/results/documents_cost_<platform>.json.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from bench.common import REPO, Bench

CONFIG = os.path.join(REPO, "configs", "tiny_cpu.yaml")
EOS = 10  # a byte-level corpus's newline: a line a document


def packed_batch(global_batch: int, seq_len: int, vocab: int, mean_document: float, seed: int = 0) -> np.ndarray:
    """(global_batch, seq_len + 1) int32 tokens: documents of random lengths end to end, each
    ended by EOS, no other token equal to it."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(EOS + 1, vocab, size=(global_batch, seq_len + 1), dtype=np.int32)
    for row in tokens:
        at = 0
        while True:
            at += max(1, int(rng.exponential(mean_document)))
            if at >= len(row):
                break
            row[at] = EOS
    return tokens


def time_steps(trainers: dict, batch, steps: int) -> dict[str, list[float]]:
    """Each trainer's step times, calls alternating between them; the first (compile) dropped."""
    import jax

    states = {name: t.init() for name, t in trainers.items()}
    steps_of = {name: t.train_step for name, t in trainers.items()}  # jitted, with the mesh's rules
    placed = {name: jax.device_put(batch, t.batch_sharding) for name, t in trainers.items()}
    seconds: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(steps + 1):
        for name in trainers:
            start = time.perf_counter()
            states[name], metrics = steps_of[name](states[name], placed[name])
            jax.block_until_ready(metrics["loss"])
            seconds[name].append(time.perf_counter() - start)
    return {name: s[1:] for name, s in seconds.items()}


def main(argv=None) -> None:
    bench = Bench(__doc__, "documents_cost")
    bench.add_argument("--steps", type=int, default=20, help="timed steps of each (default 20)")
    bench.add_argument("--mean-document", type=float, default=200.0,
                       help="mean document length in tokens (default 200)")
    bench.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = bench.parse_args(argv)
    import jax

    from megascale_jax.config import load_config
    from megascale_jax.parallel.mesh import make_mesh, use_cpu_devices
    from megascale_jax.training.trainer import build_trainer

    plain_cfg = load_config(CONFIG, args.overrides)
    use_cpu_devices(plain_cfg.mesh.cpu_devices_per_process(1))  # before the backend starts
    bench.refuse_existing(f"documents_cost_{jax.default_backend()}")
    configs = {"plain": plain_cfg, "documents_apart": load_config(CONFIG, [*args.overrides, f"model.document_eos={EOS}"])}
    mesh = make_mesh(plain_cfg.mesh)
    trainers = {name: build_trainer(cfg, mesh) for name, cfg in configs.items()}
    m, t = plain_cfg.model, plain_cfg.train
    batch = packed_batch(t.global_batch, m.seq_len, m.vocab, args.mean_document)
    seconds = time_steps(trainers, batch, args.steps)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    ratio = median["documents_apart"] / median["plain"]
    documents = int((batch[:, :-1] == EOS).sum()) + t.global_batch
    print(f"step {median['plain'] * 1e3:.1f} ms plain, {median['documents_apart'] * 1e3:.1f} ms with documents "
          f"apart: {ratio:.3f}x ({documents} documents in {t.global_batch} x {m.seq_len} tokens; "
          f"median of {args.steps})")
    bench.write({"config": os.path.relpath(CONFIG, REPO), "overrides": args.overrides, "mesh": dict(mesh.shape),
                 "global_batch": t.global_batch, "seq_len": m.seq_len, "window": m.window, "attention": m.attention,
                 "mean_document_tokens": args.mean_document, "documents_in_batch": documents, "steps": args.steps,
                 "step_s": {name: round(v, 6) for name, v in median.items()}, "ratio": round(ratio, 4),
                 "all_step_s": {name: [round(x, 6) for x in s] for name, s in seconds.items()}})


if __name__ == "__main__":
    main()
