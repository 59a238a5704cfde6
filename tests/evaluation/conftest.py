"""Shared pieces of the evaluation tests: a tokenizer small enough to tokenise by hand, and a
bigram "model" whose log-probabilities float64 numpy computes independently."""

import numpy as np
import pytest

from megascale_jax.evaluation.requests import Encoder

VOCAB = ["<s>", "a", "b", "c", " ", "bc", " a", "x"]  # id = index; "<s>" is the prefix/BOS token
IDS = {piece: i for i, piece in enumerate(VOCAB)}


def greedy_encode(text: str, add_special_tokens: bool = True, bos: bool = False) -> list[int]:
    """Longest match first over VOCAB (so "bc" and " a" merge), BOS first if `bos` and special."""
    out, i = ([IDS["<s>"]] if bos and add_special_tokens else []), 0
    while i < len(text):
        piece = max((p for p in VOCAB if text.startswith(p, i)), key=len)
        out.append(IDS[piece])
        i += len(piece)
    return out


@pytest.fixture
def encoder():
    return Encoder(lambda text, special: greedy_encode(text, special), IDS["<s>"], "<s>")


@pytest.fixture
def bos_encoder():
    return Encoder(lambda text, special: greedy_encode(text, special, bos=True), IDS["<s>"], "<s>")


class Bigram:
    """logits[t] = table[token t]: causal by construction, so a row's scores depend only on the
    tokens up to each position, whatever padding follows."""

    def __init__(self, vocab: int, seed: int):
        self.table = np.random.default_rng(seed).normal(0, 2, (vocab, vocab))

    def logits(self, tokens):
        return self.table[np.asarray(tokens)]

    def logprob(self, previous: int, token: int) -> float:
        row = self.table[previous]
        return float(row[token] - np.log(np.sum(np.exp(row - row.max()))) - row.max())

    def score_batch(self, tokens, targets, mask):
        """A float64 numpy score_batch (the contract batching.score calls)."""
        logits = self.logits(tokens)
        top = logits.max(-1, keepdims=True)
        logp = logits - (np.log(np.exp(logits - top).sum(-1, keepdims=True)) + top)
        picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
        return (picked * mask).sum(-1), ((logits.argmax(-1) == targets) | (mask == 0)).all(-1)
