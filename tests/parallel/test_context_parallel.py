"""Context parallelism (mesh.cp; parallel/context_parallel.py): every sequence split over cp
trains exactly as on one device, and the cp axis moves the attention halo and nothing else but
the gradients' reduction (the weights are replicated over cp, as over dp).

Exact: the loss and every gradient of one step against one device's, float32, rel 1e-6 (a
gradient: the norm of its difference over its own norm), from the same initial parameters and
batch. Bytes: the compiled step's collectives over cp, read from its HLO text as
`observe.collectives` reads them for the benches, against `context_parallel.halo_bytes` — each
layer's permutes of keys and values forward and of their gradients backward — and against the
gradient bytes a device holds for the all-reduce.
"""

import functools
import json

import jax
import numpy as np
import pytest

from megascale_jax.config import ConfigError, load_config
from megascale_jax.observe import collectives
from megascale_jax.parallel import context_parallel, layout
from megascale_jax.parallel.mesh import make_mesh
from megascale_jax.training import data
from megascale_jax.training.trainer import build_trainer

# window 6: a halo of 5 keys, within a slice at cp 2 and 4 (16 and 8 tokens), two hops at cp 8 (4)
SMALL = ["model.layers=2", "model.d_model=64", "model.heads=4", "model.kv_heads=2", "model.seq_len=32",
         "model.window=6", "train.global_batch=4", "mesh.pp=1", "mesh.cpu_devices=8", "parallel.zero1=false"]
ONE = ["mesh.dp=1", "mesh.cp=1", "mesh.tp=1"]


def _config(overrides):
    return load_config(None, SMALL + list(overrides))


@functools.lru_cache(maxsize=None)
def _initial_params(model_overrides: tuple[str, ...]):
    """One device's initial parameters, on the host (initialisation does not depend on the mesh:
    tests/parallel/test_parity.py)."""
    cfg = _config(ONE + list(model_overrides))
    return jax.device_get(build_trainer(cfg, make_mesh(cfg.mesh)).init().params)


# The equality tests and the byte counts read the same steps (cp 2, cp 8, cp 4 x tp 2, cp 4 with
# full attention), each compiled once (`step`'s cache) on one xdist worker, which also computes
# each one-device reference once.
STEPS = pytest.mark.xdist_group("context_parallel_steps")


def step(overrides):
    """(loss, gradients on the host, the compiled program's HLO text, config, mesh, params) of one
    `loss_and_grads` on the configured mesh, from the shared initial parameters and step 0's batch."""
    return _step(tuple(overrides))


@functools.lru_cache(maxsize=None)
def _step(overrides: tuple[str, ...]):
    cfg = _config(overrides)
    mesh = make_mesh(cfg.mesh)
    trainer = build_trainer(cfg, mesh)
    # One device's parameters in this layout's stored order (the interleaved pipeline's layers are
    # stored in the order it runs them: parallel/layout.py), its gradients back in the canonical.
    params = jax.device_put(layout.to_stored(cfg, _initial_params(tuple(o for o in overrides if o.startswith("model.")))),
                            trainer.state_shardings.params)
    batches = data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train")
    batch = data.make_global_batch(batches, 0, trainer.batch_sharding)
    compiled = trainer.loss_and_grads.lower(params, batch).compile()
    loss, grads = compiled(params, batch)
    return float(loss), layout.to_canonical(cfg, jax.device_get(grads)), compiled.as_text(), cfg, mesh, params


@functools.lru_cache(maxsize=None)
def _reference(model_overrides: tuple[str, ...]):
    loss, grads, *_ = step(ONE + list(model_overrides))
    return loss, grads


def assert_matches_one_device(overrides):
    loss, grads, *_ = step(overrides)
    ref_loss, ref_grads = _reference(tuple(o for o in overrides if o.startswith("model.")))
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (loss, ref_loss)
    flat, ref_flat = jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)
    assert len(flat) == len(ref_flat)
    for (path, g), r in zip(flat, ref_flat):
        assert np.linalg.norm(r) > 0
        rel = np.linalg.norm(g - r) / np.linalg.norm(r)
        assert rel <= 1e-6, (jax.tree_util.keystr(path), rel)


SLOW = pytest.mark.slow  # the fast tier keeps cp 2 and cp 8 (two hops); the full suite runs all


@STEPS
@pytest.mark.parametrize("overrides", [
    ["mesh.cp=2"],
    # cp 4 with tp 2 (cp 4 alone proves nothing more: the halo code sees the cp size only)
    pytest.param(["mesh.cp=4", "mesh.tp=2"], marks=SLOW),
    ["mesh.cp=8"],  # the window reaches back over two slices: two permutes a layer
    # cp 2 with tp 2 or dp 2: in the layouts below (dp2 x cp2 x tp2 with ZeRO-1, dp2 x cp2 with microbatches)
    pytest.param(["mesh.cp=4", "model.window=null"], marks=SLOW),  # full attention: k and v all-gathered
    # the Pallas kernel on each slice behind its halo's padded queries (interpret mode on the CPU)
    ["mesh.cp=2", "model.attention=pallas"],
    pytest.param(["mesh.cp=8", "model.attention=pallas"], marks=SLOW),  # two hops, rank 0's keys masked
    # full attention: each rank's queries at their offset into the all-gathered keys
    ["mesh.cp=4", "model.attention=pallas", "model.window=null"],
    ["mesh.cp=2", "model.loss_chunks=2"],  # the loss in slices, each a share of every rank's part
    # sequence parallelism (GSPMD's): the residual stream over cp and tp between blocks
    ["mesh.cp=2", "mesh.tp=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=xla"],
    # ... and its explicit edges with collective matmul, on each rank's slice (the step manual over cp)
    pytest.param(["mesh.dp=2", "mesh.cp=2", "mesh.tp=2", "parallel.sequence_parallel=true",
                  "parallel.tp_overlap=collective_matmul"], marks=SLOW),  # 11 s: the full suite's
    # the pipeline (GPipe) with packed documents; 1F1B and full attention in the layouts below
    ["mesh.pp=2", "mesh.cp=4", "parallel.microbatches=4", "model.layers=4", "parallel.pp_schedule=gpipe",
     "model.document_eos=10"],
], ids=lambda o: " ".join(o))
def test_context_parallel_matches_one_device(overrides):
    assert_matches_one_device(["mesh.dp=1", "mesh.tp=1", *overrides])


@pytest.mark.slow
@STEPS
@pytest.mark.parametrize("overrides", [
    ["mesh.dp=2", "mesh.cp=2", "mesh.tp=2", "parallel.zero1=true"],
    ["mesh.dp=1", "mesh.cp=4", "mesh.tp=2", "model.document_eos=10"],  # packed documents kept apart
    ["mesh.dp=1", "mesh.cp=2", "mesh.tp=2", "model.block=serial", "model.window=null"],
    ["mesh.dp=2", "mesh.cp=4", "mesh.tp=1", "model.kv_heads=1", "model.window=20"],  # GQA 4:1, three hops
    ["mesh.dp=2", "mesh.cp=2", "mesh.tp=1", "parallel.microbatches=2"],
    # all four axes' kinds at once: the accumulation and the pipeline manual over cp (left to GSPMD,
    # cp and tp automatic in a region manual over dp or pp aborted XLA's partitioner)
    ["mesh.dp=2", "mesh.cp=2", "mesh.tp=2", "parallel.microbatches=2", "model.document_eos=10"],
    ["mesh.dp=1", "mesh.pp=2", "mesh.cp=2", "mesh.tp=2", "parallel.microbatches=2", "model.layers=4",
     "parallel.zero1=true"],
    # the pipeline: every stage runs a chunk every tick (the halo's permutes are collectives over
    # every device: a stage skipping its chunk under a `cond` hung the program), idle ones masked
    ["mesh.dp=2", "mesh.pp=2", "mesh.cp=2", "mesh.tp=1", "parallel.microbatches=2", "model.layers=4"],
    ["mesh.dp=1", "mesh.pp=2", "mesh.cp=2", "mesh.tp=1", "parallel.microbatches=2", "model.layers=4",
     "model.window=null"],
    ["mesh.dp=1", "mesh.pp=2", "mesh.cp=2", "mesh.tp=1", "parallel.microbatches=4", "model.layers=4",
     "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2"],
    ["mesh.dp=1", "mesh.cp=4", "mesh.tp=2", "model.loss_chunks=4"],
    ["mesh.dp=1", "mesh.pp=2", "mesh.cp=2", "mesh.tp=1", "parallel.microbatches=2", "model.layers=4",
     "model.loss_chunks=2"],
    # Pallas with documents and GQA: the keys' ids and the pre-start segment in one kernel
    ["mesh.dp=1", "mesh.cp=4", "mesh.tp=2", "model.attention=pallas", "model.document_eos=10"],
    ["mesh.dp=2", "mesh.cp=2", "mesh.tp=2", "model.attention=pallas", "model.window=null", "model.document_eos=10",
     "model.block=serial"],
], ids=lambda o: " ".join(o))
def test_context_parallel_layouts_match_one_device(overrides):
    assert_matches_one_device(overrides)


@functools.lru_cache(maxsize=None)
def _evaluated(overrides: tuple[str, ...]):
    """(eval loss, per-row summed log-probabilities, per-row all-greedy) of the trainer's
    evaluation on `overrides`' mesh, from the shared initial parameters, step 0's batch and a
    seeded mask. Row 0 is scored at one position of the sequence's last slice only, its target
    made the one-device argmax there, so it is greedy on every rank (the other ranks score none of
    its tokens) — the combination over cp is tested on a True as well as on Falses."""
    cfg = _config(overrides)
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    one = _initial_params(tuple(o for o in overrides if o.startswith("model.")))
    params = jax.device_put(layout.to_stored(cfg, one), trainer.state_shardings.params)
    batches = data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train")
    batch = np.array(jax.device_get(data.make_global_batch(batches, 0, trainer.batch_sharding)))
    rows, s = cfg.train.global_batch, cfg.model.seq_len
    mask = (np.random.default_rng(62).random((rows, s)) < 0.5).astype(np.int32)
    j = s - 3
    from megascale_jax.model.transformer import Transformer
    logits = jax.jit(Transformer(_config(ONE + [o for o in overrides if o.startswith("model.")]).model).apply)(
        {"params": one}, batch[:1, :-1])
    batch[0, j + 1], mask[0] = int(np.argmax(logits[0, j])), 0
    mask[0, j] = 1
    put = lambda x: jax.device_put(x, trainer.batch_sharding)
    summed, greedy = trainer.score_rows(params, put(batch), put(mask))
    return float(trainer.eval_loss(params, put(batch))), np.asarray(summed), np.asarray(greedy).tolist()


@STEPS
@pytest.mark.parametrize("overrides", [
    # sequence parallelism's explicit edges and collective matmul, on each rank's slice
    pytest.param(["mesh.dp=2", "mesh.cp=2", "mesh.tp=2", "parallel.sequence_parallel=true",
                  "parallel.tp_overlap=collective_matmul"], marks=SLOW),
    pytest.param(["mesh.dp=1", "mesh.pp=2", "mesh.cp=2", "mesh.tp=2", "parallel.microbatches=2", "model.layers=4",
                  "model.document_eos=10"], marks=SLOW),
], ids=lambda o: " ".join(o))
def test_evaluation_on_cp_slices_matches_one_device(overrides):
    """The evaluation loss and the downstream scores run as training runs the model (each cp rank
    its slice, manual over cp, through the pipeline at pp > 1): one device's, row for row."""
    loss, summed, greedy = _evaluated(tuple(overrides))
    ref_loss, ref_summed, ref_greedy = _evaluated(tuple(ONE + [o for o in overrides if o.startswith("model.")]))
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (loss, ref_loss)
    np.testing.assert_allclose(summed, ref_summed, rtol=1e-5)
    assert greedy == ref_greedy and greedy[0] and not all(greedy)


def _cp_collectives(hlo: str, mesh):
    shape, names = tuple(mesh.devices.shape), tuple(mesh.axis_names)
    return [c for c in collectives.collectives(hlo) if collectives.group_axes(c.groups[0], shape, names) == "cp"]


@STEPS
def test_sequence_parallelism_with_cp_moves_nothing_more_over_cp():
    """With sequence parallelism (GSPMD's edges) the residual stream is split over cp and tp: over
    cp the step still moves the halo and the gradients' all-reduce only."""
    _, _, hlo, _, mesh, _ = step(["mesh.dp=1", "mesh.cp=2", "mesh.tp=2", "parallel.sequence_parallel=true",
                                  "parallel.tp_overlap=xla"])
    assert {c.op for c in _cp_collectives(hlo, mesh)} == {"collective-permute", "all-reduce"}


@STEPS
@pytest.mark.parametrize("overrides", [
    ["mesh.cp=2"], pytest.param(["mesh.cp=8"], marks=SLOW), pytest.param(["mesh.cp=4", "mesh.tp=2"], marks=SLOW),
    # microbatches and the loss in slices: each rank sums its own tokens' gradients, which cross cp
    # once a step (the accumulation is manual over cp; left to GSPMD they crossed it every microbatch)
    ["mesh.cp=2", "parallel.microbatches=2"],
    pytest.param(["mesh.cp=4", "mesh.tp=2", "model.loss_chunks=2"], marks=SLOW),
    # sequence parallelism's explicit edges: on each rank's slice, nothing gathered over cp
    pytest.param(["mesh.cp=2", "mesh.tp=2", "parallel.sequence_parallel=true", "parallel.tp_overlap=collective_matmul"],
                 marks=SLOW),
], ids=lambda o: " ".join(o))
def test_cp_moves_the_halo_and_the_gradient_reduction_only(overrides):
    """Per layer and direction each rank sends 2 x halo x rows x kv width bytes (k and v forward,
    their gradients backward), in permutes; the other collectives over cp are the gradients'
    all-reduce, once a step (and the loss's 4 bytes): nothing gathers the sequence, the tokens or
    the targets."""
    _, _, hlo, cfg, mesh, params = step(["mesh.dp=1", "mesh.tp=1", *overrides])
    found = _cp_collectives(hlo, mesh)
    assert {c.op for c in found} == {"collective-permute", "all-reduce"}, found
    mo, cp = cfg.model, cfg.mesh.cp
    kv_width = mo.kv_heads * mo.head_dim // cfg.mesh.tp
    ideal = 2 * mo.layers * context_parallel.halo_bytes(mo.window, mo.seq_len, cp, cfg.train.global_batch, kv_width, 4)
    assert sum(c.sent_bytes * c.executions for c in found if c.op == "collective-permute") == ideal
    # the gradients a device holds, each all-reduced once, and the loss; the parallel block's two
    # output biases get one gradient (both add to the same sum), which XLA may reduce once (it
    # does at one microbatch; with several each has its own accumulator)
    held = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * 4 for x in jax.tree.leaves(params))
    shared = int(np.prod(params["layers"]["attn"]["bo"].sharding.shard_shape(params["layers"]["attn"]["bo"].shape))) * 4
    assert sum(c.nbytes * c.executions for c in found if c.op == "all-reduce") in (held + 4, held - shared + 4)


@STEPS
def test_full_attention_all_gathers_keys_and_values():
    """window=null: per layer k and v all-gathered over cp, their gradients reduce-scattered."""
    _, _, hlo, cfg, mesh, _ = step(["mesh.dp=1", "mesh.tp=1", "mesh.cp=4", "model.window=null"])
    found = _cp_collectives(hlo, mesh)
    mo = cfg.model
    whole = cfg.train.global_batch * mo.seq_len * mo.kv_heads * mo.head_dim * 4  # one of k, v: every rank's
    for op in ("all-gather", "reduce-scatter"):
        assert sum(c.nbytes * c.executions for c in found if c.op == op) == 2 * mo.layers * whole
    assert {c.op for c in found} == {"all-gather", "reduce-scatter", "all-reduce"}


def test_the_batch_is_whole_rows_on_every_cp_rank():
    """Rows of seq_len + 1 tokens (inputs and targets) do not split over a cp dividing seq_len:
    every cp rank gets whole rows, and each process still reads whole rows."""
    cfg = _config(["mesh.dp=2", "mesh.cp=4", "mesh.tp=1"])
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    assert tuple(trainer.batch_sharding.spec) == ("dp", None)
    assert data.process_row_range(trainer.batch_sharding, (4, 33)) == (0, 4)


@pytest.mark.parametrize("overrides,message", [
    (["mesh.cp=3"], "model.seq_len=32 must be divisible by mesh.cp=3"),
    (["mesh.cp=2", "model.attention=cudnn", "model.window=null"],
     "mesh.cp=2 with full attention .* runs with model.attention=xla|pallas, not cudnn"),
    (["mesh.cp=2", "model.loss_chunks=32"], "model.loss_chunks=32 must divide each cp rank's model.seq_len/mesh.cp=16"),
    (["mesh.dp=2", "mesh.cp=4", "mesh.tp=2"],
     r"mesh dp\*pp\*cp\*tp=2\*1\*4\*2=16 devices do not match mesh.cpu_devices=8"),
])
def test_bad_context_parallel_configs_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        cfg = _config(overrides)
        from megascale_jax.config import check_runtime
        check_runtime(cfg, "cpu", 8)
    assert "\n" not in str(e.value)


def cuda_step_text(overrides) -> str:
    """The train step on `overrides`' mesh lowered for CUDA on this CPU-only machine (nothing compiled)."""
    cfg = _config(overrides)
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         jax.eval_shape(trainer.init), trainer.state_shardings)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), np.int32,
                                 sharding=trainer.batch_sharding)
    return trainer.train_step.trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()


def test_the_step_lowers_for_cuda():
    """dp2 x cp2 x tp2 for CUDA: the halo's permutes are in the GPU program, forward and backward."""
    text = cuda_step_text(["mesh.dp=2", "mesh.cp=2", "mesh.tp=2"])
    assert text.count("stablehlo.collective_permute") == 4  # k and v, forward and backward, in the layer loops


def test_the_pallas_kernels_lower_for_cuda_on_each_slice():
    """Pallas's attention on each cp rank's slice for CUDA: the kernels (forward, dq, dk/dv) are
    Triton calls in the program beside the halo's permutes. cuDNN's needs the CUDA plugin even to
    lower: tests/aot compiles it for eight H100s."""
    common = ["mesh.dp=2", "mesh.cp=2", "mesh.tp=2", "model.attention=pallas", "model.dtype=bfloat16",
              "model.d_model=128", "model.heads=2", "model.kv_heads=2"]
    text = cuda_step_text(common)
    assert text.count("stablehlo.collective_permute") == 4, text.count("stablehlo.collective_permute")
    assert text.count("__gpu$xla.gpu.triton") >= 3, text.count("__gpu$xla.gpu.triton")  # forward, dq, dk/dv
    # full attention: the queries' offset into the all-gathered keys is an input of each kernel
    text = cuda_step_text(common + ["model.window=null"])
    assert text.count("stablehlo.all_gather") >= 2 and text.count("__gpu$xla.gpu.triton") >= 3


@pytest.mark.slow
def test_a_checkpoint_resumes_across_a_change_of_cp(run_main, tmp_path):
    """3 steps on cp4 x tp2, resumed for 3 more on dp2 x cp2: the losses of one device's 6 steps
    (the state does not depend on cp: parameters are replicated over it, checkpoints canonical)."""
    from megascale_jax import train

    common = ["model.layers=2", "model.seq_len=64", "model.window=20", "train.global_batch=4", "train.log_every=1",
              "train.eval_every=0", "train.eval_batches=0", "data.val_fraction=0", "checkpoint.every=3",
              "train.sample_at_end=0", "observe.tensorboard=false"]
    runs = [("cp", "mesh.dp=1 mesh.cp=4 mesh.tp=2 mesh.cpu_devices=8", 3),
            ("cp", "mesh.dp=2 mesh.cp=2 mesh.tp=1 mesh.cpu_devices=4", 6),
            ("one", "mesh.dp=1 mesh.cp=1 mesh.tp=1 mesh.cpu_devices=1", 6)]
    for run, mesh, steps in runs:
        code, _, err = run_main(train.main, ["--run-dir", run, *common, *mesh.split(), f"train.steps={steps}"], tmp_path)
        assert code == 0, err

    def losses(run):
        return [json.loads(line)["loss"] for line in open(tmp_path / run / "metrics.jsonl")]

    assert len(losses("cp")) == 6
    np.testing.assert_allclose(losses("cp"), losses("one"), rtol=1e-5)
