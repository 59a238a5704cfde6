"""Fused-kernel benchmark on one GPU: attention, LayerNorm(+residual) and bias+GeLU vs XLA/cuDNN.

    python -m bench.kernels.attention                       # the issue's grid, bf16, head dim 128
    python -m bench.kernels.attention --seqs 2048 --windows 512 --iters 5

Attention: forward+backward time and achieved TFLOP/s for XLA dense causal, XLA masked window,
cuDNN window, Pallas window (and jax-triton window when installed), for every (seq, window).
FLOPs count only the useful work of each problem: 4·d per visible (query, key) pair and head
forward, 2.5× that backward (the FlashAttention convention), so a kernel that skips nothing
cannot look faster than it is. LayerNorm and GeLU: forward+backward time of the Pallas kernel
vs the same math left to XLA's fusion. Prints tables and writes
bench/results/attention_<device>.json with the device, jax/jaxlib versions and the command.
An implementation that fails (e.g. XLA's dense scores out of memory) is recorded as an error.
"""

import re
import statistics
import sys
import time

from bench.common import Bench
from megascale_jax.planner.costs import FLASH_FWD_BWD, visible_pairs


def attention_flops(batch, heads, head_dim, seq, window) -> float:
    return FLASH_FWD_BWD * 4 * batch * heads * head_dim * visible_pairs(seq, window)


def time_fwd_bwd(fn, args, iters: int) -> float:
    """Median seconds of one jitted forward+backward (grad of a random projection of the output)."""
    import jax
    import jax.numpy as jnp

    cot = jax.random.normal(jax.random.PRNGKey(1), jax.eval_shape(fn, *args).shape, args[0].dtype)
    step = jax.grad(lambda *a: jnp.vdot(fn(*a), cot).real.astype(jnp.float32), argnums=tuple(range(len(args))))
    return median_seconds(step, args, iters)


def median_seconds(fn, args, iters: int) -> float:
    """Median seconds of `iters` calls of jit(fn)(*args), after one that compiles and warms up."""
    import jax

    step = jax.jit(fn)
    jax.block_until_ready(step(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_impls(window):
    from megascale_jax.model.attention import attend
    from pallas_kernels import flash_attention, triton_attention

    impls = {
        "xla_dense_causal": lambda q, k, v: attend(q, k, v, window=None, implementation="xla"),
        "xla_window": lambda q, k, v: attend(q, k, v, window=window, implementation="xla"),
        "cudnn_window": lambda q, k, v: attend(q, k, v, window=window, implementation="cudnn"),
        "pallas_window": lambda q, k, v: flash_attention(q, k, v, window=window),
    }
    if triton_attention.available():
        impls["triton_window"] = lambda q, k, v: triton_attention.triton_flash_attention(q, k, v, window=window)
    return impls


def bench_attention(args):
    import jax
    import jax.numpy as jnp

    rows = []
    for seq in args.seqs:
        keys = jax.random.split(jax.random.PRNGKey(seq), 3)
        shapes = [(args.batch, seq, n, args.head_dim) for n in (args.heads, args.kv_heads, args.kv_heads)]
        qkv = [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes)]
        for window in args.windows:
            for name, fn in attention_impls(window).items():
                if name == "xla_dense_causal" and window != args.windows[0]:
                    continue  # independent of the window: measured once per seq
                effective = None if name == "xla_dense_causal" else window
                row = {"impl": name, "seq": seq, "window": effective}
                try:
                    seconds = time_fwd_bwd(fn, qkv, args.iters)
                    flops = attention_flops(args.batch, args.heads, args.head_dim, seq, effective)
                    row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12)
                except Exception as e:  # noqa: BLE001 — an impl that cannot run is a result too
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                rows.append(row)
                print(f"{seq:>7}{str(effective):>8}  {name:<18}" + (
                    f"{row['ms']:>10.3f}{row['tflops']:>9.1f}" if "ms" in row else f"  {row['error']}"),
                    flush=True)
    return rows


def bench_fused(args):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import (bias_gelu, bias_gelu_reference, layer_norm_residual,
                                layer_norm_residual_reference)

    tokens, d, f = args.fused_tokens, args.d_model, 4 * args.d_model
    key = jax.random.PRNGKey(0)
    x, r = (jax.random.normal(k, (tokens, d), jnp.bfloat16) for k in jax.random.split(key, 2))
    h = jax.random.normal(key, (tokens, f), jnp.bfloat16)
    scale, bias, fbias = jnp.ones(d), jnp.zeros(d), jax.random.normal(key, (f,))
    cases = {
        ("layer_norm_residual", "pallas"): (lambda x, r: layer_norm_residual(x, r, scale, bias)[0], (x, r)),
        ("layer_norm_residual", "xla"): (lambda x, r: layer_norm_residual_reference(x, r, scale, bias)[0], (x, r)),
        ("bias_gelu", "pallas"): (lambda h: bias_gelu(h, fbias), (h,)),
        ("bias_gelu", "xla"): (lambda h: bias_gelu_reference(h, fbias), (h,)),
    }
    rows = []
    for (kernel, impl), (fn, fargs) in cases.items():
        row = {"kernel": kernel, "impl": impl, "tokens": tokens, "d_model": d}
        try:
            row["ms"] = time_fwd_bwd(fn, fargs, args.iters) * 1e3
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
        print(f"{kernel:<22}{impl:<8}" + (f"{row['ms']:>10.3f}" if "ms" in row else f"  {row['error']}"), flush=True)
    return rows


def main(argv=None) -> int:
    bench = Bench(__doc__, "attention_<device>")
    bench.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192, 32768])
    bench.add_argument("--windows", type=int, nargs="+", default=[512, 1024, 4096])
    bench.add_argument("--batch", type=int, default=1)
    bench.add_argument("--heads", type=int, default=16)
    bench.add_argument("--kv-heads", type=int, default=16)
    bench.add_argument("--head-dim", type=int, default=128)
    bench.add_argument("--d-model", type=int, default=4096, help="LayerNorm / GeLU width (GeLU: 4x)")
    bench.add_argument("--fused-tokens", type=int, default=16384)
    bench.add_argument("--iters", type=int, default=20)
    bench.add_argument("--allow-cpu", action="store_true",
                       help="run anyway on the CPU (interpret mode; only to smoke-test this script)")
    args = bench.parse_args(argv)

    import jax

    if jax.default_backend() != "gpu" and not args.allow_cpu:
        print(f"{bench.parser.prog} needs a GPU (JAX backend is {jax.default_backend()!r}); "
              "run it on a GPU machine, or pass --allow-cpu with tiny sizes to smoke-test it",
              file=sys.stderr)
        return 2

    device = jax.devices()[0].device_kind
    bench.refuse_existing(f"attention_{re.sub(r'[^a-z0-9]+', '_', device.lower()).strip('_')}")
    print(f"{device}, jax {jax.__version__}, batch {args.batch}, heads {args.heads}/{args.kv_heads}, "
          f"head dim {args.head_dim}, bf16, fwd+bwd")
    print(f"{'seq':>7}{'window':>8}  {'impl':<18}{'ms':>10}{'TFLOP/s':>9}")
    attention = bench_attention(args)
    print(f"\n{'kernel':<22}{'impl':<8}{'ms':>10}")
    fused = bench_fused(args)

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    bench.write({"triton": triton_version, "attention": attention, "fused": fused,
                 "settings": {k: v for k, v in vars(args).items() if k not in ("out", "overwrite", "allow_cpu")}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
