"""The few lines of text a run ends with: what the model it just trained writes after
`train.sample_prompt` (`train.sample_at_end` new tokens; 0 = off), so that a run shows what it
learned, not only a loss.

It is `python -m megascale_jax.sample RUN_DIR --prompt PROMPT --max-new-tokens N --temperature
0.8 --top-p 0.95` on the final parameters: gathered from the mesh onto one device in canonical
layer order and decoded with the KV cache of `model/decode.py`, sampled (greedy decoding of a
small byte-level model falls into loops) from a fixed seed, so a run prints the same text every
time. Byte-level runs (`data.source=stdlib|files`) decode ids as UTF-8 bytes; a run on a token
file uses its recorded tokenizer (`training.tokenizer.run_tokenizer`, which needs `tokenizers`).

A model without a sliding window continues only up to `model.seq_len` tokens in all, so its
sample is cut to what fits. Process 0 of a single-process run only: in a multi-process run the
parameters are spread over hosts, and gathering them just to print text is not worth a
collective at the end of every job — the one line printed instead names the `sample` command.
What cannot be sampled (these cases, or a token file without its tokenizer) is one line saying
why, not a failed run.
"""

from __future__ import annotations

import jax

from megascale_jax.model import decode

TEMPERATURE, TOP_P, SEED = 0.8, 0.95, 0
PREFIX = "| "  # marks the sample's lines apart from the log lines around it


def sample_text(cfg, run_dir: str, trainer, state) -> str:
    """The log lines of the sample: a header, then the prompt and its continuation, each line
    prefixed with `PREFIX`."""
    if jax.process_count() > 1:
        return (f"train.sample_at_end: not sampled in a run of {jax.process_count()} processes; run `python -m "
                f"megascale_jax.sample {run_dir} --prompt {cfg.train.sample_prompt!r}` on its checkpoint")
    try:
        encode, decode_ids = codec(cfg, run_dir)
    except (ImportError, ValueError) as e:  # no `tokenizers`, or a token file without its tokenizer
        return f"train.sample_at_end: no sample ({e})"
    prompt = encode(cfg.train.sample_prompt)
    if max(prompt) >= cfg.model.vocab:
        return (f"train.sample_at_end: no sample: train.sample_prompt encodes to token id {max(prompt)}, outside "
                f"model.vocab={cfg.model.vocab}")
    # A model without a sliding window continues only up to seq_len tokens in all (model/decode.py).
    limit = decode.length_limit(cfg.model)
    count = cfg.train.sample_at_end if limit is None else min(cfg.train.sample_at_end, limit - len(prompt))
    if count < 1:
        return (f"train.sample_at_end: no sample: train.sample_prompt fills model.seq_len={limit} of a model "
                "without a sliding window")
    params = jax.device_get(trainer.to_canonical(state).params)
    text = cfg.train.sample_prompt + decode_ids(decode.generate(cfg.model, params, prompt, count, TEMPERATURE,
                                                                TOP_P, SEED))
    header = (f"sample: {count} tokens after {cfg.train.sample_prompt!r} "
              f"(temperature {TEMPERATURE}, top-p {TOP_P}, seed {SEED}):")
    return "\n".join([header, *(PREFIX + line for line in text.splitlines())])


def codec(cfg, run_dir: str):
    """(encode, decode) between text and the run's token ids."""
    from megascale_jax.training.tokenizer import BYTE_LEVEL_SOURCES, run_tokenizer

    if cfg.data.source in BYTE_LEVEL_SOURCES:  # the ids are the text's UTF-8 bytes
        return (lambda text: list(text.encode("utf-8")),
                lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    tokenizer = run_tokenizer(run_dir, cfg)
    return lambda text: tokenizer.encode(text).ids, tokenizer.decode
