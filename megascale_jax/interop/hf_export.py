"""A run's checkpoint as a Hugging Face model directory (`python -m megascale_jax.export_hf`).

Writes `config.json` (hf_models), `model.safetensors` in float32 (the run's master weights,
exactly) or bfloat16 (half the bytes: each weight rounded to nearest even, as torch's
`.to(torch.bfloat16)` rounds it; transformers then loads the model in bfloat16), sharded with an
index above `max_shard_bytes` (default 5 GB, as `save_pretrained`), and the tokenizer the run's token ids
mean: `tokenizer.json` with a `tokenizer_config.json` naming transformers' generic
`PreTrainedTokenizerFast`, so `AutoModelForCausalLM.from_pretrained(OUT_DIR)` and
`AutoTokenizer.from_pretrained(OUT_DIR)` load it with no custom code and no network.

The source is the run's newest committed checkpoint (or step N), whatever mesh and pipeline
layout wrote it: checkpoints hold the canonical layer order (`training.trained`).
"""

from __future__ import annotations

import json
import os
import sys

import ml_dtypes
import numpy as np

from megascale_jax.config import ModelConfig
from megascale_jax.interop import hf_models, hf_weights
from megascale_jax.training import tokenizer as tokenizers_
from megascale_jax.training import trained

DEFAULT_MAX_SHARD_BYTES = 5 * 10 ** 9
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}  # what the safetensors hold
_WRITTEN = ("config.json", hf_weights.SINGLE_FILE, hf_weights.INDEX_FILE, "tokenizer.json", "tokenizer_config.json")


class ExportError(ValueError):
    """A user mistake (no exact HF equivalent, a target that holds a model): one line."""


def check_target(out_dir: str, overwrite: bool) -> None:
    """Refuse to write over a model unless `overwrite`, and into a directory that holds anything
    else (a run directory given twice); old shards are removed when overwriting."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"{out_dir} exists and is not a directory; pass another OUT_DIR")
    names = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    held = [f for f in names if f in _WRITTEN or f.endswith(".safetensors")]
    foreign = [f for f in names if f not in held]
    if foreign:  # a run directory, or anything else of the user's: an export is never mixed into it
        raise ExportError(f"{out_dir} holds files an export does not write ({foreign[0]}): pass an empty or new OUT_DIR")
    if held and not overwrite:
        raise ExportError(f"{out_dir} already holds a model ({held[0]}); pass --overwrite to replace it, or another OUT_DIR")
    for f in held:
        if f.endswith(".safetensors") or f == hf_weights.INDEX_FILE:
            os.remove(os.path.join(out_dir, f))  # a smaller model must not leave stale shards behind


def export(run_dir: str, out_dir: str, step: int | None = None, overwrite: bool = False,
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: str = "float32") -> dict:
    """Write the HF directory of a run; returns {step, architecture, files, parameters}."""
    cfg = trained.run_config(run_dir)
    try:
        hf_models.mapping_for(cfg.model)  # refused before any weight is read
    except hf_models.Unsupported as e:
        raise ExportError(str(e)) from None
    check_target(out_dir, overwrite)
    try:
        tokenizer = tokenizers_.run_tokenizer(run_dir, cfg)
    except tokenizers_.TokenizerError as e:
        raise ExportError(str(e)) from None
    end = tokenizers_.run_end_of_text(run_dir, cfg)
    run = trained.load(run_dir, step, warn=lambda line: print(line, file=sys.stderr))
    return {"step": run.step, **write(cfg.model, run.params, out_dir, tokenizer, max_shard_bytes, end, dtype)}


def write(model: ModelConfig, params, out_dir: str, tokenizer=None,
          max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, end: int | None = None, dtype: str = "float32") -> dict:
    """config.json, the safetensors and (given a `tokenizers.Tokenizer`) the tokenizer files of
    canonical-order `params` in `out_dir`; returns {architecture, files, parameters}. `end`: the
    token that ends a document (a model's own tokenizer's EOS, e.g. Llama's `</s>`), else this
    project's BPE's `<|endoftext|>` where the vocabulary has it. `dtype`: one of `DTYPES`."""
    try:
        mapping = hf_models.mapping_for(model)
    except hf_models.Unsupported as e:
        raise ExportError(str(e)) from None
    if dtype not in DTYPES:
        raise ExportError(f"cannot export in {dtype!r}; choose one of {', '.join(DTYPES)}")
    if end is None and tokenizer is not None:
        end = tokenizer.token_to_id(tokenizers_.END_OF_TEXT)
    # this project's BPE begins and ends documents with one token; a model's own tokenizer adds its
    # BOS itself (its post-processor, saved in tokenizer.json): only its EOS is named
    own = tokenizer.id_to_token(end) if tokenizer is not None and end is not None else None
    bpe = own == tokenizers_.END_OF_TEXT
    tensors = {name: t.astype(DTYPES[dtype], copy=False) for name, t in hf_weights.to_hf(model, mapping, params).items()}
    os.makedirs(out_dir, exist_ok=True)
    files = hf_weights.write_safetensors(tensors, out_dir, max_shard_bytes)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_models.hf_config(model, bos_id=end if bpe else None, eos_id=end, dtype=dtype), f, indent=2)
    if tokenizer is not None:
        tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
        special = {"bos_token": own, "eos_token": own} if bpe else {"eos_token": own} if own is not None else {}
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.seq_len,
                       "clean_up_tokenization_spaces": False, **special}, f, indent=2)
    return {"architecture": mapping.architecture, "files": files,
            "parameters": sum(int(t.size) for t in tensors.values())}
