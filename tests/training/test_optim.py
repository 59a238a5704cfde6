"""LAMB and AdamW: layer-wise trust ratio, decay mask, schedule, and sharded == unsharded."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from megascale_jax.training import optim
from megascale_jax.parallel import sharding
from megascale_jax.config import MeshConfig, OptimConfig
from megascale_jax.parallel.mesh import make_mesh

LAYERS = 3


def random_tree(key, scale=1.0):
    """A parameter-shaped tree like the model's: stacked layer leaves plus unstacked ones."""
    shapes = {
        "embed": (16, 8),
        "final_norm": {"scale": (8,), "bias": (8,)},
        "layers": {"attn": {"wq": (LAYERS, 8, 4, 2), "bq": (LAYERS, 4, 2)},
                   "mlp": {"w1": (LAYERS, 8, 16), "b1": (LAYERS, 16)},
                   "norm": {"scale": (LAYERS, 8)}},
    }
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten([scale * jax.random.normal(k, s) for k, s in zip(keys, leaves)])


def axes_of_layers(tree):
    """The layer axis of each leaf of a `random_tree`: 0 under `layers` (as the model's metadata
    names it), `NO_LAYER_AXIS` elsewhere."""
    return {k: jax.tree.map(lambda _: 0 if k == "layers" else optim.NO_LAYER_AXIS, v) for k, v in tree.items()}


def unstack(tree):
    """Split every stacked leaf into one leaf per layer: {'layers': {'0': ..., '1': ...}}."""
    layers = tree["layers"]
    per_layer = {str(i): jax.tree.map(lambda x: x[i], layers) for i in range(LAYERS)}
    return {**{k: v for k, v in tree.items() if k != "layers"}, "layers": per_layer}


@pytest.mark.slow
def test_lamb_is_optax_lamb_applied_per_layer():
    """Our stacked-layer LAMB equals optax.lamb run on the same parameters split per layer."""
    cfg = OptimConfig(name="lamb", lr=1e-2, warmup=0, min_lr_ratio=1.0, weight_decay=0.1, clip=None)
    ours = optim.make_optimizer(cfg, 10, axes_of_layers(random_tree(jax.random.key(0))))
    reference = optax.lamb(1e-2, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=0.1,
                           mask=lambda p: jax.tree_util.tree_map_with_path(
                               lambda path, _: str(path[-1].key) in optim.DECAYED, p))
    params = random_tree(jax.random.key(0))
    ref_params = unstack(params)
    state, ref_state = ours.init(params), reference.init(ref_params)
    update, ref_update = jax.jit(ours.update), jax.jit(reference.update)
    for step in range(3):
        grads = random_tree(jax.random.key(step + 1), scale=0.1)
        updates, state = update(grads, state, params)
        ref_updates, ref_state = ref_update(unstack(grads), ref_state, ref_params)
        params, ref_params = optax.apply_updates(params, updates), optax.apply_updates(ref_params, ref_updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), unstack(params), ref_params)


def test_per_layer_trust_ratio_differs_from_whole_stack_ratio():
    """Guard: with very different layer scales, one stack-wide norm would give another update."""
    params = {"layers": {"w1": jnp.stack([jnp.ones((4, 4)), 100 * jnp.ones((4, 4))])}}
    grads = {"layers": {"w1": jax.random.normal(jax.random.key(0), (2, 4, 4))}}
    ours, _ = optim.scale_by_layerwise_trust_ratio({"layers": {"w1": 0}}).update(grads, optax.EmptyState(), params)
    whole, _ = optax.scale_by_trust_ratio().update(grads, optax.ScaleByTrustRatioState(), params)
    for i in range(2):
        p, g = params["layers"]["w1"][i], grads["layers"]["w1"][i]
        expected = g * jnp.linalg.norm(p) / jnp.linalg.norm(g)
        np.testing.assert_allclose(ours["layers"]["w1"][i], expected, rtol=1e-5)
    assert not np.allclose(ours["layers"]["w1"], whole["layers"]["w1"])


def test_the_layer_axis_is_found_by_name_not_position():
    """A leaf whose logical axes put `layers` second gets one trust ratio per entry of that axis
    (float64 NumPy reference); the model's own metadata gives axis 0 for stacked leaves."""
    names = {"w": jax.sharding.PartitionSpec("embed", "layers", "mlp")}
    boxed = {"w": nn.Partitioned(jnp.zeros((3, 2, 4)), names=("embed", "layers", "mlp"))}
    axes = optim.layer_axes(boxed)
    assert axes == {"w": 1}, (axes, names)
    p = np.asarray(jax.random.normal(jax.random.key(1), (3, 2, 4)), np.float64)
    p[:, 1] *= 50.0  # layer 1 much larger than layer 0: a whole-leaf ratio would differ
    g = np.asarray(jax.random.normal(jax.random.key(2), (3, 2, 4)), np.float64)
    ours, _ = optim.scale_by_layerwise_trust_ratio(axes).update(
        {"w": jnp.asarray(g, jnp.float32)}, optax.EmptyState(), {"w": jnp.asarray(p, jnp.float32)})
    expected = np.stack([g[:, i] * np.linalg.norm(p[:, i]) / np.linalg.norm(g[:, i]) for i in range(2)], axis=1)
    np.testing.assert_allclose(ours["w"], expected, rtol=1e-5)

    from megascale_jax.config import load_config
    from megascale_jax.model.transformer import Transformer
    cfg = load_config(None, ["model.layers=2", "model.d_model=16", "model.heads=2", "model.kv_heads=2"])
    model = Transformer(cfg.model, cfg.parallel)
    model_boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, cfg.model.seq_len), jnp.int32))
    model_axes = optim.layer_axes(model_boxed["params"])
    assert set(jax.tree.leaves(model_axes["layers"])) == {0}
    assert model_axes["embed"] == optim.NO_LAYER_AXIS and model_axes["head"] == optim.NO_LAYER_AXIS


def test_decay_mask_skips_norms_and_biases():
    mask = optim.decay_mask(random_tree(jax.random.key(0)))
    assert mask["embed"] and mask["layers"]["attn"]["wq"] and mask["layers"]["mlp"]["w1"]
    assert not mask["layers"]["attn"]["bq"] and not mask["layers"]["mlp"]["b1"]
    assert not mask["layers"]["norm"]["scale"] and not mask["final_norm"]["bias"]


def test_schedule_warmup_then_cosine():
    cfg = OptimConfig(lr=2.0, warmup=4, min_lr_ratio=0.1)
    lr = optim.learning_rate_schedule(cfg, total_steps=20)
    np.testing.assert_allclose([lr(0), lr(2), lr(4)], [0.0, 1.0, 2.0], rtol=1e-6)
    middle = 0.2 + (2.0 - 0.2) * 0.5 * (1 + np.cos(np.pi * 8 / 16))
    np.testing.assert_allclose(lr(12), middle, rtol=1e-5)
    np.testing.assert_allclose(lr(20), 0.2, rtol=1e-5)


@pytest.mark.parametrize("name", ["lamb", "adamw"])
def test_sharded_state_equals_unsharded(name):
    """ZeRO-1 state sharded over dp=4 × tp=2 under jit gives the single-device update."""
    cfg = OptimConfig(name=name, lr=1e-2, warmup=1, weight_decay=0.1, clip=1.0)
    params = random_tree(jax.random.key(0))
    tx = optim.make_optimizer(cfg, 10, axes_of_layers(params))
    grads = [random_tree(jax.random.key(i + 1), scale=0.5) for i in range(3)]

    def run(param_sharding, state_sharding):
        update = jax.jit(lambda g, s, p: tx.update(g, s, p), out_shardings=None)
        p = jax.device_put(params, param_sharding)
        s = jax.device_put(tx.init(params), state_sharding)
        for g in grads:
            u, s = update(jax.device_put(g, param_sharding), s, p)
            p = optax.apply_updates(p, u)
        return jax.device_get(p), s

    one = make_mesh(MeshConfig(dp=1, tp=1, cpu_devices=1))
    ref, _ = run(sharding.replicated(one), sharding.replicated(one))

    mesh = make_mesh(MeshConfig(dp=4, tp=2, cpu_devices=8))
    tp_spec = lambda x: NamedSharding(mesh, jax.sharding.PartitionSpec(*([None] * (x.ndim - 1) + ["tp"])))
    param_shardings = jax.tree.map(tp_spec, params)
    moment_shardings = jax.tree.map(lambda s, x: sharding.zero1_sharding(s, x.shape, mesh), param_shardings, params)
    state_shardings = optax.tree_map_params(tx, lambda _, s: s, tx.init(params), moment_shardings,
                                            transform_non_params=lambda _: sharding.replicated(mesh))
    out, state = run(param_shardings, state_shardings)
    inner = state.inner_state  # inside the injected learning rate
    mu = inner[1].mu if name == "lamb" else inner[1][0].mu
    assert "dp" in str(mu["layers"]["mlp"]["w1"].sharding.spec)  # the state really is sharded
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), out, ref)


@pytest.mark.parametrize("name", ["lamb", "adamw"])
def test_the_state_carries_the_learning_rate_each_update_used(name):
    """The reported lr is read from the optimizer state (inject_hyperparams): after update k it is
    the warmup+cosine value at k, the closed form of which is checked above."""
    cfg = OptimConfig(name=name, lr=2.0, warmup=4, min_lr_ratio=0.1, clip=None)
    params = random_tree(jax.random.key(0))
    tx = optim.make_optimizer(cfg, 20, axes_of_layers(params))
    state = tx.init(params)
    schedule = optim.learning_rate_schedule(cfg, total_steps=20)
    for k in range(6):
        _, state = tx.update(random_tree(jax.random.key(k + 1)), state, params)
        np.testing.assert_allclose(optim.current_learning_rate(state), schedule(k), rtol=1e-6)
    assert float(optim.current_learning_rate(state)) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi / 16))))


@pytest.mark.parametrize("scale", [0.01, 10.0], ids=["under-the-limit", "clipped"])
def test_clipping_with_a_given_norm_is_optax_clipping(scale):
    """optim.clip_by_global_norm with the train step's own norm (`grad_norm=`), and without it,
    gives what optax.clip_by_global_norm gives, bit for bit, below and above the limit."""
    grads = random_tree(jax.random.key(3), scale)
    want, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
    ours = optim.clip_by_global_norm(1.0)
    for kwargs in ({"grad_norm": optax.tree.norm(grads)}, {}):
        got, _ = ours.update(grads, ours.init(grads), **kwargs)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("schedule", ["linear", "wsd"])
def test_linear_and_warmup_stable_decay_schedules_by_hand(schedule):
    """lr 2, warmup 4, 20 updates, ending at 0.2: linear falls on a straight line from update 4 to
    20; wsd (decay_fraction 0.25) holds 2 until update 15, then falls straight to 0.2 at 20."""
    cfg = OptimConfig(lr=2.0, warmup=4, min_lr_ratio=0.1, schedule=schedule, decay_fraction=0.25)
    lr = optim.learning_rate_schedule(cfg, total_steps=20)
    counts = np.arange(21)
    warm = 2.0 * counts / 4
    if schedule == "linear":
        after = 2.0 + (0.2 - 2.0) * (counts - 4) / 16
    else:
        after = np.where(counts < 15, 2.0, 2.0 + (0.2 - 2.0) * (counts - 15) / 5)
    expected = np.where(counts < 4, warm, after)
    np.testing.assert_allclose([float(lr(c)) for c in counts], expected, rtol=1e-6, atol=1e-7)
