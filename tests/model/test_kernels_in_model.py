"""The model trained with the Pallas kernels equals the model trained with XLA's ops."""

import numpy as np
import pytest

from megascale_jax.training import data
from megascale_jax.config import load_config
from megascale_jax.parallel.mesh import make_mesh
from megascale_jax.training.trainer import build_trainer

SMALL = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.kv_heads=2", "model.seq_len=40",
         "model.window=12", "train.global_batch=4", "optim.warmup=1", "optim.lr=1e-2"]


def losses(overrides, steps=3):
    cfg = load_config(None, SMALL + overrides)
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    batches = data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train")
    state, out = trainer.init(), []
    for step in range(steps):
        state, metrics = trainer.train_step(state, data.make_global_batch(batches, step, trainer.batch_sharding))
        out.append(float(metrics["loss"]))
    return np.array(out)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["mesh.dp=1", "mesh.tp=1", "mesh.cpu_devices=1"],
                                  ["mesh.dp=2", "mesh.tp=2", "mesh.cpu_devices=4"],
                                  # packed documents (each line of the text one): the kernels' segment ids
                                  ["mesh.dp=2", "mesh.tp=2", "mesh.cpu_devices=4", "model.document_eos=10"]],
                         ids=["1dev", "dp2tp2", "dp2tp2-documents"])
def test_pallas_kernels_train_like_xla(mesh):
    reference = losses(mesh)
    assert reference[-1] < reference[0]
    fused = losses(mesh + ["model.attention=pallas", "model.fused_norm=true", "model.fused_mlp=true"])
    np.testing.assert_allclose(fused, reference, rtol=1e-5)
