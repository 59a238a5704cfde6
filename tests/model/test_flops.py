"""megascale_jax.model.flops against hand counts, Megatron's closed form and the paper's model sizes."""

import dataclasses
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import pytest

from megascale_jax.model import flops
from megascale_jax.config import Config, ModelConfig, ParallelConfig, MeshConfig, TrainConfig, load_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# layers 2, d 8, heads 2 (head_dim 4), mlp 32, vocab 16, seq 4.
SMALL = ModelConfig(layers=2, d_model=8, heads=2, kv_heads=2, mlp_ratio=4.0, vocab=16, seq_len=4,
                    block="parallel", norm="layernorm")


def _replace(**kw):
    return dataclasses.replace(SMALL, **kw)


# ----------------------------------------------------------------------------- parameters

def test_param_count_by_hand():
    embed, head, final_norm = 16 * 8, 8 * 16, 8 + 8
    norm = 8 + 8  # one shared layernorm: scale + bias
    attn = (8 * 2 * 4 + 2 * 4) + (8 * 2 * 4 + 2 * 4) + (8 * 2 * 4 + 2 * 4) + (2 * 4 * 8 + 8)  # q, k, v, o
    mlp = (8 * 32 + 32) + (32 * 8 + 8)
    assert (norm, attn, mlp) == (16, 288, 552)
    assert flops.param_count(SMALL) == embed + head + final_norm + 2 * (norm + attn + mlp) == 1984


def test_param_count_block_norm_and_gqa_variants():
    assert flops.param_count(_replace(block="serial")) == 1984 + 2 * 16  # a second layernorm per layer
    assert flops.param_count(_replace(norm="rmsnorm")) == 1984 - 2 * 8 - 8  # no biases: layers + final
    # serial rmsnorm: each layer's one 16-value layernorm becomes two 8-value rmsnorms; final 16 -> 8.
    assert flops.param_count(_replace(block="serial", norm="rmsnorm")) == 1984 + 2 * (2 * 8 - 16) - 8 == 1976
    # kv_heads=1: wk, wv shrink from (8, 2, 4) to (8, 1, 4), bk, bv from (2, 4) to (1, 4).
    assert flops.param_count(_replace(kv_heads=1)) == 1984 - 2 * 2 * (8 * 4 + 4) == 1840


def test_paper_model_sizes():
    p175 = flops.param_count(load_config(os.path.join(REPO, "configs/gpt_175b.yaml"), planning=True).model)
    p530 = flops.param_count(load_config(os.path.join(REPO, "configs/gpt_530b.yaml"), planning=True).model)
    # per layer: 12 d^2 weights, biases q k v o (4d) + w1 (4d) + w2 (d), one layernorm (2d)
    assert p175 == 96 * (12 * 12288**2 + 9 * 12288 + 2 * 12288) + 2 * 64000 * 12288 + 2 * 12288
    assert p175 == 175_532_040_192
    assert p530 == 531_127_439_360
    assert abs(p175 / 175e9 - 1) < 0.02 and abs(p530 / 530e9 - 1) < 0.03
    p1b = flops.param_count(load_config(os.path.join(REPO, "configs/gpt_1b.yaml"), planning=True).model)
    assert 1.0e9 < p1b < 1.6e9


# ----------------------------------------------------------------------------- FLOPs

def test_forward_flops_by_hand():
    matmul_weights = 8 * 2 * 4 * 4 + 2 * 8 * 32  # q, k, v, o + w1, w2 = 768 per layer
    attention = 2 * 2 * 2 * 4 * 4  # qk and pv: 2 FLOPs x heads x head_dim x 4 keys = 128
    lm_head = 2 * 8 * 16
    assert flops.forward_flops_per_token(SMALL) == 2 * (2 * matmul_weights + attention) + lm_head == 3584
    assert flops.model_flops_per_token(SMALL) == 3 * 3584


def test_window_reduces_attention_flops_exactly():
    full = flops.forward_flops_per_token(SMALL)
    assert flops.forward_flops_per_token(_replace(window=1)) == full - 2 * 2 * 2 * 2 * 4 * (4 - 1)
    assert flops.forward_flops_per_token(_replace(window=2)) == full - 2 * (2 * 2 * 2 * 4 * 2) == 3456
    for w in (4, 5, 4096):  # a window covering the sequence is full attention
        assert flops.forward_flops_per_token(_replace(window=w)) == full


def test_gqa_flops():
    # k and v projections shrink from 8x8 to 8x4 each; attention FLOPs do not depend on kv_heads.
    assert flops.forward_flops_per_token(SMALL) - flops.forward_flops_per_token(_replace(kv_heads=1)) \
        == 2 * 2 * 2 * (8 * 4)


@pytest.mark.parametrize("name", ["gpt_175b", "gpt_530b", "gpt_1b"])
def test_megatron_closed_form(name):
    m = load_config(os.path.join(REPO, "configs", f"{name}.yaml"), planning=True).model
    l, h, s, V = m.layers, m.d_model, m.seq_len, m.vocab  # Narayanan et al. 2021, eq. (3) per token
    assert flops.model_flops_per_token(m) == 72 * l * h * h + 12 * l * h * s + 6 * h * V


# ----------------------------------------------------------------------------- peaks and MFU

@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100-SXM4-40GB", 312e12), ("nvidia h100 80gb hbm3", 989e12),
    ("cpu", None), ("TFRT_CPU_0", None), ("NVIDIA GeForce RTX 4090", None), ("", None),
])
def test_peak_flops(kind, peak):
    assert flops.peak_flops(SimpleNamespace(device_kind=kind)) == peak
    assert flops.peak_flops(kind) == peak


def test_mfu():
    h100 = SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")
    a100 = SimpleNamespace(device_kind="NVIDIA A100-SXM4-80GB")
    per_token = flops.model_flops_per_token(SMALL)
    assert flops.mfu(1e9, SMALL, [h100, a100]) == pytest.approx(1e9 * per_token / (989e12 + 312e12))
    assert flops.mfu(1e9, SMALL, [h100, SimpleNamespace(device_kind="cpu")]) is None
    assert flops.mfu(1e9, SMALL, []) is None


def test_mfu_none_on_cpu_devices():
    jax = pytest.importorskip("jax")
    cpus = jax.devices("cpu")
    assert flops.peak_flops(cpus[0]) is None
    assert flops.mfu(1e6, SMALL, cpus) is None


# ----------------------------------------------------------------------------- memory

def test_memory_estimate_sharding():
    cfg = Config(model=SMALL, train=TrainConfig(global_batch=8))
    one = flops.memory_estimate(cfg)
    assert one["parameters"] == one["gradients"] == 4 * flops.param_count(SMALL)
    assert one["optimizer"] == 2 * 4 * flops.param_count(SMALL)
    assert one["total"] == pytest.approx(sum(v for k, v in one.items() if k != "total"))

    tp2 = flops.memory_estimate(dataclasses.replace(cfg, mesh=MeshConfig(tp=2)))
    assert tp2["parameters"] == one["parameters"] / 2
    zero = flops.memory_estimate(dataclasses.replace(cfg, mesh=MeshConfig(dp=4), parallel=ParallelConfig(zero1=True)))
    assert zero["optimizer"] == one["optimizer"] / 4 and zero["parameters"] == one["parameters"]
    # Fewer sequences per microbatch -> proportionally fewer stored activations.
    micro = flops.memory_estimate(dataclasses.replace(cfg, parallel=ParallelConfig(microbatches=2)))
    assert micro["activations"] == pytest.approx(one["activations"] / 2)
    # The loss in 4 sequence slices holds one slice's fp32 logits: 3/4 of 8 x seq x vocab x 4 bytes fewer.
    sliced = flops.memory_estimate(dataclasses.replace(cfg, model=dataclasses.replace(SMALL, loss_chunks=4)))
    assert one["activations"] - sliced["activations"] == pytest.approx(3 / 4 * 8 * SMALL.seq_len * SMALL.vocab * 4)


def test_memory_estimate_follows_the_pipeline_table():
    """Stash slots come from the schedule table: 1F1B's activations are flat in m (at a fixed
    microbatch size), gpipe's grow with it; stashing residuals costs more than stashing inputs."""
    def activations(schedule, m, stash="inputs", virtual=1):
        cfg = Config(model=dataclasses.replace(SMALL, layers=8), mesh=MeshConfig(pp=4),
                     train=TrainConfig(global_batch=2 * m),
                     parallel=ParallelConfig(pp_schedule=schedule, pp_virtual=virtual, microbatches=m, pp_stash=stash))
        return flops.memory_estimate(cfg)["activations"]

    assert activations("1f1b", 8) == activations("1f1b", 32)
    assert activations("interleaved_1f1b", 8, virtual=2) == activations("interleaved_1f1b", 32, virtual=2)
    assert activations("gpipe", 32) > activations("gpipe", 16) > activations("gpipe", 8)
    assert activations("1f1b", 8, "residuals") > activations("1f1b", 8, "inputs")


# ----------------------------------------------------------------------------- CLI

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megascale_jax.flops", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_175b_with_mesh_overrides():
    r = _cli("--config", "configs/gpt_175b.yaml", "mesh.dp=8", "mesh.pp=8", "mesh.tp=8")
    assert r.returncode == 0, r.stderr
    assert "parameters:" in r.stdout and "175,532,040,192" in r.stdout and "175.53B" in r.stdout
    assert "dp=8 pp=8 tp=8" in r.stdout and "total" in r.stdout


@pytest.mark.parametrize("n, text", [
    (175_532_040_192, "175.53B"), (2_000_000_000_000, "2.00T"), (791_808, "791.81K"),
    (1_270_000, "1.27M"), (999, "999"), (0, "0"),
])
def test_format_count_picks_the_largest_unit_reached(n, text):
    assert flops.format_count(n) == text


def test_cli_tiny_model_in_k_and_mib_not_zero_billions(capsys):
    assert flops.main(["--config", os.path.join(REPO, "configs", "tiny_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    params = flops.param_count(load_config(os.path.join(REPO, "configs", "tiny_cpu.yaml"), []).model)
    assert params < 1e6  # a K-sized model: the case that printed "(0.00B)"
    assert f"{params:,} ({params / 1e3:.2f}K)" in out
    assert "0.00B" not in out and "0.00 GiB" not in out
    assert "MiB" in out


@pytest.mark.parametrize("override, words", [
    ("mesh.foo=1", "mesh.foo"), ("mesh.pp=7", "mesh.pp=7"), ("model.heads=many", "model.heads"),
    ("nodot=1", "section.key=value"),
])
def test_cli_config_errors_exit_2_with_one_line(override, words):
    r = _cli("--config", "configs/gpt_175b.yaml", override)
    assert r.returncode == 2
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr


def test_cli_missing_config_file():
    r = _cli("--config", "configs/does_not_exist.yaml")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "does_not_exist" in r.stderr


@pytest.mark.parametrize("overrides", [
    {},
    {"block": "serial", "norm": "rmsnorm", "kv_heads": 1},
    {"heads": 8, "kv_heads": 2, "mlp_ratio": 2.5, "window": 7},
])
def test_param_count_equals_initialised_model(overrides):
    import jax
    from megascale_jax.model.transformer import Transformer

    cfg = dataclasses.replace(ModelConfig(layers=3, d_model=64, heads=4, kv_heads=4, vocab=300), **overrides)
    shapes = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), jax.numpy.zeros((1, 8), "int32")))
    counted = sum(x.size for x in jax.tree.leaves(shapes))
    assert flops.param_count(cfg) == counted


@pytest.mark.parametrize("layout", [["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "parallel.microbatches=2"],
                                    ["mesh.dp=1", "mesh.pp=4", "mesh.tp=2", "parallel.microbatches=4"],
                                    ["mesh.dp=4", "mesh.tp=2"],
                                    ["mesh.dp=2", "mesh.tp=4", "model.kv_heads=1"]],  # k/v whole on each tp rank
                         ids=["dp2pp2tp2", "pp4tp2", "dp4tp2", "dp2tp4-kv1"])
def test_parameter_estimate_matches_the_real_per_device_shards(layout):
    """The estimate's parameter bytes against the bytes of one device's shards of the trainer's
    actual sharded parameters (embedding and head are on every pp stage). Within 2%: the
    estimate divides the small norms and biases by tp, which replicate them."""
    import math

    from megascale_jax.parallel.mesh import make_mesh
    from megascale_jax.training.trainer import build_trainer

    cfg = load_config(None, ["model.layers=8", "model.d_model=64", "model.heads=4", "model.kv_heads=2",
                             "model.seq_len=32", "train.global_batch=8", *layout])
    trainer = build_trainer(cfg, make_mesh(cfg.mesh))
    real = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(trainer.abstract_params))
    assert flops.memory_estimate(cfg)["parameters"] == pytest.approx(real, rel=0.02)


@pytest.mark.slow
def test_an_undonated_step_holds_a_second_state_and_the_estimate_counts_it():
    """train.donate=false (the campaign's no_donation lever): XLA's buffer assignment aliases no
    output to the state, so the compiled step holds the new state beside the old, and the memory
    estimate adds that second state (parameters and moments); donated, the whole state is aliased."""
    import math

    from megascale_jax.parallel.mesh import make_mesh
    from megascale_jax.training.trainer import build_trainer

    def compiled(donate):
        cfg = load_config(None, ["model.layers=2", "model.d_model=64", "model.heads=4", "model.kv_heads=2",
                                 "model.seq_len=32", "train.global_batch=4", "optim.name=adamw", "mesh.dp=1", "mesh.tp=1",
                                 f"train.donate={str(donate).lower()}"])
        trainer = build_trainer(cfg, make_mesh(cfg.mesh))
        state = jax.eval_shape(trainer.init)
        batch = jax.ShapeDtypeStruct((4, 33), jax.numpy.int32, sharding=trainer.batch_sharding)
        analysis = trainer.train_step.lower(state, batch).compile().memory_analysis()
        params = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state.params))
        return cfg, analysis, params

    cfg, donated, params = compiled(True)
    undonated_cfg, undonated, _ = compiled(False)
    assert donated.alias_size_in_bytes >= 3 * params  # parameters and both AdamW moments
    assert undonated.alias_size_in_bytes == 0
    assert flops.compiled_bytes(undonated) - flops.compiled_bytes(donated) >= 0.99 * 3 * params
    extra = flops.memory_estimate(undonated_cfg)["total"] - flops.memory_estimate(cfg)["total"]
    assert extra == pytest.approx(3 * flops.memory_estimate(cfg)["parameters"])


def test_compiled_step_that_exceeds_the_device_is_refused_in_one_line():
    """The pre-flight check on XLA's own buffer assignment (training.trainer.check_compiled_memory): a step
    whose compiled peak exceeds the limit is refused naming both sizes; one that fits passes."""
    import jax.numpy as jnp
    import numpy as np

    from megascale_jax.config import ConfigError

    x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 512)), jnp.float32)
    analysis = jax.jit(lambda a: jnp.tanh(a @ a.T) @ a).lower(x).compile().memory_analysis()
    needed = flops.compiled_bytes(analysis)
    # At least the argument and the (256, 512) float32 result, held side by side (no donation).
    assert needed >= 2 * x.nbytes
    flops.check_compiled_fits(analysis, needed, "a test device")  # exactly fits: no error
    flops.check_compiled_fits(analysis, None, "a test device")  # no limit known: no check
    with pytest.raises(ConfigError) as e:
        flops.check_compiled_fits(analysis, needed - 1, "a test device")
    message = str(e.value)
    assert "\n" not in message and flops.format_bytes(needed) in message and "a test device" in message
    assert "train.global_batch" in message


def test_a_background_saves_device_copy_is_capped_to_what_fits_beside_the_step():
    """flops.device_copy_bytes by hand: a 10 GiB state beside a 60 GiB step in a 64 GiB limit
    copies 4 GiB on the device; with room, all of it; a user's cap bounds it; no limit known (a
    CPU), only the user's cap; a step that fills the limit leaves none."""
    gib = 2**30
    assert flops.device_copy_bytes(10 * gib, 60 * gib, 64 * gib, None) == 4 * gib
    assert flops.device_copy_bytes(10 * gib, 50 * gib, 64 * gib, None) == 10 * gib
    assert flops.device_copy_bytes(10 * gib, 50 * gib, 64 * gib, 2.5) == int(2.5 * gib)
    assert flops.device_copy_bytes(10 * gib, 0, None, None) == 10 * gib
    assert flops.device_copy_bytes(10 * gib, 0, None, 0) == 0
    assert flops.device_copy_bytes(10 * gib, 70 * gib, 64 * gib, None) == 0


def test_memory_estimate_with_full_remat_keeps_layer_inputs_and_one_layer():
    """model.remat=full: each layer keeps only its (tokens, d_model) input, and one layer's full
    activations are live while its backward recomputes it. By hand for SMALL (8 sequences of 4
    tokens, d 8, 2 layers, float32, xla attention with 2 heads): one layer stores (2 + 13) values
    per token and element of d (what the compiled step keeps, docs/compile.md) plus 2 score values
    per (head, query, key)."""
    cfg = Config(model=dataclasses.replace(SMALL, remat="full"), train=TrainConfig(global_batch=8))
    tokens, d, layers = 8 * 4, 8, 2
    one_layer = tokens * d * (2 + 13) + 8 * 2 * 4 * 4 * 2
    logits = tokens * 16 * 4  # fp32 logits of the vocab of 16
    expected = (layers * tokens * d + one_layer) * 4 + logits
    assert flops.memory_estimate(cfg)["activations"] == expected
    stored = flops.memory_estimate(Config(model=SMALL, train=TrainConfig(global_batch=8)))["activations"]
    assert stored == layers * one_layer * 4 + logits  # no remat: every layer's activations


def test_stash_slot_bytes_by_hand_and_the_activations_they_add_up_to():
    """SMALL with 8 layers on pp=4, 2 sequences of 4 tokens per microbatch, float32, xla attention.
    A slot holds one microbatch's chunk input (8 tokens x d 8) with pp_stash=inputs, and also the
    chunk's residuals (2 layers x (8 x 8 x 15 values + 2 seqs x 2 heads x 4 x 4 scores x 2)) with
    pp_stash=residuals."""
    def cfg(stash):
        return Config(model=dataclasses.replace(SMALL, layers=8), mesh=MeshConfig(pp=4), train=TrainConfig(global_batch=8),
                      parallel=ParallelConfig(pp_schedule="1f1b", microbatches=4, pp_stash=stash))

    chunk_input = 8 * 8
    chunk = 2 * (8 * 8 * (2 + 13) + 2 * 2 * 4 * 4 * 2)
    assert flops.stash_slot_bytes(cfg("inputs")) == chunk_input * 4
    assert flops.stash_slot_bytes(cfg("residuals")) == (chunk + chunk_input) * 4
    slots = flops.pipeline_schedule.build("1f1b", 4, 1, 4).slots
    logits = 8 * 16 * 4
    assert flops.memory_estimate(cfg("inputs"))["activations"] == slots * chunk_input * 4 + chunk * 4 + logits
    assert flops.memory_estimate(cfg("residuals"))["activations"] == slots * (chunk + chunk_input) * 4 + logits


def test_memory_estimate_counts_the_gradient_accumulator_and_sequence_parallel_splits():
    """With several microbatches, dp > 1 or a pipeline the step sums gradients into a float32
    accumulator as large as the gradients; one microbatch on one replica has none. Sequence parallelism divides the values tp would otherwise replicate by tp, and keeps
    one whole value (the GEMMs' gathered input)."""
    base = Config(model=SMALL, train=TrainConfig(global_batch=8))
    assert "gradient accumulator" not in flops.memory_estimate(base)
    for changed in (dataclasses.replace(base, parallel=ParallelConfig(microbatches=2)),
                    dataclasses.replace(base, mesh=MeshConfig(dp=2))):
        parts = flops.memory_estimate(changed)
        assert parts["gradient accumulator"] == parts["gradients"] == 4 * flops.param_count(SMALL)
    tp = dataclasses.replace(base, mesh=MeshConfig(tp=2))
    sp = dataclasses.replace(tp, parallel=ParallelConfig(sequence_parallel=True))
    tokens_layers = 8 * SMALL.seq_len * SMALL.d_model * SMALL.layers
    saved = flops.memory_estimate(tp)["activations"] - flops.memory_estimate(sp)["activations"]
    kept = flops.KEPT_VALUES_REPLICATED / 2 - flops.KEPT_SP_GATHERED
    assert saved == pytest.approx(tokens_layers * kept * 4)  # fp32 SMALL


def test_memory_estimate_counts_the_weight_copies_the_compiled_step_holds():
    """By hand for SMALL (2 parallel-block layers of d 8, mlp 32, bias; no kv sharing): one layer's
    weights are 4·8·8 + 2·8·32 matrices + 4·8 + 32 + 8 biases + one layernorm's 2·8. A bf16 rolled scan keeps them in
    bf16 (2 B each); unrolled it keeps none, unless rematerialised (an f32 slice, 4 B); an
    interleaved stage also holds one chunk's f32 weights and gradient (8 B over pp_virtual)."""
    per_layer = 4 * 8 * 8 + 2 * 8 * 32 + 4 * 8 + 32 + 8 + 2 * 8
    assert flops.layer_params(SMALL) == per_layer  # the count this test stands on
    bf16 = dataclasses.replace(SMALL, dtype="bfloat16")

    def parts(model, **parallel):
        mesh = MeshConfig(pp=2) if parallel else MeshConfig()
        cfg = Config(model=model, mesh=mesh, train=TrainConfig(global_batch=8), parallel=ParallelConfig(**parallel))
        return {k: v for k, v in flops.memory_estimate(cfg).items() if "weight" in k}

    assert parts(bf16) == {"bf16 weights kept for the backward": 2 * 2 * per_layer}
    assert parts(SMALL) == {}  # float32: nothing converted
    assert parts(dataclasses.replace(bf16, scan_unroll=2)) == {}
    assert parts(dataclasses.replace(bf16, scan_unroll=2, remat="full")) == {
        "f32 layer weights sliced for the backward": 4 * 2 * per_layer}
    interleaved = parts(dataclasses.replace(SMALL, layers=4), pp_schedule="interleaved_1f1b", pp_virtual=2,
                        microbatches=4)
    assert interleaved == {"one chunk's weights and gradient": 2 * 4 * (4 // 2 * per_layer) / 2}
