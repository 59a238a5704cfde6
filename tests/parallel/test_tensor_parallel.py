"""Tensor-parallel modes: same loss and gradients as one device, and the collectives they compile to.

Structure is read from the compiled HLO of one forward+backward on tp=8: inside the scanned layer
(the while-loop bodies) collective matmul leaves only collective-permutes for activations, and
the parallel block needs half the TP collectives of the serial block.
"""

import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from megascale_jax.training import data
from megascale_jax.parallel import sharding
from megascale_jax.config import load_config
from megascale_jax.parallel.mesh import make_mesh
from megascale_jax.model.transformer import loss_fn
from megascale_jax.training.trainer import build_trainer

MODEL = ["model.layers=2", "model.d_model=64", "model.heads=8", "model.kv_heads=8", "model.seq_len=32",
         "model.window=10", "train.global_batch=8", "parallel.zero1=false"]
MODES = [("none", False), ("none", True), ("collective_matmul", True), ("xla", False), ("xla", True)]
# Every mode on dp=2 x tp=4 (dp and tp together); collective matmul also on tp=8, its rings' length
# being the tp size. The other modes see tp's size only through GSPMD's or one collective's split,
# as at tp=4 (tp=8 ran them all: 8 more compiles proving nothing more).
MESH_MODES = ([(("2", "4"), overlap, sp) for overlap, sp in MODES]
              + [(("1", "8"), overlap, sp) for overlap, sp in MODES if overlap == "collective_matmul"])


def loss_and_grads(overrides, params=None, batch=None):
    cfg = load_config(None, MODEL + overrides)
    mesh = make_mesh(cfg.mesh)
    trainer = build_trainer(cfg, mesh)
    params = jax.device_put(params, trainer.state_shardings.params) if params is not None else trainer.init().params
    with jax.set_mesh(mesh), sharding.axis_rules(cfg):
        loss, grads = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(trainer.model, p, b)))(
            params, jax.device_put(batch, trainer.batch_sharding))
    return float(loss), jax.device_get(grads), jax.device_get(params)


@pytest.fixture(scope="module", params=["parallel", "serial"])
def reference(request):
    block = f"model.block={request.param}"
    one = ["mesh.dp=1", "mesh.tp=1", "mesh.cpu_devices=1", block]
    cfg = load_config(None, MODEL + one)
    batch = data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train").rows(2, 0, 8)
    params = jax.device_get(build_trainer(cfg, make_mesh(cfg.mesh)).init().params)
    leaves, treedef = jax.tree.flatten(params)  # move away from the init so biases and norms matter
    keys = jax.random.split(jax.random.key(3), len(leaves))
    params = treedef.unflatten([x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    loss, grads, _ = loss_and_grads(one, params, batch)
    return block, params, batch, loss, grads


# The block's one-device reference is a module fixture: one xdist worker computes each once.
@pytest.mark.slow
@pytest.mark.xdist_group("tensor_parallel_reference")
@pytest.mark.parametrize("mesh,overlap,sp", MESH_MODES,
                         ids=[f"{o}-sp{int(s)}-{'tp8' if m[0] == '1' else 'dp2tp4'}" for m, o, s in MESH_MODES])
def test_modes_match_one_device(reference, mesh, overlap, sp):
    block, params, batch, ref_loss, ref_grads = reference
    overrides = [f"mesh.dp={mesh[0]}", f"mesh.tp={mesh[1]}", block, f"parallel.tp_overlap={overlap}",
                 f"parallel.sequence_parallel={str(sp).lower()}"]
    loss, grads, _ = loss_and_grads(overrides, params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for (path, g), ref in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=str(path))


@pytest.mark.slow
@pytest.mark.parametrize("pieces,bidirectional", [(1, False), (2, True), (4, True), (4, False)])
def test_collective_matmul_rings_equal_the_plain_product(pieces, bidirectional):
    """The ppermute rings on tp=8, for several piece counts and directions, against x @ w on one
    device in float64 numpy: values, and gradients against the unsplit product's (in float64 numpy)."""
    from jax.sharding import AxisType, PartitionSpec as P
    from megascale_jax.parallel.tensor_parallel import all_gather_matmul, matmul_reduce_scatter

    tp = 8
    mesh = jax.make_mesh((tp,), ("tp",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(pieces * 10 + bidirectional)
    x, w1 = rng.normal(size=(2, tp * 8, 16)), rng.normal(size=(16, tp * 3))
    h, w2 = rng.normal(size=(2, tp * 8, tp * 3)), rng.normal(size=(tp * 3, 16))
    gather = jax.shard_map(lambda x, w: all_gather_matmul(x, w, tp, pieces, bidirectional), mesh=mesh,
                           in_specs=(P(None, "tp", None), P(None, "tp")), out_specs=P(None, None, "tp"))
    scatter = jax.shard_map(lambda h, w: matmul_reduce_scatter(h, w, tp, pieces, bidirectional), mesh=mesh,
                            in_specs=(P(None, None, "tp"), P("tp", None)), out_specs=P(None, "tp", None))
    f32 = lambda *a: [np.float32(v) for v in a]
    probes = [rng.normal(size=(a @ b).shape) for a, b in ((x, w1), (h, w2))]

    def both(x, w1, h, w2, probe1, probe2):  # both rings, values and gradients: one program
        values = gather(x, w1), scatter(h, w2)
        grads = [jax.grad(lambda a, b: (ring(a, b) * probe).sum(), argnums=(0, 1))(a, b)
                 for ring, a, b, probe in ((gather, x, w1, probe1), (scatter, h, w2, probe2))]
        return values, grads

    values, grads = jax.jit(both)(*f32(x, w1, h, w2, *probes))
    np.testing.assert_allclose(values[0], x @ w1, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(values[1], h @ w2, rtol=1e-5, atol=1e-4)
    # d/da sum((a @ b) * probe) = probe @ b.T, d/db = sum over the batch of a.T @ probe (float64)
    for (got_a, got_b), a, b, probe in zip(grads, (x, h), (w1, w2), probes):
        np.testing.assert_allclose(got_a, probe @ b.T, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(got_b, np.einsum("bsi,bso->io", a, probe), rtol=1e-5, atol=1e-4)


def layer_collectives(overrides) -> dict[str, int]:
    """Collective ops inside the while-loop bodies (the scanned layers, forward and backward)."""
    cfg = load_config(None, MODEL + ["mesh.dp=1", "mesh.tp=8"] + overrides)
    mesh = make_mesh(cfg.mesh)
    trainer = build_trainer(cfg, mesh)
    batch = jax.ShapeDtypeStruct((8, 33), np.int32, sharding=trainer.batch_sharding)
    with jax.set_mesh(mesh), sharding.axis_rules(cfg):
        step = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(trainer.model, p, b)))
        text = step.lower(trainer.abstract_params, batch).compile().as_text()
    computations = {m.group(1): m.group(2) for m in
                    re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) .*?\{\n(.*?)^\}", text, re.M | re.S)}
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    assert bodies, "expected the scanned layers as while loops"
    ops = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")
    return {op: sum(len(re.findall(rf"= [^=]*? {op}(?:-start)?\(", computations[b])) for b in bodies) for op in ops}


@pytest.mark.slow
def test_collective_matmul_leaves_only_permutes_in_the_layer():
    for block in ("parallel", "serial"):
        ops = layer_collectives([f"model.block={block}", "parallel.sequence_parallel=true",
                                 "parallel.tp_overlap=collective_matmul"])
        assert ops["all-gather"] == 0 and ops["reduce-scatter"] == 0, (block, ops)
        assert ops["collective-permute"] > 0, (block, ops)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["plain", "sequence-parallel"])
def test_parallel_block_has_half_the_tp_collectives(sp):
    sp_flag = [f"parallel.sequence_parallel={str(sp).lower()}"]
    parallel = layer_collectives(["model.block=parallel"] + sp_flag)
    serial = layer_collectives(["model.block=serial"] + sp_flag)
    # Activation collectives: all-reduce without SP; all-gather + reduce-scatter with SP.
    kinds = ("all-gather", "reduce-scatter") if sp else ("all-reduce",)
    assert sum(parallel[k] for k in kinds) * 2 == sum(serial[k] for k in kinds) > 0, (parallel, serial)


def test_xla_overlap_flags_are_accepted(tmp_path):
    """An unknown XLA flag aborts the process: the flag set must parse on this jaxlib."""
    from megascale_jax.parallel.tensor_parallel import XLA_OVERLAP_FLAGS

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(XLA_OVERLAP_FLAGS)}
    code = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: x * 2)(jnp.ones(3)).sum()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "6.0", out.stderr[-2000:]
