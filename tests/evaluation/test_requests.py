"""Requests built as lm-eval's HFLM builds them: hand-tokenised cases (conftest's VOCAB) and, where
lm-eval is installed, its own window functions as the reference."""

import numpy as np
import pytest

from megascale_jax.evaluation.requests import (Encoder, Request, disjoint_window, item_requests, model_input,
                                               rolling_windows, truncated)
from megascale_jax.evaluation.tasks import Choice, Continuation, Document, TaskError

from conftest import IDS, greedy_encode


def test_trailing_context_whitespace_moves_to_the_continuation(encoder):
    # "ab " + "c": context "ab" -> [a, b]; whole "ab c" -> [a, b, " ", c]; continuation [" ", c]
    assert encoder.pair("ab ", "c") == Request((1, 2), (4, 3))


def test_the_continuation_is_the_whole_strings_tokens_after_the_context(encoder):
    assert encoder.pair("a", "bc") == Request((1,), (5,))  # whole "abc" = [a, bc]
    assert encoder.pair("x", " a") == Request((7,), (6,))  # " a" is one token
    # "ab" + "c": whole "abc" = [a, bc] and the context alone [a, b]: nothing left for the continuation
    assert encoder.pair("ab", "c") == Request((1, 2), ())
    with pytest.raises(TaskError, match="t.jsonl:3: a continuation encodes to no tokens"):
        item_requests(Continuation("ab", "c"), encoder, 8, "t.jsonl:3")


def test_an_empty_context_is_the_prefix_token(encoder):
    assert encoder.pair("", "ab") == Request((IDS["<s>"],), (1, 2))
    starts_with_it = Encoder(lambda s, special: greedy_encode(s, special), IDS["a"], "a")
    assert starts_with_it.pair("", "ab") == Request((1,), (2,))  # lm-eval: the first token is the context
    without = Encoder(lambda s, special: greedy_encode(s, special), None, None)
    with pytest.raises(TaskError, match="BOS or EOS"):
        item_requests(Choice("", ("ab",), ("ab",), 0), without, 8, "here")


def test_a_bos_is_added_unless_the_text_starts_with_it(bos_encoder):
    assert bos_encoder.pair("a", " a") == Request((0, 1), (6,))  # whole [<s>, a, " a"], context [<s>, a]
    assert bos_encoder.tok_encode("<s>a") == [0, 1]  # HFLM.tok_encode: has_bos_prefix -> no special tokens
    assert bos_encoder.tok_encode("ab") == [0, 1, 2]
    # the empty-context continuation is encoded without special tokens
    assert bos_encoder.pair("", "ab") == Request((0,), (1, 2))


def test_left_truncation_to_max_length():
    request = Request(tuple(range(10)), (20, 21, 22))
    inputs, targets, n = model_input(request, 8)
    assert inputs == [4, 5, 6, 7, 8, 9, 20, 21] and targets == [5, 6, 7, 8, 9, 20, 21, 22] and n == 3
    assert truncated(request, 8)
    assert not truncated(Request(tuple(range(6)), (20, 21, 22)), 8)  # 9 = max_length + 1 tokens: fits
    assert truncated(Request(tuple(range(7)), (20, 21, 22)), 8)
    with pytest.raises(TaskError, match="longer than the model's 2"):
        item_requests(Continuation("x", "abab"), Encoder(lambda s, sp: greedy_encode(s, sp), 0, "<s>"), 2, "w")


def test_rolling_windows_by_hand():
    tokens = list(range(11, 18))  # 7 tokens, max_length 3
    windows = [disjoint_window(w) for w in rolling_windows(tokens, 0, 3)]
    assert windows == [([0], [11, 12, 13]), ([13], [14, 15, 16]), ([14, 15, 16], [17])]
    predicted = [t for _, p in windows for t in p]
    assert predicted == tokens  # every token predicted once


def test_rolling_windows_match_lm_eval():
    utils = pytest.importorskip("lm_eval.utils", reason="lm-eval is not installed")
    rng = np.random.default_rng(3)
    for _ in range(40):
        tokens = rng.integers(1, 50, int(rng.integers(1, 40))).tolist()
        max_length = int(rng.integers(1, 12))
        theirs = list(map(utils.make_disjoint_window, utils.get_rolling_token_windows(tokens, 0, max_length, 1)))
        assert [disjoint_window(w) for w in rolling_windows(tokens, 0, max_length)] == theirs


def test_item_requests_per_kind(encoder):
    assert item_requests(Choice("a", ("a", "bc"), (" a", " bc"), 0), encoder, 8, "w") == [
        Request((1,), (6,)), Request((1,), (4, 5))]
    assert len(item_requests(Document("abcabcabc"), encoder, 3, "w")) == 2  # [a bc a bc a bc] in windows of 3
