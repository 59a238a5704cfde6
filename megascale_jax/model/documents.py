"""Packed documents kept apart: where each token's document starts, from the tokens themselves.

A packed sequence holds the end of one document, whole documents, and the start of another,
each ended by the end-of-document token `model.document_eos` (the tokenizer's EOS, which the
loader puts after every document). With it set:

* attention: a query sees only keys of its own document (and, with a window, of the window),
  on top of the causal mask;
* positions: rotary positions count from the document's start (`model.rope_restart`), so a
  document reads the same wherever packing put it;
* loss: the target after an end-of-document token (the next document's first token, predicted
  from another document) is not trained on: its loss counts zero. The mean stays over all
  target positions (batch x seq), so that microbatches, pipeline stages and data-parallel
  shards sum exactly as without documents: the loss is the per-document losses' sum over the
  batch's token count, 1/length below the mean over trained targets (0.1% for 1,000-token
  documents).

A document's id is how many end-of-document tokens precede it in the sequence: the token itself
belongs to the document it ends. Derived from the input tokens inside the step, so the batch
needs nothing beside its tokens and every mesh layout gets it with the tokens' own sharding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Documents(NamedTuple):
    ids: jax.Array  # (batch, seq) int32: the document each position belongs to
    positions: jax.Array  # (batch, seq) int32: the position within that document


def layout(tokens: jax.Array, eos: int) -> Documents:
    """Documents of (batch, seq) input tokens ended by `eos`."""
    ends = (tokens == eos).astype(jnp.int32)
    ids = jnp.cumsum(ends, axis=1) - ends  # EOS tokens preceding each position, itself excluded
    index = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    starts = jnp.concatenate([jnp.ones_like(ids[:, :1], dtype=bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)  # each position's document start
    return Documents(ids, index - first)


def same_document(ids: jax.Array) -> jax.Array:
    """(batch, seq, seq) bool: True where query i and key j are in one document."""
    return ids[:, :, None] == ids[:, None, :]


def trained_targets(tokens: jax.Array, eos: int) -> jax.Array:
    """(batch, seq) float32 weights of the targets: 0 after an end-of-document token, else 1."""
    return (tokens != eos).astype(jnp.float32)
