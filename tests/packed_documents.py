"""Packed documents and the independent reference the documents tests share (`model.document_eos`):
rows cut from a stream of random documents as the loader packs them, and each document's own
losses, computed by running it alone, unpacked, through the plain model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from megascale_jax.config import ModelConfig
from megascale_jax.model.transformer import Transformer


def packed_batch(seed: int, rows: int, seq_len: int, eos: int, vocab: int) -> np.ndarray:
    """Rows of seq_len + 1 tokens cut from a stream of documents of 1-14 random tokens (ids above
    `eos`, below `vocab`), each ended by `eos`: a row starts and ends mid-document."""
    rng = np.random.default_rng(seed)
    stream = []
    while len(stream) < rows * (seq_len + 1) + 40:
        stream += [*rng.integers(eos + 1, vocab, size=int(rng.integers(1, 15))), eos]
    start = int(rng.integers(0, 20))
    return np.asarray(stream[start:start + rows * (seq_len + 1)]).reshape(rows, seq_len + 1)


def unpacked_loss_sum(cfg: ModelConfig, params, batch: np.ndarray) -> float:
    """Each row split at its `cfg.document_eos` tokens by hand, each piece through the plain model
    (no documents, positions from 0) on its own, the next-token losses of every target not after
    an end-of-document token summed in float64."""
    eos = cfg.document_eos
    plain = Transformer(dataclasses.replace(cfg, document_eos=None, attention="xla"))
    pieces = []  # (inputs, targets) of each document, as it would be alone
    for row in batch:
        inputs, targets = row[:-1], row[1:]
        bounds = [0, *[i + 1 for i, t in enumerate(inputs) if t == eos and i + 1 < len(inputs)], len(inputs)]
        pieces += [(inputs[a:b], targets[a:b]) for a, b in zip(bounds, bounds[1:])]
    # each alone at the start of a row of its own, right-padded: causal attention never reads the padding
    rows = np.full((len(pieces), cfg.seq_len), eos + 1)
    for r, (inputs, _) in enumerate(pieces):
        rows[r, :len(inputs)] = inputs
    logits = np.asarray(jax.jit(plain.apply)({"params": params}, jnp.asarray(rows)), np.float64)
    total = 0.0
    for r, (inputs, targets) in enumerate(pieces):
        z = logits[r, :len(inputs)]
        logz = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
        losses = logz - z[np.arange(len(inputs)), targets]
        total += float(losses[inputs != eos].sum())
    return total
