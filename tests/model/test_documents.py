"""Packed documents kept apart (`model.document_eos`, megascale_jax/model/documents.py): a packed,
masked step computes exactly what each document computes alone. The reference runs every
document of every packed row through the model unpacked (its own sequence, positions from 0, no
mask beyond the causal one and the window) and sums its next-token losses in float64; the packed
loss times the batch's target count must equal that sum."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megascale_jax.config import ModelConfig, load_config
from megascale_jax.config_checks import ConfigError
from megascale_jax.model import documents
from megascale_jax.model.transformer import Transformer, loss_fn

import packed_documents  # tests/: the packed rows and the documents-alone reference the tests share

EOS = 3
SHAPE = dict(layers=2, d_model=64, heads=4, kv_heads=2, seq_len=32, vocab=97, dtype="float32")


def packed_batch(seed: int, rows: int, seq_len: int) -> np.ndarray:
    return packed_documents.packed_batch(seed, rows, seq_len, EOS, SHAPE["vocab"])


def perturbed_params(model, seed):
    params = model.init(jax.random.key(seed), jnp.zeros((1, model.cfg.seq_len), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, params, is_leaf=lambda x: hasattr(x, "value"))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return treedef.unflatten([x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def test_the_layout_counts_documents_and_positions_from_each_documents_start():
    tokens = jnp.asarray([[5, 9, EOS, 4, EOS, EOS, 7], [EOS, 8, 8, 8, 8, 8, 8]])
    layout = documents.layout(tokens, EOS)
    np.testing.assert_array_equal(layout.ids, [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(layout.positions, [[0, 1, 2, 0, 1, 0, 0], [0, 0, 1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(documents.trained_targets(tokens, EOS), [[1, 1, 0, 1, 0, 0, 1], [0, 1, 1, 1, 1, 1, 1]])


@pytest.mark.slow
@pytest.mark.parametrize("window, block, loss_chunks, attention", [
    (None, "parallel", 1, "xla"), (5, "parallel", 1, "xla"), (5, "serial", 4, "xla"), (5, "parallel", 1, "pallas"),
    (None, "serial", 1, "pallas")], ids=["causal", "window", "serial-sliced-loss", "pallas-window", "pallas-causal"])
def test_a_packed_masked_loss_is_the_documents_own_losses(window, block, loss_chunks, attention):
    """The Pallas kernel (interpret mode) with segment ids too: the reference runs XLA's attention."""
    cfg = ModelConfig(**SHAPE, window=window, block=block, loss_chunks=loss_chunks, document_eos=EOS,
                      attention=attention)
    model = Transformer(cfg)
    params = perturbed_params(model, seed=4)
    batch = packed_batch(seed=9, rows=3, seq_len=cfg.seq_len)
    assert (batch[:, :-1] == EOS).sum() >= 6  # several documents a row, some cut at a row's edge
    packed = float(jax.jit(loss_fn, static_argnums=0)(model, params, jnp.asarray(batch))) * batch.shape[0] * cfg.seq_len
    np.testing.assert_allclose(packed, packed_documents.unpacked_loss_sum(cfg, params, batch), rtol=1e-6)
    plain = Transformer(dataclasses.replace(cfg, document_eos=None, attention="xla"))
    plain = float(jax.jit(loss_fn, static_argnums=0)(plain, params, jnp.asarray(batch)))
    assert abs(plain * batch.shape[0] * cfg.seq_len - packed) > 1e-3 * packed  # the masks change the loss


@pytest.mark.slow
def test_rotary_positions_kept_or_restarted_give_one_loss_inside_documents():
    """model.rope_restart=false keeps the packed row's positions. Rotary attention depends on the
    distance between query and key only, and documents never attend across, so both give the
    documents' own loss up to float32 rounding (the angles of late positions are larger: restart
    keeps them small at long contexts). Without documents the rows differ (the control)."""
    cfg = ModelConfig(**SHAPE, document_eos=EOS)
    params = perturbed_params(Transformer(cfg), seed=4)
    batch = jnp.asarray(packed_batch(seed=9, rows=2, seq_len=cfg.seq_len))
    restarted = float(loss_fn(Transformer(cfg), params, batch))
    kept = float(loss_fn(Transformer(dataclasses.replace(cfg, rope_restart=False)), params, batch))
    np.testing.assert_allclose(kept, restarted, rtol=1e-6)


@pytest.mark.slow
def test_restarted_positions_are_what_the_rotary_embedding_rotates_by(monkeypatch):
    """The wiring the loss cannot see (above): with model.rope_restart q and k rotate by each
    document's own positions, without it by the row's."""
    from megascale_jax.model import transformer

    seen = []
    rotary = transformer.rotary
    monkeypatch.setattr(transformer, "rotary", lambda x, positions, *a: seen.append(positions) or rotary(x, positions, *a))
    cfg = ModelConfig(**{**SHAPE, "layers": 1}, document_eos=EOS)
    params = perturbed_params(Transformer(cfg), seed=4)
    tokens = jnp.asarray(packed_batch(seed=9, rows=2, seq_len=cfg.seq_len))[:, :-1]
    layout = documents.layout(tokens, EOS)
    assert int(layout.positions.max()) < cfg.seq_len - 1 and int((layout.positions == 0).sum()) > 2 * tokens.shape[0]
    for restart in (True, False):
        seen.clear()
        Transformer(dataclasses.replace(cfg, rope_restart=restart)).apply({"params": params}, tokens)
        assert len(seen) >= 2  # q and k (the scan may trace its body more than once)
        for positions in seen:
            if restart:  # the layout's, handed to every layer as it is
                np.testing.assert_array_equal(positions, layout.positions)
            else:  # the row's own: one position a column (an arange traced inside the layer)
                assert positions.shape == (cfg.seq_len,)


def test_an_end_of_document_token_outside_the_vocabulary_is_one_line():
    with pytest.raises(ConfigError, match="model.document_eos=300 must be a token id below model.vocab=256") as raised:
        load_config(None, ["model.document_eos=300"])
    assert "\n" not in str(raised.value)
    # every layout keeps documents apart: the pipeline's stages, the Pallas kernel
    load_config(None, ["model.document_eos=3", "mesh.pp=2", "mesh.dp=1", "parallel.microbatches=2"])
    load_config(None, ["model.document_eos=3", "model.attention=pallas"])
