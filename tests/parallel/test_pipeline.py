"""The pipeline executor computes the single-device loss and gradients, for every schedule, alone
and with dp and tp, stashing chunk inputs or vjp residuals; its activation memory is flat in the
number of microbatches for 1F1B, and stashing residuals removes the backward's forward recompute."""

import functools
import re

import jax
import numpy as np
import pytest

from megascale_jax.training import data
from megascale_jax.parallel import layout, pipeline, sharding
from megascale_jax.config import load_config
from megascale_jax.parallel.mesh import make_mesh
from megascale_jax.model.transformer import Transformer, loss_fn, score_fn
from megascale_jax.training.trainer import build_trainer

import packed_documents  # tests/: packed rows of documents and the documents-alone reference

MODEL = ["model.layers=8", "model.d_model=32", "model.heads=4", "model.kv_heads=2", "model.seq_len=16",
         "model.window=6", "train.global_batch=8"]


def config(*overrides):
    return load_config(None, MODEL + list(overrides))


def one_device(*overrides):
    return config("mesh.dp=1", "mesh.pp=1", "mesh.tp=1", "mesh.cpu_devices=1", *overrides)


# The tests against the module's one-device references (`reference`, `documents_reference`) run
# on one xdist worker, which computes each reference once.
REFERENCE = pytest.mark.xdist_group("pipeline_reference")


@pytest.fixture(scope="module")
def reference():
    return reference_for()


def reference_for(*overrides, batch=None):
    """Random (non-initial) parameters, a real batch (or `batch`), and plain autodiff on one device."""
    cfg = one_device(*overrides)
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    params = jax.device_get(trainer.init().params)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    params = treedef.unflatten([x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    if batch is None:
        batches = data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train")
        batch = batches.rows(3, 0, cfg.train.global_batch)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(trainer.model, p, batch)))(params)
    return params, batch, float(loss), jax.device_get(grads)


COLLECTIVE_MATMUL = ("parallel.sequence_parallel=true", "parallel.tp_overlap=collective_matmul")
RESIDUALS = ("parallel.pp_stash=residuals",)
ALL_REDUCE = ("parallel.zero1=false",)  # the default is ZeRO-1 (reduce-scatter)
ELEMENTWISE = ("model.remat=elementwise",)
GRID = [
    # (dp, pp, tp, schedule, virtual, microbatches, extra overrides)
    # Plain 1F1B on dp2 x pp2 x tp2 at m = 4 is not its own case: its parts are, ZeRO-1's
    # reduce-scatter (the residuals and collective-matmul cases), chunk inputs stashed at m > p (the
    # all-reduce case) and dp x pp x tp at m = 4 (the downstream scores).
    (2, 2, 2, "gpipe", 1, 2, ()),
    (2, 2, 2, "interleaved_1f1b", 2, 2, ()),
    # 1F1B's table is generic in p: pp = 2 (above and below) and pp = 8 here; pp = 4 in the
    # evaluation, documents and downstream-score tests
    (1, 4, 2, "interleaved_1f1b", 2, 4, ()),
    (1, 8, 1, "1f1b", 1, 8, ()),
    (2, 2, 2, "1f1b", 1, 2, COLLECTIVE_MATMUL),  # explicit tp collectives inside every stage
    # stash vjp residuals instead of chunk inputs (no forward recompute in the backward)
    (2, 2, 2, "gpipe", 1, 2, RESIDUALS),  # last chunk's backward ticks after its forward
    (2, 2, 2, "1f1b", 1, 4, RESIDUALS),
    (1, 4, 2, "interleaved_1f1b", 2, 4, RESIDUALS),
    (2, 2, 2, "1f1b", 1, 2, COLLECTIVE_MATMUL + RESIDUALS),
    # without ZeRO-1: chunk gradients all-reduced over dp inside the tick loop
    (2, 2, 2, "1f1b", 1, 4, ALL_REDUCE),
    (4, 2, 1, "interleaved_1f1b", 2, 2, ALL_REDUCE + RESIDUALS),
    # norms and activations rematerialised inside each layer (jax.checkpoint, as model.remat=dots
    # is through its policy), under tp collectives, the chunk's vjp residuals stashed
    (2, 2, 2, "1f1b", 1, 2, ELEMENTWISE + COLLECTIVE_MATMUL + RESIDUALS),
]


def grid_id(dp, pp, tp, schedule, v, m, extra):
    return (f"dp{dp}pp{pp}tp{tp}-{schedule}-v{v}m{m}{'-collective-matmul' if COLLECTIVE_MATMUL[1] in extra else ''}"
            f"{'-residuals' if RESIDUALS[0] in extra else ''}{'-all-reduce' if ALL_REDUCE[0] in extra else ''}"
            f"{'-elementwise' if ELEMENTWISE[0] in extra else ''}")


@pytest.mark.slow
@pytest.mark.parametrize("dp,pp,tp,schedule,v,m,extra", GRID, ids=[grid_id(*g) for g in GRID])
@REFERENCE
def test_loss_and_gradients_equal_one_device(reference, dp, pp, tp, schedule, v, m, extra):
    cfg = config(f"mesh.dp={dp}", f"mesh.pp={pp}", f"mesh.tp={tp}", f"parallel.pp_schedule={schedule}",
                 f"parallel.pp_virtual={v}", f"parallel.microbatches={m}", *extra)
    assert_pipeline_equals_one_device(cfg, reference)


@pytest.mark.slow
@pytest.mark.parametrize("pp,sp", [(2, True), (1, True), (2, False)], ids=["pp2-sp", "pp1-sp", "pp2"])
@REFERENCE
def test_the_loss_in_sequence_slices_equals_one_devices_whole_loss(reference, pp, sp):
    """`model.loss_chunks`: the head's logits one sequence slice at a time, on the pipeline's last
    stage and under GSPMD at pp = 1, with sequence parallelism's vocab-parallel head and without,
    against the whole loss on one device (`reference`)."""
    cfg = config("mesh.dp=2", f"mesh.pp={pp}", "mesh.tp=2", "parallel.microbatches=2",
                 f"parallel.sequence_parallel={str(sp).lower()}", "model.loss_chunks=4")
    assert_pipeline_equals_one_device(cfg, reference)


# A Llama-shaped model with the options Hugging Face mappings need; the tied head is the
# embedding's transpose on the last stage, its gradient added to the first stage's.
HF_OPTIONS = ("model.block=serial", "model.norm=rmsnorm", "model.activation=swiglu", "model.bias=false",
              "model.tied_embeddings=true", "model.rope_fraction=0.5", "model.rope_base=500000")


@pytest.mark.slow
def test_hf_model_options_with_tied_embeddings_equal_one_device():
    reference = reference_for(*HF_OPTIONS)
    cfg = config("mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "parallel.pp_schedule=interleaved_1f1b",
                 "parallel.pp_virtual=2", "parallel.microbatches=2", *HF_OPTIONS)
    trainer, params, batch, _ = assert_pipeline_equals_one_device(cfg, reference)
    np.testing.assert_allclose(float(trainer.eval_loss(params, batch)), reference[2], rtol=1e-5)


def assert_pipeline_equals_one_device(cfg, reference, loss_rtol=1e-5):
    """The pipelined loss and gradients of `cfg` equal one device's (`reference`); returns the
    trainer, its placed parameters and batch, and the loss."""
    params, batch, ref_loss, ref_grads = reference
    mesh = make_mesh(cfg.mesh)
    trainer = build_trainer(cfg, mesh)
    params = jax.device_put(layout.to_stored(cfg, params), trainer.state_shardings.params)
    batch = jax.device_put(batch, trainer.batch_sharding)
    loss, grads = trainer.loss_and_grads(params, batch)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=loss_rtol)
    assert set(grads) == set(ref_grads)  # a tied model has no head, and no head gradient
    if cfg.parallel.zero1 and cfg.mesh.dp > 1:  # reduce-scattered to the moments' dp split
        assert "dp" in str(grads["layers"]["mlp"]["w1"].sharding.spec), grads["layers"]["mlp"]["w1"].sharding
    for path, g in jax.tree_util.tree_flatten_with_path(jax.device_get(layout.to_canonical(cfg, grads)))[0]:
        ref = ref_grads
        for key in path:
            ref = ref[key.key]
        scale = np.abs(ref).max()
        assert scale > 0, path
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5 * scale, err_msg=str(path))
    return trainer, params, batch, float(loss)


# Packed documents kept apart (model.document_eos): rows of random documents ended by EOS
# (tests/packed_documents.py). Each stage recomputes a microbatch's document layout from its tokens
# for the chunk's attention and rotary positions; the last stage drops the targets after an EOS.
EOS = 3
DOCUMENTS = (f"model.document_eos={EOS}",)
DOCUMENTS_GRID = [  # 1F1B: with loss chunks and with collective matmul below
    (2, 2, 2, "gpipe", 1, 2, ()),
    # the masks rebuilt in the backward from the backward's microbatch, not stashed
    (2, 2, 1, "interleaved_1f1b", 2, 2, RESIDUALS),
    (1, 4, 2, "1f1b", 1, 4, ("model.loss_chunks=4",)),  # the boundary targets dropped slice by slice
    (2, 2, 2, "1f1b", 1, 2, COLLECTIVE_MATMUL),
]


@pytest.fixture(scope="module")
def documents_reference():
    """One device's loss and gradients on packed rows of documents, and the documents' own summed
    losses, each document run alone through the plain model (`unpacked_loss_sum`)."""
    cfg = one_device(*DOCUMENTS)
    batch = packed_documents.packed_batch(5, cfg.train.global_batch, cfg.model.seq_len, EOS, cfg.model.vocab)
    assert (batch[:, :-1] == EOS).any(axis=1).mean() >= 0.75  # most rows hold a document boundary
    reference = reference_for(*DOCUMENTS, batch=batch)
    plain = float(jax.jit(loss_fn, static_argnums=0)(Transformer(one_device().model), reference[0], batch))
    assert abs(plain - reference[2]) > 1e-3 * reference[2]  # the documents change the loss
    return reference, packed_documents.unpacked_loss_sum(cfg.model, reference[0], batch)


@pytest.mark.slow
@pytest.mark.parametrize("dp,pp,tp,schedule,v,m,extra", DOCUMENTS_GRID, ids=[grid_id(*g) for g in DOCUMENTS_GRID])
@REFERENCE
def test_packed_documents_through_the_pipeline_equal_one_device_and_each_document_alone(
        documents_reference, dp, pp, tp, schedule, v, m, extra):
    reference, alone = documents_reference
    cfg = config(f"mesh.dp={dp}", f"mesh.pp={pp}", f"mesh.tp={tp}", f"parallel.pp_schedule={schedule}",
                 f"parallel.pp_virtual={v}", f"parallel.microbatches={m}", *DOCUMENTS, *extra)
    _, _, batch, loss = assert_pipeline_equals_one_device(cfg, reference, loss_rtol=1e-6)
    targets = batch.shape[0] * cfg.model.seq_len  # the loss is the documents' losses over every target
    np.testing.assert_allclose(loss * targets, alone, rtol=1e-6)


@pytest.mark.slow
@REFERENCE
def test_packed_documents_evaluated_through_the_pipeline_equal_one_device(documents_reference):
    (params, batch, ref_loss, _), alone = documents_reference
    cfg = config("mesh.dp=1", "mesh.pp=4", "mesh.tp=2", "parallel.pp_schedule=interleaved_1f1b",
                 "parallel.pp_virtual=2", "parallel.microbatches=4", *DOCUMENTS)
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    loss = float(trainer.eval_loss(jax.device_put(layout.to_stored(cfg, params), trainer.state_shardings.params),
                                   jax.device_put(batch, trainer.batch_sharding)))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(loss * batch.shape[0] * cfg.model.seq_len, alone, rtol=1e-6)


# The memory and recompute tests read the same compiled steps (1F1B at m = 8, both stash modes):
# compiled once per worker, their numbers kept (`step_costs`), the tests on one xdist worker.
COMPILES = pytest.mark.xdist_group("pipeline_compiled_steps")


@functools.lru_cache(maxsize=None)
def step_costs(schedule: str, v: int, m: int, stash: str = "inputs") -> dict:
    """Temp bytes, dot count and FLOPs of `compile_step`'s program."""
    compiled = compile_step(schedule, v, m, stash)
    return {"temp": compiled.memory_analysis().temp_size_in_bytes, "dots": compiled.as_text().count(" dot("),
            "flops": compiled.cost_analysis()["flops"]}


def compile_step(schedule: str, v: int, m: int, stash: str = "inputs"):
    """The compiled pipelined step (loss and gradients), one sequence per microbatch."""
    cfg = load_config(None, ["model.layers=4", "model.d_model=64", "model.heads=4", "model.kv_heads=2",
                             "model.seq_len=64", f"train.global_batch={m}", "mesh.dp=1", "mesh.pp=2", "mesh.tp=1",
                             "mesh.cpu_devices=2", f"parallel.microbatches={m}", f"parallel.pp_schedule={schedule}",
                             f"parallel.pp_virtual={v}", f"parallel.pp_stash={stash}"])
    mesh = make_mesh(cfg.mesh)
    trainer = build_trainer(cfg, mesh)
    params = trainer.abstract_params
    batch = jax.ShapeDtypeStruct((m, 65), np.int32, sharding=trainer.batch_sharding)
    with jax.set_mesh(mesh), sharding.axis_rules():
        return jax.jit(lambda p, b: pipeline.loss_and_grads(cfg, mesh, p, b)).lower(params, batch).compile()


def temp_bytes(schedule: str, v: int, m: int, stash: str = "inputs") -> int:
    return step_costs(schedule, v, m, stash)["temp"]


@pytest.mark.slow
@COMPILES
@pytest.mark.parametrize("schedule,v,stash", [("1f1b", 1, "inputs"), ("interleaved_1f1b", 2, "inputs"),
                                              ("gpipe", 1, "inputs"), ("1f1b", 1, "residuals")])
def test_activation_memory_flat_in_microbatches_except_gpipe(schedule, v, stash):
    activation = 64 * 64 * 4  # one microbatch's chunk input: seq 64 × d_model 64 × float32
    small, large = temp_bytes(schedule, v, 8, stash), temp_bytes(schedule, v, 32, stash)
    growth_per_microbatch = (large - small) / 24
    if schedule == "gpipe":
        assert growth_per_microbatch >= 0.9 * activation  # GPipe stashes every microbatch
    else:
        assert growth_per_microbatch < 0.1 * activation  # about p in flight, whatever m


@pytest.mark.slow
@COMPILES
def test_stashing_residuals_removes_the_backward_recompute():
    """Same 1F1B step, both stash modes: with residuals the backward runs no chunk forward, so the
    compiled program has fewer matmuls and FLOPs (by about one chunk forward per backward)."""
    steps = {stash: step_costs("1f1b", 1, 8, stash) for stash in ("inputs", "residuals")}
    dots = {k: c["dots"] for k, c in steps.items()}
    flops = {k: c["flops"] for k, c in steps.items()}
    assert dots["residuals"] < dots["inputs"], dots
    assert flops["residuals"] < 0.9 * flops["inputs"], flops


@pytest.mark.slow
def test_training_with_pipeline_matches_and_state_is_layout_independent():
    """3 train steps at dp=2×pp=2×tp=2 (interleaved, v=2: the layers are stored stage-major)
    equal one device; the state moves between layouts in canonical order."""
    def run(trainer, state=None, steps=3):
        cfg = trainer.cfg
        batches = data.SequenceBatches.from_config(cfg, data.load_tokens(cfg), "train")
        state = trainer.init() if state is None else trainer.to_stored(jax.device_put(state, trainer.state_shardings))
        losses = []
        for i in range(steps):
            state, metrics = trainer.train_step(state, data.make_global_batch(batches, i, trainer.batch_sharding))
            losses.append(float(metrics["loss"]))
        return np.array(losses), jax.device_get(trainer.to_canonical(state))

    piped_cfg = config("mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "parallel.microbatches=2",
                       "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2")
    one = one_device()
    one_trainer = build_trainer(one, make_mesh(one.mesh))  # one trainer, its step compiled once for all three runs
    ref_losses, ref_state = run(one_trainer)
    losses, state = run(build_trainer(piped_cfg, make_mesh(piped_cfg.mesh)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # The pipeline's state is the ordinary parameter tree: hand it to a pp=1 trainer and back.
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    more_ref, _ = run(one_trainer, state=ref_state, steps=2)
    more_from_pp, _ = run(one_trainer, state=state, steps=2)
    np.testing.assert_allclose(more_from_pp, more_ref, rtol=1e-4)


EVAL_GRID = [  # dp2 x pp2 x tp2 under GSPMD's tp is scored through the same forward (downstream scores)
    (1, 4, 2, "1f1b", 1, 4, ()),
    (1, 4, 2, "interleaved_1f1b", 2, 4, ()),
    (2, 2, 2, "1f1b", 1, 2, COLLECTIVE_MATMUL),  # explicit tp collectives: idle stages compute and mask
]


@pytest.mark.slow
@pytest.mark.parametrize("dp,pp,tp,schedule,v,m,extra", EVAL_GRID, ids=[grid_id(*g) for g in EVAL_GRID])
@REFERENCE
def test_evaluation_through_the_pipeline_equals_one_device(reference, dp, pp, tp, schedule, v, m, extra):
    """The trainer's evaluation at pp > 1 runs the pipeline forward only (the forward half of the
    schedule's table) and gives the single-device loss."""
    params, batch, ref_loss, _ = reference
    cfg = config(f"mesh.dp={dp}", f"mesh.pp={pp}", f"mesh.tp={tp}", f"parallel.pp_schedule={schedule}",
                 f"parallel.pp_virtual={v}", f"parallel.microbatches={m}", *extra)
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    loss = trainer.eval_loss(jax.device_put(layout.to_stored(cfg, params), trainer.state_shardings.params),
                             jax.device_put(batch, trainer.batch_sharding))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)


def test_compiled_evaluation_gathers_no_layer_weights_over_pp():
    """On a pp=2 mesh (nothing else to gather over), the evaluation program has no all-gather at
    all; the plain model compiled with the same sharded parameters gathers the layer weights."""
    cfg = config("mesh.dp=1", "mesh.pp=2", "mesh.tp=1", "mesh.cpu_devices=2", "parallel.microbatches=2")
    mesh = make_mesh(cfg.mesh)
    trainer = build_trainer(cfg, mesh)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), np.int32,
                                 sharding=trainer.batch_sharding)
    text = trainer.eval_loss.lower(trainer.abstract_params, batch).compile().as_text()
    assert text.count("all-gather(") == 0 and "collective-permute" in text  # activations do move
    with jax.set_mesh(mesh), sharding.axis_rules():
        plain = jax.jit(lambda p, b: loss_fn(trainer.model, p, b)).lower(trainer.abstract_params, batch)
        assert plain.compile().as_text().count("all-gather(") > 0


# ------------------------------------------------------------------ what the compiled step moves

COLLECTIVES = ("all-to-all", "collective-permute", "all-gather", "all-reduce", "reduce-scatter")


def hlo_ops(text: str) -> list[tuple[bool, str, int]]:
    """(inside a while loop, opcode, elements of the result) of every collective and transpose of
    a compiled HLO module; "inside" means in a computation reachable from a loop body."""
    computations = {m.group(1): m.group(2) for m in
                    re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) .*?\{\n(.*?)^\}", text, re.M | re.S)}
    called = {name: set(re.findall(r"(?:body|condition|to_apply|calls|true_computation|false_computation)"
                                   r"=%?([\w.\-]+)", body))
              | {c.strip().lstrip("%") for group in re.findall(r"branch_computations=\{([^}]*)\}", body)
                 for c in group.split(",")}
              for name, body in computations.items()}
    inside, todo = set(), re.findall(r"body=%?([\w.\-]+)", text)
    while todo:
        name = todo.pop()
        if name not in inside:
            inside.add(name)
            todo += called.get(name, ())
    ops = []
    for name, body in computations.items():
        for shape, op in re.findall(rf"= (.+?) ({'|'.join(COLLECTIVES)}|transpose)(?:-start)?\(", body):
            elements = sum(int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                           for dims in re.findall(r"\[([\d,]*)\]", shape))
            ops.append((name in inside, op, elements))
    return ops


# The interleaved step's weight traffic and the chunk gradients' reduction are read from one
# compiled step (dp=2 x pp=2, v=2, no ZeRO-1), compiled once on one xdist worker.
TRAIN_STEPS = pytest.mark.xdist_group("pipeline_compiled_train_steps")


@functools.lru_cache(maxsize=None)
def compiled_train_step(*overrides):
    cfg = config("mesh.tp=1", "mesh.cpu_devices=8", *overrides)
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         trainer.init.lower().out_info, trainer.state_shardings)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), np.int32,
                                 sharding=trainer.batch_sharding)
    return cfg, trainer, trainer.train_step.lower(state, batch).compile().as_text()


@TRAIN_STEPS
def test_interleaved_step_moves_and_transposes_no_weights_outside_the_tick_loop():
    """pp=2, v=2 (8 layers: stage 0 runs chunks 0 and 2, stage 1 chunks 1 and 3): each stage's
    stored block is its chunks in run order, so outside the tick loop the compiled step has no op
    that moves or re-lays out data — no permute, all-to-all, all-gather or transpose — only the
    all-reduces that sum the embedding's and head's gradients over pp and dp (no ZeRO-1, so no
    gather of updated parameters over dp). (Storing the layers in network order needed a
    collective-permute of every layer leaf each step, for the weights and their gradients.)
    The step is the one `test_chunk_gradients_are_reduced_over_dp_inside_the_tick_loop` reads."""
    _, _, text = compiled_train_step("mesh.dp=2", "mesh.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                                     "parallel.pp_virtual=2", "parallel.microbatches=2", "parallel.zero1=false")
    ops = hlo_ops(text)
    outside = [(op, n) for inside, op, n in ops if not inside and op != "all-reduce" and n > 1]
    assert outside == [], outside
    assert any(inside and op == "collective-permute" for inside, op, _ in ops)  # the pipeline's own sends


@pytest.mark.slow
@TRAIN_STEPS
@pytest.mark.parametrize("schedule,v,zero1", [("1f1b", 1, True), ("interleaved_1f1b", 2, True),
                                              ("interleaved_1f1b", 2, False)])
def test_chunk_gradients_are_reduced_over_dp_inside_the_tick_loop(schedule, v, zero1):
    """dp=2 × pp=2: every layer gradient element is reduced over dp inside the tick loop (as a
    reduce-scatter with ZeRO-1); after the loop only the embedding, final norm and head are.
    Storing the reductions after the loop (as one psum of all layer gradients) fails this."""
    cfg, trainer, text = compiled_train_step(
        "mesh.dp=2", "mesh.pp=2", f"parallel.pp_schedule={schedule}", f"parallel.pp_virtual={v}",
        "parallel.microbatches=2", f"parallel.zero1={str(zero1).lower()}")
    per_stage = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
    layers = per_stage(trainer.abstract_params["layers"]) // cfg.mesh.pp
    others = per_stage({k: x for k, x in trainer.abstract_params.items() if k != "layers"})
    # The layer leaves ZeRO-1 splits over dp (the others have no dimension dp divides).
    split = sum(x.size for x, s in zip(jax.tree.leaves(trainer.abstract_params["layers"]),
                                       jax.tree.leaves(trainer.state_shardings.params["layers"]))
                if "dp" in str(sharding.zero1_sharding(s, x.shape, trainer.mesh).spec)) // cfg.mesh.pp
    ops = hlo_ops(text)
    dp = 2  # a reduce-scatter's result is 1/dp of what it reduces
    reduced = lambda where: sum(n * (dp if op == "reduce-scatter" else 1) for inside, op, n in ops
                                if inside == where and op in ("all-reduce", "reduce-scatter"))
    # In the loop body, one reduction per leaf of one chunk (the chunk just completed; run v times).
    assert reduced(True) >= layers // v, (reduced(True), layers, v)
    # After the loop: the embedding, final norm and head, summed over dp and over pp (+ scalars).
    assert reduced(False) <= 2 * others + 64, (reduced(False), others)
    scattered = sum(n * dp for inside, op, n in ops if inside and op == "reduce-scatter")
    assert scattered >= split // v if zero1 else scattered == 0, (scattered, split, v)
    assert split > 0.9 * layers


SCORED = [(2, 1, 2, "1f1b", 1, 1, ()), (2, 2, 2, "1f1b", 1, 4, ()), (1, 4, 2, "interleaved_1f1b", 2, 4, COLLECTIVE_MATMUL)]


@pytest.fixture(scope="module")
def scored_reference(reference):
    """The rows, their masks and one device's scores (`score_fn`) for the downstream-score tests."""
    params, batch, _, _ = reference
    rng = np.random.default_rng(11)
    mask = np.zeros(batch[:, 1:].shape, np.float32)
    for row, (start, length) in enumerate(zip(rng.integers(0, 12, len(mask)), rng.integers(1, 5, len(mask)))):
        mask[row, start:start + length] = 1.0  # one continuation per row, as lm-eval's requests
    mask[3] = 0.0  # a padding row
    one = one_device()
    model = build_trainer(one, make_mesh(one.mesh)).model
    # row 5: one scored target, made the argmax there (what follows it does not change its logits)
    batch = np.array(batch)
    mask[5] = 0.0
    mask[5, 9] = 1.0
    batch[5, 10] = np.argmax(jax.jit(model.apply)({"params": params}, batch[:, :-1])[5, 9])
    want_sum, want_greedy = jax.jit(functools.partial(score_fn, model))(params, batch, mask)
    assert np.asarray(want_greedy)[[3, 5]].all()
    return params, batch, mask, want_sum, want_greedy


@pytest.mark.parametrize("dp,pp,tp,schedule,v,m,extra", SCORED, ids=[grid_id(*g) for g in SCORED])
@REFERENCE
def test_downstream_scores_on_the_mesh_equal_one_device(scored_reference, dp, pp, tp, schedule, v, m, extra):
    """`Trainer.score_rows` (train.eval_tasks: each row's summed log-probability of its masked
    targets and whether each was the argmax), through the pipeline at pp > 1, equals the model's
    one-device scores (`score_fn`, what `python -m megascale_jax.evaluate` runs) row for row."""
    params, batch, mask, want_sum, want_greedy = scored_reference
    cfg = config(f"mesh.dp={dp}", f"mesh.pp={pp}", f"mesh.tp={tp}", f"parallel.pp_schedule={schedule}",
                 f"parallel.pp_virtual={v}", f"parallel.microbatches={m}", *extra)
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    stored = jax.device_put(layout.to_stored(cfg, params), trainer.state_shardings.params)
    got_sum, got_greedy = trainer.score_rows(stored, jax.device_put(batch, trainer.batch_sharding),
                                             jax.device_put(mask, trainer.batch_sharding))
    assert np.asarray(want_sum)[3] == 0.0 and (np.asarray(want_sum)[np.arange(8) != 3] < 0).all()
    np.testing.assert_allclose(np.asarray(got_sum), np.asarray(want_sum), rtol=1e-5)
    assert np.asarray(got_greedy).tolist() == np.asarray(want_greedy).tolist()
