"""`python -m megascale_jax.plan --compile`: the trainer's own step compiled for an H100/H200 on
this CPU-only machine, in the compile-only environment (`configs/aot/setup_env.sh`, which `.ci/run`
sets up; these tests skip where it is missing). Compiles of ~10-60 s each on 2 cores:

* the GPU campaign's same-work row (cuDNN attention, window 512, AdamW, 8 sequences) for one H200:
  at most the PyTorch peer's measured peak, 48.7 GiB (issue 56, item 3), with the same-work
  kernels (cuDNN's fused attention forward and backward, every layer's GEMMs);
* docs/compile.md's commands: the same-work row above, and dp 2 x tp 8 on two hosts of H100s
  (the layer scan rolled) run as written: it fits;
* 8 H100s at tp = 8 with sequence parallelism and collective matmul: tp moves its ideal bytes
  (`planner.traffic`, within 5%), and collective matmul's permutes are asynchronous with compute
  scheduled inside their windows.

What they cost (CPU seconds of the compile-only child, 2026-11-28, 2 shared cores): the same-work
row 55 (gpt_1b unrolled, as documented), the 8-GPU tp = 8 compile 58, the two-host command 29, the
FP8 step 20, the campaign's FP8 rows 3; each compile is XLA's GPU pipeline (the tiny FP8 step: 15 of
its 20 s), not start-up (jax with the CUDA plugin and the trainer imported: 1.6 s a process) nor
tracing (2-3 s), and neither Triton GEMMs off nor LLVM/ptxas optimisation off shortens one. No two
tests compile the same program (the documented first command is the same-work test's compile).
"""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megascale_jax import plan
from megascale_jax.aot import environment

REPO = Path(__file__).resolve().parents[2]
GPT_1B = ["--config", str(REPO / "configs" / "gpt_1b.yaml")]
PEER_PEAK_BYTES = 52288372224  # the FlexAttention peer's peak on the H200, 2026-11-27 (48.7 GiB)
SAME_WORK = ["model.window=512", "parallel.microbatches=1", "optim.name=adamw", "train.global_batch=8"]

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("aot")]


@pytest.fixture(scope="module", autouse=True)
def compile_environment():
    try:
        environment.python()
    except environment.MissingEnvironment as e:
        pytest.skip(str(e))


def compiled(capsys, *argv) -> tuple[int, dict]:
    code = plan.main(["--compile", "--json", *argv])
    out, err = capsys.readouterr()
    assert out, err
    return code, json.loads(out)


def test_the_same_work_row_compiles_for_the_h200_within_the_peers_peak(capsys):
    # docs/compile.md's first command, as written (its --json: what is asserted below)
    assert shlex.split(documented_commands()[0])[3:] == ["--compile", "--gpu", "h200", "--gpus", "1", "--config",
                                                         "configs/gpt_1b.yaml", *SAME_WORK]
    code, report = compiled(capsys, *GPT_1B, "--gpu", "h200", "--gpus", "1", *SAME_WORK)
    assert code == 0 and report["jax"] == "0.11.2" and report["device"] == "NVIDIA H200"
    assert report["memory"]["peak"] <= PEER_PEAK_BYTES
    # the peak is arguments + outputs - aliased + temporaries, and the state is donated
    m = report["memory"]
    assert m["peak"] == m["argument"] + m["output"] - m["alias"] + m["temp"] + m["code"]
    assert m["alias"] >= 0.99 * report["state_bytes"]
    kernels = report["kernels"]["per_step"]
    layers = 24
    assert kernels["custom_calls"] == {"__cudnn$fmhaSoftmax": layers, "__cudnn$fmhaSoftmaxBackward": layers}
    # every layer's two forward GEMMs (QKV+MLP-up, out+MLP-down) and their four backward ones, at least
    assert kernels["gemms"]["triton"] >= 6 * layers
    # the pre-compile estimate (the train command's start-up check) within 5% of the compile
    from megascale_jax.config import load_config
    from megascale_jax.model import flops
    estimate = flops.memory_estimate(load_config(GPT_1B[1], SAME_WORK, planning=True))["total"]
    assert estimate == pytest.approx(m["peak"], rel=0.05)
    # the roofline prices every kernel: its FLOPs hold every GEMM's and cuDNN's attention besides
    roof = report["roofline"]
    assert roof["kernels"] == kernels["kernels"] - sum(kernels.get("collectives", {}).values())
    assert roof["flops"] > report["kernels"]["gemm_flops_per_step"]["triton"]
    assert roof["step_s"] == pytest.approx(sum(roof["by_part_s"].values()))
    # the largest buffers are named by the part that owns them: with the layer scan unrolled (the
    # shipped config) the float32 logits first, and what the backward keeps under each layer part
    top = report["peak_buffers"][0]
    assert top["part"] == "LM head/loss" and "50304" in top["shape"]
    by_part = report["peak_bytes_by_part"]
    assert all(by_part[part] > 4 * 2**30 for part in ("attention", "MLP", "QKV + MLP-up GEMM", "optimizer state"))


def documented_commands() -> list[str]:
    sys.path.insert(0, str(REPO / "tests"))
    from test_readme import COMPILE_MARK, readme_commands
    return readme_commands((REPO / "docs" / "compile.md").read_text(), marked=COMPILE_MARK)


def test_the_documented_compiles_run_as_written():
    """docs/compile.md's commands print what it says: the two-host one (dp 2 x tp 8 on two hosts of
    H100s) fits and moves dp's ideal bytes. The first, the same-work row, is compiled (with --json)
    by the test above."""
    commands = documented_commands()
    assert len(commands) == 2
    for command in commands[1:]:
        argv = shlex.split(command)
        done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert "fits: yes" in done.stdout and "largest buffers live at the peak" in done.stdout
    assert "collectives over dp" in done.stdout and "(1.00x)" in done.stdout


def test_eight_gpus_at_tp_8_move_the_ideal_bytes_and_overlap_collective_matmuls_permutes(capsys):
    # gpt_1b's width and sequence, not a smaller model's: the overlap depends on the sizes XLA's
    # scheduler sees. At d_model 512 (seq 512) 24 of the 144 asynchronous permutes had no compute in
    # their window, at 256 56 of 176 (2026-11-28); 4 layers (the scan rolled) cost what 2 do.
    code, report = compiled(capsys, *GPT_1B, "--gpu", "h100-sxm", "--gpus", "8", "mesh.tp=8",
                            "parallel.sequence_parallel=true", "parallel.tp_overlap=collective_matmul",
                            "parallel.microbatches=1", "model.layers=4", "model.scan_unroll=1")
    assert code == 0 and report["topology"] == "1x1x8" and report["mesh"] == {"dp": 1, "pp": 1, "cp": 1, "tp": 8}
    assert report["collective_bytes"]["tp"] == pytest.approx(report["ideal_collective_bytes"]["tp"], rel=0.05)
    permutes = report["overlap"]["tp"]["collective-permute"]
    assert permutes["async"] > 0 and permutes["overlapped"] == permutes["async"]


def test_cudnn_attention_on_context_parallel_slices_compiles_for_eight_h100s(capsys):
    """mesh.cp with model.attention=cudnn (issue 62): each cp rank's slice runs cuDNN's fused
    attention behind its halo (the biased kernel: the keys before the sequence's start are a
    segment of their own), forward and backward in every layer, on dp 2 x cp 2 x tp 2, and the cp
    axis carries the halo. Manual over every mesh axis: jax's cuDNN partitioner never sees it (with
    dp left automatic the GPU compile crashed)."""
    layers = 2
    code, report = compiled(capsys, "--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--gpu", "h100-sxm",
                            "--gpus", "8", "mesh.dp=2", "mesh.cp=2", "mesh.tp=2", f"model.layers={layers}",
                            "model.dtype=bfloat16", "model.attention=cudnn", "model.window=64")
    assert code == 0 and report["mesh"] == {"dp": 2, "pp": 1, "cp": 2, "tp": 2}
    assert report["kernels"]["per_step"]["custom_calls"] == {"__cudnn$fmhaScaleBiasSoftmax": layers,
                                                             "__cudnn$fmhaScaleBiasSoftmaxBackward": layers}
    assert report["collective_bytes"]["cp"] > 0


def test_fp8_layer_gemms_become_cublaslt_fp8_gemms_for_the_h200(capsys):
    """model.fp8: every layer GEMM (2 forward, 4 backward a layer) is cuBLASLt's FP8 GEMM in the
    program compiled for sm_90, none silently left in bf16; the LM head's 3 stay bf16 (cuBLAS
    GEMMs forced: without a device XLA cannot autotune, and would pick Triton for all)."""
    layers = 4
    code, report = compiled(capsys, "--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--gpu", "h200",
                            "--gpus", "1", "mesh.dp=1", "mesh.tp=1", f"model.layers={layers}", "model.dtype=bfloat16",
                            "model.attention=cudnn", "model.fp8=true", "--xla-option",
                            "xla_gpu_enable_triton_gemm=false")
    assert code == 0
    kernels = report["kernels"]["per_step"]
    assert kernels["custom_calls"]["__cublas$lt$matmul$f8"] == 6 * layers
    assert kernels["gemms"] == {"cublas-fp8": 6 * layers, "cublas": 3, "cudnn": 2 * layers}
    assert report["kernels"]["gemm_flops_per_step"]["cublas-fp8"] > 0  # FP8 GEMMs count their FLOPs


def test_the_campaigns_fp8_rate_rows_compile_to_cublaslt_fp8_gemms_for_the_h200():
    """bench/campaign/rates.py's FP8 rows (gpt_1b's six layer GEMMs, each with its formats), as the
    campaign compiles them on a GPU (Triton GEMMs off), hold `__cublas$lt$matmul$f8` when compiled
    for an H200 here: the rates the next GPU run records are FP8's."""
    script = """
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding
from bench.campaign.rates import FP8_FORMATS, model_layer_gemms
from megascale_jax.aot.targets import target
device = topologies.get_topology_desc(platform="cuda", target_config=target("h200").proto(), topology="1x1x1").devices[0]
on = SingleDeviceSharding(device)
for which, m, k, n in model_layer_gemms(False):
    fa, fb = (getattr(jnp, f) for f in FP8_FORMATS[which])
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=on)
            for shape, dtype in (((m, k), fa), ((k, n), fb), ((), jnp.bfloat16), ((), jnp.bfloat16))]
    gemm = lambda a, b, sa, sb: jnp.dot(a.astype(jnp.bfloat16) * sa, b.astype(jnp.bfloat16) * sb)
    text = jax.jit(gemm).lower(*args).compile(compiler_options={"xla_gpu_enable_triton_gemm": False}).as_text()
    print(which, m, k, n, "__cublas$lt$matmul$f8" in text)
"""
    import os

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)  # the CPU mesh's simulated-device flags mean nothing to this compile
    done = subprocess.run([environment.python(), "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == 6 and all(row[-1] == "True" for row in rows), done.stdout
