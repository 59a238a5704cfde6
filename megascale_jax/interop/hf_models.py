"""Which Hugging Face architecture a model config *is*, exactly, and that architecture's config.json.

Four mappings; for each, transformers computes the same function from the same weights
(tests/interop/test_hf_parity.py compares logits):

| HF model_type | block    | norm      | MLP             | biases       | window | rotary   |
|---------------|----------|-----------|-----------------|--------------|--------|----------|
| llama         | serial   | rmsnorm   | swiglu          | any          | null   | full     |
| mistral       | serial   | rmsnorm   | swiglu          | none         | any    | full     |
| starcoder2    | serial   | layernorm | gelu, gelu_tanh | any          | any    | full     |
| phi           | parallel | layernorm | gelu, gelu_tanh | all          | null   | any part |

GQA, tied or untied embeddings, the rotary base and the norms' epsilon map in every case.

MegaScale's parallel block goes to **Phi**: Phi's decoder layer feeds *one* `input_layernorm` to
both attention and MLP and adds both to the residual, `y = x + Attn(LN(x)) + MLP(LN(x))`, our
block exactly; like ours it has biases on every projection, GQA, a GeLU MLP and partial rotary in
the half-split (GPT-NeoX) layout. The alternatives are worse fits: GPT-NeoX's parallel residual
has two norms (an export would duplicate ours, an import would need them equal), GPT-J has no
GQA, no q/k/v biases and interleaved rotary. Phi's one extra, a bias on the LM head, is exported
as zeros, and an imported one must be zero. Phi has no sliding window, and no HF architecture has
both the parallel block and a window, so a parallel block with `model.window` set is refused.

Nothing here needs jax or transformers: config.json is written and read as JSON.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megascale_jax.config import ModelConfig


class Unsupported(ValueError):
    """A model config or an HF directory with no exact counterpart: the message is one line."""


@dataclasses.dataclass(frozen=True)
class Mapping:
    model_type: str
    architecture: str  # the transformers class config.json names
    requires: tuple[tuple[str, tuple, str], ...]  # (ModelConfig key, allowed values, why)
    modules: dict  # our layer part -> the HF module it is (see hf_weights)
    final_norm: str = "model.norm"
    head_bias: bool = False  # the HF LM head has a bias (zero here)


_SERIAL = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "norm1": "input_layernorm", "norm2": "post_attention_layernorm"}
_FULL_ROTARY = ("rope_fraction", (1.0,), "rotates every head dim")
LLAMA = Mapping(
    "llama", "LlamaForCausalLM",
    (("activation", ("swiglu",), "has a SwiGLU MLP"), ("window", (None,), "has no sliding window (Mistral has)"),
     _FULL_ROTARY),
    {**_SERIAL, "g": "mlp.gate_proj", "1": "mlp.up_proj", "2": "mlp.down_proj"})
MISTRAL = dataclasses.replace(
    LLAMA, model_type="mistral", architecture="MistralForCausalLM",
    requires=(("activation", ("swiglu",), "has a SwiGLU MLP"), ("bias", (False,), "has no biases"), _FULL_ROTARY))
STARCODER2 = Mapping(
    "starcoder2", "Starcoder2ForCausalLM",
    (("activation", ("gelu", "gelu_tanh"), "has a GeLU MLP"), _FULL_ROTARY),
    {**_SERIAL, "1": "mlp.c_fc", "2": "mlp.c_proj"})
PHI = Mapping(
    "phi", "PhiForCausalLM",
    (("norm", ("layernorm",), "uses LayerNorm"), ("activation", ("gelu", "gelu_tanh"), "has a GeLU MLP"),
     ("bias", (True,), "has biases on every projection"),
     ("window", (None,), "has no sliding window (no HF architecture has the parallel block with one)")),
    {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.dense",
     "norm": "input_layernorm", "1": "mlp.fc1", "2": "mlp.fc2"},
    final_norm="model.final_layernorm", head_bias=True)
MAPPINGS = {m.model_type: m for m in (LLAMA, MISTRAL, STARCODER2, PHI)}

_GELU_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}  # ours -> HF hidden_act
_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                   "gelu_fast": None, "silu": "swiglu"}  # HF hidden_act -> ours (None: no exact match)


def mapping_for(m: ModelConfig) -> Mapping:
    """The HF architecture `m` is exactly; `Unsupported` names the first option that blocks it."""
    if m.block == "parallel":
        mapping = PHI
    elif m.norm == "rmsnorm":
        mapping = MISTRAL if m.window is not None else LLAMA
    else:
        mapping = STARCODER2
    for key, allowed, why in mapping.requires:
        value = getattr(m, key)
        if value not in allowed:
            shown = "null" if value is None else str(value).lower()
            fix = " or ".join("null" if a is None else str(a).lower() for a in allowed)
            raise Unsupported(f"model.{key}={shown} has no exact Hugging Face equivalent: a {m.block} block with "
                              f"{m.norm} maps to {mapping.architecture}, which {why}; set model.{key}={fix}")
    return mapping


def hf_config(m: ModelConfig, bos_id: int | None = None, eos_id: int | None = None, dtype: str = "float32") -> dict:
    """config.json for the HF architecture `m` is (see `mapping_for`), its weights in `dtype`."""
    mapping = mapping_for(m)
    rope = {"rope_type": "default", "rope_theta": m.rope_base}
    config: dict[str, Any] = {
        "architectures": [mapping.architecture], "model_type": mapping.model_type,
        "vocab_size": m.vocab, "hidden_size": m.d_model, "intermediate_size": m.mlp_dim,
        "num_hidden_layers": m.layers, "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads,
        "max_position_embeddings": m.seq_len, "tie_word_embeddings": m.tied_embeddings,
        "rope_theta": m.rope_base,  # transformers 4 reads this; 5 reads rope_parameters (and converts this)
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": dtype,  # transformers 5 also reads it as `dtype`
        "bos_token_id": bos_id, "eos_token_id": eos_id,
    }
    if mapping in (LLAMA, MISTRAL):
        config.update(hidden_act="silu", rms_norm_eps=m.epsilon, head_dim=m.head_dim)
        if mapping is LLAMA:
            config.update(attention_bias=m.bias, mlp_bias=m.bias)
        else:
            config.update(sliding_window=m.window)
    elif mapping is STARCODER2:
        config.update(hidden_act=_GELU_NAMES[m.activation], norm_epsilon=m.epsilon, use_bias=m.bias,
                      sliding_window=m.window, residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0)
    else:
        config.update(hidden_act=_GELU_NAMES[m.activation], layer_norm_eps=m.epsilon, qk_layernorm=False,
                      partial_rotary_factor=m.rope_fraction, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
        rope["partial_rotary_factor"] = m.rope_fraction
    config["rope_parameters"] = rope
    return config


def model_keys(hf: dict, where: str) -> tuple[Mapping, dict]:
    """(mapping, {ModelConfig key: value}) that an HF config.json (`hf`, read from `where`)
    implies. `Unsupported` for an architecture or an option with no exact counterpart here."""
    model_type = hf.get("model_type")
    if model_type not in MAPPINGS:
        name = (hf.get("architectures") or [None])[0]
        raise Unsupported(f"{where}: a {model_type or 'unnamed'} model{f' ({name})' if name else ''} is not supported; "
                          f"model.init_from reads {', '.join(sorted(MAPPINGS))}")
    mapping = MAPPINGS[model_type]

    def need(key: str):
        if key not in hf:
            raise Unsupported(f"{where}: config.json has no {key!r}; it is not a complete {model_type} config")
        return hf[key]

    d, heads = need("hidden_size"), need("num_attention_heads")
    rope = hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", (hf.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type != "default" or hf.get("rope_scaling"):
        raise Unsupported(f"{where}: rope_type={rope_type} (rope scaling) is not supported; only the default rotary")
    head_dim = hf.get("head_dim") or d // heads
    if head_dim * heads != d:
        raise Unsupported(f"{where}: head_dim={head_dim} x num_attention_heads={heads} != hidden_size={d}; "
                          "this model needs head_dim = d_model / heads")
    activation = _HF_ACTIVATIONS.get(hf.get("hidden_act", "silu" if mapping in (LLAMA, MISTRAL) else None))
    keys = {
        "block": "parallel" if mapping is PHI else "serial",
        "norm": "rmsnorm" if mapping in (LLAMA, MISTRAL) else "layernorm",
        "activation": activation,
        "vocab": need("vocab_size"), "d_model": d, "heads": heads,
        "kv_heads": hf.get("num_key_value_heads") or heads, "layers": need("num_hidden_layers"),
        "mlp_dim": need("intermediate_size"),
        "tied_embeddings": bool(hf.get("tie_word_embeddings", mapping is STARCODER2)),
        "rope_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "rope_fraction": float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor",
                                                                         0.5 if mapping is PHI else 1.0))),
    }
    if activation is None or (activation == "swiglu") != (mapping in (LLAMA, MISTRAL)):
        raise Unsupported(f"{where}: hidden_act={hf.get('hidden_act')} has no exact counterpart here for {model_type}")
    if mapping is LLAMA:
        if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
            raise Unsupported(f"{where}: attention_bias and mlp_bias differ; model.bias sets both")
        keys.update(bias=bool(hf.get("attention_bias", False)), window=None, epsilon=float(hf.get("rms_norm_eps", 1e-6)))
    elif mapping is MISTRAL:
        keys.update(bias=False, window=hf.get("sliding_window"), epsilon=float(hf.get("rms_norm_eps", 1e-6)))
    elif mapping is STARCODER2:
        keys.update(bias=bool(hf.get("use_bias", True)), window=hf.get("sliding_window"),
                    epsilon=float(hf.get("norm_epsilon", 1e-5)))
    else:
        if hf.get("qk_layernorm"):
            raise Unsupported(f"{where}: qk_layernorm=true (Phi's optional q/k norms) is not supported")
        keys.update(bias=True, window=None, epsilon=float(hf.get("layer_norm_eps", 1e-5)))
    return mapping, keys


# How each implied key is set in our config, when it differs (mlp_dim and epsilon are derived).
_SETTING = {"mlp_dim": "mlp_hidden", "epsilon": "norm_eps"}


def mismatches(m: ModelConfig, keys: dict) -> list[str]:
    """`model.KEY=VALUE` settings that would make `m` match the implied `keys` (empty: it does)."""
    def shown(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    return [f"model.{_SETTING.get(k, k)}={shown(v)}" for k, v in keys.items() if getattr(m, k) != v]
