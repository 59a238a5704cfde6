"""`python -m megascale_jax.tokenize --input 'GLOB' --vocab N --out DIR [--overwrite]`
`python -m megascale_jax.tokenize --tokenizer PATH --input 'shards/*.jsonl' --out DIR [--workers N]`

The first trains a byte-level BPE of N tokens on the local text files GLOB matches (no network),
encodes them (`megascale_jax.training.tokenizer`). The second encodes a corpus's JSONL (plain, .gz,
.zst) or Parquet shards, each document the `--text-field` of a line or row, with a model's own
tokenizer (a tokenizer.json or a Hugging Face model directory; `training.pretrained_tokenizer`).
Both write DIR/tokenizer.json, DIR/tokens.bin and DIR/tokens.json and print the overrides that
train on the result: `data.source=tokens data.path=DIR/tokens.bin data.token_dtype=... model.vocab=N`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from typing import Optional, Sequence

from megascale_jax import cli
from megascale_jax.training import tokenizer as bpe


def parse_args(argv):
    parser = cli.ArgumentParser(prog="python -m megascale_jax.tokenize", description="Write the token file a corpus encodes to: with a byte-level BPE trained on it, or with a model's own tokenizer.")
    parser.add_argument("--input", required=True, help="glob (quote it): text files, e.g. 'corpus/**/*.txt'; with "
                        "--tokenizer, JSONL or Parquet shards, e.g. 'shards/*.jsonl.gz'")
    parser.add_argument("--vocab", type=int, help=f"train a BPE of this many tokens (at least {bpe.MIN_VOCAB})")
    parser.add_argument("--tokenizer", help="encode with this tokenizer.json or Hugging Face model directory instead")
    parser.add_argument("--text-field", default="text", help="with --tokenizer: each line's/row's text field (default text)")
    parser.add_argument("--workers", type=int, default=1, help="with --tokenizer: shards encoded at once (processes)")
    parser.add_argument("--eos", default=None, help="with --tokenizer: the end-of-document token, where the tokenizer "
                        "does not say")
    parser.add_argument("--stop-at-bad-line", action="store_true", help="with --tokenizer: stop at a bad JSONL line "
                        "(not JSON, not UTF-8, no text field) instead of skipping and counting it")
    parser.add_argument("--out", required=True, help="directory for tokenizer.json, tokens.bin and tokens.json")
    parser.add_argument("--overwrite", action="store_true", help="replace those files if they exist")
    args = parser.parse_args(argv)
    if (args.vocab is None) == (args.tokenizer is None):
        parser.error("give --vocab N (train a BPE on the files) or --tokenizer PATH (encode with a model's own), "
                     "one of the two")
    if args.workers < 1:
        parser.error(f"--workers {args.workers} must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("tokenizers") is None:  # an optional dependency: one line, not a traceback
        return cli.user_error(bpe.TokenizerError("python -m megascale_jax.tokenize needs the `tokenizers` package; "
                                                 "pip install -e '.[interop]'"))
    if args.tokenizer:
        return encode_with_tokenizer(args)
    try:
        paths = bpe.input_files(args.input, warn=lambda line: print(line, file=sys.stderr))
        tokenizer = bpe.train_bpe(paths, args.vocab)
        tokens = bpe.encode_files(tokenizer, paths)
        meta = bpe.write(args.out, tokenizer, tokens, paths, args.overwrite)
    except (bpe.TokenizerError, OSError) as e:
        return cli.user_error(e)
    token_file = os.path.join(args.out, bpe.TOKENS_FILE)
    print(f"{meta['tokens']:,} tokens from {meta['files']} files, vocabulary {meta['vocab']:,}; wrote "
          f"{os.path.join(args.out, bpe.TOKENIZER_FILE)} and {token_file}")
    print(f"train on it: data.source=tokens data.path={token_file} data.token_dtype={meta['token_dtype']} "
          f"model.vocab={meta['vocab']}")
    return 0


def encode_with_tokenizer(args) -> int:
    """`--tokenizer`: the shards encoded with a model's own tokenizer (`training.pretrained_tokenizer`)."""
    from megascale_jax.training import documents, pretrained_tokenizer

    started = time.perf_counter()
    try:
        meta = pretrained_tokenizer.tokenize_corpus(
            args.tokenizer, args.input, args.out, args.text_field, args.workers, args.eos, args.stop_at_bad_line,
            args.overwrite, log=lambda line: print(line, file=sys.stderr))
    except (bpe.TokenizerError, documents.DocumentError, OSError) as e:
        return cli.user_error(e)
    seconds = time.perf_counter() - started
    token_file = os.path.join(args.out, bpe.TOKENS_FILE)
    print(f"{meta['tokens']:,} tokens in {meta['documents']:,} documents from {meta['shards']} shards "
          f"({meta['text_bytes'] / 1e6:,.1f} MB of text, {meta['text_bytes'] / 1e6 / seconds / args.workers:.2f} MB/s "
          f"a worker); vocabulary {meta['vocab']:,}; wrote {token_file}")
    print(f"train on it: data.source=tokens data.path={token_file} data.token_dtype={meta['token_dtype']} "
          f"model.vocab={meta['vocab']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
