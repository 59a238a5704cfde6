"""Our parameter tree <-> Hugging Face tensors, and safetensors files in and out.

The conversion is a relabelling plus transposes and reshapes, so export followed by import is
bitwise. Our weights are stored input-features first, `x @ w` (q: (d_model, heads, head_dim),
output projection: (heads, head_dim, d_model), MLP: (d_model, mlp) and (mlp, d_model)), with the
layers stacked on a leading axis; HF's `nn.Linear` weights are (out_features, in_features), one
tensor per layer. So an HF weight is our weight flattened to (in, out) and transposed, and back.
The head dims keep their order: HF's q_proj rows are head-major like our (heads, head_dim), and
both rotate half-split pairs, so no permutation is needed anywhere.

Leaf names map to HF modules through the architecture's `Mapping.modules` (hf_models): `wq`/`bq`
-> modules["q"] weight/bias, `w1` -> modules["1"], norms' `scale`/`bias` -> weight/bias.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

from megascale_jax.config import ModelConfig
from megascale_jax.interop.hf_models import Mapping

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# Weights whose input features are their first dim; the others (wo, w2) have them all but the last.
_INPUT_FIRST = frozenset({"wq", "wk", "wv", "wg", "w1"})


def _hf_leaf(mapping: Mapping, part: str, leaf: str) -> str:
    """The HF name, under `model.layers.{i}.`, of our layer leaf `part/leaf` (e.g. attn/wq)."""
    if part.startswith("norm"):
        return f"{mapping.modules[part]}.{'weight' if leaf == 'scale' else 'bias'}"
    return f"{mapping.modules[leaf[1:]]}.{'weight' if leaf[0] == 'w' else 'bias'}"


def _to_hf(leaf: str, x: np.ndarray) -> np.ndarray:
    if leaf.startswith("w"):
        inputs = 1 if leaf in _INPUT_FIRST else x.ndim - 1
        return np.ascontiguousarray(x.reshape(int(np.prod(x.shape[:inputs])), -1).T)
    return x.reshape(-1)


def _from_hf(leaf: str, t: np.ndarray, shape: tuple) -> np.ndarray:
    return (t.T if leaf.startswith("w") else t).reshape(shape)


def _edges(mapping: Mapping, m: ModelConfig) -> dict[str, tuple[str, Callable, Callable]]:
    """Non-layer tensors: HF name -> (our path, ours->HF, HF->ours)."""
    same = lambda x: x  # noqa: E731
    out = {"model.embed_tokens.weight": ("embed", same, same)}
    for leaf in ("scale", "bias") if m.norm == "layernorm" else ("scale",):
        out[f"{mapping.final_norm}.{'weight' if leaf == 'scale' else 'bias'}"] = (f"final_norm/{leaf}", same, same)
    if not m.tied_embeddings:
        out["lm_head.weight"] = ("head", lambda x: np.ascontiguousarray(x.T), lambda t: t.T)
    return out


def to_hf(m: ModelConfig, mapping: Mapping, params) -> dict[str, np.ndarray]:
    """HF tensors (name -> float32 array) of our canonical-order `params`."""
    flat = _flatten(params)
    tensors = {name: to(np.asarray(flat[path])) for name, (path, to, _) in _edges(mapping, m).items()}
    if mapping.head_bias:
        tensors["lm_head.bias"] = np.zeros((m.vocab,), np.float32)
    for path, stacked in flat.items():
        if path.startswith("layers/"):
            _, part, leaf = path.split("/")
            stacked = np.asarray(stacked)
            for i in range(m.layers):
                tensors[f"model.layers.{i}.{_hf_leaf(mapping, part, leaf)}"] = _to_hf(leaf, stacked[i])
    return tensors


def from_hf(m: ModelConfig, mapping: Mapping, abstract_params, read: Callable[[str, tuple], np.ndarray]):
    """Our parameter tree (canonical order, float32 numpy) from HF tensors. `read(name, shape)`
    returns the HF tensor `name`, checked to have `shape`; `abstract_params` gives our shapes."""
    flat = {path: tuple(a.shape) for path, a in _flatten(abstract_params).items()}
    out = {}
    for name, (path, to, back) in _edges(mapping, m).items():
        shape = flat[path]
        out[path] = back(read(name, to(np.empty(shape, np.float32)).shape))
    for path, shape in flat.items():
        if path.startswith("layers/"):
            _, part, leaf = path.split("/")
            hf_shape = _to_hf(leaf, np.empty(shape[1:], np.float32)).shape
            out[path] = np.stack([_from_hf(leaf, read(f"model.layers.{i}.{_hf_leaf(mapping, part, leaf)}", hf_shape),
                                           shape[1:]) for i in range(m.layers)])
    return _unflatten(out)


def _flatten(tree, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[prefix + key] = value
    return flat


def _unflatten(flat: dict) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


# ----------------------------------------------------------------------------- files


def write_safetensors(tensors: dict[str, np.ndarray], out_dir: str, max_shard_bytes: int) -> list[str]:
    """`model.safetensors`, or shards `model-0000k-of-0000n.safetensors` and their index when the
    tensors exceed `max_shard_bytes` (HF's 5 GB convention). Returns the files written."""
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.numpy import save_file

    split = split_state_dict_into_shards_factory(
        tensors, get_storage_size=lambda a: a.nbytes, max_shard_size=max_shard_bytes,
        filename_pattern="model{suffix}.safetensors")
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, os.path.join(out_dir, filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                 "weight_map": split.tensor_to_filename}
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
    return sorted(split.filename_to_tensors)


class SafetensorsReader:
    """Reads tensors by name from an HF directory's `model.safetensors` or its shards' index.
    Raises ValueError with a one-line message for a missing, corrupt or incomplete file."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.files = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index} is not a safetensors index ({e}); re-download or re-export it") from None
        elif os.path.isfile(os.path.join(directory, SINGLE_FILE)):
            self.files = None
        else:
            raise ValueError(f"{directory} has no {SINGLE_FILE} (or {INDEX_FILE}); model.init_from needs "
                             "safetensors weights beside config.json")
        self._open: dict = {}

    def _file(self, name: str):
        from safetensors import safe_open

        filename = SINGLE_FILE if self.files is None else self.files.get(name)
        if filename is None:
            raise ValueError(f"{os.path.join(self.directory, INDEX_FILE)} does not list tensor {name}")
        if filename not in self._open:
            path = os.path.join(self.directory, filename)
            try:
                self._open[filename] = safe_open(path, framework="numpy")
            except Exception as e:  # missing shard, truncated or garbage header
                raise ValueError(f"{path} is not a readable safetensors file ({str(e).splitlines()[0]}); "
                                 "re-download or re-export it") from None
        return self._open[filename], filename

    def read(self, name: str, shape: tuple) -> np.ndarray:
        f, filename = self._file(name)
        if name not in f.keys():
            raise ValueError(f"{os.path.join(self.directory, filename)} has no tensor {name}; "
                             "it does not match its config.json")
        try:
            t = f.get_tensor(name)
        except Exception as e:
            raise ValueError(f"{os.path.join(self.directory, filename)}: tensor {name} is unreadable "
                             f"({str(e).splitlines()[0]})") from None
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{os.path.join(self.directory, filename)}: {name} has shape {tuple(t.shape)} but "
                             f"config.json implies {tuple(shape)}")
        return t.astype(np.float32)

    def has(self, name: str) -> bool:
        return name in self.files if self.files is not None else name in self._file(name)[0].keys()
