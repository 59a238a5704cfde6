"""`python -m megascale_jax.tokenize --input 'GLOB' --vocab N --out DIR [--overwrite]`

Trains a byte-level BPE of N tokens on the local text files GLOB matches (no network), encodes
them, and writes DIR/tokenizer.json, DIR/tokens.bin and DIR/tokens.json
(`megascale_jax.training.tokenizer`). Prints the overrides that train on the result:
`data.source=tokens data.path=DIR/tokens.bin data.token_dtype=... model.vocab=N`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Optional, Sequence

from megascale_jax import cli
from megascale_jax.training import tokenizer as bpe


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m megascale_jax.tokenize", description="Train a byte-level BPE on local text files and write the token file it encodes.")
    parser.add_argument("--input", required=True, help="glob of local text files (quote it), e.g. 'corpus/**/*.txt'")
    parser.add_argument("--vocab", required=True, type=int, help=f"tokens in the vocabulary (at least {bpe.MIN_VOCAB})")
    parser.add_argument("--out", required=True, help="directory for tokenizer.json, tokens.bin and tokens.json")
    parser.add_argument("--overwrite", action="store_true", help="replace those files if they exist")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("tokenizers") is None:  # an optional dependency: one line, not a traceback
        return cli.user_error(bpe.TokenizerError("python -m megascale_jax.tokenize needs the `tokenizers` package; "
                                                 "pip install -e '.[interop]'"))
    try:
        paths = bpe.input_files(args.input)
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


if __name__ == "__main__":
    sys.exit(main())
