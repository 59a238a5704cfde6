"""What `data.stream=true` costs: time to the first step and peak memory on a corpus of 2 GB against
one of 20 MB, and the on-the-fly tokenizer's throughput.

    python -m bench.data.stream_memory [--large-gb 2] [--small-mb 20] [--steps 200] [--workers 1]

Writes two synthetic JSONL corpora of random words (8 shards each, generated here, seeded, nothing
downloaded) to a temporary directory, trains a BPE of 1,024 tokens on 4 MB of them, then trains
configs/tiny_cpu.yaml (vocabulary 1,024) for `--steps` steps on each with data.stream=true and a
fresh cache, sampling the resident memory of the training process and of its tokenizing workers
every 0.1 s. Time to the first step is the wall time from the command's start until metrics.jsonl
holds a record. Then one worker alone (`shard_cache.tokenize_readers`) tokenizes `--throughput-mb`
of a shard: MB of text a second on one core. JSON to bench/results/stream_memory_<platform>.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.common import REPO, Bench, python_module, with_repo_on_path

CONFIG = os.path.join(REPO, "configs", "tiny_cpu.yaml")
SHARDS = 8


def write_corpus(directory: str, total_bytes: int, seed: int) -> int:
    """`SHARDS` JSONL shards of documents of 200-6,000 random words' text; returns the text bytes."""
    rng = np.random.default_rng(seed)
    words = np.array(["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=int(n)))
                      for n in rng.integers(1, 10, size=5000)])
    os.makedirs(directory)
    written = 0
    for shard in range(SHARDS):
        with open(os.path.join(directory, f"part-{shard:03d}.jsonl"), "w") as f:
            while written < total_bytes * (shard + 1) // SHARDS:
                lengths = rng.integers(200, 6000, size=16)
                picks = words[rng.integers(0, len(words), size=int(lengths.sum()))]
                cuts = np.cumsum(lengths)[:-1]
                lines = []
                for doc in np.split(picks, cuts):
                    text = " ".join(doc)
                    written += len(text)
                    lines.append(json.dumps({"text": text}))
                f.write("\n".join(lines) + "\n")
    return written


def train_tokenizer(corpus: str, out: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sample = os.path.join(os.path.dirname(out), "sample.txt")
    with open(os.path.join(corpus, "part-000.jsonl")) as f, open(sample, "w") as s:
        s.write(f.read(4 << 20))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([sample], trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"], show_progress=False,
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(out)
    return out


def measure_run(work: str, name: str, corpus: str, tokenizer: str, steps: int, workers: int) -> dict:
    """Train on `corpus` streamed; peak RSS of the trainer and of its workers, time to the first step."""
    import psutil

    run_dir = os.path.join(work, f"run-{name}")
    argv = python_module("megascale_jax.train", "--config", CONFIG, "--run-dir", run_dir, "data.source=jsonl",
                         f"data.path={corpus}/*.jsonl", f"data.tokenizer={tokenizer}", "data.stream=true",
                         f"data.cache_dir={work}/cache-{name}", f"data.tokenize_workers={workers}", "model.vocab=1024",
                         f"train.steps={steps}", "train.eval_every=0", "train.eval_batches=0", "data.val_fraction=0",
                         "checkpoint.every=0", "train.sample_at_end=0", f"train.log_every={steps}")
    start = time.perf_counter()
    trainer = psutil.Popen(argv, cwd=REPO, env=with_repo_on_path({**os.environ, "JAX_PLATFORMS": "cpu"}),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak_trainer = peak_workers = peak_total = 0
    first_step_s = None
    metrics = os.path.join(run_dir, "metrics.jsonl")
    while trainer.poll() is None:
        try:
            main_rss = trainer.memory_info().rss
            workers_rss = sum(c.memory_info().rss for c in trainer.children(recursive=True))
        except psutil.Error:
            continue
        peak_trainer, peak_workers = max(peak_trainer, main_rss), max(peak_workers, workers_rss)
        peak_total = max(peak_total, main_rss + workers_rss)
        if first_step_s is None and os.path.exists(metrics) and os.path.getsize(metrics):
            first_step_s = time.perf_counter() - start
        time.sleep(0.1)
    wall = time.perf_counter() - start
    stderr = trainer.stderr.read()
    if trainer.returncode:
        raise SystemExit(f"the {name} run failed:\n{stderr[-3000:]}")
    records = [json.loads(line) for line in open(metrics)]
    waits = [r["data_wait_s"] for r in records[1:]]
    tokenized = 0
    for directory, _, files in os.walk(os.path.join(work, f"cache-{name}", "stream")):
        if "meta.json" in files:
            with open(os.path.join(directory, "meta.json")) as f:
                tokenized += json.load(f)["text_bytes"]
    mib = 1 << 20
    return {"corpus": name, "steps": steps, "time_to_first_step_s": round(first_step_s, 2), "wall_s": round(wall, 1),
            "peak_rss_trainer_mib": round(peak_trainer / mib, 1), "peak_rss_workers_mib": round(peak_workers / mib, 1),
            "peak_rss_total_mib": round(peak_total / mib, 1), "tokenize_workers": workers,
            "median_step_time_s": round(float(np.median([r["step_time_s"] for r in records[1:]])), 4),
            "data_wait_s_mean_after_first": round(float(np.mean(waits)), 5),
            "data_wait_s_max_after_first": round(float(np.max(waits)), 5),
            "text_bytes_in_complete_shards": tokenized}


def measure_throughput(work: str, corpus: str, tokenizer: str, megabytes: int) -> dict:
    """One worker, one core: a shard cut to `megabytes` of JSONL tokenized as the loader's workers do."""
    from megascale_jax.training import pretrained_tokenizer, shard_cache

    shard = os.path.join(work, "throughput", "cut.jsonl")
    os.makedirs(os.path.dirname(shard))
    with open(os.path.join(corpus, "part-000.jsonl")) as f, open(shard, "w") as out:
        for line in f:
            out.write(line)
            if out.tell() > megabytes << 20:
                break
    tok = pretrained_tokenizer.load(tokenizer)
    job = {"tokenizer": tokenizer, "eos": tok.token_to_id("<|endoftext|>"), "dtype": "uint16", "text_field": "text",
           "val_fraction": 0.0, "stop_at_bad_line": False, "part": "bench",
           "readers": [[[shard, os.path.join(work, "throughput", "cache")]]]}
    start = time.perf_counter()
    shard_cache.tokenize_readers(job)
    seconds = time.perf_counter() - start
    with open(os.path.join(work, "throughput", "cache", "meta.json")) as f:
        meta = json.load(f)
    return {"text_mb": round(meta["text_bytes"] / 1e6, 1), "tokens": meta["tokens"]["train"],
            "seconds": round(seconds, 2), "mb_per_s_per_core": round(meta["text_bytes"] / 1e6 / seconds, 2),
            "tokens_per_s_per_core": round(meta["tokens"]["train"] / seconds)}


def main(argv=None) -> None:
    bench = Bench(__doc__, "stream_memory")
    bench.add_argument("--large-gb", type=float, default=2.0, help="the large corpus's text, GB (default 2)")
    bench.add_argument("--small-mb", type=float, default=20.0, help="the small corpus's text, MB (default 20)")
    bench.add_argument("--steps", type=int, default=200, help="training steps on each corpus (default 200)")
    bench.add_argument("--workers", type=int, default=1, help="data.tokenize_workers (default 1)")
    bench.add_argument("--throughput-mb", type=int, default=50, help="text tokenized by one worker alone (default 50)")
    args = bench.parse_args(argv)
    import jax
    import tokenizers

    bench.refuse_existing(f"stream_memory_{jax.default_backend()}")
    with tempfile.TemporaryDirectory(prefix="stream-memory-") as work:
        sizes = {"small": int(args.small_mb * 1e6), "large": int(args.large_gb * 1e9)}
        written, rows = {}, []
        for name, size in sizes.items():
            start = time.perf_counter()
            written[name] = write_corpus(os.path.join(work, name), size, seed=len(name))
            seconds = time.perf_counter() - start
            print(f"{name}: {written[name] / 1e6:,.0f} MB of text in {SHARDS} shards ({seconds:.0f} s)")
        tokenizer = train_tokenizer(os.path.join(work, "small"), os.path.join(work, "tokenizer.json"))
        for name in sizes:
            rows.append(measure_run(work, name, os.path.join(work, name), tokenizer, args.steps, args.workers))
            print(json.dumps(rows[-1]))
        throughput = measure_throughput(work, os.path.join(work, "large"), tokenizer, args.throughput_mb)
        print(json.dumps(throughput))
    small, large = rows
    bench.write({"config": os.path.relpath(CONFIG, REPO), "overrides": ["model.vocab=1024"],
                 "text_bytes": written, "shards": SHARDS, "tokenizers": tokenizers.__version__,
                 "cpu_cores": os.cpu_count(), "runs": rows, "throughput": throughput,
                 "summary": {
                     "peak_rss_total_mib": {"small": small["peak_rss_total_mib"], "large": large["peak_rss_total_mib"]},
                     "time_to_first_step_s": {"small": small["time_to_first_step_s"],
                                              "large": large["time_to_first_step_s"]},
                     "tokenizing_mb_per_s_per_core": throughput["mb_per_s_per_core"],
                     "step_waits_for_data": large["data_wait_s_mean_after_first"] > 0.1 * large["median_step_time_s"]}})


if __name__ == "__main__":
    main()
