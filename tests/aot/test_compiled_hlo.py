"""The compile-only report's readers (megascale_jax/aot) on hand-written XLA text, and `plan
--compile`'s bad inputs: what needs no compile-only environment. The compiles themselves are in
test_compile_for_gpu.py."""

import json
from pathlib import Path

import pytest

from megascale_jax import plan
from megascale_jax.aot import compiled_hlo, summary, targets
from megascale_jax.observe.hlo_parts import instructions

REPO = Path(__file__).resolve().parents[2]
LAYER = 'op_name="jit(train_step)/jvp(Transformer)/while/body/layers'

# A scheduled module: the entry launches a cuDNN attention call, a synchronous all-reduce over
# devices {0,1} and a layer loop of 3 iterations; the body has a Triton GEMM fusion, a loop fusion,
# an all-gather written as all-gather-start/done around the GEMM, and a collective-permute wrapped
# in a generic async-start/async-done (as XLA's dump writes it) with nothing scheduled inside.
MODULE = f"""HloModule jit_train_step, is_scheduled=true, num_partitions=4

%gemm_computation (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {{
  %p0 = bf16[64,32]{{1,0}} parameter(0)
  %p1 = bf16[32,16]{{1,0}} parameter(1)
  ROOT %dot.1 = bf16[64,16]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, metadata={{{LAYER}/mlp/dot_general"}}
}}

%gelu_computation (p0.1: bf16[64,16]) -> bf16[64,16] {{
  %p0.1 = bf16[64,16]{{1,0}} parameter(0)
  ROOT %tanh.1 = bf16[64,16]{{1,0}} tanh(%p0.1), metadata={{{LAYER}/mlp/tanh"}}
}}

%permute_wrapper (p0.2: f32[8]) -> f32[8] {{
  %p0.2 = f32[8]{{0}} parameter(0)
  ROOT %collective-permute.1 = f32[8]{{0}} collective-permute(%p0.2), channel_id=2, source_target_pairs={{{{0,2}},{{2,0}},{{1,3}},{{3,1}}}}
}}

%body (param.9: (s32[], bf16[64,32])) -> (s32[], bf16[64,32]) {{
  %param.9 = (s32[], bf16[64,32]{{1,0}}) parameter(0)
  %get-tuple-element.1 = bf16[64,32]{{1,0}} get-tuple-element(%param.9), index=1
  %all-gather-start.1 = (bf16[16,16]{{1,0}}, bf16[32,16]{{1,0}}) all-gather-start(%get-tuple-element.1), channel_id=1, replica_groups={{{{0,1}},{{2,3}}}}, dimensions={{0}}
  %gemm_fusion.1 = bf16[64,16]{{1,0}} fusion(%get-tuple-element.1, %get-tuple-element.1), kind=kCustom, calls=%gemm_computation, backend_config={{"fusion_backend_config":{{"block_level_fusion_config":{{"num_warps":"4"}},"kind":"__triton_gemm"}}}}
  %all-gather-done.1 = bf16[32,16]{{1,0}} all-gather-done(%all-gather-start.1)
  %loop_fusion.1 = bf16[64,16]{{1,0}} fusion(%gemm_fusion.1), kind=kLoop, calls=%gelu_computation
  %async-start.1 = ((f32[8]{{0}}), f32[8]{{0}}, u32[]) async-start(%bitcast.1), calls=%permute_wrapper
  %async-done.1 = f32[8]{{0}} async-done(%async-start.1)
  ROOT %tuple.1 = (s32[], bf16[64,32]{{1,0}}) tuple(%get-tuple-element.1, %get-tuple-element.1)
}}

%cond (param.10: (s32[], bf16[64,32])) -> pred[] {{
  %param.10 = (s32[], bf16[64,32]{{1,0}}) parameter(0)
  ROOT %constant.1 = pred[] constant(false)
}}

ENTRY %main (param.1: bf16[64,32]) -> bf16[64,32] {{
  %param.1 = bf16[64,32]{{1,0}} parameter(0), metadata={{op_name="state.params[\\'layers\\'][\\'mlp\\'][\\'w1\\']"}}
  %attention.1 = (bf16[8,4,64,16]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%param.1), custom_call_target="__cudnn$fmhaSoftmax"
  %all-reduce.1 = bf16[64,32]{{1,0}} all-reduce(%param.1), channel_id=3, replica_groups={{{{0,1}},{{2,3}}}}, to_apply=%cond
  %while.1 = (s32[], bf16[64,32]{{1,0}}) while(%all-reduce.1), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
  ROOT %get-tuple-element.2 = bf16[64,32]{{1,0}} get-tuple-element(%while.1), index=1
}}
"""
MESH = ((2, 1, 2), ("dp", "pp", "tp"))  # device d sits at dp = d // 2, tp = d % 2


def test_the_kernel_inventory_counts_each_kernel_once_in_the_program_and_per_iteration_per_step():
    inventory = compiled_hlo.kernel_inventory(MODULE, instructions(MODULE))
    static, per_step = inventory["static"], inventory["per_step"]
    # entry: the cuDNN call, the all-reduce; body: the GEMM, the GeLU, the all-gather, the permute
    assert static["kernels"] == 6 and per_step["kernels"] == 2 + 4 * 3
    assert static["fusions"] == {"__triton_gemm": 1, "kLoop": 1} and per_step["fusions"] == {"__triton_gemm": 3, "kLoop": 3}
    assert per_step["gemms"] == {"triton": 3, "cudnn": 1}
    assert per_step["custom_calls"] == {"__cudnn$fmhaSoftmax": 1}
    assert per_step["collectives"] == {"all-gather": 3, "collective-permute": 3, "all-reduce": 1}
    assert inventory["gemm_flops_per_step"]["triton"] == 3 * 2 * 64 * 16 * 32  # by hand: 2 x out x contracted


def test_overlap_reads_both_async_spellings_and_counts_the_kernels_inside_the_window():
    rows = compiled_hlo.overlap(MODULE, instructions(MODULE), *MESH)
    found = {(r["op"], r["axes"]): r for r in rows}
    assert found[("all-gather", "tp")]["async"] and found[("all-gather", "tp")]["kernels_between"] == 1
    assert found[("all-gather", "tp")]["flops_between"] == 2 * 64 * 16 * 32
    assert found[("collective-permute", "dp")]["async"] and found[("collective-permute", "dp")]["kernels_between"] == 0
    assert not found[("all-reduce", "tp")]["async"]
    by_axis = compiled_hlo.overlap_by_axis(rows)
    assert by_axis["tp"]["all"] == {"collectives": 4, "async": 3, "overlapped": 3}
    assert by_axis["dp"]["collective-permute"] == {"collectives": 3, "async": 3, "overlapped": 0}


LIVE_RANGE = """HloLiveRange (max 10):
  BufferLiveRange:
    loop_fusion.1{}:1-2
  Live ranges at 7 (peak):
    loop_dynamic_update_slice_fusion.3{}: 6442450944 bytes (cumulative: 6442450944 bytes)
    param.1{}: 1610612736 bytes (cumulative: 8053063680 bytes)
    while.1{1}: 1024 bytes (cumulative: 8053064704 bytes)
  Stack trace breakdown for peak usage: 8053064704 bytes
"""
ASSIGNMENT = """BufferAssignment:
allocation 0: size 1610612736, parameter 0, shape |bf16[24,2048,8192]| at ShapeIndex {}:
 value: <1 param.1 @0> (size=1610612736,offset=0): bf16[24,2048,8192]{2,1,0}
allocation 1: size 6442451968, preallocated-temp:
 value: <2 loop_dynamic_update_slice_fusion.3 @0> (size=6442450944,offset=0): bf16[24,8,2048,8192]{3,2,1,0}
 value: <3 while.1{1} (phi) @0> (size=1024,offset=6442450944): f32[256]{0}
"""
USAGE = """Memory Space: default (color=0)
Total bytes: 8053064704 (7.50GiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
    6.00GiB( 80%);    6.00GiB;            0;                1; bf16[24,8,2048,8192]
    6.00GiB( 80%);     1.0KiB;   6442450944;                1; f32[256]
  The rest 0 values are less than 5% of the total size and not shown.
"""
SAVES = f"""HloModule m, is_scheduled=true

%stack (p: bf16[24,8,2048,8192], u: bf16[8,2048,8192]) -> bf16[24,8,2048,8192] {{
  %u = bf16[8,2048,8192]{{2,1,0}} parameter(1)
  %bitcast.4 = bf16[8,2048,8192]{{2,1,0}} bitcast(%u), metadata={{{LAYER}/qkv_mlp_up/dot_general"}}
  ROOT %dynamic-update-slice.1 = bf16[24,8,2048,8192]{{3,2,1,0}} dynamic-update-slice(%p, %bitcast.4), metadata={{op_name="jit(train_step)/jvp(Transformer)/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice"}}
}}

ENTRY %main (param.1: bf16[24,2048,8192]) -> bf16[24,2048,8192] {{
  %param.1 = bf16[24,2048,8192]{{2,1,0}} parameter(0), metadata={{op_name="state.opt_state[0].mu[\\'layers\\']"}}
  %loop_dynamic_update_slice_fusion.3 = bf16[24,8,2048,8192]{{3,2,1,0}} fusion(%param.1, %param.1), kind=kLoop, calls=%stack, metadata={{op_name="jit(train_step)/jvp(Transformer)/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice"}}
  %while.1 = (s32[], f32[256]{{0}}) while(%param.1), condition=%stack, body=%stack
  ROOT %r = bf16[24,2048,8192]{{2,1,0}} copy(%param.1)
}}
"""


def test_the_buffers_live_at_the_peak_are_named_by_the_part_that_owns_them():
    buffers = compiled_hlo.peak_buffers(LIVE_RANGE, ASSIGNMENT, instructions(SAVES))
    assert [(b["bytes"], b["shape"], b["part"]) for b in buffers] == [
        (6442450944, "bf16[24,8,2048,8192]{3,2,1,0}", "kept for the backward: QKV + MLP-up GEMM"),
        (1610612736, "bf16[24,2048,8192]{2,1,0}", "optimizer state"),
        (1024, "f32[256]{0}", "layer scan state")]
    assert compiled_hlo.bytes_by_part(buffers)["optimizer state"] == 1610612736


def test_the_temporaries_ranges_come_from_xlas_usage_report_with_the_parts_placed_there():
    chunks = compiled_hlo.heap_chunks(USAGE, ASSIGNMENT, instructions(SAVES))
    assert chunks == [
        {"bytes": 6 * 2**30, "offset": 0, "shapes": "bf16[24,8,2048,8192]",
         "parts": ["kept for the backward: QKV + MLP-up GEMM"]},
        {"bytes": 1024, "offset": 6442450944, "shapes": "f32[256]", "parts": ["layer scan state"]}]


def test_the_h200s_allocator_limit_is_the_one_measured_on_it():
    measured = json.loads((REPO / "bench/results/gpu_nvidia_h200_2026-11-27.json").read_text())["memory_limit_bytes"]
    assert targets.TARGETS["h200"].limit_bytes() == pytest.approx(measured, rel=1e-9)


@pytest.mark.parametrize("gpus, topology", [(1, "1x1x1"), (8, "1x1x8"), (16, "1x2x8"), (64, "1x8x8")])
def test_the_topology_is_whole_hosts_of_eight(gpus, topology):
    assert targets.topology(gpus) == topology


def run(capsys, *argv):
    code = plan.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


CONFIG = ["--config", str(REPO / "configs" / "gpt_1b.yaml")]


@pytest.mark.parametrize("argv, says", [
    (["--gpu", "a100-80g", "--gpus", "1"], "known GPUs: h100-sxm, h200"),
    (["--gpu", "b200", "--gpus", "1"], "known GPUs: h100-sxm, h200"),
    (["--gpu", "h100-sxm", "--gpus", "12"], "use a multiple of 8"),
    (["--gpu", "h100-sxm", "--gpus", "8", "mesh.pp=3", "parallel.microbatches=3", "train.global_batch=9"], "not divisible by mesh.tp x mesh.pp"),
    (["--gpu", "h100-sxm", "--gpus", "8", "mesh.tp=8", "mesh.dp=2"], "disagrees with --gpus=8"),
])
def test_compile_refuses_bad_input_in_one_line_before_anything_starts(capsys, argv, says):
    code, out, err = run(capsys, "--compile", *CONFIG, *argv)
    assert code == 2 and out == "" and says in err and len(err.strip().splitlines()) == 1


def test_compile_without_the_environment_names_the_script_that_makes_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_AOT_VENV", str(tmp_path / "nowhere"))
    code, out, err = run(capsys, "--compile", *CONFIG, "--gpu", "h200", "--gpus", "1")
    assert code == 2 and "bash configs/aot/setup_env.sh" in err and len(err.strip().splitlines()) == 1


def test_a_step_that_does_not_fit_names_its_peak_the_limit_and_what_shrinks_it():
    report = {"memory": {"peak": 90 * 2**30}, "outside_step": {"checkpoint_copy": 0, "input_batches": 2**20},
              "limit_bytes": targets.TARGETS["h100-sxm"].limit_bytes(), "device": "NVIDIA H100 80GB HBM3"}
    assert not summary.fits(report)
    line = summary.does_not_fit(report)
    assert "90.0 GiB" in line and "58.9 GiB" in line and "model.remat" in line and "\n" not in line


# ------------------------------------------------------------------ the roofline

STACKED = """HloModule m, is_scheduled=true

%read_one_layer (p0: f32[24,4096,1024], p1: s32[], p2: f32[4096,1024]) -> f32[4096,1024] {
  %p0 = f32[24,4096,1024]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[4096,1024]{1,0} parameter(2)
  %dynamic-slice.1 = f32[1,4096,1024]{2,1,0} dynamic-slice(%p0, %p1, %p1, %p1), dynamic_slice_sizes={1,4096,1024}
  %bitcast.1 = f32[4096,1024]{1,0} bitcast(%dynamic-slice.1)
  ROOT %add.1 = f32[4096,1024]{1,0} add(%bitcast.1, %p2)
}

%write_one_layer (q0: f32[24,4096,1024], q1: f32[1,4096,1024], q2: s32[]) -> f32[24,4096,1024] {
  %q0 = f32[24,4096,1024]{2,1,0} parameter(0)
  %q1 = f32[1,4096,1024]{2,1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %view = f32[24,4096,1024]{2,1,0} bitcast(%q0)
  ROOT %dynamic-update-slice.1 = f32[24,4096,1024]{2,1,0} dynamic-update-slice(%view, %q1, %q2, %q2, %q2)
}

%gemm_into_stack (r0: bf16[4096,512], r1: bf16[512,1024], r2: bf16[24,4096,1024], r3: s32[]) -> (bf16[24,4096,1024], s8[1024]) {
  %r0 = bf16[4096,512]{1,0} parameter(0)
  %r1 = bf16[512,1024]{1,0} parameter(1)
  %r2 = bf16[24,4096,1024]{2,1,0} parameter(2)
  %r3 = s32[] parameter(3)
  %custom-call.9 = (bf16[4096,1024]{1,0}, s8[1024]{0}) custom-call(%r0, %r1), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"lhs_contracting_dimensions":["1"]}}
  %bitcast.9 = bf16[1,4096,1024]{2,1,0} bitcast(%custom-call.9#0)
  %dynamic-update-slice.9 = bf16[24,4096,1024]{2,1,0} dynamic-update-slice(%r2, %bitcast.9, %r3, %r3, %r3)
  %workspace = s8[1024]{0} get-tuple-element(%custom-call.9), index=1
  ROOT %tuple.9 = (bf16[24,4096,1024]{2,1,0}, s8[1024]{0}) tuple(%dynamic-update-slice.9, %workspace)
}

ENTRY %main (stack: f32[24,4096,1024], i: s32[], x: f32[4096,1024], y: f32[1,4096,1024]) -> f32[24,4096,1024] {
  %stack = f32[24,4096,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = f32[4096,1024]{1,0} parameter(2)
  %y = f32[1,4096,1024]{2,1,0} parameter(3)
  %loop_fusion.1 = f32[4096,1024]{1,0} fusion(%stack, %i, %x), kind=kLoop, calls=%read_one_layer
  %a = bf16[4096,512]{1,0} parameter(4)
  %b = bf16[512,1024]{1,0} parameter(5)
  %s = bf16[24,4096,1024]{2,1,0} parameter(6)
  %dynamic-slice-fusion.9 = (bf16[24,4096,1024]{2,1,0}, s8[1024]{0}) fusion(%a, %b, %s, %i), kind=kCustom, calls=%gemm_into_stack, backend_config={"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":{"name":"dynamic_slice_fusion"}}}
  ROOT %loop_dynamic_update_slice_fusion.1 = f32[24,4096,1024]{2,1,0} fusion(%stack, %y, %i), kind=kLoop, calls=%write_one_layer
}
"""
LAYER_BYTES = 4096 * 1024 * 4


def test_the_roofline_counts_a_slice_of_a_stack_and_an_in_place_update_by_what_they_touch():
    from megascale_jax.aot import roofline
    from megascale_jax.planner import calibration

    gpu = calibration.gpu("h200")
    rows = {r["kernel"]: r for r in roofline.kernel_costs(STACKED, instructions(STACKED), gpu, None)}
    # one layer read from the stack, x read, the sum written (the index is 4 bytes)
    assert rows["loop_fusion.1"]["bytes"] == 3 * LAYER_BYTES + 4
    # the update read and written in place (the buffer seen through a bitcast): not the 24-layer buffer
    assert rows["loop_dynamic_update_slice_fusion.1"]["bytes"] == 2 * LAYER_BYTES + 4
    assert rows["loop_fusion.1"]["seconds"] == pytest.approx((3 * LAYER_BYTES + 4) / 4.3e12)
    # a cuBLAS GEMM writing its output into the stack (XLA's dynamic-slice fusion): its operands
    # read, one layer and the workspace written; the GEMM is cuBLAS's
    gemm = rows["dynamic-slice-fusion.9"]
    assert gemm["bytes"] == 2 * (4096 * 512 + 512 * 1024) + 2 * 4096 * 1024 + 1024 + 4
    assert gemm["flops"] == 2 * 4096 * 1024 * 512
    assert compiled_hlo.kernel_inventory(STACKED, instructions(STACKED))["static"]["gemms"] == {"cublas": 1}


def test_the_roofline_prices_cudnn_attention_by_its_windows_pairs_and_gemms_by_their_flops():
    from megascale_jax.aot import roofline
    from megascale_jax.planner import calibration, costs

    gpu = calibration.gpu("h200")
    rows = roofline.kernel_costs(MODULE, instructions(MODULE), gpu, window=16)
    attention = next(r for r in rows if r["kind"] == "__cudnn$fmhaSoftmax")
    # output bf16[8,4,64,16]: batch 8, 4 heads, 64 queries, head_dim 16; each query sees <= 16 keys
    pairs = 16 * 17 // 2 + (64 - 16) * 16
    assert attention["flops"] == 4 * 16 * 8 * 4 * pairs
    gemm = next(r for r in rows if r["kind"] == "__triton_gemm")
    assert gemm["runs"] == 3 and gemm["flops"] == 3 * 2 * 64 * 16 * 32
    assert gemm["seconds"] == pytest.approx(3 * max(costs.gemm_s(64, 32, 16, gpu), roofline.LAUNCH_S,
                                                    (64 * 32 * 2 * 2 + 64 * 16 * 2) / gpu.hbm_stream_bandwidth))
    assert roofline.summary(rows)["step_s"] == pytest.approx(sum(r["seconds"] for r in rows))
