"""The campaign's op table (bench/campaign/op_table.py) and the part rules it names ops with
(megascale_jax/observe/hlo_parts.py): the part rules on hand-written HLO names,
the module-text parser, and a real traced train step of the tiny model on the CPU, whose ops
must cover every model part and add up to the step's device op time."""

import json
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from bench.campaign import ladder, model, op_table, profile
from megascale_jax.config import load_config
from megascale_jax.observe import device_profile, hlo_parts
from megascale_jax.observe.hlo_parts import Instruction, part_of

LAYER = "jit(train_step)/jvp(Transformer)/while/body/closed_call/layers"
BACKWARD = "jit(train_step)/transpose(jvp(Transformer))/while/body/closed_call/layers"
CPU = {"dry_run": True, "device": {"backend": "cpu", "memory_limit_bytes": None}}


@pytest.mark.parametrize("instruction,part", [
    (Instruction("fusion", f"{LAYER}/attention/bqkgd,bskd->bkgqs/dot_general"), "attention"),
    (Instruction("custom-call", f"{LAYER}/attention/dot_product_attention"), "attention"),  # a cuDNN kernel
    (Instruction("dot", f"{LAYER}/qkv_projection/dot_general"), "QKV projection"),
    (Instruction("custom-call", f"{BACKWARD}/out_projection/dot_general"), "output projection"),  # cuBLAS
    (Instruction("fusion", f"{BACKWARD}/mlp/dot_general"), "MLP"),
    (Instruction("custom-call", f"{LAYER}/qkv_mlp_up/dot_general"), "QKV + MLP-up GEMM"),  # the parallel block's
    (Instruction("fusion", f"{BACKWARD}/out_mlp_down/dot_general"), "output + MLP-down GEMM"),
    (Instruction("fusion", "jit(step)/transpose(jvp(norm))/mul"), "norms"),  # a scope at the top: wrapped
    (Instruction("fusion", "jit(train_step)/jvp(Transformer)/lm_head/bsd,dv->bsv/dot_general"), "LM head/loss"),
    (Instruction("fusion", "jit(train_step)/jvp(loss)/reduce_max"), "LM head/loss"),
    (Instruction("gather", "jit(train_step)/jvp(Transformer)/embed/jit(_take)/gather"), "embedding"),
    (Instruction("fusion", "jit(train_step)/mul"), "optimizer"),  # outside the gradient
    (Instruction("fusion", "jit(train_step)/jit(_where)/select_n"), "optimizer"),
    (Instruction("fusion", "jit(train_step)/cond/branch_1_fun/optimizer_update/mul"), "optimizer"),  # the update
    (Instruction("copy", f"{LAYER}/mlp/mul"), "copies/transposes"),  # data movement first, whatever the scope
    (Instruction("transpose", ""), "copies/transposes"),
    (Instruction("fusion", "", (("dynamic-slice", ""), ("convert", f"{LAYER}/mlp/mul"), ("bitcast", ""))),
     "copies/transposes"),
    (Instruction("dynamic-slice", "jit(train_step)/jvp(Transformer)/while/body/jit(dynamic_index_in_dim)"),
     "other"),  # the layer scan's plumbing, in the gradient but in no part
    (Instruction("fusion", ""), "other"),  # no metadata: no guess
    (Instruction(""), "other"),  # an op the module's text does not have
])
def test_rules_name_the_part(instruction, part):
    assert part_of(instruction) == part


def test_a_fusion_is_the_part_most_of_its_instructions_are_in():
    mlp, attention = ("multiply", f"{LAYER}/mlp/mul"), ("divide", f"{LAYER}/attention/div")
    own = f"{LAYER}/add"  # XLA gives a fusion a vaguer op_name than its instructions'
    assert part_of(Instruction("fusion", own, (mlp, mlp, attention))) == "MLP"
    assert part_of(Instruction("fusion", own, (mlp, attention))) == "other"  # a tie: no guess
    assert part_of(Instruction("fusion", f"{LAYER}/norm/mul", (("add", ""),))) == "norms"  # none inside: its own
    assert part_of(Instruction("all-reduce", f"{LAYER}/mlp/psum"), collective=True) == "collectives"


HLO = """HloModule jit_step, is_scheduled=true

%fused_computation.1 (param_0: f32[4,8], param_1: s32[]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %constant.3 = f32[] constant(1), metadata={op_name="jit(step)/jvp(Transformer)/attention/div"}
  %index = s32[] subtract(%constant.3, %constant.3), metadata={op_name="jit(step)/jvp(Transformer)/while/body/sub"}
  ROOT %tanh.2 = f32[4,8]{1,0} tanh(%param_0), metadata={op_name="jit(step)/jvp(Transformer)/mlp/tanh" stack_frame_id=3}
}

ENTRY %main.9 (Arg_0.1: f32[4,8]) -> (f32[4,8], s32[]) {
  %Arg_0.1 = f32[4,8]{1,0} parameter(0)
  %tanh_fusion = f32[4,8]{1,0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_computation.1
  %while.4 = (f32[4,8]{1,0}, /*index=1*/s32[]) while(%tuple.3), condition=%cond, body=%body
  ROOT %copy.5 = f32[4,8]{1,0} copy(%tanh_fusion), metadata={op_name="jit(step)/mul"}
}
"""


def test_instructions_reads_opcodes_metadata_and_a_fusions_instructions():
    found = hlo_parts.instructions(HLO)
    # Parameters, constants and scalars are left out of a fusion's instructions: a CSE'd constant
    # and the loop index carry other ops' op_names.
    assert found["tanh_fusion"] == Instruction("fusion", "", (("tanh", "jit(step)/jvp(Transformer)/mlp/tanh"),))
    assert found["while.4"].opcode == "while"
    assert found["copy.5"] == Instruction("copy", "jit(step)/mul")
    assert part_of(found["tanh_fusion"]) == "MLP"


PRODUCTS_HLO = """HloModule jit_step, is_scheduled=true

%gemm_computation (p0: bf16[2,8,16], p1: bf16[2,16,4]) -> bf16[2,8,4] {
  %p0 = bf16[2,8,16]{2,1,0} parameter(0)
  %p1 = bf16[2,16,4]{2,1,0} parameter(1)
  ROOT %dot.3 = bf16[2,8,4]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

ENTRY %main (a: bf16[32,64], b: bf16[64,128]) -> bf16[32,128] {
  %a = bf16[32,64]{1,0} parameter(0)
  %b = bf16[64,128]{1,0} parameter(1)
  %dot.1 = bf16[32,128]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %custom-call.2 = (bf16[128,32]{1,0}, s8[4194304]{0}) custom-call(bf16[64,128]{0,1} %b, bf16[64,32]{1,0} %c), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["0"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %gemm_fusion = bf16[2,8,4]{2,1,0} fusion(%x, %y), kind=kCustom, calls=%gemm_computation
  ROOT %add.4 = bf16[32,128]{1,0} add(%dot.1, %dot.1)
}
"""


def test_instructions_count_a_matrix_products_flops_from_the_modules_shapes():
    """2 x output elements x contracted size, by hand: a dot whose operands are named (their shapes
    looked up), a cuBLAS GEMM custom call (its workspace left out, its contracting dimension in the
    backend config) and a fusion of a batched dot; anything else 0."""
    found = hlo_parts.instructions(PRODUCTS_HLO)
    assert found["dot.1"].flops == 2 * 32 * 128 * 64
    assert found["custom-call.2"].flops == 2 * 128 * 32 * 64
    assert found["gemm_fusion"].flops == 2 * (2 * 8 * 4) * 16
    assert found["add.4"].flops == 0 and found["a"].flops == 0


@pytest.mark.slow
def test_the_model_names_its_parts_in_the_lowered_steps_metadata():
    """The scopes the rules read are the model's own (transformer.layer, norm, embed_tokens,
    project_vocab, token_losses), for both blocks."""
    from megascale_jax.model import transformer

    for block, scopes in (("parallel", ("qkv_mlp_up", "out_mlp_down")), ("serial", ("qkv_projection", "out_projection"))):
        cfg = load_config(None, ["model.layers=1", "model.d_model=32", "model.seq_len=16", f"model.block={block}"])
        tokens = jnp.arange(2 * (cfg.model.seq_len + 1), dtype=jnp.int32).reshape(2, -1) % cfg.model.vocab
        net = transformer.Transformer(cfg.model)
        params = net.init(jax.random.key(0), tokens[:, :-1])["params"]
        text = jax.jit(jax.grad(lambda p: transformer.loss_fn(net, p, tokens))).lower(params).as_text(debug_info=True)
        for scope in (*scopes, "attention", "mlp", "norm", "embed", "lm_head", "loss"):
            assert re.search(rf"[/(]{scope}[)/]", text), (block, scope)  # a scope at the top is wrapped: jvp(loss)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A traced train step of the campaign's profiled configuration at the dry run's shapes:
    (device 0's ops, the module's instructions, the table)."""
    changes, _ = ladder.strongest_fixed(CPU)
    overrides = ladder.row_overrides(True, changes) + ["train.global_batch=2"]
    hlo_text, module, path = op_table.trace_train_step(model.CONFIG, overrides, str(tmp_path_factory.mktemp("trace")))
    ops = device_profile.read_ops(path, module)[0]
    hlo = hlo_parts.instructions(hlo_text)
    return ops, hlo, op_table.table(ops, hlo, op_table.STEPS)


@pytest.mark.slow
def test_every_model_part_takes_time_in_a_real_step(traced):
    _, _, table = traced
    # the profiled configuration has the parallel block: its two fused GEMMs are parts of their own
    for part in ("attention", "QKV + MLP-up GEMM", "output + MLP-down GEMM", "MLP", "LM head/loss", "norms",
                 "embedding", "optimizer"):
        assert table["by_part"].get(part, 0) > 0, (part, table["by_part"])
    # The rules leave little unnamed: the layer scan's plumbing and metadata-less reductions. Counted
    # in executed ops, not seconds: on a loaded CPU one op's time swings (CI once put "other" at 30%
    # of the time with 11% of the ops).
    ops, hlo, _ = traced
    executed = {o.name: o.is_collective for o in ops if o.is_compute or o.is_collective}
    unnamed = [n for n, collective in executed.items() if part_of(hlo.get(n, Instruction("")), collective) == "other"]
    assert len(unnamed) < 0.2 * len(executed), sorted(unnamed)


def test_the_parts_add_up_to_the_steps_device_op_time(traced):
    ops, hlo, table = traced
    # Every executed HLO op but the containers, whose time is their ops'.
    op_time = sum(o.end_ns - o.start_ns for o in ops if not o.kind.startswith(device_profile.CONTAINERS))
    parts = {p: s for p, s in table["by_part"].items() if p != "total"}
    assert sum(parts.values()) == pytest.approx(table["by_part"]["total"], rel=1e-9)
    assert table["by_part"]["total"] == pytest.approx(op_time / 1e9 / op_table.STEPS, rel=0.01)
    assert set(parts) <= set(op_table.PARTS)
    # Every op the trace names is an instruction of the compiled module.
    assert {o.name for o in ops} <= set(hlo)

    rows = table["top_ops"]
    assert len(rows) == op_table.TOP
    assert [r["seconds"] for r in rows] == sorted((r["seconds"] for r in rows), reverse=True)
    assert all(r["share"] == pytest.approx(r["seconds"] / table["by_part"]["total"]) for r in rows)
    assert table["busy_s"] > 0
    # each part's own top ops: every op of the part when it has fewer, ranked, and of that part
    assert set(table["top_by_part"]) == set(parts)
    for part, ranked in table["top_by_part"].items():
        assert 0 < len(ranked) <= op_table.PER_PART and all(r["part"] == part for r in ranked)
        assert [r["seconds"] for r in ranked] == sorted((r["seconds"] for r in ranked), reverse=True)
        assert ranked[0]["seconds"] == max(r["seconds"] for r in rows + ranked if r["part"] == part)


def test_the_steps_matrix_products_are_its_model_flops(traced):
    """Every matrix product of the traced step (the dry run's 2 layers, d_model 64, 4 heads of 16,
    MLP 256, vocab 256, 2 x 64 tokens; XLA's attention computes every (query, key) score before the
    window's mask) adds up to 3 x the forward's products, by hand: the backward multiplies twice.
    The GEMM parts' top products carry the rate they ran at."""
    _, _, table = traced
    layers, d, heads, head_dim, mlp, seq, vocab, tokens = 2, 64, 4, 16, 256, 64, 256, 2 * 64
    weights = d * 3 * d + d * d + 2 * d * mlp  # q, k, v; out; MLP up and down
    forward = layers * (2 * weights + 2 * 2 * heads * head_dim * seq) + 2 * d * vocab
    assert table["products"]["flops"] == 3 * tokens * forward
    assert table["products"]["tflop_per_s"] > 0
    for part in ("QKV + MLP-up GEMM", "output + MLP-down GEMM"):
        assert any(r.get("tflop_per_s", 0) > 0 for r in table["top_by_part"][part]), part


def test_the_profiled_configuration_is_the_ladders_strongest_fixed_one():  # the levers' base too
    changes, flags = ladder.strongest_fixed(CPU)
    assert (changes["model.block"], changes["model.window"], changes["model.attention"], changes["optim.name"]) == (
        "parallel", ladder.WINDOW[True], "xla", "adamw")
    assert flags == ()
    changes, flags = ladder.strongest_fixed({"dry_run": False, "device": {"backend": "gpu"}})
    assert (changes["model.window"], changes["model.attention"], flags) == (512, "cudnn", ())  # flags: a lever
    assert changes["model.scan_unroll"] == 24  # gpt_1b's layers, unrolled as configs/gpt_1b.yaml ships


def test_an_op_table_that_fails_is_one_line_beside_the_profiled_runs_numbers(monkeypatch):
    """Bad input (issue 36): the op table's run failing (the whole model not fitting, a compile
    error) costs the table only; the section keeps the checked run's numbers."""
    def fails(out, settings):
        raise RuntimeError("bench.campaign.op_table: RESOURCE_EXHAUSTED: Out of memory while trying to allocate\n...")

    monkeypatch.setattr(profile, "checked_run", lambda run_dir, settings: {"profiled_steps": [2, 4, 6]})
    monkeypatch.setattr(profile, "op_table_run", fails)
    result = profile.run(CPU)
    assert result["profiled_steps"] == [2, 4, 6] and "top_ops" not in result
    assert result["op_table_error"].startswith("RuntimeError: bench.campaign.op_table: RESOURCE_EXHAUSTED") and "\n" not in result["op_table_error"]


def test_on_a_gpu_the_op_table_runs_without_cuda_graphs(monkeypatch, tmp_path):
    """With XLA's command buffers the trace names each CUDA graph, not its kernels (H200,
    2026-11-27: the whole step 'other'): the op table's process gets them turned off. Then the same
    process at half the batch, and each part's line through both tables (seconds made up here:
    the dry run on the CPU runs the table at the batch only)."""
    seen = {}

    def run(command, env, limit_s, prefix):
        seen["xla_flags"] = env.get("XLA_FLAGS", "")
        out = command[command.index("--out") + 1]
        batch = int(next(a for a in command if a.startswith("train.global_batch=")).split("=")[1])
        seen.setdefault("batches", []).append(batch)
        by_part = {"MLP": 0.01 * batch, "optimizer": 0.005, "total": 0.01 * batch + 0.005}
        with open(out, "w") as f:
            json.dump({"top_ops": [], "top_by_part": {}, "by_part": by_part, "steps_traced": 2,
                       "busy_s": 0.0, "device": 0}, f)
        return SimpleNamespace(ok=True)

    monkeypatch.setattr(profile.process, "run", run)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    gpu = {**CPU, "batch": 2, "device": {**CPU["device"], "backend": "gpu"}}
    result = profile.op_table_run(str(tmp_path / "table.json"), gpu)
    assert seen["xla_flags"].split() == [profile.NO_CUDA_GRAPHS]
    assert result["op_table"]["xla_flags"] == [profile.NO_CUDA_GRAPHS]
    assert seen["batches"] == [2, 1] and result["by_part_half_batch"]["batch"] == 1
    assert result["by_part_half_batch"]["by_part"]["MLP"] == pytest.approx(0.01)
    split = result["batch_split"]
    assert split["MLP"] == {"per_sequence_s": pytest.approx(0.01), "per_step_s": pytest.approx(0.0, abs=1e-12)}
    assert split["optimizer"] == {"per_sequence_s": pytest.approx(0.0, abs=1e-12), "per_step_s": pytest.approx(0.005)}


def test_a_launch_of_several_kernels_counts_its_products_flops_once():
    """cuBLAS can run one GEMM as two kernels back to back (the product, its split-K reduction), and
    cuDNN attention's backward as eight: a call is a run of one instruction's kernels, so the FLOPs
    a step (2 traced steps: each launches the GEMM twice, once as 2 kernels) are 2 launches' worth."""
    gemm = Instruction("custom-call", "jvp(Transformer)/layers/qkv_mlp_up/dot_general", flops=1e12)
    hlo = {"custom-call.1": gemm, "fusion.2": Instruction("fusion")}
    times = [("custom-call.1", 0, 4), ("custom-call.1", 4, 5), ("fusion.2", 5, 6), ("custom-call.1", 6, 10),
             ("fusion.2", 10, 11)]
    ops = [device_profile.Op(0, name, 1e9 * (step * 11 + start), 1e9 * (step * 11 + end))
           for step in range(2) for name, start, end in times]
    table = op_table.table(ops, hlo, steps=2)
    assert table["products"]["flops"] == 2e12  # 2 launches a step of 1e12, not 3 kernels' worth
    assert table["products"]["seconds"] == pytest.approx(9.0)
    gemm_row = next(r for r in table["top_ops"] if r["op"] == "custom-call.1")
    assert gemm_row["calls"] == 2 and gemm_row["tflop_per_s"] == pytest.approx(2e12 / 9.0 / 1e12)
