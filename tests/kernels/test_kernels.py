"""Pallas kernels against their pure-jnp references, in interpret mode on the CPU.

Every case draws fresh random inputs and a random cotangent and checks the forward output and
all input gradients. Tolerances (max abs error, scaled by max(1, max |reference|)):
  float32: 5e-6 — both sides accumulate in float32; only the summation order differs.
  bfloat16: 2e-2 — the kernel rounds probabilities and outputs to bf16 (eps 7.8e-3), the
            reference (same bf16 inputs) keeps float32 until its final cast.
Interpret-mode kernels are slow to compile, so each case is jitted once at XLA -O0, shapes stay
small (seq 40-96, head dim 16-64, blocks 8-32) and seq is mostly not a multiple of the block.
"""

import importlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from megascale_jax.model import documents
from megascale_jax.model.attention import attend, masked_attention

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
TOL = {jnp.float32: 5e-6, jnp.bfloat16: 2e-2}
_seed = itertools.count(1)


def _random(*shapes, dtype=jnp.float32):
    """Fresh standard-normal arrays (numpy RNG: no per-shape XLA compile)."""
    rng = np.random.default_rng(next(_seed))
    return [jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype) for shape in shapes]


def _run(fn, *args):
    """fn(*args) compiled once at XLA -O0: interpret-mode kernels compile slowly, run fast."""
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def _value_and_vjp(fn, args, cotangent):
    """(fn(*args), vjp of `cotangent`)."""
    def both(args, cotangent):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(cotangent)
    return _run(both, args, cotangent)


def _assert_close(actual, expected, dtype, tol=None):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert a.shape == e.shape and a.dtype == e.dtype
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        assert np.all(np.isfinite(a))
        err, scale = np.abs(a - e).max(), max(1.0, np.abs(e).max())
        assert err <= (tol or TOL[dtype]) * scale, f"max abs error {err:.3g} (reference scale {scale:.3g})"


# ---------------------------------------------------------------------------------------------
# Flash attention
# ---------------------------------------------------------------------------------------------

# (seq, heads, kv_heads, head_dim, window, block_q, block_k, dtype)
ATTENTION_CASES = [
    (40, 4, 4, 16, None, 16, 16, jnp.float32),  # full causal, seq not a block multiple
    (40, 4, 2, 16, 1, 16, 16, jnp.float32),  # window 1: only the diagonal
    (48, 4, 1, 16, 5, 16, 16, jnp.float32),  # window < block, GQA 4
    (64, 4, 2, 16, 20, 16, 8, jnp.float32),  # window spans blocks, block_q != block_k
    (40, 2, 2, 16, 100, 16, 16, jnp.float32),  # window >= seq == causal
    (72, 2, 1, 16, 16, 8, 32, jnp.float32),  # padding to lcm leaves whole query blocks empty
    (33, 2, 1, 64, 12, 16, 16, jnp.float32),  # head dim 64
    (56, 4, 2, 32, 24, 16, 16, jnp.bfloat16),
    (96, 4, 1, 32, None, 32, 16, jnp.bfloat16),
]


@pytest.mark.slow
@pytest.mark.parametrize("seq,heads,kv_heads,head_dim,window,block_q,block_k,dtype", ATTENTION_CASES)
def test_flash_attention_matches_reference(seq, heads, kv_heads, head_dim, window, block_q, block_k, dtype):
    batch = 2
    q, k, v, do = _random((batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim),
                          (batch, seq, kv_heads, head_dim), (batch, seq, heads, head_dim), dtype=dtype)
    kernel = lambda q, k, v: pk.flash_attention(q, k, v, window=window, block_q=block_q, block_k=block_k)  # noqa: E731
    # The bf16 reference runs in float32 on the same (bf16-valued) inputs.
    reference = lambda q, k, v: pk.attention_reference(  # noqa: E731
        *(x.astype(jnp.float32) for x in (q, k, v)), window=window).astype(dtype)
    _assert_close(_value_and_vjp(kernel, (q, k, v), do), _value_and_vjp(reference, (q, k, v), do), dtype)


def test_attend_pallas_matches_xla_and_default_blocks():
    # Independent reference: the model's own XLA attention; default (clamped) block sizes.
    q, k, v = _random((1, 45, 4, 16), (1, 45, 2, 16), (1, 45, 2, 16))
    for window in (None, 7):
        pallas = _run(lambda q, k, v: attend(q, k, v, window=window, implementation="pallas"), q, k, v)
        _assert_close(pallas, attend(q, k, v, window=window, implementation="xla"), jnp.float32)


def _document_ids(batch, seq):
    """Segment ids of packed documents: `documents.layout` of random tokens, a quarter of them an
    end-of-document token (documents of one token, a row starting with an end among them)."""
    tokens = np.random.default_rng(next(_seed)).integers(0, 8, (batch, seq))
    tokens[-1, 0] = 0
    return documents.layout(jnp.asarray(tokens), 0).ids


def _each_document_alone(window, ids):
    """Attention of every document run alone through `attention_reference` (no segment ids: its
    own short sequence), the outputs put back in place; `ids` concrete, so the cuts are static."""
    ids = np.asarray(ids)

    def attention(q, k, v):
        rows = []
        for b, row in enumerate(ids):
            cuts = [0, *np.flatnonzero(np.diff(row)) + 1, len(row)]
            rows.append(jnp.concatenate([pk.attention_reference(q[b:b + 1, i:j], k[b:b + 1, i:j], v[b:b + 1, i:j],
                                                                window=window)[0] for i, j in zip(cuts, cuts[1:])]))
        return jnp.stack(rows)
    return attention


# (seq, heads, kv_heads, head_dim, window, block_q, block_k, dtype) as ATTENTION_CASES
DOCUMENT_CASES = [
    (40, 4, 2, 16, None, 16, 16, jnp.float32),  # full causal, seq not a block multiple
    (64, 4, 1, 16, 20, 16, 8, jnp.float32),  # window across blocks, GQA 4, block_q != block_k
    (48, 2, 2, 16, 5, 8, 16, jnp.float32),  # window < block
    (56, 4, 2, 32, 24, 16, 16, jnp.bfloat16),
]


@pytest.mark.slow
@pytest.mark.parametrize("seq,heads,kv_heads,head_dim,window,block_q,block_k,dtype", DOCUMENT_CASES)
def test_flash_attention_keeps_documents_apart(seq, heads, kv_heads, head_dim, window, block_q, block_k, dtype):
    """segment_ids: forward and every gradient equal each document run alone (`_each_document_alone`)
    and the model's XLA attention with the same documents, to rel 1e-6 in float32."""
    batch = 2
    q, k, v, do = _random((batch, seq, heads, head_dim), (batch, seq, kv_heads, head_dim),
                          (batch, seq, kv_heads, head_dim), (batch, seq, heads, head_dim), dtype=dtype)
    ids = _document_ids(batch, seq)
    assert (np.asarray(ids).max(axis=1) >= 2).all()  # three documents a row or more
    kernel = lambda q, k, v: pk.flash_attention(q, k, v, window=window, segment_ids=ids, block_q=block_q,  # noqa: E731
                                                block_k=block_k)
    got = _value_and_vjp(kernel, (q, k, v), do)
    f32 = lambda fn: lambda *a: fn(*(x.astype(jnp.float32) for x in a)).astype(dtype)  # noqa: E731
    alone = _value_and_vjp(f32(_each_document_alone(window, ids)), (q, k, v), do)
    xla = _value_and_vjp(f32(lambda q, k, v: attend(q, k, v, window=window, implementation="xla", documents=ids)),
                         (q, k, v), do)
    tol = 1e-6 if dtype == jnp.float32 else TOL[dtype]
    _assert_close(got, alone, dtype, tol)
    _assert_close(got, xla, dtype, tol)
    # the control: without segment ids the kernel attends across documents
    crossing = _run(lambda q, k, v: pk.flash_attention(q, k, v, window=window, block_q=block_q, block_k=block_k),
                    q, k, v)
    assert np.abs(np.asarray(crossing, np.float32) - np.asarray(got[0], np.float32)).max() > 0.1


# (kv_len, queries, q_offset, window, heads, kv_heads, block_q, block_k, documents, traced offset)
OFFSET_CASES = [
    (48, 16, 32, None, 4, 2, 16, 16, False, True),  # the last of three slices under full attention
    (48, 16, 16, None, 2, 2, 8, 16, True, True),  # a middle slice, packed documents
    (40, 24, 11, 9, 4, 1, 16, 8, False, True),  # a window, an offset not a block multiple, GQA 4
    (40, 16, 24, 7, 2, 2, 16, 16, True, False),  # a window's halo in front of the queries, documents
]


@pytest.mark.parametrize("kv_len,n,offset,window,heads,kv_heads,block_q,block_k,docs,traced", OFFSET_CASES)
def test_flash_attention_on_a_run_of_the_keys_positions_matches_xla(kv_len, n, offset, window, heads, kv_heads,
                                                                     block_q, block_k, docs, traced):
    """Queries at key positions q_offset .. q_offset + n - 1 (a context-parallel rank's slice
    against the keys it holds): the output and every gradient equal XLA's masked attention over
    the same positions, the offset a Python int or an int32 traced at run time."""
    batch, d = 2, 16
    q, k, v, do = _random((batch, n, heads, d), (batch, kv_len, kv_heads, d), (batch, kv_len, kv_heads, d),
                          (batch, n, heads, d))
    ids = jnp.asarray(np.sort(np.random.default_rng(kv_len + n).integers(0, 3, (batch, kv_len)), axis=1), jnp.int32)
    q_ids, k_ids = (ids[:, offset:offset + n], ids) if docs else (None, None)
    positions, keys = offset + np.arange(n), np.arange(kv_len)
    mask = (keys[None, :] <= positions[:, None]) & ((positions[:, None] - keys[None, :] < window) if window else True)
    mask = jnp.asarray(mask)
    if docs:
        mask = mask[None] & (q_ids[:, :, None] == k_ids[:, None, :])

    def kernel(q, k, v, off):
        return pk.flash_attention(q, k, v, window=window, q_offset=off if traced else offset, segment_ids=q_ids,
                                  kv_segment_ids=k_ids, block_q=block_q, block_k=block_k)

    got = _value_and_vjp(kernel, (q, k, v, jnp.int32(offset)), do)
    want = _value_and_vjp(lambda q, k, v, off: masked_attention(q, k, v, mask), (q, k, v, jnp.int32(offset)), do)
    _assert_close(got[0], want[0], jnp.float32)
    _assert_close(got[1][:3], want[1][:3], jnp.float32)


def test_flash_attention_rejects_bad_shapes():
    q, k = _random((1, 8, 3, 16), (1, 8, 2, 16))
    with pytest.raises(ValueError, match="kv_heads dividing heads"):
        pk.flash_attention(q, k, k)
    with pytest.raises(ValueError, match="window=0"):
        pk.flash_attention(q, q, q, window=0)
    with pytest.raises(ValueError, match="segment_ids"):
        pk.flash_attention(q, q, q, segment_ids=jnp.zeros((1, 7), jnp.int32))


# ---------------------------------------------------------------------------------------------
# Block skipping: the kernels' loop bounds, checked against the dense mask
# ---------------------------------------------------------------------------------------------

def _needed_pairs(seq, window, block_q, block_k, q_offset=0, kv_len=None):
    """(q block, kv block) pairs holding at least one visible (query, key) entry, from the mask;
    query row i at key position q_offset + i."""
    i, j = q_offset + np.arange(seq)[:, None], np.arange(kv_len or seq)[None, :]
    visible = (j <= i) & ((i - j < window) if window is not None else True)
    rows, cols = np.nonzero(visible)
    return set(zip((rows // block_q).tolist(), (cols // block_k).tolist()))


def _visited_pairs(range_fn, n_blocks, transpose, **kw):
    lo, hi = (np.asarray(a) for a in range_fn(jnp.arange(n_blocks), **kw))
    pairs = {(b, o) for b in range(n_blocks) for o in range(lo[b], hi[b] + 1)}
    return {(o, b) for b, o in pairs} if transpose else pairs


@pytest.mark.parametrize("seq,window,block_q,block_k", [
    (40, None, 16, 16), (40, 1, 16, 16), (48, 5, 16, 16), (64, 20, 16, 8), (40, 100, 16, 16),
    (72, 16, 8, 32), (200, 33, 32, 16), (129, 64, 64, 64), (100, 7, 32, 8)])
def test_block_ranges_are_exactly_the_blocks_the_window_touches(seq, window, block_q, block_k):
    # Forward/dq bounds (kv_block_range) and dk/dv bounds (q_block_range) must both equal the set
    # of blocks with a visible entry: never fewer (wrong result), never more (wasted work).
    padded = -(-seq // np.lcm(block_q, block_k)) * np.lcm(block_q, block_k)
    kw = dict(seq_len=seq, window=window, block_q=block_q, block_k=block_k)
    needed = _needed_pairs(seq, window, block_q, block_k)
    assert _visited_pairs(pk.kv_block_range, padded // block_q, False, **kw) == needed
    assert _visited_pairs(pk.q_block_range, padded // block_k, True, **kw) == needed
    assert pk.visited_kv_blocks(seq, window, block_q, block_k) == len(needed)


@pytest.mark.parametrize("seq,kv_len,q_offset,window,block_q,block_k", [
    (16, 48, 32, None, 16, 16), (16, 48, 16, None, 8, 16), (24, 40, 11, 9, 16, 8), (16, 40, 24, 7, 16, 16),
    (64, 256, 192, None, 32, 16), (64, 256, 100, 40, 16, 32), (40, 200, 37, 100, 8, 8)])
def test_block_ranges_with_an_offset_are_exactly_the_blocks_the_queries_reach(seq, kv_len, q_offset, window,
                                                                             block_q, block_k):
    """Queries at key positions q_offset + i (a cp rank's slice against the keys it holds): the
    forward's and the dk/dv kernel's bounds are the blocks with a visible entry, and the unmasked
    spans exactly the visited blocks the mask does not cut."""
    lcm = np.lcm(block_q, block_k)
    q_blocks, kv_blocks = -(-seq // lcm) * lcm // block_q, -(-kv_len // lcm) * lcm // block_k
    kw = dict(seq_len=seq, window=window, block_q=block_q, block_k=block_k, q_offset=q_offset)
    needed = _needed_pairs(seq, window, block_q, block_k, q_offset, kv_len)
    assert _visited_pairs(pk.kv_block_range, q_blocks, False, **kw) == needed
    assert _visited_pairs(pk.q_block_range, kv_blocks, True, **kw) == needed
    i = q_offset + np.arange(q_blocks * block_q)[:, None]
    j = np.arange(kv_blocks * block_k)[None, :]
    visible = (j <= i) & ((i - j < window) if window is not None else True)
    tiles = visible.reshape(q_blocks, block_q, kv_blocks, block_k)
    whole = {(a, b) for a, b in zip(*np.nonzero(tiles.all(axis=(1, 3))))}
    full_kw = dict(window=window, block_q=block_q, block_k=block_k, q_offset=q_offset)
    for range_fn, full_fn, n_blocks, transpose in ((pk.kv_block_range, pk.full_kv_block_range, q_blocks, False),
                                                   (pk.q_block_range, pk.full_q_block_range, kv_blocks, True)):
        lo, hi = range_fn(jnp.arange(n_blocks), **kw)
        a, b = (np.asarray(x) for x in pk.unmasked_span(lo, hi, *full_fn(jnp.arange(n_blocks), **full_kw)))
        unmasked = {(n, o) for n in range(n_blocks) for o in range(a[n], b[n])}
        unmasked = {(o, n) for n, o in unmasked} if transpose else unmasked
        assert unmasked == whole & needed, (range_fn.__name__, sorted(unmasked ^ (whole & needed))[:5])


@pytest.mark.parametrize("seq,window,block_q,block_k", [
    (40, None, 16, 16), (40, 1, 16, 16), (48, 5, 16, 16), (64, 20, 16, 8), (40, 100, 16, 16),
    (72, 16, 8, 32), (200, 33, 32, 16), (129, 64, 64, 64), (100, 7, 32, 8), (256, 96, 16, 32)])
def test_unmasked_blocks_are_exactly_the_visited_blocks_the_mask_would_not_change(seq, window, block_q, block_k):
    """The kernels skip the mask on the (query block, KV block) pairs every one of whose entries
    is visible (over the padded blocks' whole rows and columns), from either side's bounds; the
    masked rest of each visited range is what the dense mask cuts."""
    padded = -(-seq // np.lcm(block_q, block_k)) * np.lcm(block_q, block_k)
    i, j = np.arange(padded)[:, None], np.arange(padded)[None, :]
    visible = (j <= i) & ((i - j < window) if window is not None else True)
    tiles = visible.reshape(padded // block_q, block_q, padded // block_k, block_k)
    whole = {(a, b) for a, b in zip(*np.nonzero(tiles.all(axis=(1, 3))))}
    kw = dict(seq_len=seq, window=window, block_q=block_q, block_k=block_k)
    needed = _needed_pairs(seq, window, block_q, block_k)
    for range_fn, full_fn, n_blocks, transpose in ((pk.kv_block_range, pk.full_kv_block_range, padded // block_q, False),
                                                   (pk.q_block_range, pk.full_q_block_range, padded // block_k, True)):
        lo, hi = (np.asarray(x) for x in range_fn(jnp.arange(n_blocks), **kw))
        full = full_fn(jnp.arange(n_blocks), window=window, block_q=block_q, block_k=block_k)
        a, b = (np.asarray(x) for x in pk.unmasked_span(jnp.asarray(lo), jnp.asarray(hi), *full))
        unmasked = {(n, o) for n in range(n_blocks) for o in range(a[n], b[n])}
        unmasked = {(o, n) for n, o in unmasked} if transpose else unmasked
        assert unmasked == whole & needed, (range_fn.__name__, sorted(unmasked ^ (whole & needed))[:5])


def test_a_long_window_runs_mostly_unmasked():
    """At seq 32,768 and window 4,096 with the GPU's default (128, 64) tiles, 94% of the visited
    (query block, KV block) pairs skip the mask: only the band's two edges build it."""
    seq, window, bq, bk = 32768, 4096, 128, 64
    kw = dict(window=window, block_q=bq, block_k=bk)
    lo, hi = pk.kv_block_range(jnp.arange(seq // bq), seq_len=seq, **kw)
    a, b = pk.unmasked_span(lo, hi, *pk.full_kv_block_range(jnp.arange(seq // bq), **kw))
    unmasked, visited = int((b - a).sum()), int((hi - lo + 1).sum())
    assert visited == pk.visited_kv_blocks(seq, window, bq, bk) and unmasked > 0.93 * visited


def test_visited_blocks_grow_as_seq_times_window():
    block, window = 64, 512
    for seq in (4096, 16384, 65536):
        visited = pk.visited_kv_blocks(seq, window, block, block)
        q_blocks = seq // block
        assert visited <= q_blocks * (window // block + 1)  # O(s·w / block²)
        assert visited < pk.visited_kv_blocks(seq, None, block, block) / (seq // window / 4)
    # Doubling seq at fixed window doubles the work (up to the first window's ramp).
    ratio = pk.visited_kv_blocks(65536, window, block, block) / pk.visited_kv_blocks(32768, window, block, block)
    assert 1.99 < ratio < 2.01
    assert pk.visited_kv_blocks(4096, None, block, block) == 64 * 65 // 2  # causal: O(s² / block²)


# ---------------------------------------------------------------------------------------------
# LayerNorm (+ residual) and bias + GeLU
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_norm_matches_reference(residual, dtype):
    shape = (3, 20, 48)  # 60 rows: not a multiple of block_rows=16
    x, r, dy, dh = _random(shape, shape, shape, shape, dtype=dtype)
    scale, bias = (1 + a for a in _random((48,), (48,)))  # float32 parameters, as in the model
    if residual:
        args, cot = (x, r, scale, bias), (dy, dh)
        kernel = lambda x, r, s, b: pk.layer_norm_residual(x, r, s, b, eps=1e-5, block_rows=16)  # noqa: E731
        reference = lambda x, r, s, b: pk.layer_norm_residual_reference(x, r, s, b, eps=1e-5)  # noqa: E731
    else:
        args, cot = (x, scale, bias), dy
        kernel = lambda x, s, b: pk.layer_norm(x, s, b, eps=1e-5, block_rows=16)  # noqa: E731
        reference = lambda x, s, b: pk.layer_norm_reference(x, s, b, eps=1e-5)  # noqa: E731
    _assert_close(_value_and_vjp(kernel, args, cot), _value_and_vjp(reference, args, cot), dtype)


@pytest.mark.parametrize("approximate", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bias_gelu_matches_reference(approximate, dtype):
    x, dy = _random((3, 10, 40), (3, 10, 40), dtype=dtype)  # 30 x 40: both axes padded
    (bias,) = _random((40,))
    kernel = lambda x, b: pk.bias_gelu(x, b, approximate=approximate, block_rows=16, block_cols=16)  # noqa: E731
    reference = lambda x, b: pk.bias_gelu_reference(x, b, approximate=approximate)  # noqa: E731
    _assert_close(_value_and_vjp(kernel, (x, bias), dy), _value_and_vjp(reference, (x, bias), dy), dtype)


# ---------------------------------------------------------------------------------------------
# Optional extra: jax-triton
# ---------------------------------------------------------------------------------------------

def test_triton_module_imports_without_triton():
    module = importlib.import_module("pallas_kernels.triton_attention")
    if module.available():
        pytest.skip("jax-triton is installed; the GPU suite covers it")
    q = _random((1, 16, 2, 16))[0]
    with pytest.raises(ImportError, match="jax-triton"):
        module.triton_flash_attention(q, q, q, window=4)
