"""Grouped-query attention with fewer kv heads than tp ranks (Llama-70B: 8 kv heads at tp=16).

Each kv head is then replicated over tp/kv_heads ranks: the k/v projections are whole on every tp
rank while q stays split, and the loss and gradients still equal one device's (DESIGN §4) — for
both blocks, with sequence parallelism and collective matmul, and through the pipeline with
ZeRO-1. A tp that neither divides kv_heads nor is a multiple of it is refused in one line.
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from megascale_jax.config import ConfigError, load_config
from megascale_jax.parallel import sharding
from megascale_jax.parallel.mesh import make_mesh
from megascale_jax.training import data
from megascale_jax.training.trainer import build_trainer

MODEL = ["model.layers=2", "model.d_model=64", "model.heads=8", "model.seq_len=32", "model.vocab=256",
         "model.window=12", "train.global_batch=8", "parallel.zero1=false"]
COLLECTIVE_MATMUL = ["parallel.sequence_parallel=true", "parallel.tp_overlap=collective_matmul"]


def trainer_for(overrides):
    cfg = load_config(None, MODEL + list(overrides))
    return cfg, build_trainer(cfg, make_mesh(cfg.mesh))


@functools.lru_cache(maxsize=None)
def reference(kv_heads: int, block: str):
    """Perturbed parameters, a real batch, and the loss and gradients on one device."""
    model = [f"model.kv_heads={kv_heads}", f"model.block={block}"]
    cfg, trainer = trainer_for(model + ["mesh.dp=1", "mesh.tp=1", "mesh.cpu_devices=1"])
    params = jax.device_get(trainer.init().params)
    leaves, treedef = jax.tree.flatten(params)  # away from the init, so biases and norms matter
    keys = jax.random.split(jax.random.key(5), len(leaves))
    params = treedef.unflatten([x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    batch = data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train").rows(1, 0, 8)
    loss, grads = trainer.loss_and_grads(params, batch)
    return model, params, batch, float(loss), jax.device_get(grads)


CASES = [
    # (kv_heads, block, dp, pp, tp, extra overrides)
    (1, "parallel", 2, 1, 2, []),
    (1, "serial", 1, 1, 2, COLLECTIVE_MATMUL),
    (2, "parallel", 1, 1, 4, COLLECTIVE_MATMUL),
    (1, "parallel", 1, 1, 2, ["parallel.tp_overlap=xla", "parallel.sequence_parallel=true"]),
    # the pipeline (manual over dp and pp, tp left to GSPMD) reduce-scatters to ZeRO-1's moments
    (1, "parallel", 2, 2, 2, ["parallel.microbatches=2", "parallel.zero1=true"]),
]


def case_id(kv, block, dp, pp, tp, extra):
    mode = "-".join(o.split("=")[1] for o in extra if "tp_overlap" in o or "zero1" in o)
    return f"kv{kv}-{block}-dp{dp}pp{pp}tp{tp}" + (f"-{mode}" if mode else "")


@pytest.mark.slow
@pytest.mark.xdist_group("gqa_reference")  # one worker computes each one-device `reference` once
@pytest.mark.parametrize("kv_heads,block,dp,pp,tp,extra", CASES, ids=[case_id(*c) for c in CASES])
def test_kv_heads_fewer_than_tp_match_one_device(kv_heads, block, dp, pp, tp, extra):
    model, params, batch, ref_loss, ref_grads = reference(kv_heads, block)
    cfg, trainer = trainer_for(model + [f"mesh.dp={dp}", f"mesh.pp={pp}", f"mesh.tp={tp}", *extra])

    # k and v (weights and biases) whole on every tp rank; q, o, the MLP still split over tp.
    attn = trainer.state_shardings.params["layers"]["attn"]
    for name in ("wk", "wv", "bk", "bv"):
        assert "tp" not in jax.tree.leaves(tuple(attn[name].spec)), (name, attn[name].spec)
    assert attn["wq"].spec == P("pp", None, "tp", None) and attn["bq"].spec == P("pp", "tp", None)
    assert attn["wo"].spec == P("pp", "tp", None, None)
    if cfg.parallel.zero1:  # the moments of the replicated k/v are still split over dp
        moments = jax.tree.leaves(trainer.state_shardings.opt_state, is_leaf=lambda x: hasattr(x, "spec"))
        assert any(s.spec == P("pp", "dp", None, None) for s in moments), moments

    loss, grads = trainer.loss_and_grads(jax.device_put(params, trainer.state_shardings.params),
                                         jax.device_put(batch, trainer.batch_sharding))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    for (path, g), ref in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(grads))[0],
                              jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=str(path))


def test_rules_replicate_kv_heads_only_when_tp_does_not_divide_them():
    def rules(kv_heads, tp, *extra):
        return dict(sharding.rules_for(load_config(None, MODEL + [
            f"model.kv_heads={kv_heads}", f"mesh.tp={tp}", "mesh.dp=1", "mesh.pp=1", *extra])))

    assert rules(8, 8)["kv_heads"] == rules(4, 2)["kv_heads"] == "tp"
    assert rules(1, 2)["kv_heads"] is rules(2, 8)["kv_heads"] is None
    assert rules(2, 8)["heads"] == "tp" and rules(2, 8)["act_seq"] == "cp"  # over cp (size 1 here), not tp
    assert rules(2, 8, "parallel.sequence_parallel=true")["act_seq"] == "tp"
    assert dict(sharding.rules_for()) == dict(sharding.LOGICAL_RULES)


@pytest.mark.parametrize("heads,kv_heads,tp,needle", [
    (6, 3, 2, "model.kv_heads=3 and mesh.tp=2 must divide one another"),
    (8, 1, 8, "model.kv_heads=1 x head_dim=4 must be divisible by mesh.tp=8"),
])
def test_kv_heads_that_tp_cannot_place_are_refused_in_one_line(heads, kv_heads, tp, needle):
    overrides = [f"model.heads={heads}", f"model.kv_heads={kv_heads}", f"model.d_model={4 * heads}",
                 f"mesh.tp={tp}", "mesh.dp=1", "mesh.pp=1"]
    with pytest.raises(ConfigError) as err:
        load_config(None, MODEL + overrides)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
