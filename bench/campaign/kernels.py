"""Campaign section a, kernels: attention forward+backward per (seq, window) and contender, the
Pallas kernel's tiles tuned per shape, and the Pallas LayerNorm+residual and bias+GeLU kernels
against XLA. Timing, FLOP count and the fused-kernel cases are bench/kernels/attention.py's.

Contenders: XLA dense causal (once per seq: it ignores the window), XLA masked window, cuDNN
window, Pallas window (every (block_q, block_k) of the shape's grid tried, then on a GPU the
fastest tile at each further Triton pipelining depth of STAGES; the fastest kept, all recorded),
jax-triton's window forward when installed, and tokamax's Mosaic GPU attention when importable.
cuDNN's and the best Pallas tile's forward are also timed alone (`forward_alone`). A contender
that cannot run here is one line ("skipped: needs a GPU"); one that fails is one line of error;
either way the others go on.

Fast but wrong is worthless, and the Pallas kernels have never run on a GPU before this
campaign: up to CHECK_MAX_SEQ (where the float32 reference's scores still fit) every
contender's forward output is compared with `attention_reference` in float32, as `rel_err`.
"""

from __future__ import annotations

import types

from bench.campaign import process
from bench.kernels.attention import attention_flops, attention_impls, bench_fused, median_seconds, time_fwd_bwd

SHAPES = {  # keyed by dry_run
    False: dict(seqs=(2048, 8192, 32768), windows=(512, 1024, 4096), batch=1, heads=16, head_dim=128, iters=20,
                blocks=((64, 64), (64, 128), (128, 64), (128, 128)), fused_tokens=16384, d_model=4096),
    True: dict(seqs=(64,), windows=(16, 32), batch=1, heads=2, head_dim=32, iters=2,
               blocks=((16, 16), (32, 32)), fused_tokens=64, d_model=64),
}
CHECK_MAX_SEQ = 8192
# Triton pipelining depths: the tiles are tried at the first (flash_attention's default, the only
# one the H200 ran on 2026-11-23, where the kernel fell to half of cuDNN's speed at long windows),
# the fastest tile at the others on a GPU (3-4 is Hopper's usual range).
STAGES = (2, 3, 4)


def tokamax_attention(window: int, on_gpu: bool):
    """tokamax's Mosaic GPU attention (sm90 supports the window), or why it cannot run here."""
    try:
        import tokamax
    except Exception as e:  # noqa: BLE001 — an optional peer that does not import is one line, never a failure
        return f"skipped: tokamax is not importable ({process.one_line(e)}); bench/campaign/gpu_wheels.sh fetches it"
    if not on_gpu:
        return "skipped: needs a GPU"
    return lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(window - 1, 0), implementation="mosaic")


def contenders(window: int, on_gpu: bool) -> dict:
    """name -> attention function, or a one-line reason it cannot run here."""
    impls = attention_impls(window)
    del impls["pallas_window"]  # tuned separately, per block size
    if not on_gpu:
        impls["cudnn_window"] = "skipped: needs a GPU"
    impls.setdefault("triton_window", "skipped: jax-triton is not importable; bench/campaign/gpu_wheels.sh fetches it")
    impls["tokamax_window"] = tokamax_attention(window, on_gpu)
    return impls


def relative_error(fn, qkv, reference) -> float:
    import jax
    import jax.numpy as jnp

    out = jax.jit(fn)(*qkv).astype(jnp.float32)
    return float(jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference))


def timed(row: dict, fn, qkv, shape: dict, reference) -> dict:
    """`row` (its seq and window) plus the median fwd+bwd time, TFLOP/s and, given a reference,
    rel_err; or the one-line error."""
    try:
        seconds = time_fwd_bwd(fn, qkv, shape["iters"])
        work = attention_flops(shape["batch"], shape["heads"], shape["head_dim"], row["seq"], row["window"])
        row.update(ms=seconds * 1e3, tflops=work / seconds / 1e12)
        if reference is not None:
            row["rel_err"] = relative_error(fn, qkv, reference)
    except Exception as e:  # noqa: BLE001 — an implementation that cannot run is a result too
        row["error"] = process.one_line(e)
    return row


def tuned_pallas(seq: int, window: int, qkv, shape, reference, on_gpu: bool = False) -> dict:
    """The Pallas window kernel at every tile size of shape["blocks"], then on a GPU the fastest
    tile at each pipelining depth of STAGES (interpret mode has none): the fastest try's numbers,
    and all tries."""
    from pallas_kernels import flash_attention

    def attempt(blocks, stages):
        fn = lambda q, k, v: flash_attention(q, k, v, window=window, block_q=blocks[0], block_k=blocks[1],
                                             num_stages=stages)
        return timed({"seq": seq, "window": window, "blocks": list(blocks), "stages": stages}, fn, qkv, shape, None)

    tries = [attempt(blocks, STAGES[0]) for blocks in shape["blocks"]]
    row = {"contender": "pallas_window", "seq": seq, "window": window, "tried": tries}
    if not any("ms" in t for t in tries):
        return {**row, "error": tries[0]["error"]}
    tile = min((t for t in tries if "ms" in t), key=lambda t: t["ms"])["blocks"]
    if on_gpu:
        tries += [attempt(tile, stages) for stages in STAGES[1:]]
    best = min((t for t in tries if "ms" in t), key=lambda t: t["ms"])
    fn = lambda q, k, v: flash_attention(q, k, v, window=window, block_q=best["blocks"][0], block_k=best["blocks"][1],
                                         num_stages=best["stages"])
    return {**row, "blocks": best["blocks"], "stages": best["stages"], "ms": best["ms"], "tflops": best["tflops"],
            **forward_alone(fn, qkv, shape),
            **({"rel_err": relative_error(fn, qkv, reference)} if reference is not None else {})}


def forward_alone(fn, qkv, shape: dict) -> dict:
    """The forward's own median ms (the fwd+bwd row's `ms` less it is the backward's), for the
    kernels the ladder chooses between (cuDNN, the best Pallas tile): where the gap to cuDNN is."""
    try:
        return {"forward_ms": median_seconds(fn, qkv, shape["iters"]) * 1e3}
    except Exception as e:  # noqa: BLE001 — the fwd+bwd row still counts
        return {"forward_error": process.one_line(e)}


def show(row: dict) -> None:
    result = f"{row['ms']:>10.3f}{row['tflops']:>9.2f}" if "ms" in row else f"  {row.get('error') or row['skipped']}"
    forward = f"  (forward {row['forward_ms']:.3f})" if "forward_ms" in row else ""
    print(f"{row['seq']:>7}{str(row['window']):>8}  {row['contender']:<18}{result}{forward}", flush=True)


def run(settings: dict) -> dict:
    import jax
    import jax.numpy as jnp

    from pallas_kernels import attention_reference

    shape = SHAPES[settings["dry_run"]]
    on_gpu = settings["device"]["backend"] == "gpu"
    rows = []
    for seq in shape["seqs"]:
        keys = jax.random.split(jax.random.PRNGKey(seq), 3)
        qkv = [jax.random.normal(key, (shape["batch"], seq, shape["heads"], shape["head_dim"]), jnp.bfloat16)
               for key in keys]
        check = seq <= CHECK_MAX_SEQ

        def reference(window):
            return attention_reference(*(x.astype(jnp.float32) for x in qkv), window=window) if check else None

        for window in shape["windows"]:
            ref = reference(window)
            for name, fn in contenders(window, on_gpu).items():
                dense = name == "xla_dense_causal"
                if dense and window != shape["windows"][0]:
                    continue  # independent of the window: measured once per seq
                row = {"contender": name, "seq": seq, "window": None if dense else window}
                if isinstance(fn, str):
                    row["skipped"] = fn
                else:
                    timed(row, fn, qkv, shape, reference(None) if dense else ref)
                    if name == "cudnn_window" and "ms" in row:
                        row.update(forward_alone(fn, qkv, shape))
                rows.append(row)
                show(row)
            rows.append(tuned_pallas(seq, window, qkv, shape, ref, on_gpu))
            show(rows[-1])
    fused = bench_fused(types.SimpleNamespace(fused_tokens=shape["fused_tokens"], d_model=shape["d_model"],
                                              iters=shape["iters"]))
    return {"settings": dict(shape), "attention": rows, "fused": fused}
