"""NaN triage: a non-finite step keeps its input state (held) until the host replays it, and a
replayed transient fault leaves no trace in the run's results."""

import json
import os

import jax
import numpy as np
import pytest

from megascale_jax import train
from megascale_jax.cluster.faults import NanBatch
from megascale_jax.observe.timings import read_timings
from megascale_jax.config import load_config
from megascale_jax.parallel.mesh import make_mesh
from megascale_jax.training import data
from megascale_jax.training.trainer import build_trainer
from megascale_jax.training.triage import release

SMALL = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.kv_heads=2", "model.seq_len=40",
         "model.window=12", "train.global_batch=4", "optim.warmup=1", "optim.lr=1e-2"]


def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.slow
def test_a_non_finite_step_holds_the_state_until_released():
    cfg = load_config(None, SMALL + ["mesh.dp=2", "mesh.tp=2", "mesh.cpu_devices=4"])
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    batches = data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train")
    batch = [data.make_global_batch(batches, i, trainer.batch_sharding) for i in range(3)]
    state, _ = trainer.train_step(trainer.init(), batch[0])
    before = leaves(state)

    state, bad = trainer.train_step(state, NanBatch(2, cfg.model.vocab)(2, batch[1]))  # one device's token
    assert not np.isfinite(float(bad["loss"]))
    assert int(state.step) == -2  # held: -1 - updates done
    assert all(np.array_equal(a, b) for a, b in zip(leaves(state)[1:], before[1:]))  # params, moments, count
    state, later = trainer.train_step(state, batch[2])  # dispatched before the host saw the NaN
    assert np.isfinite(float(later["loss"])) and int(state.step) == -2  # a finite step leaves it held too
    assert all(np.array_equal(a, b) for a, b in zip(leaves(state)[1:], before[1:]))

    replayed, good = trainer.train_step(release(state, 1, trainer.state_shardings.step), batch[1])
    reference, expected = trainer.train_step(trainer.train_step(trainer.init(), batch[0])[0], batch[1])
    assert int(replayed.step) == 2 and float(good["loss"]) == float(expected["loss"])
    assert all(np.array_equal(a, b) for a, b in zip(leaves(replayed), leaves(reference)))


def test_the_hold_costs_no_memory_beside_a_plain_donated_step():
    """The hold is a lax.cond around the optimizer update, not a select between the updated and
    the given state: a select needs the updated state in temporaries beside the donated one
    (on XLA:CPU 0.55x the parameters' bytes, 9% of this step's peak), the cond updates in place.
    The reference is the same step with no hold at all, built here from optax."""
    import optax

    from megascale_jax.model import flops
    from megascale_jax.model.transformer import loss_fn
    from megascale_jax.parallel import sharding
    from megascale_jax.training.state import TrainState

    cfg = load_config(None, ["model.layers=4", "model.d_model=256", "model.heads=4", "model.kv_heads=2",
                             "model.seq_len=32", "train.global_batch=2", "optim.name=adamw", "mesh.dp=1", "mesh.tp=1"])
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    state = jax.eval_shape(trainer.init)
    batch = jax.ShapeDtypeStruct((2, cfg.model.seq_len + 1), jax.numpy.int32, sharding=trainer.batch_sharding)
    optimizer = optax.chain(optax.clip_by_global_norm(cfg.optim.clip), optax.adamw(1e-3, weight_decay=0.1))

    def plain_step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(trainer.model, p, batch))(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state), loss

    plain_state = TrainState(state.step, state.params, jax.eval_shape(optimizer.init, state.params))
    with jax.set_mesh(trainer.mesh), sharding.axis_rules(cfg):
        plain = jax.jit(plain_step, donate_argnums=0).lower(plain_state, batch).compile().memory_analysis()
    held = trainer.train_step.lower(state, batch).compile().memory_analysis()
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    assert flops.compiled_bytes(held) <= flops.compiled_bytes(plain) + 0.05 * params


def test_the_step_reduces_the_gradients_to_their_norm_once():
    """The finite check's global norm is the one clipping uses (optim.clip_by_global_norm's
    `grad_norm=`): the compiled step has a single scalar square root, not one on each side of the
    hold's cond (XLA cannot share a reduction across it)."""
    import re

    cfg = load_config(None, SMALL + ["mesh.dp=1", "mesh.tp=1", "optim.name=adamw"])
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    batch = jax.ShapeDtypeStruct((4, cfg.model.seq_len + 1), jax.numpy.int32, sharding=trainer.batch_sharding)
    hlo = trainer.train_step.lower(jax.eval_shape(trainer.init), batch).compile().as_text()
    assert len(re.findall(r"= f32\[\] sqrt\(", hlo)) == 1


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_a_transient_nan_in_the_pipeline_is_replayed_to_the_fault_free_result(tmp_path, monkeypatch, run_main):
    """pp=2 with microbatches; the NaN lands on a checkpoint step, so the save inside the
    replayed step is the one that commits (its data position is that of the step), and on a
    profiled step, whose trace is dropped and taken again when the step is replayed."""
    args = ["train.steps=4", "mesh.dp=1", "mesh.pp=2", "mesh.tp=1", "mesh.cpu_devices=2", "parallel.microbatches=2",
            "checkpoint.every=3", "train.eval_every=0", "observe.profile_every=3", "train.sample_at_end=0", *SMALL]
    code, _, err = run_main(train.main, ["--run-dir", "clean", *args], tmp_path)
    assert code == 0, err
    monkeypatch.setenv("MEGASCALE_FAULT_NAN", "0:3")
    code, _, err = run_main(train.main, ["--run-dir", "nan", *args], tmp_path)
    assert code == 0, err
    assert "non-finite loss or gradient at step 3" in err and "a transient fault; device self-test passed" in err
    clean, replayed = metrics(tmp_path / "clean"), metrics(tmp_path / "nan")
    assert [r["step"] for r in replayed] == [1, 2, 3, 4]
    assert [(r["loss"], r["grad_norm"]) for r in replayed] == [(r["loss"], r["grad_norm"]) for r in clean]
    with open(tmp_path / "nan" / "checkpoints" / "3" / "meta" / "metadata") as f:
        assert json.load(f)["data_step"] == 3
    # The replayed step 3 was traced once more: its device rows are there, once per device.
    traced = read_timings(str(tmp_path / "nan"))
    rows = traced.select("device_compute")
    assert sorted(traced.step[rows].tolist()) == [3, 3]
