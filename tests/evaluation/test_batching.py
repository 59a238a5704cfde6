"""Fixed-shape batches and the reduction back, against a float64 bigram scored request by request."""

import numpy as np

from megascale_jax.evaluation import batching
from megascale_jax.evaluation.requests import Request

from conftest import Bigram


def random_requests(rng, n, vocab, max_length):
    out = []
    for _ in range(n):
        context = rng.integers(0, vocab, int(rng.integers(1, 2 * max_length))).tolist()
        continuation = rng.integers(0, vocab, int(rng.integers(1, max_length + 1))).tolist()
        out.append(Request(tuple(context), tuple(continuation)))
    return out


def expected(model: Bigram, request: Request, max_length: int):
    """log P(continuation | the last max_length tokens before it), token by token."""
    seq = list(request.context + request.continuation)[-(max_length + 1):]
    k = len(request.continuation)
    pairs = list(zip(seq[-k - 1:-1], seq[-k:]))
    ll = sum(model.logprob(prev, tok) for prev, tok in pairs)
    return ll, all(int(np.argmax(model.table[prev])) == tok for prev, tok in pairs)


def test_rows_hold_the_input_targets_and_continuation_mask():
    tokens, targets, mask = batching.rows([Request((1, 2, 3), (4, 5))], 6)
    np.testing.assert_array_equal(tokens, [[1, 2, 3, 4, 0, 0]])
    np.testing.assert_array_equal(targets, [[2, 3, 4, 5, 0, 0]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 0, 0]])


def test_batches_have_one_shape_and_the_last_is_padded():
    rng = np.random.default_rng(0)
    requests = random_requests(rng, 10, 16, 8)
    shapes = [(t.shape, tg.shape, m.shape, real) for t, tg, m, real in batching.batches(requests, 4, 8)]
    assert shapes == [((4, 8), (4, 8), (4, 8), 4)] * 2 + [((4, 8), (4, 8), (4, 8), 2)]
    *_, (_, _, last_mask, _) = batching.batches(requests, 4, 8)
    assert not last_mask[2:].any()


def test_score_equals_request_by_request_float64():
    rng = np.random.default_rng(1)
    model, max_length = Bigram(16, seed=2), 8
    requests = random_requests(rng, 23, 16, max_length)
    # a request whose continuation the bigram predicts greedily, so is_greedy is exercised both ways
    best = [int(np.argmax(model.table[5]))]
    requests.append(Request((3, 5), (best[0], int(np.argmax(model.table[best[0]])))))
    logprobs, greedy = batching.score(requests, model.score_batch, 5, max_length)
    want = [expected(model, r, max_length) for r in requests]
    np.testing.assert_allclose(logprobs, [w[0] for w in want], rtol=1e-12)
    assert greedy.tolist() == [w[1] for w in want] and greedy[-1]
