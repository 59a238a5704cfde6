"""A byte-level BPE tokenizer trained on a local corpus, and the flat token file that
`data.source=tokens` reads (`python -m megascale_jax.tokenize`).

Byte-level (GPT-2 style, Hugging Face `tokenizers`): every byte has a token, so any text
encodes and `decode(encode(text)) == text` exactly. Documents (the input files) are separated by
END_OF_TEXT, as GPT-2 does. Token ids are written as one flat uint16 file (uint32 above 65,536
tokens) beside `tokenizer.json` and `tokens.json`, which records the dtype, the vocabulary and the
tokenizer file's SHA-256; a run on the token file copies these into its run directory
(`record_in_run_dir`). Nothing here touches the network.

`run_tokenizer` says what any run's token ids mean: the BPE it recorded, or for byte-level data
(`data.source=stdlib|files`, ids are raw UTF-8 bytes) `byte_tokenizer()`, a BPE with the 256
byte tokens and no merges, so that its ids are the text's bytes and it saves as an ordinary
tokenizer.json that transformers' `PreTrainedTokenizerFast` wraps.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil

import numpy as np

from megascale_jax import run_dir as run_dirs

END_OF_TEXT = "<|endoftext|>"
TOKENIZER_FILE, TOKENS_FILE, META_FILE = "tokenizer.json", "tokens.bin", "tokens.json"
BYTE_LEVEL_SOURCES = ("stdlib", "files")  # data.source values whose ids are UTF-8 bytes
MIN_VOCAB = 256 + 1  # every byte, and END_OF_TEXT


class TokenizerError(ValueError):
    """A user mistake (no input files, a vocabulary too small, an output that exists): one line."""


def input_files(pattern: str, warn=print) -> list[str]:
    """The text files `pattern` matches, sorted. A file that is not UTF-8 text throughout (a
    binary, a Parquet or compressed file: the BPE trainer stops at its first invalid byte) is
    left out with one warning counting them; none left, or all empty, is a TokenizerError."""
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not paths:
        raise TokenizerError(f"--input {pattern!r} matches no files; pass a glob of local text files")
    text = [p for p in paths if _is_utf8_text(p)]
    if not text:
        raise TokenizerError(f"--input {pattern!r}: none of the {len(paths)} matched files is UTF-8 text (e.g. "
                             f"{paths[0]}); pass text files, or encode JSONL/Parquet shards with --tokenizer")
    if len(text) < len(paths):
        skipped = sorted(set(paths) - set(text))
        warn(f"warning: skipped {len(skipped)} of {len(paths)} files that are not UTF-8 text, e.g. {skipped[0]}")
    if not any(os.path.getsize(p) for p in text):
        raise TokenizerError(f"--input {pattern!r}: all {len(text)} matched files are empty")
    return text


def _is_utf8_text(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TokenizerError(f"cannot read {path} ({e.strerror}); pass readable text files") from None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\0" not in data


def train_bpe(paths: list[str], vocab: int):
    """A byte-level BPE of `vocab` tokens (bytes, END_OF_TEXT, then merges) trained on `paths`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab < MIN_VOCAB:
        raise TokenizerError(f"--vocab {vocab} is below {MIN_VOCAB} (256 bytes and {END_OF_TEXT}); raise it")
    if vocab > 1 << 32:
        raise TokenizerError(f"--vocab {vocab} does not fit a uint32 token file; lower it")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train(paths, trainer)
    return tokenizer


def encode_files(tokenizer, paths: list[str]) -> np.ndarray:
    """The files' token ids, END_OF_TEXT after each, as one flat array of the smallest dtype."""
    eos, dtype = tokenizer.token_to_id(END_OF_TEXT), token_dtype(tokenizer.get_vocab_size())
    pieces = []  # one compact array per file: no Python int per token of the whole corpus
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            pieces.append(np.asarray(tokenizer.encode(f.read()).ids + [eos], dtype=dtype))
    return np.concatenate(pieces)


def token_dtype(vocab: int) -> str:
    return "uint16" if vocab <= 1 << 16 else "uint32"


def write(out_dir: str, tokenizer, tokens: np.ndarray, paths: list[str], overwrite: bool = False) -> dict:
    """tokenizer.json, tokens.bin and tokens.json in `out_dir`; an existing one is kept unless
    `overwrite`. Returns the metadata written to tokens.json."""
    targets = output_files(out_dir, overwrite)
    tokenizer.save(targets[0])
    tokens.tofile(targets[1])
    meta = {"vocab": tokenizer.get_vocab_size(), "token_dtype": str(tokens.dtype), "tokens": int(tokens.size),
            "end_of_text": tokenizer.token_to_id(END_OF_TEXT), "files": len(paths),
            "tokenizer_sha256": sha256(targets[0])}
    with open(targets[2], "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def output_files(out_dir: str, overwrite: bool) -> list[str]:
    """out_dir's tokenizer.json, tokens.bin and tokens.json, the directory made; a TokenizerError
    where one exists and `overwrite` is off (nothing is replaced by mistake)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise TokenizerError(f"--out {out_dir} is a file, not a directory; pass another --out")
    targets = [os.path.join(out_dir, name) for name in (TOKENIZER_FILE, TOKENS_FILE, META_FILE)]
    existing = [t for t in targets if os.path.exists(t)]
    if existing and not overwrite:
        raise TokenizerError(f"{existing[0]} exists; pass --overwrite to replace it, or another --out")
    os.makedirs(out_dir, exist_ok=True)
    return targets


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def byte_tokenizer():
    """Byte b is token b: `encode(text).ids == list(text.encode("utf-8"))`, and decode inverts it
    (an incomplete UTF-8 sequence decodes to U+FFFD). No end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in enumerate(_byte_chars())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_chars() -> list[str]:
    """The printable character GPT-2's byte-level alphabet writes byte b as, for b in 0..255:
    printable Latin-1 bytes stand for themselves, the others take code points from 256 up."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def run_tokenizer(run_dir: str, cfg):
    """The tokenizer whose ids a run's model reads and writes (`cfg` is the run's Config): its
    recorded RUN_DIR/tokenizer/tokenizer.json for `data.source=tokens|jsonl|parquet`, else (the
    byte-level sources) the byte tokenizer."""
    from tokenizers import Tokenizer

    if cfg.data.source in BYTE_LEVEL_SOURCES:
        return byte_tokenizer()
    path = os.path.join(run_dirs.tokenizer_dir(run_dir), TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise TokenizerError(f"{path} does not exist: the run read data.path={cfg.data.path!r}, a token file with no "
                             f"{TOKENIZER_FILE} beside it, so what its ids mean is unknown; put the tokenizer there")
    return Tokenizer.from_file(path)


def run_end_of_text(run_dir: str, cfg) -> int | None:
    """The end-of-document token id a run's tokens.json records (the tokenize command's and the
    jsonl/parquet sources' meta: a model's own EOS, e.g. Llama's `</s>`), None where it has none."""
    if cfg.data.source in BYTE_LEVEL_SOURCES:
        return None
    return end_of_text_beside(run_dirs.tokenizer_dir(run_dir))


def end_of_text_beside(directory: str) -> int | None:
    """The end-of-document token id the tokens.json in `directory` records, None where none does."""
    try:
        with open(os.path.join(directory, META_FILE)) as f:
            return json.load(f).get("end_of_text")
    except (OSError, ValueError):
        return None


def prefix_token(tokenizer, end_of_text: int | None) -> int | None:
    """lm-evaluation-harness's prefix token for the run's model as `export_hf` writes it (its BOS,
    else EOS: the run's end-of-text is both), else `<|endoftext|>` where the tokenizer has one."""
    return tokenizer.token_to_id(END_OF_TEXT) if end_of_text is None else end_of_text


def record_in_run_dir(token_file: str, run_dir: str) -> None:
    """Copy the tokenizer that wrote `token_file` (tokenizer.json and tokens.json beside it) into
    `run_dir`/tokenizer/, so the run says which tokenizer its token ids mean. A token file with
    no tokenizer beside it (made elsewhere) records nothing."""
    source = os.path.dirname(os.path.abspath(token_file))
    files = [os.path.join(source, name) for name in (TOKENIZER_FILE, META_FILE)]
    if not all(os.path.isfile(f) for f in files):
        return
    target = run_dirs.tokenizer_dir(run_dir)
    os.makedirs(target, exist_ok=True)
    for f in files:
        shutil.copyfile(f, os.path.join(target, os.path.basename(f)))
