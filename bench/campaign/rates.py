"""Campaign section f, rates: the device's own GEMM time by shape and its streaming HBM rate, as
the planner prices them (issue 40: "every calibration constant a datasheet value or a
measurement of ours: GEMM efficiency by shape"). `megascale_jax.planner.measured.gemm_fit` turns
the rows into the planner's constants.

Each GEMM, bf16 (m × k) · (k × n) → bf16 as the model's layers run theirs, is its own jitted
function (its own HLO module), compiled, run once, then run REPEATS times under `jax.profiler`; its time is the
device time of its module's ops in the trace (`observe.device_profile.read_ops`), divided by the
repeats. Timed on the device, not from the host: a 2-GFLOP GEMM takes ~3 µs on an H100, well
under the ~20 µs the host takes to dispatch a call, so host timing would measure the dispatch.
The shapes: squares (the size curve), and the GEMMs the planner's validation prices (this
project's 1.4B at 8 sequences; MegaScale's 175B and Llama 3's 405B at tp 8), forward, input and
weight gradient.

The stream: y = 2x + 1 over STREAM_BYTES of float32, one read and one write a value, the same way
(bytes moved over device time), set beside the datasheet's bandwidth.

Concurrency (PyTorch, on a GPU only: JAX gives no control of CUDA streams; in a process of its
own, `concurrency_in_process`, so PyTorch's CUDA libraries never load beside JAX's and a crash
there costs that row only): how much of a
memory-bound kernel (a softmax over attention scores, as Megatron's unfused attention runs one)
hides beside a GEMM (an MLP's) when the two run on two CUDA streams, `hidden_share` = (t_gemm +
t_softmax − t_both) / min(t_gemm, t_softmax). MegaScale's parallel block lets the attention and the
MLP "be executed in parallel, thereby reducing the computation time" (§3.1); the planner can
price that only with this number measured.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from bench.campaign import process  # imports neither JAX nor PyTorch

REPEATS = {False: 10, True: 2}  # keyed by dry_run
CONCURRENCY_LIMIT_S = 180  # its process: PyTorch's import and CUDA start, 3 x 22 timed launches of ~2 ms
STREAM_BYTES = {False: (2**28, 2**30, 2**32), True: (2**16,)}


def linear_gemms(tokens: int, k: int, n: int) -> list[tuple[int, int, int]]:
    """A linear layer's three GEMMs as (m, k, n): forward x·W, input gradient dy·Wᵀ, weight
    gradient xᵀ·dy (the planner's `costs.linear_s`)."""
    return [(tokens, k, n), (tokens, n, k), (k, tokens, n)]


def gemm_shapes(dry_run: bool) -> list[tuple[int, int, int]]:
    if dry_run:
        return [(32, 32, 32), (64, 64, 64), (128, 64, 32)]
    squares = [(s, s, s) for s in (512, 1024, 2048, 4096, 8192)]
    model = [*linear_gemms(16384, 2048, 3 * 2048 + 8192),  # gpt_1b at 8 x 2048: QKV + MLP-up, one GEMM
             *linear_gemms(16384, 2048 + 8192, 2048),  # its attention-out + MLP-down
             (16384, 2048, 50304)]  # its LM head's forward
    megascale = [*linear_gemms(2048, 12288, 3 * 12288 // 8), (2048, 12288, 4 * 12288 // 8),  # 175B, tp 8, 2,048 tokens
                 (2048, 12288, 7 * 12288 // 8), (2048, 12288 // 8, 12288), (2048, 4 * 12288 // 8, 12288)]
    llama3 = [(8192, 16384, (128 + 16) * 128 // 8), (8192, 16384, 2 * 53248 // 8), (8192, 53248 // 8, 16384)]
    return squares + model + megascale + llama3


def device_seconds(compiled, args, repeats: int) -> float:
    """Device seconds per call of `compiled(*args)`: its module's ops in a trace of `repeats` calls."""
    import jax

    from megascale_jax.observe import device_profile

    jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory(prefix="campaign-rates-") as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(repeats):
                jax.block_until_ready(compiled(*args))
        ops = device_profile.read_ops(device_profile.latest_trace(trace_dir), device_profile.hlo_module_name(compiled))
    if not ops:
        raise RuntimeError("the trace holds no op of its module")
    return sum(o.end_ns - o.start_ns for o in ops[min(ops)] if o.is_compute) * 1e-9 / repeats


def gemm_row(m: int, k: int, n: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    def gemm(a, b):  # as the model's layers multiply: bf16 in and out, float32 accumulation inside
        return jnp.dot(a, b)

    gemm.__name__ = f"gemm_{m}x{k}x{n}"  # its own HLO module name, so the trace tells the shapes apart
    a, b = (jax.random.normal(jax.random.PRNGKey(i), shape, jnp.bfloat16) for i, shape in ((0, (m, k)), (1, (k, n))))
    seconds = device_seconds(jax.jit(gemm).lower(a, b).compile(), (a, b), repeats)
    return {"m": m, "k": k, "n": n, "seconds": seconds, "tflops": 2 * m * k * n / seconds / 1e12}


def model_layer_gemms(dry_run: bool) -> list[tuple[str, int, int, int]]:
    """(which, m, k, n) of gpt_1b's six layer GEMMs at 8 x 2048 tokens (`gemm_shapes`' model rows)
    and which FP8 formats each multiplies: forward e4m3 x e4m3, input gradient e5m2 x e4m3, weight
    gradient e4m3 x e5m2 (model/fp8.py)."""
    if dry_run:
        return [("forward", 32, 32, 32), ("input gradient", 32, 32, 32), ("weight gradient", 32, 32, 32)]
    shapes = [*linear_gemms(16384, 2048, 3 * 2048 + 8192), *linear_gemms(16384, 2048 + 8192, 2048)]
    return [(which, *shape) for which, shape in zip(("forward", "input gradient", "weight gradient") * 2, shapes)]


FP8_FORMATS = {"forward": ("float8_e4m3fn", "float8_e4m3fn"), "input gradient": ("float8_e5m2", "float8_e4m3fn"),
               "weight gradient": ("float8_e4m3fn", "float8_e5m2")}


def fp8_gemm_row(which: str, m: int, k: int, n: int, repeats: int, on_gpu: bool) -> dict:
    """One of the model's layer GEMMs as `model.fp8` runs it: FP8 operands scaled back to bf16 and
    multiplied, which XLA's GEMM rewriter must turn into cuBLASLt's FP8 GEMM. Compiled with Triton
    GEMMs off (as the campaign's fp8 lever runs: a Triton fusion would multiply upcast bf16), its
    rate is set beside the bf16 GEMM of the same shape; `fp8_gemm` says whether the compiled
    program holds `__cublas$lt$matmul$f8`: a row without it timed a bf16 product, and says so."""
    import jax
    import jax.numpy as jnp

    def gemm(a, b, sa, sb):
        return jnp.dot(a.astype(jnp.bfloat16) * sa, b.astype(jnp.bfloat16) * sb)

    gemm.__name__ = f"fp8_gemm_{m}x{k}x{n}"
    fa, fb = (getattr(jnp, f) for f in FP8_FORMATS[which])
    a = jax.random.normal(jax.random.PRNGKey(0), (m, k), jnp.float32).astype(fa)
    b = jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.float32).astype(fb)
    sa, sb = jnp.bfloat16(0.5), jnp.bfloat16(0.25)
    options = {"xla_gpu_enable_triton_gemm": False} if on_gpu else None
    compiled = jax.jit(gemm).lower(a, b, sa, sb).compile(compiler_options=options)
    seconds = device_seconds(compiled, (a, b, sa, sb), repeats)
    row = {"which": which, "m": m, "k": k, "n": n, "formats": list(FP8_FORMATS[which]), "seconds": seconds,
           "tflops": 2 * m * k * n / seconds / 1e12, "fp8_gemm": "__cublas$lt$matmul$f8" in compiled.as_text()}
    if not row["fp8_gemm"]:
        row["note"] = "XLA did not make this an FP8 GEMM: the time is a bf16 product's"
    return row


def stream_row(nbytes: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    def stream(x):
        return 2 * x + 1

    stream.__name__ = f"stream_{nbytes}"
    x = jnp.ones((nbytes // 4,), jnp.float32)
    seconds = device_seconds(jax.jit(stream).lower(x).compile(), (x,), repeats)
    return {"bytes": nbytes, "seconds": seconds, "tb_per_s": 2 * nbytes / seconds / 1e12}


def hidden_share(t_gemm: float, t_memory: float, t_both: float) -> float:
    """The share of the shorter kernel's time that running both at once saved: 0 when they ran as
    if one after the other, 1 when the shorter one was hidden whole behind the longer."""
    return (t_gemm + t_memory - t_both) / min(t_gemm, t_memory)


def concurrency_row(on_gpu: bool, repeats: int = 20) -> dict:
    """A bf16 GEMM (8192 x 12288 x 6144: an MLP's) and a softmax over bf16 scores (48 x 2048 x
    2048 per call, 4 calls: an unfused attention's), each alone and both at once on two CUDA
    streams; median seconds of `repeats` (CUDA events), and `hidden_share`."""
    if not on_gpu:
        return {"skipped": "skipped: needs a GPU (PyTorch's CUDA streams)"}
    import statistics

    import torch

    device = torch.device("cuda")
    a = torch.randn(8192, 12288, device=device, dtype=torch.bfloat16)
    b = torch.randn(12288, 6144, device=device, dtype=torch.bfloat16)
    scores = torch.randn(48, 2048, 2048, device=device, dtype=torch.bfloat16)
    gemm_stream, memory_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def gemm():
        with torch.cuda.stream(gemm_stream):
            a @ b

    def memory():
        with torch.cuda.stream(memory_stream):
            for _ in range(4):
                torch.softmax(scores, dim=-1)

    def timed(*launches) -> float:
        times = []
        for _ in range(repeats + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for stream in (gemm_stream, memory_stream):
                stream.wait_event(start)
            for launch in launches:
                launch()
            for stream in (gemm_stream, memory_stream):
                torch.cuda.current_stream().wait_stream(stream)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(times[2:])  # the first two warm up

    t_gemm, t_memory, t_both = timed(gemm), timed(memory), timed(gemm, memory)
    return {"gemm_s": t_gemm, "softmax_s": t_memory, "both_s": t_both,
            "hidden_share": hidden_share(t_gemm, t_memory, t_both)}


def concurrency_in_process(on_gpu: bool) -> dict:
    """`concurrency_row` run as `python -m bench.campaign.rates --concurrency OUT`: its row, or the
    one line saying why that process failed."""
    if not on_gpu:
        return concurrency_row(False)
    with tempfile.TemporaryDirectory(prefix="campaign-concurrency-") as work:
        out = os.path.join(work, "concurrency.json")
        done = process.run(process.python("bench.campaign.rates", "--concurrency", out), env=dict(os.environ),
                           limit_s=CONCURRENCY_LIMIT_S, prefix="  [concurrency]")
        if not done.ok:
            return {"error": done.failure(CONCURRENCY_LIMIT_S)}
        with open(out) as f:
            return json.load(f)


def run(settings: dict) -> dict:
    dry_run = settings["dry_run"]
    repeats = REPEATS[dry_run]
    result = {"repeats": repeats, "gemms": [], "stream": []}
    print(f"{'m':>7}{'k':>7}{'n':>7}{'us':>10}{'TFLOP/s':>9}")
    for m, k, n in gemm_shapes(dry_run):
        try:
            row = gemm_row(m, k, n, repeats)
            print(f"{m:>7}{k:>7}{n:>7}{row['seconds'] * 1e6:>10.1f}{row['tflops']:>9.1f}", flush=True)
        except Exception as e:  # noqa: BLE001 — a shape that cannot run is a row with its error
            row = {"m": m, "k": k, "n": n, "error": process.one_line(e)}
            print(f"{m:>7}{k:>7}{n:>7}  {row['error']}", flush=True)
        result["gemms"].append(row)
    on_gpu = settings.get("device", {}).get("backend") == "gpu"
    result["fp8_gemms"] = []
    for which, m, k, n in model_layer_gemms(dry_run):
        try:
            row = fp8_gemm_row(which, m, k, n, repeats, on_gpu)
            print(f"fp8 {which:<16}{m:>7}{k:>7}{n:>7}{row['seconds'] * 1e6:>10.1f}{row['tflops']:>9.1f}"
                  f"  {'cuBLASLt FP8' if row['fp8_gemm'] else row['note']}", flush=True)
        except Exception as e:  # noqa: BLE001 — a shape that cannot run is a row with its error
            row = {"which": which, "m": m, "k": k, "n": n, "error": process.one_line(e)}
            print(f"fp8 {which:<16}{m:>7}{k:>7}{n:>7}  {row['error']}", flush=True)
        result["fp8_gemms"].append(row)
    for nbytes in STREAM_BYTES[dry_run]:
        try:
            row = stream_row(nbytes, repeats)
            print(f"stream {nbytes / 2**20:.0f} MiB: {row['tb_per_s']:.2f} TB/s", flush=True)
        except Exception as e:  # noqa: BLE001
            row = {"bytes": nbytes, "error": process.one_line(e)}
        result["stream"].append(row)
    result["concurrency"] = concurrency_in_process(on_gpu and not dry_run)
    print(f"concurrency: {result['concurrency']}", flush=True)
    return result


def main(argv=None) -> int:
    """`--concurrency OUT`: `concurrency_row` on this machine's GPU, written to OUT as JSON."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "--concurrency":
        print("usage: python -m bench.campaign.rates --concurrency OUT.json", file=sys.stderr)
        return 2
    row = concurrency_row(True)
    with open(argv[1], "w") as f:
        json.dump(row, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
