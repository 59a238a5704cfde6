"""Requests as fixed-shape numpy batches, and the per-row scores back as per-request values.

The model side is one function the caller supplies,

    score_batch(tokens int32 [B, L], targets int32 [B, L], mask float32 [B, L])
        -> (logprob_sum float [B], all_greedy bool [B])

the sum over the masked positions of log P(target | tokens up to here), and whether each
masked target is the argmax there (lm-eval's `is_greedy`). Everything about devices — one CPU
for `python -m megascale_jax.evaluate`, the training mesh in the loop — lives in that function;
this module is plain numpy, so both score the same rows. Every batch has the same shape
(B = the caller's batch size, L = the model's max length: the last batch is padded with rows
whose mask is all zero, dropped on the way back), so one compiled function serves them all.

A row is HFLM's causal input (`requests.model_input`), right-padded as HFLM pads: a causal
model's scores at the real positions do not depend on what follows them.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np

from megascale_jax.evaluation.requests import Request, model_input

ScoreBatch = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple]


def rows(requests: Sequence[Request], max_length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens, targets (int32) and continuation mask (float32), each [len(requests), max_length]."""
    n = len(requests)
    tokens = np.zeros((n, max_length), np.int32)
    targets = np.zeros((n, max_length), np.int32)
    mask = np.zeros((n, max_length), np.float32)
    for i, request in enumerate(requests):
        inputs, next_tokens, scored = model_input(request, max_length)
        length = len(inputs)
        tokens[i, :length] = inputs
        targets[i, :length] = next_tokens
        mask[i, length - scored:length] = 1.0
    return tokens, targets, mask


def batches(requests: Sequence[Request], batch_size: int, max_length: int
            ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """(tokens, targets, mask, real rows) of `batch_size` rows each, the last padded."""
    for start in range(0, len(requests), batch_size):
        chunk = requests[start:start + batch_size]
        tokens, targets, mask = rows(chunk, max_length)
        pad = batch_size - len(chunk)
        if pad:
            tokens, targets, mask = (np.pad(a, ((0, pad), (0, 0))) for a in (tokens, targets, mask))
        yield tokens, targets, mask, len(chunk)


def score(requests: Sequence[Request], score_batch: ScoreBatch, batch_size: int, max_length: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """Each request's (log-likelihood float64 of the float32 sum, is_greedy bool), in order."""
    if batch_size < 1:
        raise ValueError(f"batch_size {batch_size}: must be >= 1")
    logprobs, greedy = [], []
    for tokens, targets, mask, real in batches(requests, batch_size, max_length):
        summed, all_greedy = score_batch(tokens, targets, mask)
        logprobs.append(np.asarray(summed, np.float64)[:real])
        greedy.append(np.asarray(all_greedy, bool)[:real])
    if not logprobs:
        return np.zeros(0), np.zeros(0, bool)
    return np.concatenate(logprobs), np.concatenate(greedy)

