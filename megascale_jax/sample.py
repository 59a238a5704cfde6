"""`python -m megascale_jax.sample RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
[--top-p P] [--seed S] [--step N]`

Prints the continuation of TEXT (not TEXT itself) that the run's newest committed checkpoint (or
step N) generates: greedy at temperature 0 (the default), else sampled with temperature and top-p
from a seeded key, so the same command prints the same text. It runs on one device — the CPU is
enough — whatever mesh trained the run (`training.trained.load` reads the parameters onto one
device), decoding with a KV cache (`model.decode`). Text becomes ids with the run's tokenizer
(`training.tokenizer.run_tokenizer`: the BPE recorded in RUN_DIR/tokenizer/, or bytes), and
generation stops early at that tokenizer's end-of-text token, if it has one.

How long: the prompt may be at most `model.seq_len` tokens, the longest sequence the model was
trained on. A model with a sliding window then continues as long as asked (it never attends
farther than it was trained to, and its cache holds only the window); a model without one stops
at seq_len tokens of prompt and continuation together: a longer request is refused, not cut.

Mistakes — a missing run directory or checkpoint, an empty or too long prompt, a bad option —
are one `error:` line on stderr and exit 2, before any parameter is read.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Optional, Sequence

from megascale_jax import cli
from megascale_jax.config import ConfigError


def parse_args(argv):
    parser = cli.ArgumentParser(prog="python -m megascale_jax.sample",
                                     description="Continue a prompt with a trained run's model.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a training run")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sample")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens "
                        "holding this much probability (default 1.0: all)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling key's seed (default 0)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    return cli.parse(parser, argv)


def option_error(args) -> str | None:
    if not args.prompt:
        return "--prompt is empty; give the text to continue"
    if args.max_new_tokens < 1:
        return f"--max-new-tokens {args.max_new_tokens}: generate at least 1 token"
    if not args.temperature >= 0:  # also NaN
        return f"--temperature {args.temperature}: must be >= 0 (0 = greedy)"
    if not 0 < args.top_p <= 1:
        return f"--top-p {args.top_p}: must be in (0, 1] (1 = no cut)"
    return None


def length_error(prompt_ids: list[int], max_new_tokens: int, model) -> str | None:
    """Why the prompt or the requested length does not fit the model (`model`: a ModelConfig)."""
    from megascale_jax.model import decode

    n = len(prompt_ids)
    if n > model.seq_len:
        return (f"--prompt is {n} tokens, more than model.seq_len={model.seq_len}, the longest sequence the "
                f"model was trained on; shorten it")
    too_big = [i for i in prompt_ids if i >= model.vocab]
    if too_big:
        return f"--prompt encodes to token id {too_big[0]}, outside the model's vocabulary (model.vocab={model.vocab})"
    limit = decode.length_limit(model)
    if limit is not None and n + max_new_tokens > limit:
        fix = f"pass --max-new-tokens {limit - n} or less" if limit > n else "shorten the prompt"
        return (f"--max-new-tokens {max_new_tokens}: the prompt's {n} tokens + {max_new_tokens} exceed "
                f"model.seq_len={limit}, the longest text a model without a sliding window can continue; {fix}")
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    problem = option_error(args)
    if problem:
        return cli.user_error(problem)
    if importlib.util.find_spec("tokenizers") is None:
        return cli.user_error("python -m megascale_jax.sample needs the `tokenizers` package; "
                              "pip install -e '.[interop]'")
    from megascale_jax.model import decode
    from megascale_jax.training import trained
    from megascale_jax.training.tokenizer import END_OF_TEXT, TokenizerError, run_tokenizer

    try:
        cfg = trained.run_config(args.run_dir)
        tokenizer = run_tokenizer(args.run_dir, cfg)
        prompt_ids = tokenizer.encode(args.prompt).ids
        problem = length_error(prompt_ids, args.max_new_tokens, cfg.model)
        if problem:
            return cli.user_error(problem)
        run = trained.load(args.run_dir, args.step, warn=lambda line: print(line, file=sys.stderr))
    except (ConfigError, TokenizerError) as e:
        return cli.user_error(e)
    new = decode.generate(run.cfg.model, run.params, prompt_ids, args.max_new_tokens, args.temperature,
                          args.top_p, args.seed, eos_id=tokenizer.token_to_id(END_OF_TEXT))
    print(tokenizer.decode(new), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
