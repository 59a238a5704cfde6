"""Banded sliding-window attention (model/attention.py `banded_attention`): each block of queries
scored against only the keys its window reaches. Held to a float64 NumPy attention written here
and to the explicit-mask reference (`masked_attention`), outputs and gradients, with grouped-query
heads, packed documents, and a context-parallel rank's received keys (a halo shorter than the
window, keys before the sequence's start)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megascale_jax.model import attention
from megascale_jax.model.documents import same_document


def inputs(seed, n, halo=0, heads=4, kv_heads=2, head_dim=8, batch=2):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, n, heads, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, halo + n, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, halo + n, kv_heads, head_dim), jnp.float32)
    return q, k, v


def numpy_attention(q, k, v, window, first=0, halo=0, ids=None, key_ids=None):
    """float64, one query at a time: softmax over the keys at positions p - window < key <= p,
    key >= 0, of its own document."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, n, heads, head_dim = q.shape
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for i in range(n):
            p = first + i
            seen = [j for j in range(k.shape[1]) if 0 <= first - halo + j <= p and p - (first - halo + j) < window
                    and (ids is None or key_ids[b, j] == ids[b, i])]
            for h in range(heads):
                s = k[b, seen, h // group] @ q[b, i, h] / np.sqrt(head_dim)
                e = np.exp(s - s.max())
                out[b, i, h] = (e / e.sum()) @ v[b, seen, h // group]
    return out


def test_blocks_equal_float64_numpy_with_documents_and_grouped_heads():
    q, k, v = inputs(0, 32)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 3, (2, 32)).cumsum(axis=1) // 7)  # runs of documents
    got = attention.banded_attention(q, k, v, window=8, block=8, ids=ids, key_ids=ids)
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, k, v, 8, ids=np.asarray(ids), key_ids=np.asarray(ids)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("first, halo, window, block", [(0, 0, 8, 8), (40, 5, 8, 16), (0, 7, 8, 8), (24, 3, 4, 8)],
                         ids=["no halo", "halo shorter than the window", "rank 0's zeros", "window below the block"])
def test_outputs_and_gradients_equal_the_explicit_mask(first, halo, window, block):
    """The context-parallel rank's view: queries at first.., keys from first - halo; the reference
    masks the same keys explicitly (window, causal, before the sequence's start)."""
    n = 32
    q, k, v = inputs(1, n, halo)
    mask = (attention.window_mask(first + jnp.arange(n), first - halo + jnp.arange(halo + n), window)
            & (first - halo + jnp.arange(halo + n) >= 0)[None, :])
    cotangent = jax.random.normal(jax.random.key(2), q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent)

    banded = jax.jit(lambda q, k, v: attention.banded_attention(q, k, v, window, block, first=first, halo=halo))
    explicit = jax.jit(lambda q, k, v: attention.masked_attention(q, k, v, mask))
    np.testing.assert_allclose(np.asarray(banded(q, k, v)), np.asarray(explicit(q, k, v)), rtol=1e-5, atol=1e-6)
    grads = [jax.jit(jax.grad(loss(fn), (0, 1, 2)))(q, k, v) for fn in (banded, explicit)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_xla_path_bands_long_sequences_only():
    assert attention.band_block(2048, 512) == 512  # gpt_1b: 1,023 keys a query, not 2,048
    assert attention.band_block(1000, 100) == 100  # the smallest divisor at least w - 1
    assert attention.band_block(128, 32) is None  # fewer than 4 blocks of 64: the explicit mask
    assert attention.band_block(4096, None) is None  # full attention
    q, k, v = inputs(3, 512, heads=2, kv_heads=1)
    ids = jnp.repeat(jnp.arange(4), 128)[None].repeat(2, axis=0)
    got = jax.jit(lambda q, k, v: attention.attend(q, k, v, window=16, implementation="xla", documents=ids))(q, k, v)
    want = jax.jit(lambda q, k, v: attention.masked_attention(
        q, k, v, attention.sliding_window_mask(512, 16) & same_document(ids)))(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_a_block_the_window_does_not_fit_is_refused():
    q, k, v = inputs(4, 32)
    with pytest.raises(ValueError, match="block >= window - 1"):
        attention.banded_attention(q, k, v, window=16, block=8)
