"""Decoder-only transformer with MegaScale's parallel block and sliding-window attention.

    parallel block:  y = x + Attn(LN(x)) + MLP(LN(x))          (one shared norm)
    serial block:    h = x + Attn(LN1(x));  y = h + MLP(LN2(h)) (standard pre-LN)

Rotary positions, grouped-query attention, a GeLU MLP, biases on every projection (GPT-3 style),
untied embedding and LM head. The layers are stacked on a leading `layers` axis and run with
`nn.scan`, so compile time does not grow with depth and the pipeline can later split that axis.

Parameters are float32; compute runs in `model.dtype` (bf16 on GPU) with float32 softmax,
norms and loss. Every parameter and key activation carries logical axis names; the mapping to
mesh axes lives in `megascale_jax.sharding`, not here.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from megascale_jax.attention import attend
from megascale_jax.config import ModelConfig

INIT_STD = 0.02


def _param(module: nn.Module, name: str, init, shape, axes):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


def _constrain(x, axes):
    return nn.with_logical_constraint(x, axes)


class Norm(nn.Module):
    """LayerNorm (scale + bias) or RMSNorm (scale), computed in float32."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        xf = x.astype(jnp.float32)
        scale = _param(self, "scale", nn.initializers.ones, (d,), ("norm",))
        if self.cfg.norm == "rmsnorm":
            y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6) * scale
        else:
            bias = _param(self, "bias", nn.initializers.zeros, (d,), ("norm",))
            mean = jnp.mean(xf, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
            y = (xf - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias
        return y.astype(self.cfg.dtype)


def rotary(x, positions):
    """Rotary position embedding on (batch, seq, heads, head_dim), rotating half-split pairs."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # (seq, half)
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nn.Module):
    """Column-parallel q/k/v (heads over tp), row-parallel output projection."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        d, h, k, hd = c.d_model, c.heads, c.kv_heads, c.head_dim
        normal = nn.initializers.normal(INIT_STD)
        out_init = nn.initializers.normal(INIT_STD / (2 * c.layers) ** 0.5)
        zeros = nn.initializers.zeros

        def project(name, n, axes):
            w = _param(self, "w" + name, normal, (d, n, hd), ("embed", axes, "head_dim"))
            b = _param(self, "b" + name, zeros, (n, hd), (axes, "head_dim"))
            y = jnp.einsum("bsd,dnh->bsnh", x, w.astype(c.dtype)) + b.astype(c.dtype)
            return _constrain(y, ("batch", "seq", axes, "head_dim"))

        q, kk, v = project("q", h, "heads"), project("k", k, "kv_heads"), project("v", k, "kv_heads")
        positions = jnp.arange(x.shape[1])
        q, kk = rotary(q, positions), rotary(kk, positions)
        o = attend(q, kk, v, window=c.window, implementation=c.attention)
        o = _constrain(o, ("batch", "seq", "heads", "head_dim"))
        wo = _param(self, "wo", out_init, (h, hd, d), ("heads", "head_dim", "embed"))
        bo = _param(self, "bo", zeros, (d,), ("embed",))
        return jnp.einsum("bsnh,nhd->bsd", o, wo.astype(c.dtype)) + bo.astype(c.dtype)


class Mlp(nn.Module):
    """Column-parallel up projection (mlp over tp), GeLU, row-parallel down projection."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        d, f = c.d_model, c.mlp_dim
        w1 = _param(self, "w1", nn.initializers.normal(INIT_STD), (d, f), ("embed", "mlp"))
        b1 = _param(self, "b1", nn.initializers.zeros, (f,), ("mlp",))
        w2 = _param(self, "w2", nn.initializers.normal(INIT_STD / (2 * c.layers) ** 0.5), (f, d), ("mlp", "embed"))
        b2 = _param(self, "b2", nn.initializers.zeros, (d,), ("embed",))
        hidden = jnp.einsum("bsd,df->bsf", x, w1.astype(c.dtype)) + b1.astype(c.dtype)
        hidden = jax.nn.gelu(hidden, approximate=c.activation == "gelu_tanh")
        hidden = _constrain(hidden, ("batch", "seq", "mlp"))
        return jnp.einsum("bsf,fd->bsd", hidden, w2.astype(c.dtype)) + b2.astype(c.dtype)


class Block(nn.Module):
    """One transformer layer; `(x, _) -> (y, None)` so that `nn.scan` can stack it."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, _):
        if self.cfg.block == "parallel":
            h = Norm(self.cfg, name="norm")(x)
            y = x + Attention(self.cfg, name="attn")(h) + Mlp(self.cfg, name="mlp")(h)
        else:
            x = x + Attention(self.cfg, name="attn")(Norm(self.cfg, name="norm1")(x))
            y = x + Mlp(self.cfg, name="mlp")(Norm(self.cfg, name="norm2")(x))
        return _constrain(y, ("batch", "seq", "embed")), None


def scanned_blocks(cfg: ModelConfig, length: int):
    """`length` stacked layers as one module: `(x, None) -> (x, None)`."""
    return nn.scan(
        Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=length,
        metadata_params={nn.PARTITION_NAME: "layers"})


def embed_tokens(cfg: ModelConfig, embed, tokens):
    x = jnp.take(embed, tokens, axis=0).astype(cfg.dtype)
    return _constrain(x, ("batch", "seq", "embed"))


def run_layers(cfg: ModelConfig, layer_params, x):
    """Apply a stack of layers (any leading length) given their parameters: one pipeline chunk."""
    length = jax.tree.leaves(layer_params)[0].shape[0]
    return scanned_blocks(cfg, length)(cfg).apply({"params": layer_params}, x, None)[0]


def project_vocab(cfg: ModelConfig, x, head):
    # float32 accumulation: the loss should not see logits rounded to bf16
    logits = jnp.einsum("bsd,dv->bsv", x, head.astype(cfg.dtype), preferred_element_type=jnp.float32)
    return _constrain(logits, ("batch", "seq", "vocab"))


def lm_logits(cfg: ModelConfig, final_norm_params, head, x):
    """Final norm + LM head given their parameters (the pipeline's last stage)."""
    return project_vocab(cfg, Norm(cfg).apply({"params": final_norm_params}, x), head)


def cross_entropy(logits, targets):
    """Mean next-token cross entropy in float32."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - target_logit)


class Transformer(nn.Module):
    """tokens (batch, seq) int32 -> logits (batch, seq, vocab) float32."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        embed = _param(self, "embed", nn.initializers.normal(INIT_STD), (c.vocab, c.d_model), ("vocab", "embed"))
        x = embed_tokens(c, embed, tokens)
        x, _ = scanned_blocks(c, c.layers)(c, name="layers")(x, None)
        x = Norm(c, name="final_norm")(x)
        head = _param(self, "head", nn.initializers.normal(INIT_STD), (c.d_model, c.vocab), ("embed", "vocab"))
        return project_vocab(c, x, head)


def loss_fn(model: Transformer, params, batch):
    """Mean next-token cross entropy; `batch` is (batch, seq_len + 1) tokens."""
    return cross_entropy(model.apply({"params": params}, batch[:, :-1]), batch[:, 1:])
