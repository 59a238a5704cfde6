"""`model.init_from=PATH`: start training from a Hugging Face model's weights, on any mesh.

`check` runs before anything compiles: PATH's config.json must be an architecture of
`hf_models.MAPPINGS` and imply exactly the config's model section (vocab, sizes, block, norm,
MLP, biases, window, rotary, epsilon); the one-line error lists every `model.KEY=VALUE` that
would make it match. `load_params` reads the safetensors (one file or shards with an index; bf16
or fp32 tensors become float32), checks every tensor's shape against config.json, and returns our
parameter tree in canonical layer order, which the trainer then shards onto its mesh. A run that
resumes from its own checkpoint ignores `init_from`.
"""

from __future__ import annotations

import json
import os

import numpy as np

from megascale_jax.config import Config, ConfigError
from megascale_jax.interop import hf_models, hf_weights


def check(cfg: Config) -> hf_models.Mapping:
    """The HF architecture of `cfg.model.init_from`, matching the model section, or ConfigError."""
    path = cfg.model.init_from
    config_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ConfigError(f"model.init_from={path!r} is not a directory; pass a Hugging Face model directory")
    try:
        with open(config_file) as f:
            hf = json.load(f)
    except OSError:
        raise ConfigError(f"model.init_from={path!r} has no readable config.json; pass a Hugging Face model directory")
    except ValueError as e:
        raise ConfigError(f"{config_file} is not valid JSON ({e}); re-download or re-export it") from None
    try:
        mapping, keys = hf_models.model_keys(hf, path)
    except hf_models.Unsupported as e:
        raise ConfigError(f"model.init_from: {e}") from None
    differ = hf_models.mismatches(cfg.model, keys)
    if differ:
        raise ConfigError(f"model.init_from={path!r} is a {mapping.architecture} that differs from the model "
                          f"section; set {' '.join(differ)}")
    try:
        hf_weights.SafetensorsReader(path)
    except ValueError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    return mapping


def load_params(cfg: Config, abstract_params) -> dict:
    """Our canonical-order parameters (float32 numpy) from `cfg.model.init_from`'s safetensors."""
    mapping = check(cfg)
    reader = hf_weights.SafetensorsReader(cfg.model.init_from)
    try:
        params = hf_weights.from_hf(cfg.model, mapping, abstract_params, reader.read)
        if mapping.head_bias and reader.has("lm_head.bias"):
            bias = reader.read("lm_head.bias", (cfg.model.vocab,))
            if np.any(bias != 0):
                raise ValueError(f"{cfg.model.init_from}: lm_head.bias is not zero (max |b| = "
                                 f"{np.abs(bias).max():.3g}) and this model's LM head has no bias")
    except ValueError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    return params
