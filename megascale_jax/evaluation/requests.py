"""Items to token requests, exactly as lm-evaluation-harness's HFLM makes them (lm-eval 0.4.13).

A request is (context tokens, continuation tokens): the model is scored on the continuation
given the context. How lm-eval builds them, and so how they are built here:

* `TemplateLM._encode_pair` (api/model.py): whitespace at the end of the context moves to the
  start of the continuation; then whole = tok(context + continuation), context = tok(context),
  continuation = whole[len(context):]. The split is by tokens of the whole string, so a merge
  across the boundary is tokenised as the model would see the text.
* `TemplateLM.loglikelihood`: an empty context becomes the prefix token — HFLM's
  `prefix_token_id`, the tokenizer's BOS, else its EOS — with the continuation encoded without
  special tokens; if the continuation already starts with that token it is the context instead.
* `HFLM.tok_encode`: the tokenizer's own special tokens (a BOS its post-processor adds), except
  when the string already starts with the prefix token's text.
* `HFLM._loglikelihood_tokens`: the model reads `(context + continuation)[-(max_length + 1):][:-1]`
  — cut from the LEFT to max_length tokens — and the continuation is scored on the last
  len(continuation) positions. A request of more than max_length + 1 tokens is truncated
  (lm-eval logs a warning; here it is counted). A continuation longer than max_length cannot be
  scored (lm-eval asserts): refused.
* `HFLM.loglikelihood_rolling`: a document is cut into windows by `utils.get_rolling_token_windows`
  (context_len=1) and `utils.make_disjoint_window`, each window a request, its log-likelihoods
  summed.

`Encoder` holds what these need from a tokenizer: `encode(text, add_special_tokens)`, the prefix
token and its text; `for_tokenizer` builds it from a Hugging Face `tokenizers.Tokenizer`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from megascale_jax.evaluation.tasks import Choice, Continuation, Document, Item, TaskError


@dataclasses.dataclass(frozen=True)
class Request:
    context: tuple[int, ...]
    continuation: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Encoder:
    """encode(text, add_special_tokens) -> ids; `prefix_token` the id an empty context (and a
    document's first rolling window) is conditioned on, None where the tokenizer has none;
    `prefix_text` its text (`tokenizer.decode([prefix_token])` with special tokens kept)."""
    encode: Callable[[str, bool], list[int]]
    prefix_token: Optional[int]
    prefix_text: Optional[str]

    def tok_encode(self, text: str) -> list[int]:
        """HFLM.tok_encode with add_special_tokens=None: no special tokens when the text already
        starts with the prefix token's text, else the tokenizer's default."""
        starts_with_prefix = self.prefix_text is not None and text.startswith(self.prefix_text)
        return list(self.encode(text, not starts_with_prefix))

    def prefix(self, why: str) -> int:
        if self.prefix_token is None:
            raise TaskError(f"{why} needs the tokenizer's BOS or EOS token (lm-eval's prefix token), and the run's "
                            "tokenizer has neither")
        return self.prefix_token

    def pair(self, context: str, continuation: str) -> Request:
        """TemplateLM.loglikelihood's encoding of one (context, continuation)."""
        if context == "":
            cont = list(self.encode(continuation, False))
            if not cont:
                raise TaskError(f"the continuation {continuation!r} encodes to no tokens")
            prefix = self.prefix("an empty context")
            return Request((prefix,), tuple(cont)) if cont[0] != prefix else Request(tuple(cont[:1]), tuple(cont[1:]))
        spaces = len(context) - len(context.rstrip())
        if spaces:
            continuation, context = context[-spaces:] + continuation, context[:-spaces]
        whole = self.tok_encode(context + continuation)
        context_enc = self.tok_encode(context)
        return Request(tuple(context_enc), tuple(whole[len(context_enc):]))

    def rolling(self, text: str, max_length: int) -> list[Request]:
        """HFLM.loglikelihood_rolling's windows of one document."""
        tokens = self.tok_encode(text)
        if not tokens:
            return []
        return [Request(tuple(c), tuple(p)) for c, p in
                map(disjoint_window, rolling_windows(tokens, self.prefix("a rolling loglikelihood"), max_length))]


def rolling_windows(tokens: list[int], prefix: int, max_length: int, context_len: int = 1):
    """lm-eval's utils.get_rolling_token_windows: (input tokens, predicted tokens) pairs that
    predict every token once, each window at most max_length tokens."""
    pred_len = max_length - context_len + 1
    first = min(max_length, len(tokens))
    yield [prefix] + tokens[:first - 1], tokens[:first]
    predicted = first
    while predicted < len(tokens):
        window_pred_len = min(len(tokens) - predicted, pred_len)
        end = predicted + window_pred_len
        yield tokens[end - max_length - 1:end - 1], tokens[end - window_pred_len:end]
        predicted += window_pred_len


def disjoint_window(pair):
    """lm-eval's utils.make_disjoint_window: the input without the tokens it predicts."""
    inputs, predicted = pair
    return inputs[:len(inputs) - (len(predicted) - 1)], predicted


def model_input(request: Request, max_length: int) -> tuple[list[int], list[int], int]:
    """(input tokens, next-token targets, continuation length): HFLM's causal input
    `(context + continuation)[-(max_length + 1):][:-1]`; the continuation is the targets' last
    `continuation length` entries."""
    seq = list(request.context + request.continuation)[-(max_length + 1):]
    return seq[:-1], seq[1:], len(request.continuation)


def truncated(request: Request, max_length: int) -> bool:
    """Whether lm-eval cuts this request from the left (and warns)."""
    return len(request.context) + len(request.continuation) > max_length + 1


def item_requests(item: Item, encoder: Encoder, max_length: int, where: str) -> list[Request]:
    """An item's requests: one per choice, one, or one per rolling window; each checked as
    lm-eval asserts (a continuation of 1..max_length tokens, a non-empty context)."""
    try:
        if isinstance(item, Choice):
            made = [encoder.pair(item.context, c) for c in item.continuations]
        elif isinstance(item, Continuation):
            made = [encoder.pair(item.context, item.target)]
        elif isinstance(item, Document):
            made = encoder.rolling(item.text, max_length)
        else:
            raise TypeError(f"not a task item: {item!r}")
    except TaskError as e:
        raise TaskError(f"{where}: {e}") from None
    for r in made:
        if not r.continuation:
            raise TaskError(f"{where}: a continuation encodes to no tokens of its own (the tokenizer merges it into "
                            "the context); lm-eval cannot score it either")
        if len(r.continuation) > max_length:
            raise TaskError(f"{where}: a continuation of {len(r.continuation)} tokens is longer than the model's "
                            f"{max_length}; lm-eval cannot score it either")
        if not r.context:
            raise TaskError(f"{where}: the context encodes to no tokens")
    return made


def for_tokenizer(tokenizer, prefix_token: int | None) -> Encoder:
    """An Encoder over a Hugging Face `tokenizers.Tokenizer` (what an exported model's
    PreTrainedTokenizerFast wraps: the same ids)."""
    text = None if prefix_token is None else tokenizer.decode([prefix_token], skip_special_tokens=False)
    return Encoder(lambda s, special: tokenizer.encode(s, add_special_tokens=special).ids, prefix_token, text)
