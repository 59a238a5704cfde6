"""Decoder-only transformer with MegaScale's parallel block and sliding-window attention.

    parallel block:  y = x + Attn(LN(x)) + MLP(LN(x))          (one shared norm)
    serial block:    h = x + Attn(LN1(x));  y = h + MLP(LN2(h)) (standard pre-LN)

Rotary positions (base and rotated share of each head configurable), grouped-query attention,
a GeLU or SwiGLU MLP, biases on every projection or none, tied or untied embedding and LM head:
the options that map the model exactly onto Hugging Face's Llama, Mistral, Starcoder2 and Phi
(`megascale_jax.interop.hf_models`). The layers are stacked on a leading `layers` axis and run with
`nn.scan`, so compile time does not grow with depth and the pipeline can later split that axis.

Parameters are float32; compute runs in `model.dtype` (bf16 on GPU) with float32 softmax,
norms and loss. Every parameter and key activation carries logical axis names; the mapping to
mesh axes lives in `megascale_jax.parallel.sharding`, not here.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels.bias_gelu import gelu_and_grad
from megascale_jax.model import documents
from megascale_jax.model.attention import attend
from megascale_jax.model.documents import Documents
from megascale_jax.config import ModelConfig, ParallelConfig
from megascale_jax.parallel import context_parallel
from megascale_jax.parallel.sharding import per_device
from megascale_jax.parallel.tensor_parallel import column_matmul, embed_lookup, row_matmul, vocab_edges_manual, vocab_logits

INIT_STD = 0.02


def _param(module: nn.Module, name: str, init, shape, axes):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


def _constrain(x, axes):
    return nn.with_logical_constraint(x, axes)


class NormParams(nn.Module):
    """A norm's parameters: scale, and for LayerNorm a bias (`norm` applies them)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self) -> dict:
        d = self.cfg.d_model
        p = {"scale": _param(self, "scale", nn.initializers.ones, (d,), ("norm",))}
        if self.cfg.norm == "layernorm":
            p["bias"] = _param(self, "bias", nn.initializers.zeros, (d,), ("norm",))
        return p


def elementwise(c: ModelConfig, fn):
    """`fn` as is, or with `model.remat=elementwise` under `jax.checkpoint`: its backward keeps
    only its inputs and recomputes the rest. The GeLU and the norms keep only their inputs
    anyway (`xla_bias_gelu`, `normalize`); what it still saves is SwiGLU's intermediates and the
    bias adds around them."""
    return jax.checkpoint(fn) if c.remat == "elementwise" else fn


def norm(c: ModelConfig, p: dict, x):
    """LayerNorm or RMSNorm of x with parameters `p`, computed in float32, returned in `c.dtype`."""
    with jax.named_scope("norm"):  # the model's parts are named in the HLO metadata (profiles, op tables)
        return elementwise(c, functools.partial(_norm, c))(p, x)


def _norm(c: ModelConfig, p: dict, x):
    if c.norm == "layernorm" and c.fused_norm:
        return pallas_kernels.layer_norm(x, p["scale"], p["bias"], eps=c.epsilon, out_dtype=c.dtype)
    centered = c.norm == "layernorm"
    bias = p["bias"] if centered else jnp.zeros((), jnp.float32)
    return normalize(x, p["scale"], bias, c.epsilon, jnp.dtype(c.dtype), centered)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def normalize(x, scale, bias, eps: float, out_dtype, centered: bool):
    """LayerNorm (`centered`) or RMSNorm of x over its last axis, in float32, times `scale` plus
    `bias`, returned in `out_dtype`. Its backward keeps x in its own dtype and each row's mean and
    1/sigma, as PyTorch's and Megatron's norms do: autodiff of the same float32 arithmetic kept
    three float32 copies of x (LayerNorm; RMSNorm two)."""
    return _normalize_fwd(x, scale, bias, eps, out_dtype, centered)[0]


def _normalize_fwd(x, scale, bias, eps: float, out_dtype, centered: bool):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True) if centered else jnp.zeros((), jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True) + eps)
    y = (xf - mean) * rstd * scale + bias
    return y.astype(out_dtype), (x, mean, rstd, scale, bias)


def _normalize_bwd(eps: float, out_dtype, centered: bool, residuals, dy):
    x, mean, rstd, scale, bias = residuals
    xhat = (x.astype(jnp.float32) - mean) * rstd
    dyf = dy.astype(jnp.float32)
    rows = tuple(range(x.ndim - 1))  # the axes scale and bias are broadcast along
    g = dyf * scale
    dx = g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True)
    if centered:
        dx = dx - jnp.mean(g, axis=-1, keepdims=True)
    dbias = jnp.sum(dyf, axis=rows) if centered else jnp.zeros_like(bias)
    return (rstd * dx).astype(x.dtype), jnp.sum(dyf * xhat, axis=rows).astype(scale.dtype), dbias.astype(bias.dtype)


normalize.defvjp(_normalize_fwd, _normalize_bwd)


def rotary(x, positions, base: float = 10000.0, dims: int | None = None):
    """Rotary position embedding on (batch, seq, heads, head_dim): the first `dims` (default all)
    of each head rotate in half-split pairs (i, i + dims/2), as GPT-NeoX and Llama do; the rest
    pass through unchanged (partial rotary, as Phi)."""
    dims = x.shape[-1] if dims is None else dims
    half = dims // 2
    freqs = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions[..., None].astype(jnp.float32) * freqs  # positions (seq,) or (batch, seq), then half
    sin, cos = jnp.sin(angles)[..., None, :], jnp.cos(angles)[..., None, :]  # one for every head
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., :half], xf[..., half:dims], xf[..., dims:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1).astype(x.dtype)


class AttentionParams(nn.Module):
    """q/k/v (column-parallel: heads over tp) and output (row-parallel) projections."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self) -> dict:
        c = self.cfg
        d, hd = c.d_model, c.head_dim
        normal, zeros = nn.initializers.normal(INIT_STD), nn.initializers.zeros
        p = {}
        for name, n, axes in (("q", c.heads, "heads"), ("k", c.kv_heads, "kv_heads"), ("v", c.kv_heads, "kv_heads")):
            p["w" + name] = _param(self, "w" + name, normal, (d, n, hd), ("embed", axes, "head_dim"))
            if c.bias:
                p["b" + name] = _param(self, "b" + name, zeros, (n, hd), (axes, "head_dim"))
        out_init = nn.initializers.normal(INIT_STD / (2 * c.layers) ** 0.5)
        p["wo"] = _param(self, "wo", out_init, (c.heads, hd, d), ("heads", "head_dim", "embed"))
        if c.bias:
            p["bo"] = _param(self, "bo", zeros, (d,), ("embed",))
        return p


class MlpParams(nn.Module):
    """Up projection w1 (column-parallel: mlp over tp), for SwiGLU also the gate wg, and the down
    projection w2 (row-parallel)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self) -> dict:
        c = self.cfg
        d, f = c.d_model, c.mlp_dim
        normal, zeros = nn.initializers.normal(INIT_STD), nn.initializers.zeros
        p = {}
        if c.activation == "swiglu":
            p["wg"] = _param(self, "wg", normal, (d, f), ("embed", "mlp"))
            if c.bias:
                p["bg"] = _param(self, "bg", zeros, (f,), ("mlp",))
        p["w1"] = _param(self, "w1", normal, (d, f), ("embed", "mlp"))
        if c.bias:
            p["b1"] = _param(self, "b1", zeros, (f,), ("mlp",))
        p["w2"] = _param(self, "w2", nn.initializers.normal(INIT_STD / (2 * c.layers) ** 0.5), (f, d), ("mlp", "embed"))
        if c.bias:
            p["b2"] = _param(self, "b2", zeros, (d,), ("embed",))
        return p


def kv_heads_axis(c: ModelConfig) -> str:
    """The logical axis of k's and v's heads: their own, or the query heads' where each tp rank
    holds a repeated kv head (`kv_sharers`)."""
    return "heads" if kv_sharers(c) > 1 else "kv_heads"


def kv_sharers(c: ModelConfig) -> int:
    """How many tp ranks use each kv head: tp / kv_heads when the mesh in scope has more tp ranks
    than kv heads (grouped-query attention, Llama-70B's 8 kv heads at tp=16), else 1."""
    tp = dict(jax.sharding.get_abstract_mesh().shape).get("tp", 1)
    return tp // c.kv_heads if tp > c.kv_heads else 1


def qkv_weights(c: ModelConfig, a: dict) -> list:
    """q, k, v weights as (d_model, heads*head_dim) matrices for `column_matmul`.

    With fewer kv heads than tp ranks the k/v weights are replicated over tp (parallel/sharding.py),
    and each rank computes the kv head its own query heads use: the weights repeated to one kv
    head per rank and split over tp — a local slice of what the rank holds, no communication. The
    alternative, 1/tp of the columns per rank and k and v all-gathered for attention (their
    gradients all-reduced), moved 1.27x the tp bytes of the rest of a Llama-style step."""
    wq, wk, wv = a["wq"], a["wk"], a["wv"]
    if kv_sharers(c) > 1:
        wk, wv = (_constrain(jnp.repeat(w, kv_sharers(c), axis=1), ("embed", "heads", "head_dim")) for w in (wk, wv))
    return [w.reshape(w.shape[0], -1) for w in (wq, wk, wv)]


def attention_heads(c: ModelConfig, q, k, v, a: dict, positions):
    """Projected (b, s, n*hd) q/k/v -> per head (b, s, n, hd), biased, q and k rotated for their
    `positions` (s,). k and v have one head per tp rank where `qkv_weights` repeated them."""
    def heads(y, name, axes):
        y = y.reshape(*y.shape[:2], -1, c.head_dim)
        if c.bias:
            bias = a["b" + name]
            y = y + jnp.repeat(bias, y.shape[2] // bias.shape[0], axis=0).astype(c.dtype)
        return _constrain(y, ("batch", "seq", axes, "head_dim"))

    q, k, v = heads(q, "q", "heads"), heads(k, "k", kv_heads_axis(c)), heads(v, "v", kv_heads_axis(c))
    q, k = (rotary(y, positions, c.rope_base, c.rotary_dims) for y in (q, k))
    return q, k, v


def self_attention(c: ModelConfig, q, k, v, a: dict, docs: Documents | None = None):
    """Projected (b, s, n*hd) q/k/v -> attention over the sequence (b, s, heads*head_dim), heads over
    tp; with `docs`, inside each packed document, its rotary positions from the document's start."""
    positions = (docs.positions if docs is not None and c.rope_restart
                 else context_parallel.first_position(q.shape[1]) + jnp.arange(q.shape[1]))
    q, k, v = attention_heads(c, q, k, v, a, positions)
    heads = ("batch", "seq", "heads", "head_dim")
    ids = None if docs is None else docs.ids
    if context_parallel.cp_size() > 1:  # the sequence split over mesh.cp: its own collectives, per device
        o = context_parallel.attend(q, k, v, window=c.window, documents=ids, kv_heads_axis=kv_heads_axis(c),
                                    implementation=c.attention)
    elif c.attention == "cudnn":
        # cuDNN per device (`sharding.per_device`: jax's cuDNN partitioner fails on most layouts).
        # k and v are split over tp like the query heads (validation makes tp and kv_heads divide
        # one another), so each rank's query heads find their kv heads on the same rank.
        kv = ("batch", "seq", kv_heads_axis(c), "head_dim")
        cudnn = functools.partial(attend, window=c.window, implementation="cudnn")
        if ids is None:
            o = per_device(cudnn, (heads, kv, kv), heads)(q, k, v)
        else:
            o = per_device(lambda q, k, v, d: cudnn(q, k, v, documents=d), (heads, kv, kv, ("batch", "seq")),
                           heads)(q, k, v, ids)
    else:
        o = attend(q, k, v, window=c.window, implementation=c.attention, documents=ids)
    o = _constrain(o, heads)
    return o.reshape(*o.shape[:2], -1)


def mlp_up_weights(c: ModelConfig, m: dict) -> list:
    """The MLP's column-parallel weights, in the order `mlp_activation` takes their outputs."""
    return [m["wg"], m["w1"]] if c.activation == "swiglu" else [m["w1"]]


def mlp_activation(c: ModelConfig, ups: list, m: dict):
    """The MLP's hidden activation from the outputs of `mlp_up_weights` (biases not yet added)."""
    hidden = elementwise(c, functools.partial(_mlp_activation, c))(ups, m)
    return _constrain(hidden, ("batch", "seq", "mlp"))


def _mlp_activation(c: ModelConfig, ups: list, m: dict):
    def biased(u, name):
        return u + m[name].astype(c.dtype) if c.bias else u

    if c.activation == "swiglu":
        gate, up = ups
        hidden = jax.nn.silu(biased(gate, "bg")) * biased(up, "b1")
    elif c.fused_mlp:
        hidden = pallas_kernels.bias_gelu(ups[0], m["b1"].astype(c.dtype), approximate=c.activation == "gelu_tanh")
    else:
        bias = m["b1"].astype(c.dtype) if c.bias else jnp.zeros((), c.dtype)
        hidden = xla_bias_gelu(ups[0], bias, c.activation == "gelu_tanh")
    return hidden


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def xla_bias_gelu(u, b, approximate: bool):
    """gelu(u + b) as `jax.nn.gelu` computes it, in u's dtype, for XLA to fuse. Its backward keeps
    only u and b and recomputes gelu'(u + b) in float32 (`gelu_and_grad`, the Pallas kernel's
    own), as PyTorch's GeLU keeps only its input: autodiff of jax.nn.gelu keeps five arrays of
    u's size (on an H200 at 8 sequences: 75.0 GiB against 49.7 with the Pallas kernels, which
    keep only their inputs)."""
    return jax.nn.gelu(u + b, approximate=approximate)


def _xla_bias_gelu_fwd(u, b, approximate: bool):
    return xla_bias_gelu(u, b, approximate), (u, b)


def _xla_bias_gelu_bwd(approximate: bool, residuals, g):
    u, b = residuals
    du = g.astype(jnp.float32) * gelu_and_grad((u + b).astype(jnp.float32), approximate)[1]
    db = du.sum(axis=tuple(range(du.ndim - b.ndim)))  # over every axis the bias is broadcast along
    return du.astype(u.dtype), db.astype(b.dtype)


xla_bias_gelu.defvjp(_xla_bias_gelu_fwd, _xla_bias_gelu_bwd)


def output_bias(c: ModelConfig, *biases):
    """The sum of the output projections' biases in the compute dtype (0 without biases)."""
    return sum(biases).astype(c.dtype) if c.bias else 0


def layer(c: ModelConfig, par: ParallelConfig, p: dict, x, attention):
    """One transformer layer, (b, s, d) -> (b, s, d), given its parameters `p` (attn, mlp and
    norm, or norm1 and norm2). `attention(q, k, v)` turns the projected q, k, v (b, s, n*hd) into
    the attention output (b, s, heads*hd): over the sequence when training (`self_attention`),
    over a KV cache when decoding (`decode`).

    The parallel block multiplies LN(x) by q, k, v and the MLP's first weight in one column-
    parallel matmul and leaves through one row-parallel matmul over [attention | MLP] — one TP
    collective each way instead of two (see `tensor_parallel`)."""
    a, m = p["attn"], p["mlp"]
    wo = a["wo"].reshape(-1, c.d_model)
    scope = jax.named_scope  # each part named in the HLO metadata (profiles, bench/campaign/op_table.py)
    if c.block == "parallel":
        h = norm(c, p["norm"], x)
        with scope("qkv_mlp_up"):
            q, k, v, *ups = column_matmul(h, [*qkv_weights(c, a), *mlp_up_weights(c, m)], par, c.fp8)
        with scope("attention"):
            o = attention(q, k, v)
        with scope("mlp"):
            hidden = mlp_activation(c, ups, m)
        with scope("out_mlp_down"):
            out = row_matmul([o, hidden], [wo, m["w2"]], par, c.fp8)
        return x + out + output_bias(c, a.get("bo"), m.get("b2"))
    h = norm(c, p["norm1"], x)
    with scope("qkv_projection"):
        q, k, v = column_matmul(h, qkv_weights(c, a), par, c.fp8)
    with scope("attention"):
        o = attention(q, k, v)
    with scope("out_projection"):
        x = x + row_matmul([o], [wo], par, c.fp8) + output_bias(c, a.get("bo"))
    x = _constrain(x, ("batch", "act_seq", "embed"))
    h = norm(c, p["norm2"], x)
    with scope("mlp"):
        ups = column_matmul(h, mlp_up_weights(c, m), par, c.fp8)
        return x + row_matmul([mlp_activation(c, ups, m)], [m["w2"]], par, c.fp8) + output_bias(c, m.get("b2"))


class Block(nn.Module):
    """One transformer layer's parameters and `layer`; `(x, _) -> (y, None)` so that `nn.scan`
    can stack it."""

    cfg: ModelConfig
    parallel: ParallelConfig = ParallelConfig()

    @nn.compact
    def __call__(self, x, docs: Documents | None):
        c = self.cfg
        p = {"attn": AttentionParams(c, name="attn")(), "mlp": MlpParams(c, name="mlp")()}
        for name in ("norm",) if c.block == "parallel" else ("norm1", "norm2"):
            p[name] = NormParams(c, name=name)()
        y = layer(c, self.parallel, p, x, lambda q, k, v: self_attention(c, q, k, v, p["attn"], docs))
        return _constrain(y, ("batch", "act_seq", "embed")), None


# model.remat -> what a layer's forward keeps for its backward (None: everything autodiff saves).
# dots: matmul outputs without batch dimensions (the projections and MLP matmuls, not attention's
# batched score products), the usual choice when memory, not FLOPs, limits the batch.
REMAT_POLICIES = {"none": None, "elementwise": None,  # elementwise: inside the layer (`elementwise`)
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "full": jax.checkpoint_policies.nothing_saveable}


def scanned_blocks(length: int, remat: str = "none", unroll: int = 1):
    """`length` stacked layers as one module: `(x, docs) -> (x, None)`, each layer rematerialised
    per `remat` (a ModelConfig.remat value), `unroll` of them per loop iteration; `docs` (the
    packed documents' layout, or None) the same for every layer."""
    # prevent_cse=False is safe only where the scan's loop keeps XLA from merging the backward's
    # recomputation with the forward; unrolled (the loop gone), that merge would undo the remat
    # (compiled for an H100, gpt_1b at remat=full: 61.8 GiB unrolled without it, as if no remat)
    block = Block if REMAT_POLICIES[remat] is None else nn.remat(Block, policy=REMAT_POLICIES[remat],
                                                                 prevent_cse=min(unroll, length) > 1)
    return nn.scan(
        block, variable_axes={"params": 0}, split_rngs={"params": True}, length=length, in_axes=nn.broadcast,
        unroll=min(unroll, length), metadata_params={nn.PARTITION_NAME: "layers"})


def embed_tokens(cfg: ModelConfig, embed, tokens, parallel: ParallelConfig = ParallelConfig()):
    with jax.named_scope("embed"):
        return _embed_tokens(cfg, embed, tokens, parallel)


def _embed_tokens(cfg: ModelConfig, embed, tokens, parallel: ParallelConfig):
    if vocab_edges_manual(parallel):
        x = embed_lookup(embed, tokens, cfg.dtype)
    else:
        x = jnp.take(embed, tokens, axis=0).astype(cfg.dtype)
    return _constrain(x, ("batch", "act_seq", "embed"))


def run_layers(cfg: ModelConfig, layer_params, x, parallel: ParallelConfig = ParallelConfig(),
               docs: Documents | None = None):
    """Apply a stack of layers (any leading length) given their parameters: one pipeline chunk;
    `docs` the packed documents' layout of x's tokens (`documents.layout`), or None."""
    length = jax.tree.leaves(layer_params)[0].shape[0]
    return scanned_blocks(length, cfg.remat, cfg.scan_unroll)(cfg, parallel).apply({"params": layer_params}, x, docs)[0]


def project_vocab(cfg: ModelConfig, x, head, parallel: ParallelConfig = ParallelConfig()):
    # float32 accumulation: the loss should not see logits rounded to bf16
    with jax.named_scope("lm_head"):
        if vocab_edges_manual(parallel):
            logits = vocab_logits(x, head.astype(cfg.dtype))
        elif cfg.head_grad_float32 or jnp.dtype(cfg.dtype) == jnp.float32 or not mixed_dots_backend():
            logits = jnp.einsum("bsd,dv->bsv", x, head.astype(cfg.dtype), preferred_element_type=jnp.float32)
        else:
            logits = head_logits(x, head, cfg.dtype)
        return _constrain(logits, ("batch", "seq", "vocab"))


def mixed_dots_backend() -> bool:
    """Whether the backend runs every bf16 x bf16 -> float32 GEMM the head's backward may become:
    XLA:CPU (jax 0.10) cannot when the result is laid out transposed, as a tied embedding's
    gradient is ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"), and a CPU
    has no bf16 GEMM speed to gain; there the head keeps autodiff's float32 backward.

    The backend is the mesh's devices' (the trainer traces inside `jax.set_mesh`), the host's only
    without a mesh: a step compiled for GPUs on a CPU-only machine (`plan --compile`) must be the
    step a GPU runs, though the host's own backend is the CPU."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return (device.platform if device is not None else jax.default_backend()) != "cpu"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def head_logits(x, head, dtype):
    """float32 logits of x @ head, both in `dtype`, accumulated in float32. The backward's two GEMMs
    take the logits' gradient in `dtype`, as every other GEMM's backward in the model does (and
    PyTorch's autocast): autodiff of the float32-accumulated forward would run both in float32
    (on an H200 the weight gradient's alone took 15.5 ms of a 340 ms step). Both accumulate in
    float32; the head's gradient is returned in its own (parameter) dtype."""
    return jnp.einsum("bsd,dv->bsv", x, head.astype(dtype), preferred_element_type=jnp.float32)


def _head_logits_fwd(x, head, dtype):
    return head_logits(x, head, dtype), (x, head)


def _head_logits_bwd(dtype, residuals, g):
    x, head = residuals
    g = g.astype(dtype)
    dx = jnp.einsum("bsv,dv->bsd", g, head.astype(dtype), preferred_element_type=jnp.float32)
    dhead = jnp.einsum("bsd,bsv->dv", x.astype(dtype), g, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dhead.astype(head.dtype)


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def lm_logits(cfg: ModelConfig, final_norm_params, head, x, parallel: ParallelConfig = ParallelConfig()):
    """Final norm + LM head given their parameters (the pipeline's last stage)."""
    return project_vocab(cfg, norm(cfg, final_norm_params, x), head, parallel)


def token_losses(logits, targets):
    """Each token's next-token cross entropy in float32: logsumexp(logits) - the target's logit."""
    with jax.named_scope("loss"):
        logz = jax.nn.logsumexp(logits, axis=-1)
        return logz - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def target_scores(logits, targets, mask):
    """Per row: the summed float32 log-probability of the targets where `mask` is 1, and whether
    every one of them is the argmax there — what downstream evaluation asks of the model
    (lm-evaluation-harness's log-likelihood and `is_greedy`; `evaluation.batching`)."""
    with jax.named_scope("target_scores"):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        greedy = (jnp.argmax(logits, axis=-1) == targets) | (mask == 0)
        return jnp.sum(picked * mask, axis=-1), jnp.all(greedy, axis=-1)


def score_fn(model: Transformer, params, batch, mask):
    """`target_scores` of `batch` ((batch, seq_len + 1) tokens: inputs and their next tokens, as
    `loss_fn` takes it) where `mask` (batch, seq_len) is 1."""
    tokens, targets = inputs_and_targets(batch)
    if context_parallel.manual():  # the model returns this cp rank's slice: its targets' scores
        targets, mask = context_parallel.own_slice(targets), context_parallel.own_slice(mask)
    return target_scores(model.apply({"params": params}, tokens), targets, mask)


def cross_entropy(logits, targets, weights=None):
    """Mean next-token cross entropy in float32 over every target position; `weights` (batch, seq)
    zero the targets not trained on (documents.trained_targets), the mean's count unchanged."""
    losses = token_losses(logits, targets)
    return jnp.mean(losses if weights is None else losses * weights)


def chunked_cross_entropy(cfg: ModelConfig, x, head, targets, parallel: ParallelConfig = ParallelConfig(),
                          weights=None):
    """The mean cross entropy of the LM head on `x` (batch, seq, d_model; the final norm applied),
    `cfg.loss_chunks` slices of the sequence at a time: a scan whose body projects one slice to its
    float32 logits and reduces them to the slice's summed loss, under `jax.checkpoint`, so neither
    pass holds more than one slice's logits (the backward recomputes them). The same value and
    gradients as `cross_entropy(project_vocab(...))`, up to float32 summation order.

    With the sequence split over cp (g contiguous parts, one a rank), slice k takes the k-th
    s/(g·n) tokens of every part, so each rank computes its own tokens' losses in every slice
    and nothing crosses cp but the head's gradient, once (contiguous slices of the whole
    sequence would each live on one rank, and GSPMD gathered and reshuffled them)."""
    b, s, d = x.shape
    # g: the parts x holds (1 inside a region manual over cp, where x is one rank's part)
    n, g = cfg.loss_chunks, 1 if context_parallel.manual() else context_parallel.cp_size()

    def sliced(a):  # (b, s, ...) -> (n, b, s/n, ...): the batch keeps its dp split, each part its cp rank
        a = a.reshape(b, g, n, s // (g * n), *a.shape[2:])
        return jnp.moveaxis(a, 2, 0).reshape(n, b, s // n, *a.shape[4:])

    weights = jnp.ones((b, s), jnp.float32) if weights is None else weights
    slices, slice_targets, slice_weights = sliced(x), sliced(targets), sliced(weights)

    @jax.checkpoint
    def slice_loss(x_slice, t_slice, w_slice):
        return jnp.sum(token_losses(project_vocab(cfg, x_slice, head, parallel), t_slice) * w_slice)

    def add(total, piece):
        return total + slice_loss(*piece), None

    total, _ = jax.lax.scan(add, jnp.zeros((), jnp.float32), (slices, slice_targets, slice_weights))
    return total / (b * s)


class Transformer(nn.Module):
    """tokens (batch, seq) int32 -> logits (batch, seq, vocab) float32, or with `hidden=True` the
    final norm's output (batch, seq, d_model), for a loss that applies the head itself."""

    cfg: ModelConfig
    parallel: ParallelConfig = ParallelConfig()
    hidden: bool = False

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        embed = _param(self, "embed", nn.initializers.normal(INIT_STD), (c.vocab, c.d_model), ("vocab", "embed"))
        docs = None if c.document_eos is None else documents.layout(tokens, c.document_eos)
        if docs is not None:  # whole rows, as the tokens: the cumulative sums then cross no cp rank
            docs = Documents(*(_constrain(part, ("batch", None)) for part in docs))
        if context_parallel.manual():  # whole rows in a region manual over cp: this rank's slice of them
            tokens = context_parallel.own_slice(tokens)
            docs = None if docs is None else Documents(*map(context_parallel.own_slice, docs))
        x = embed_tokens(c, embed, tokens, self.parallel)
        x, _ = scanned_blocks(c.layers, c.remat, c.scan_unroll)(c, self.parallel, name="layers")(x, docs)
        x = norm(c, NormParams(c, name="final_norm")(), x)
        if self.hidden:
            return x
        if c.tied_embeddings:
            return project_vocab(c, x, embed.T, self.parallel)
        head = _param(self, "head", nn.initializers.normal(INIT_STD), (c.d_model, c.vocab), ("embed", "vocab"))
        return project_vocab(c, x, head, self.parallel)


def lm_head(cfg: ModelConfig, params: dict):
    """The LM head (d_model, vocab): its own matrix, or the embedding's transpose when tied."""
    return params["embed"].T if cfg.tied_embeddings else params["head"]


def inputs_and_targets(batch):
    """(batch, seq_len + 1) tokens -> the inputs (batch, seq_len) and their next tokens."""
    # Whole rows on every cp rank (sharding.batch_sharding), each cutting its own slice of the
    # inputs and the targets from them: left to GSPMD, a rank took its 17 of 33 tokens (seq_len 32,
    # cp 2) and the one it lacked came from its neighbour by a permute
    return tuple(_constrain(x, ("batch", None)) for x in (batch[:, :-1], batch[:, 1:]))


def loss_fn(model: Transformer, params, batch):
    """Mean next-token cross entropy; `batch` is (batch, seq_len + 1) tokens. With
    `model.loss_chunks` > 1 the head runs slice by slice (`chunked_cross_entropy`)."""
    tokens, targets = inputs_and_targets(batch)
    eos = model.cfg.document_eos
    weights = None if eos is None else documents.trained_targets(tokens, eos)
    if context_parallel.manual():  # the model returns this cp rank's slice: the mean of its tokens
        targets, weights = (None if x is None else context_parallel.own_slice(x) for x in (targets, weights))
    if model.cfg.loss_chunks > 1:
        x = model.clone(hidden=True).apply({"params": params}, tokens)
        return chunked_cross_entropy(model.cfg, x, lm_head(model.cfg, params), targets, model.parallel, weights)
    return cross_entropy(model.apply({"params": params}, tokens), targets, weights)
