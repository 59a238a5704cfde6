"""Megatron tensor parallelism with explicit collectives, sequence parallelism and collective matmul.

`column_matmul(x, weights)` multiplies one input by several column-parallel weights (each's output
features split over tp) and `row_matmul(inputs, weights)` sums several row-parallel products
(each's input features split over tp). Both run in a `jax.shard_map` that is manual over `tp`, on
each device's local shards, so several weights share **one** collective: the parallel block feeds
q, k, v and the MLP's first matmul from one LN(x) behind one all-gather, and leaves attention and
MLP through one reduce-scatter — two TP collectives per layer where the serial block needs four.

Collectives per `parallel.sequence_parallel` / `parallel.tp_overlap`:

                 column input (fwd / bwd)              row output (fwd / bwd)
  no SP, none    identity / all-reduce                 all-reduce / identity
  SP, none       all-gather(seq) / reduce-scatter      reduce-scatter(seq) / all-gather
  SP, collective_matmul:  the all-gather is fused with the matmul as tp steps of "multiply the
                 chunk we hold, pass it on" (`ppermute`), and the reduce-scatter as tp steps of
                 "add our partial product for a chunk to the accumulator passing by". Each
                 device's chunk is cut into `parallel.tp_chunks` pieces that travel
                 independently — more, smaller transfers give XLA more matmul to hide each one
                 behind — and with `parallel.tp_bidirectional` alternate pieces go opposite ways
                 round the ring, using both directions of every link.
                 Autodiff of those loops is again a loop of matmuls and `ppermute`s (the
                 transpose of a permute is the reverse permute), so the backward pass is
                 overlapped the same way and contains no all-gather or reduce-scatter.

With tp = 1 or outside a mesh everything reduces to local matmuls; `tp_overlap=xla` leaves the
einsums to GSPMD (one collective per weight) with XLA's windowed-einsum flags on GPU.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from megascale_jax.config import ParallelConfig
from megascale_jax.model.fp8 import fp8_matmul

AXIS = "tp"


def _tp_size() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or AXIS not in mesh.axis_names else mesh.shape[AXIS]


# ----------------------------------------------------------------------------- collectives
# shard_map runs with `check_vma=True`: JAX then knows which values are replicated over tp and
# gives Megatron's f/g pair itself — a replicated input feeding a sharded matmul gets an
# all-reduce in the backward, and a `psum`'s cotangent is passed through unchanged.


def gather_seq(x):
    """All-gather the sequence (axis 1); autodiff turns it into a reduce-scatter."""
    return jax.lax.all_gather(x, AXIS, axis=1, tiled=True)


def scatter_seq(x):
    """Reduce-scatter over the sequence (axis 1); autodiff turns it into an all-gather."""
    return jax.lax.psum_scatter(x, AXIS, scatter_dimension=1, tiled=True)


# ----------------------------------------------------------------------------- collective matmul


def _ring(x, shift: int, tp: int):
    return jax.lax.ppermute(x, AXIS, [(i, (i + shift) % tp) for i in range(tp)])


def _pieces(chunk: int, pieces: int, bidirectional: bool) -> list[tuple[int, int, int]]:
    """(offset, size, direction) of the pieces one device's chunk of `chunk` tokens is cut into;
    with `bidirectional` alternate pieces go opposite ways round the ring."""
    size = chunk // pieces
    return [(j * size, size, -1 if bidirectional and j % 2 else 1) for j in range(pieces)]


def all_gather_matmul(x, w, tp: int, pieces: int, bidirectional: bool):
    """gather_seq(x) @ w with the gather split into tp ring steps overlapping the matmuls.

    x: (b, s/tp, d) this device's sequence chunk; w: (d, n) local columns -> (b, s, n)."""
    me = jax.lax.axis_index(AXIS)
    chunk = x.shape[1]
    out = jnp.zeros((x.shape[0], chunk * tp, w.shape[1]), jnp.result_type(x, w))
    layout = _pieces(chunk, pieces, bidirectional)
    held = [x[:, offset:offset + size] for offset, size, _ in layout]
    for step in range(tp):
        for i, (offset, _, sign) in enumerate(layout):
            source = (me + sign * step) % tp  # whose chunk this piece belongs to at this step
            out = jax.lax.dynamic_update_slice_in_dim(out, held[i] @ w, source * chunk + offset, axis=1)
            if step < tp - 1:  # receive from `me + sign`, i.e. everyone sends to `me - sign`
                held[i] = _ring(held[i], -sign, tp)
    return out


def matmul_reduce_scatter(h, w, tp: int, pieces: int, bidirectional: bool):
    """scatter_seq(h @ w) with the reduce-scatter split into tp ring steps overlapping the matmuls.

    h: (b, s, n) local features; w: (n, d) local rows -> (b, s/tp, d) this device's chunk, summed."""
    me = jax.lax.axis_index(AXIS)
    chunk = h.shape[1] // tp
    results = []
    for offset, size, sign in _pieces(chunk, pieces, bidirectional):
        acc = None
        for step in range(tp):
            # The accumulator for chunk c starts at c + sign, moves by `sign` and ends at c.
            target = (me - sign * (1 + step)) % tp
            part = jax.lax.dynamic_slice_in_dim(h, target * chunk + offset, size, axis=1) @ w
            acc = part if acc is None else acc + part
            if step < tp - 1:
                acc = _ring(acc, sign, tp)
        results.append(acc)
    return results[0] if len(results) == 1 else jnp.concatenate(results, axis=1)


# ----------------------------------------------------------------------------- the two layers


# XLA's own overlap for `parallel.tp_overlap=xla` (GPU only; an unknown flag aborts the process).
XLA_OVERLAP_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",
                     "--xla_gpu_threshold_for_windowed_einsum_mib=0",
                     "--xla_gpu_multi_streamed_windowed_einsum=true")


def _split(y, widths):
    return jnp.split(y, list(itertools.accumulate(widths))[:-1], axis=-1)


def _matmul(x, w, fp8: bool):
    """x @ w in x's dtype, or as an FP8 GEMM (`model.fp8`, model/fp8.py). Inside the shard_maps
    below: the FP8 GEMM's hand-written backward gives x a gradient that varies over tp, so x,
    replicated over tp, enters as varying (its transpose then sums that gradient over tp, as
    autodiff of the plain product does by itself)."""
    if not fp8:
        return x @ w.astype(x.dtype)
    if AXIS not in jax.typeof(x).manual_axis_type.varying:
        x = jax.lax.pcast(x, AXIS, to="varying")
    return fp8_matmul(x, w)


def column_matmul(x, weights, parallel: ParallelConfig, fp8: bool = False):
    """[x @ w for w in weights], x: (b, s, d), each w: (d, n_i) with n_i split over tp; `fp8`: each
    an FP8 GEMM (not with the collective matmul, which config validation refuses).

    Returns (b, s, n_i) arrays, features split over tp; the sequence is whole. A weight replicated
    over tp (k and v with fewer kv heads than tp ranks, see `sharding.rules_for`) enters sliced to
    this device's columns, so every n_i divides by tp (config validation checks kv_heads·head_dim)."""
    tp = _tp_size()
    if fp8 and tp == 1:
        # one FP8 GEMM over the weights side by side, one scale for all: XLA merges dots that share
        # their input, and a merged product of separately scaled weights is no FP8 pattern (it stays
        # bf16). Only at tp = 1: under GSPMD, concatenating column-split weights would move them.
        return _split(fp8_matmul(x, jnp.concatenate(weights, axis=1)), [w.shape[1] for w in weights])
    if tp == 1 or parallel.tp_overlap == "xla":  # local, or GSPMD's collectives for XLA to overlap
        return [fp8_matmul(x, w) if fp8 else x @ w.astype(x.dtype) for w in weights]
    sp, overlap = parallel.sequence_parallel, parallel.tp_overlap == "collective_matmul"

    def local(x, *ws):
        w = jnp.concatenate([w if fp8 else w.astype(x.dtype) for w in ws], axis=1)  # one matmul, one collective
        if sp and overlap:
            y = all_gather_matmul(x, w, tp, parallel.tp_chunks, parallel.tp_bidirectional)
        else:
            y = _matmul(gather_seq(x) if sp else x, w, fp8)
        return tuple(_split(y, [w.shape[1] for w in ws]))

    in_x = P(None, AXIS, None) if sp else P()
    run = jax.shard_map(local, in_specs=(in_x, *[P(None, AXIS)] * len(weights)),
                        out_specs=tuple(P(None, None, AXIS) for _ in weights), axis_names={AXIS}, check_vma=True)
    return list(run(x, *weights))


def row_matmul(inputs, weights, parallel: ParallelConfig, fp8: bool = False):
    """sum(h @ w for h, w in zip(inputs, weights)), each h: (b, s, n_i) with n_i split over tp;
    `fp8`: each an FP8 GEMM.

    Returns (b, s, d): sequence split over tp with sequence parallelism, else replicated."""
    tp = _tp_size()
    if fp8 and tp == 1:  # one FP8 GEMM (as in column_matmul)
        return fp8_matmul(jnp.concatenate(inputs, axis=-1), jnp.concatenate(weights, axis=0))
    if tp == 1 or parallel.tp_overlap == "xla":
        return sum(fp8_matmul(h, w) if fp8 else h @ w.astype(h.dtype) for h, w in zip(inputs, weights))
    sp, overlap = parallel.sequence_parallel, parallel.tp_overlap == "collective_matmul"

    def local(*args):
        hs, ws = args[: len(inputs)], args[len(inputs):]
        h = jnp.concatenate(hs, axis=-1)
        w = jnp.concatenate([w if fp8 else w.astype(h.dtype) for w in ws], axis=0)
        if sp and overlap:
            return matmul_reduce_scatter(h, w, tp, parallel.tp_chunks, parallel.tp_bidirectional)
        y = _matmul(h, w, fp8)
        return scatter_seq(y) if sp else jax.lax.psum(y, AXIS)

    out = P(None, AXIS, None) if sp else P()
    run = jax.shard_map(local, in_specs=(*[P(None, None, AXIS)] * len(inputs), *[P(AXIS, None)] * len(weights)),
                        out_specs=out, axis_names={AXIS}, check_vma=True)
    return run(*inputs, *weights)


# ----------------------------------------------------------------------------- the vocabulary edges


def vocab_edges_manual(parallel: ParallelConfig) -> bool:
    """Whether the embedding lookup and the LM head run as Megatron's vocab-parallel edges
    (`embed_lookup`, `vocab_logits`): with sequence parallelism on tp > 1, unless XLA is left the
    einsums (`tp_overlap=xla`)."""
    return parallel.sequence_parallel and parallel.tp_overlap != "xla" and _tp_size() > 1


def embed_lookup(table, tokens, dtype):
    """tokens (b, s) in a vocabulary-split table (V, d) -> (b, s, d) in `dtype`, the sequence
    split over tp. Each rank looks up the tokens of its slice of the vocabulary (zeros for the
    others) and the partial sums leave through one reduce-scatter over the sequence — an
    all-gather in the backward, whose result each rank adds into its own rows. Left to GSPMD, the
    lookup all-gathered the whole table and all-reduced its gradient (the table's bytes, not the
    activation's: 1.04-1.06x the ideal tp bytes of the bench's SP layouts, far more at scale)."""
    def local(table, tokens):
        rows = table.shape[0]
        index = tokens - jax.lax.axis_index(AXIS) * rows
        mine = (index >= 0) & (index < rows)
        x = jnp.take(table, jnp.where(mine, index, 0), axis=0).astype(dtype)
        return scatter_seq(jnp.where(mine[..., None], x, 0))

    return jax.shard_map(local, in_specs=(P(AXIS, None), P()), out_specs=P(None, AXIS, None),
                         axis_names={AXIS}, check_vma=False)(table, tokens)


def vocab_logits(x, head):
    """x (b, s, d), the sequence split over tp, times a vocabulary-split head (d, V) -> float32
    logits (b, s, V), the vocabulary split over tp: the sequence all-gathered in the forward and
    the input's gradient reduce-scattered in the backward — where GSPMD all-reduced it whole."""
    def local(x, head):
        return jnp.einsum("bsd,dv->bsv", gather_seq(x), head.astype(x.dtype), preferred_element_type=jnp.float32)

    return jax.shard_map(local, in_specs=(P(None, AXIS, None), P(None, AXIS)), out_specs=P(None, None, AXIS),
                         axis_names={AXIS}, check_vma=False)(x, head)
