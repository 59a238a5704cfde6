"""Actual PartitionSpecs of parameters, optimizer moments (with and without ZeRO-1) and key
activations on the default dp=4 × tp=2 mesh, against tables written out by hand from the
Megatron layout (stacked layers split over pp): column-parallel q/k/v and w1 shard their output features over tp, row-parallel
wo and w2 shard their input features over tp, the vocabulary is split over tp, batch over dp.
"""

import math

import chex
import flax.linen as nn
import jax
import pytest
from jax.sharding import PartitionSpec as P

from megascale_jax.model import transformer
from megascale_jax.parallel import sharding
from megascale_jax.config import load_config
from megascale_jax.parallel.mesh import make_mesh
from megascale_jax.training.trainer import build_trainer

# tiny_cpu: layers 4, d_model 128, heads 4, kv_heads 2, head_dim 32, mlp 512, vocab 256.
PARAM_SPECS = {
    "embed": P("tp", None),
    "head": P(None, "tp"),
    "final_norm/scale": P(),
    "final_norm/bias": P(),
    "layers/norm/scale": P("pp"),
    "layers/norm/bias": P("pp"),
    "layers/attn/wq": P("pp", None, "tp", None),
    "layers/attn/wk": P("pp", None, "tp", None),
    "layers/attn/wv": P("pp", None, "tp", None),
    "layers/attn/bq": P("pp", "tp", None),
    "layers/attn/bk": P("pp", "tp", None),
    "layers/attn/bv": P("pp", "tp", None),
    "layers/attn/wo": P("pp", "tp", None, None),
    "layers/attn/bo": P("pp"),
    "layers/mlp/w1": P("pp", None, "tp"),
    "layers/mlp/b1": P("pp", "tp"),
    "layers/mlp/w2": P("pp", "tp", None),
    "layers/mlp/b2": P("pp"),
}

# ZeRO-1 adds dp on the largest still-unsharded dimension that dp=4 divides.
ZERO1_MOMENT_SPECS = {
    "embed": P("tp", "dp"),                          # (256, 128)
    "head": P("dp", "tp"),                           # (128, 256)
    "final_norm/scale": P("dp"),                     # (128,)
    "final_norm/bias": P("dp"),
    "layers/norm/scale": P("pp", "dp"),              # (4, 128)
    "layers/norm/bias": P("pp", "dp"),
    "layers/attn/wq": P("pp", "dp", "tp", None),     # (4, 128, 4, 32)
    "layers/attn/wk": P("pp", "dp", "tp", None),     # (4, 128, 2, 32)
    "layers/attn/wv": P("pp", "dp", "tp", None),
    "layers/attn/bq": P("pp", "tp", "dp"),           # (4, 4, 32)
    "layers/attn/bk": P("pp", "tp", "dp"),           # (4, 2, 32)
    "layers/attn/bv": P("pp", "tp", "dp"),
    "layers/attn/wo": P("pp", "tp", None, "dp"),     # (4, 4, 32, 128)
    "layers/attn/bo": P("pp", "dp"),                 # (4, 128)
    "layers/mlp/w1": P("pp", "dp", "tp"),            # (4, 128, 512)
    "layers/mlp/b1": P("pp", "tp"),                  # (4, 512): no free dim, stays whole over dp
    "layers/mlp/w2": P("pp", "tp", "dp"),            # (4, 512, 128)
    "layers/mlp/b2": P("pp", "dp"),                  # (4, 128)
}


def normalized(spec) -> P:
    """Drop trailing unsharded dims so P('dp', None) == P('dp')."""
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)


def flat(tree) -> dict:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out["/".join(str(k.key) for k in path)] = leaf
    return out


# The tests reading `trained` run on one xdist worker, which builds each of its states once.
TRAINED = pytest.mark.xdist_group("sharding_trained")


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "zero1"])
def trained(request):
    cfg = load_config(None, [f"parallel.zero1={request.param}", "train.global_batch=8"])
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    return request.param, trainer, trainer.init()


@pytest.mark.slow
@TRAINED
def test_parameter_specs(trained):
    _, _, state = trained
    params = flat(state.params)
    assert set(params) == set(PARAM_SPECS)
    for name, array in params.items():
        assert normalized(array.sharding.spec) == normalized(PARAM_SPECS[name]), name


def shard_shape(shape, spec, mesh) -> tuple:
    """The per-device block of an array of `shape` laid out by `spec` (even splits only)."""
    spec = list(spec) + [None] * (len(shape) - len(spec))
    return tuple(n // math.prod(mesh.shape[a] for a in ((s,) if isinstance(s, str) else s or ()))
                 for n, s in zip(shape, spec))


@TRAINED
def test_state_is_sharded_over_the_whole_mesh_in_blocks_the_specs_imply(trained):
    zero1, trainer, state = trained
    mesh = trainer.mesh
    # Every leaf (params, moments, step, count) lives on all 8 devices in mesh order: nothing
    # was left on one device by init.
    chex.assert_tree_is_sharded(state, devices=tuple(mesh.devices.flat))
    adam = state.opt_state.inner_state[1]
    moment_specs = ZERO1_MOMENT_SPECS if zero1 else PARAM_SPECS
    for tree, specs in ((state.params, PARAM_SPECS), (adam.mu, moment_specs), (adam.nu, moment_specs)):
        for name, array in flat(tree).items():
            chex.assert_shape([s.data for s in array.addressable_shards],
                              shard_shape(array.shape, specs[name], mesh))


@TRAINED
def test_optimizer_moment_specs(trained):
    zero1, _, state = trained
    adam = state.opt_state.inner_state[1]  # injected lr around the chain: (clip, scale_by_adam, decay, trust ratio, lr)
    expected = ZERO1_MOMENT_SPECS if zero1 else PARAM_SPECS
    for moments in (adam.mu, adam.nu):
        for name, array in flat(moments).items():
            assert normalized(array.sharding.spec) == normalized(expected[name]), name
    assert normalized(adam.count.sharding.spec) == P()


@TRAINED
def test_zero1_moment_shards_are_smaller(trained):
    zero1, _, state = trained
    w1 = state.opt_state.inner_state[1].mu["layers"]["mlp"]["w1"]
    shard = w1.addressable_shards[0].data.shape
    assert shard == ((4, 128 // 4, 512 // 2) if zero1 else (4, 128, 512 // 2))


def test_activation_specs(monkeypatch):
    """Specs XLA actually chose for the outputs of the norms, the blocks and the logits."""
    cfg = load_config(None, ["train.global_batch=8"])
    mesh = make_mesh(cfg.mesh)
    trainer = build_trainer(cfg, mesh)
    params = trainer.init().params
    seen = {}

    def record(name):
        return lambda s: seen.setdefault(name, normalized(s.spec))

    def recorded_norm(*args):
        out = plain_norm(*args)
        jax.debug.inspect_array_sharding(out, callback=record("Norm"))
        return out

    plain_norm = transformer.norm
    monkeypatch.setattr(transformer, "norm", recorded_norm)

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        kind = type(context.module).__name__
        if context.method_name == "__call__" and kind in ("Block", "Transformer"):
            value = out[0] if kind == "Block" else out
            jax.debug.inspect_array_sharding(value, callback=record(kind))
        return out

    def forward(params, tokens):
        with nn.intercept_methods(interceptor):
            return trainer.model.apply({"params": params}, tokens)

    tokens = jax.device_put(jax.random.randint(jax.random.key(1), (8, cfg.model.seq_len), 0, cfg.model.vocab),
                            trainer.batch_sharding)
    with jax.set_mesh(mesh), sharding.axis_rules():
        jax.jit(forward).lower(params, tokens).compile()
    assert seen == {
        "Norm": P("dp"),        # LN(x) feeds the column-parallel matmul whole on every tp device
        "Block": P("dp"),       # after the row-parallel matmul: summed over tp, batch over dp
        "Transformer": P("dp", None, "tp"),  # logits: vocab over tp
    }


def test_logical_rules_table():
    assert sharding.logical_to_spec(("batch", "seq", "embed")) == P("dp", "cp", None)  # cp: context parallelism
    assert sharding.logical_to_spec(("embed", "mlp")) == P(None, "tp")
    assert sharding.logical_to_spec(("vocab", "embed")) == P("tp", None)


# ------------------------------------------------------------------ per_device (cuDNN attention's wrapper)

HEADS = ("batch", "seq", "heads", "head_dim")


def _attention_both_ways(cfg, mesh, q, k, v, manual_dp: bool):
    """(attention per device, attention under GSPMD) and their gradients, jitted on `mesh`, as the
    train step runs it: in a shard_map manual over dp (gradient accumulation) or fully automatic."""
    import functools

    import jax.numpy as jnp
    from megascale_jax.model.attention import attend

    xla = functools.partial(attend, window=5, implementation="xla")
    wrapped = sharding.per_device(xla, (HEADS, HEADS, HEADS), HEADS)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v)))

    def both(q, k, v):
        with sharding.axis_rules(cfg, manual=("dp",) if manual_dp else ()):
            return [jax.value_and_grad(functools.partial(loss, fn), argnums=(0, 1, 2))(q, k, v) for fn in (wrapped, xla)]

    if manual_dp:
        body = both
        both = lambda q, k, v: jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P(), axis_names={"dp"},
                                             check_vma=False)(q, k, v)
    with jax.set_mesh(mesh), sharding.axis_rules(cfg):
        spec = sharding.NamedSharding(mesh, nn.logical_to_mesh_axes(HEADS))
        q, k, v = (jax.device_put(x, spec) for x in (q, k, v))
        # the wrapper did wrap: a shard_map of its own (besides the dp one)
        assert str(jax.make_jaxpr(both)(q, k, v)).count("shard_map") >= 2 + manual_dp
        return jax.jit(both)(q, k, v)


@pytest.mark.parametrize("manual_dp", [False, True], ids=["gspmd", "inside-dp-shard-map"])
def test_per_device_attention_equals_gspmds_with_its_gradients(manual_dp):
    """`sharding.per_device` (how cuDNN attention runs on several GPUs) over dp=2 x tp=2: the same
    outputs and gradients as the attention left to GSPMD, fully automatic and inside a shard_map
    manual over dp, as gradient accumulation runs the model; seeded random inputs, 4 heads."""
    import numpy as np

    cfg = load_config(None, ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1"])
    mesh = make_mesh(cfg.mesh)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 16, 4, 8)).astype(np.float32) for _ in range(3))
    (per_loss, per_grads), (ref_loss, ref_grads) = _attention_both_ways(cfg, mesh, q, k, v, manual_dp)
    np.testing.assert_allclose(per_loss, ref_loss, rtol=1e-6)
    for got, want in zip(per_grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
# Two cases: each rank's own kv head; one kv head all ranks share, with documents kept apart (the
# document ids ride beside the heads whatever kv_heads is: separate cases proved nothing more).
@pytest.mark.parametrize("kv_heads, eos", [(2, None), (1, 7)],
                         ids=["kv-heads-over-tp", "one-kv-head-shared-by-the-ranks-documents-apart"])
def test_the_models_cudnn_path_runs_per_device_and_equals_gspmds(monkeypatch, kv_heads, eos):
    """model.attention=cudnn's wiring in the model (`transformer.self_attention`): the attention
    call gets each device's heads (4 heads / tp 2) inside gradient accumulation's shard_map, and the
    step's loss and gradients equal the same model's under GSPMD. cuDNN itself needs a GPU: here
    its call is XLA's attention, so the check is the per-device plumbing (specs, GQA kv heads, and
    with model.document_eos each device's rows of the document ids beside its heads)."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np

    from megascale_jax.model import attention

    seen = []

    def attend(q, k, v, *, window, implementation="xla", documents=None):
        if implementation == "cudnn":
            seen.append((q.shape[2], k.shape[2]))
            implementation = "xla"
        return attention.attend(q, k, v, window=window, implementation=implementation, documents=documents)

    monkeypatch.setattr(transformer, "attend", attend)
    base = load_config(None, ["mesh.dp=2", "mesh.tp=2", "parallel.microbatches=2", "model.layers=2",
                              "model.d_model=32", "model.heads=4", f"model.kv_heads={kv_heads}", "model.seq_len=16",
                              "model.window=5", "train.global_batch=8",
                              *([f"model.document_eos={eos}"] if eos is not None else [])])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, base.model.vocab, (8, 17)).astype(np.int32)
    if eos is not None:  # documents of ~6 tokens
        tokens[rng.random(tokens.shape) < 0.15] = eos
    results = []
    for cfg in (base, dataclasses.replace(base, model=dataclasses.replace(base.model, attention="cudnn"))):
        trainer = build_trainer(cfg, make_mesh(cfg.mesh))
        params = trainer.init().params
        batch = jax.device_put(jnp.asarray(tokens), trainer.batch_sharding)
        seen.clear()  # the init's calls (one dummy sequence, its attention dead code) are not the step's
        results.append(jax.device_get(trainer.loss_and_grads(params, batch)))
    # each rank: 4 query heads / tp 2, and one kv head (its own of 2, or the one all ranks share)
    assert seen and set(seen) == {(2, 1)}
    (loss, grads), (ref_loss, ref_grads) = results[1], results[0]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
