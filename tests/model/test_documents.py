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

EOS = 3
SHAPE = dict(layers=2, d_model=64, heads=4, kv_heads=2, seq_len=32, vocab=97, dtype="float32")


def packed_batch(seed: int, rows: int, seq_len: int) -> np.ndarray:
    """Rows of seq_len + 1 tokens cut from a stream of documents of 1-14 random tokens, each ended by
    EOS (as the loader packs them: a row starts and ends mid-document)."""
    rng = np.random.default_rng(seed)
    stream = []
    while len(stream) < rows * (seq_len + 1) + 40:
        stream += [*rng.integers(EOS + 1, SHAPE["vocab"], size=int(rng.integers(1, 15))), EOS]
    start = int(rng.integers(0, 20))
    return np.asarray(stream[start:start + rows * (seq_len + 1)]).reshape(rows, seq_len + 1)


def perturbed_params(model, seed):
    params = model.init(jax.random.key(seed), jnp.zeros((1, model.cfg.seq_len), jnp.int32))["params"]
    params = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, params, is_leaf=lambda x: hasattr(x, "value"))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return treedef.unflatten([x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def unpacked_loss_sum(cfg: ModelConfig, params, batch: np.ndarray) -> float:
    """Each row split at its EOS tokens by hand, each piece through the plain model on its own,
    the next-token losses of every target not after an EOS summed in float64."""
    plain = Transformer(dataclasses.replace(cfg, document_eos=None))
    pieces = []  # (inputs, targets) of each document, as it would be alone
    for row in batch:
        inputs, targets = row[:-1], row[1:]
        bounds = [0, *[i + 1 for i, t in enumerate(inputs) if t == EOS and i + 1 < len(inputs)], len(inputs)]
        pieces += [(inputs[a:b], targets[a:b]) for a, b in zip(bounds, bounds[1:])]
    # each alone at the start of a row of its own, right-padded: causal attention never reads the padding
    rows = np.full((len(pieces), cfg.seq_len), EOS + 1)
    for r, (inputs, _) in enumerate(pieces):
        rows[r, :len(inputs)] = inputs
    logits = np.asarray(jax.jit(plain.apply)({"params": params}, jnp.asarray(rows)), np.float64)
    total = 0.0
    for r, (inputs, targets) in enumerate(pieces):
        z = logits[r, :len(inputs)]
        logz = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
        losses = logz - z[np.arange(len(inputs)), targets]
        total += float(losses[inputs != EOS].sum())
    return total


def test_the_layout_counts_documents_and_positions_from_each_documents_start():
    tokens = jnp.asarray([[5, 9, EOS, 4, EOS, EOS, 7], [EOS, 8, 8, 8, 8, 8, 8]])
    layout = documents.layout(tokens, EOS)
    np.testing.assert_array_equal(layout.ids, [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(layout.positions, [[0, 1, 2, 0, 1, 0, 0], [0, 0, 1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(documents.trained_targets(tokens, EOS), [[1, 1, 0, 1, 0, 0, 1], [0, 1, 1, 1, 1, 1, 1]])


@pytest.mark.slow
@pytest.mark.parametrize("window, block, loss_chunks", [(None, "parallel", 1), (5, "parallel", 1), (5, "serial", 4)],
                         ids=["causal", "window", "serial-sliced-loss"])
def test_a_packed_masked_loss_is_the_documents_own_losses(window, block, loss_chunks):
    cfg = ModelConfig(**SHAPE, window=window, block=block, loss_chunks=loss_chunks, document_eos=EOS)
    model = Transformer(cfg)
    params = perturbed_params(model, seed=4)
    batch = packed_batch(seed=9, rows=3, seq_len=cfg.seq_len)
    assert (batch[:, :-1] == EOS).sum() >= 6  # several documents a row, some cut at a row's edge
    packed = float(jax.jit(loss_fn, static_argnums=0)(model, params, jnp.asarray(batch))) * batch.shape[0] * cfg.seq_len
    np.testing.assert_allclose(packed, unpacked_loss_sum(cfg, params, batch), rtol=1e-6)
    plain = float(loss_fn(Transformer(dataclasses.replace(cfg, document_eos=None)), params, jnp.asarray(batch)))
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


@pytest.mark.parametrize("overrides, says", [
    (["model.document_eos=3", "mesh.pp=2", "mesh.dp=1", "parallel.microbatches=2"], "not kept apart through the pipeline"),
    (["model.document_eos=3", "model.attention=pallas"], "Pallas attention kernel does not keep documents apart"),
    (["model.document_eos=300"], "model.document_eos=300 must be a token id below model.vocab=256"),
])
def test_what_does_not_keep_documents_apart_yet_is_one_line(overrides, says):
    with pytest.raises(ConfigError, match=says) as raised:
        load_config(None, overrides)
    assert "\n" not in str(raised.value)
