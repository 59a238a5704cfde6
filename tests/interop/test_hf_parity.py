"""Our model and transformers (CPU torch, an independent implementation) compute the same logits
from the same weights, for every mapping of interop/hf_models, in both directions:

* export: our random weights -> HF directory -> `AutoModelForCausalLM.from_pretrained`;
* import: a random transformers model -> `save_pretrained` -> `hf_import.load_params` -> ours.

fp32, sequences longer than the window, GQA; max |difference| <= 1e-4 x the logits' scale.
Export followed by import is bitwise.
"""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the interop extra (torch, transformers) is not installed")
transformers = pytest.importorskip("transformers", reason="the interop extra (transformers) is not installed")

from megascale_jax.config import Config, ConfigError, ModelConfig  # noqa: E402
from megascale_jax.interop import hf_export, hf_import, hf_models  # noqa: E402
from megascale_jax.model.transformer import Transformer  # noqa: E402

SEQ = 40
BASE = ModelConfig(layers=2, d_model=64, heads=4, kv_heads=2, vocab=96, seq_len=SEQ, dtype="float32")
# One config per mapping and option, each chosen to exercise something the others do not.
CASES = {
    "llama": dict(block="serial", norm="rmsnorm", activation="swiglu", bias=False, window=None,
                  rope_base=500000.0, mlp_hidden=96),
    "llama_bias_tied": dict(block="serial", norm="rmsnorm", activation="swiglu", bias=True, window=None,
                            tied_embeddings=True, kv_heads=1, norm_eps=1e-5),
    "mistral": dict(block="serial", norm="rmsnorm", activation="swiglu", bias=False, window=12, kv_heads=1),
    "starcoder2": dict(block="serial", norm="layernorm", activation="gelu_tanh", bias=True, window=12),
    "starcoder2_plain": dict(block="serial", norm="layernorm", activation="gelu", bias=False, window=None,
                             tied_embeddings=True, rope_base=1000.0),
    "phi": dict(block="parallel", norm="layernorm", activation="gelu_tanh", bias=True, window=None,
                rope_fraction=0.5),
    "phi_exact_gelu_full_rotary": dict(block="parallel", norm="layernorm", activation="gelu", bias=True,
                                       window=None, rope_fraction=1.0, tied_embeddings=True),
}
EXPECTED_TYPE = {"llama": "llama", "llama_bias_tied": "llama", "mistral": "mistral", "starcoder2": "starcoder2",
                 "starcoder2_plain": "starcoder2", "phi": "phi", "phi_exact_gelu_full_rotary": "phi"}


def model_cfg(case: str) -> ModelConfig:
    return dataclasses.replace(BASE, **CASES[case])


def abstract_params(cfg: ModelConfig):
    return nn.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), np.zeros((1, SEQ), np.int32))["params"])


def random_params(cfg: ModelConfig, seed: int):
    """Seeded values in the model's parameter tree: norm scales 1 + N(0, 0.1²), all else N(0, 0.1²),
    so that no norm is the identity and no bias zero (tracing the init, not running it: fast)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, a: ((1.0 if path[-1].key == "scale" else 0.0) + rng.normal(0, 0.1, a.shape)).astype(np.float32),
        abstract_params(cfg))


def ours(cfg: ModelConfig, params, tokens) -> np.ndarray:
    return np.asarray(Transformer(cfg).apply({"params": params}, tokens))


def theirs(directory: str, tokens) -> tuple[np.ndarray, int]:
    """transformers' logits and its count of (distinct) parameters."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy(), model.num_parameters()


def assert_same_logits(a, b):
    scale = float(np.abs(b).max())
    assert scale > 1.0, "logits too small to compare meaningfully"
    assert np.abs(a - b).max() <= 1e-4 * scale, f"max diff {np.abs(a - b).max():.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_matches_transformers(case, tmp_path):
    cfg = model_cfg(case)
    params = random_params(cfg, seed=len(case))
    tokens = np.random.default_rng(1).integers(0, cfg.vocab, (2, SEQ))
    done = hf_export.write(cfg, params, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == EXPECTED_TYPE[case]
    logits, count = theirs(str(tmp_path), tokens)
    assert done["parameters"] == count  # every tensor was loaded, none left at transformers' init
    assert_same_logits(ours(cfg, params, tokens), logits)


def test_export_then_import_is_bitwise(tmp_path):
    for case in ("mistral", "phi", "starcoder2"):
        cfg = model_cfg(case)
        params = random_params(cfg, seed=3)
        hf_export.write(cfg, params, str(tmp_path / case))
        back = hf_import.load_params(Config(model=dataclasses.replace(cfg, init_from=str(tmp_path / case))),
                                     params)
        jax.tree.map(np.testing.assert_array_equal, back, params)


@pytest.mark.parametrize("case", ["llama_bias_tied", "phi"])
def test_a_bfloat16_export_is_torchs_rounding_of_the_float32_one(case, tmp_path):
    """--dtype bfloat16: every tensor is torch's own bfloat16 rounding of the float32 export's, the
    file half its size; transformers loads the model in bfloat16 and its logits stay within
    bfloat16's error of ours; imported back, the weights are those roundings."""
    from safetensors.torch import load_file

    cfg = model_cfg(case)
    params = random_params(cfg, seed=5)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab, (2, SEQ))
    hf_export.write(cfg, params, str(tmp_path / "f32"))
    done = hf_export.write(cfg, params, str(tmp_path / "bf16"), dtype="bfloat16")
    full, half = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("f32", "bf16"))
    assert sorted(full) == sorted(half) and all(t.dtype == torch.float32 for t in full.values())
    for name, t in full.items():
        assert half[name].dtype == torch.bfloat16 and torch.equal(half[name], t.to(torch.bfloat16)), name
    sizes = [os.path.getsize(tmp_path / d / "model.safetensors") for d in ("f32", "bf16")]
    assert sizes[1] < 0.51 * sizes[0], sizes
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and model.num_parameters() == done["parameters"]
    with torch.no_grad():
        logits = model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
    want = ours(cfg, params, tokens)
    assert np.abs(logits - want).max() <= 0.05 * np.abs(want).max()
    back = hf_import.load_params(Config(model=dataclasses.replace(cfg, init_from=str(tmp_path / "bf16"))), params)
    rounded = jax.tree.map(lambda a: torch.from_numpy(np.asarray(a)).to(torch.bfloat16).float().numpy(), params)
    jax.tree.map(np.testing.assert_array_equal, back, rounded)


def _random_hf_model(case: str, directory: str):
    """A transformers model with torch's own random init, saved as safetensors."""
    cfg = model_cfg(case)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf_models.hf_config(cfg).items()
                                                  if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms and biases away from 1 and 0
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        if hasattr(model, "lm_head") and model.lm_head.bias is not None:
            model.lm_head.bias.zero_()
    model.save_pretrained(directory)
    return cfg


@pytest.mark.parametrize("case", ["llama_bias_tied", "mistral", "starcoder2", "phi"])
def test_import_matches_transformers(case, tmp_path):
    cfg = _random_hf_model(case, str(tmp_path))
    params = hf_import.load_params(Config(model=dataclasses.replace(cfg, init_from=str(tmp_path))),
                                   abstract_params(cfg))
    tokens = np.random.default_rng(2).integers(0, cfg.vocab, (2, SEQ))
    assert_same_logits(ours(cfg, params, tokens), theirs(str(tmp_path), tokens)[0])


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("options, blocked", [
    (dict(block="parallel", window=16), "model.window=16"),
    (dict(block="parallel", norm="rmsnorm"), "model.norm=rmsnorm"),
    (dict(block="serial", norm="rmsnorm", activation="gelu_tanh"), "model.activation=gelu_tanh"),
    (dict(block="serial", norm="rmsnorm", activation="swiglu", window=8, bias=True), "model.bias=true"),
    (dict(block="serial", norm="layernorm", activation="gelu", rope_fraction=0.5), "model.rope_fraction=0.5"),
])
def test_export_refuses_configs_without_exact_equivalent(options, blocked, tmp_path):
    cfg = dataclasses.replace(BASE, **options)
    with pytest.raises(hf_export.ExportError) as e:
        hf_export.write(cfg, {}, str(tmp_path))
    assert blocked in str(e.value) and "\n" not in str(e.value)
    assert not os.listdir(tmp_path)


def test_import_names_each_mismatch(tmp_path):
    cfg = model_cfg("mistral")
    hf_export.write(cfg, random_params(cfg, 0), str(tmp_path))
    wrong = dataclasses.replace(cfg, d_model=128, window=None, init_from=str(tmp_path))
    with pytest.raises(ConfigError) as e:
        hf_import.check(Config(model=wrong))
    message = str(e.value)
    assert "model.d_model=64" in message and "model.window=12" in message and "\n" not in message


def test_import_refuses_unsupported_and_broken_directories(tmp_path):
    cfg = model_cfg("phi")
    good = tmp_path / "good"
    hf_export.write(cfg, random_params(cfg, 0), str(good))
    abstract = abstract_params(cfg)
    start = lambda d: hf_import.load_params(  # noqa: E731
        Config(model=dataclasses.replace(cfg, init_from=str(d))), abstract)

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="gpt2 model \\(GPT2LMHeadModel\\) is not supported"):
        start(gpt2)

    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text((good / "config.json").read_text())
    with pytest.raises(ConfigError, match="has no model.safetensors"):
        start(missing)

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((good / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:200])
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        start(corrupt)

    # config.json says 3 layers of the right width; the weights hold 2 of another shape
    from safetensors.numpy import load_file, save_file
    shaped = tmp_path / "shaped"
    shaped.mkdir()
    (shaped / "config.json").write_text((good / "config.json").read_text())
    tensors = load_file(str(good / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    save_file(tensors, str(shaped / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"k_proj.weight has shape \(8, 64\) but config.json implies \(32, 64\)"):
        start(shaped)

    biased = tmp_path / "biased"
    biased.mkdir()
    (biased / "config.json").write_text((good / "config.json").read_text())
    tensors = load_file(str(good / "model.safetensors"))
    tensors["lm_head.bias"] = np.full((cfg.vocab,), 0.5, np.float32)
    save_file(tensors, str(biased / "model.safetensors"))
    with pytest.raises(ConfigError, match="lm_head.bias is not zero"):
        start(biased)
