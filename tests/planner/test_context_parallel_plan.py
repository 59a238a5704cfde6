"""The planner's context parallelism (mesh.cp): what a cp rank computes, holds and sends, the
gradients' reduction over dp and cp, `--search` choosing cp where only cp fits, and the layouts
the trainer refuses refused in one line. Every expected number is hand arithmetic written here."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from megascale_jax import plan
from megascale_jax.config import load_config
from megascale_jax.model import flops
from megascale_jax.planner import calibration, costs, predict, traffic
from megascale_jax.planner.search import candidates, search
from megascale_jax.planner.workload import from_config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench.parallel import collective_bytes  # noqa: E402

H100 = calibration.gpu("h100-sxm")
# A small model: d_model 64, 4 heads of 16 (kv 2: k and v are 32 wide), MLP 256, vocab 256,
# 4 layers, bf16, window 64 over 256 positions; 8 sequences a step.
SMALL = ["model.layers=4", "model.d_model=64", "model.heads=4", "model.kv_heads=2", "model.vocab=256",
         "model.seq_len=256", "model.window=64", "model.dtype=bfloat16", "model.attention=xla",
         "train.global_batch=8", "parallel.zero1=false", "mesh.tp=1"]  # (the default config's mesh is dp 4 x tp 2)
GPT_1B = str(REPO / "configs" / "gpt_1b.yaml")
LONG = ["model.attention=xla", "model.seq_len=131072", "model.window=4096", "model.remat=full",
        "train.global_batch=8", "parallel.microbatches=1"]  # gpt_1b at 128k tokens, sliding window 4,096


def workload(*overrides, gpus=8):
    return from_config(load_config(None, [*SMALL, *overrides], planning=True), gpus)


def ring_all_reduce(nbytes, n, link):
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def test_the_halo_is_the_trainers_and_spans_a_slice_a_permute():
    # window - 1, capped at the (cp - 1) slices before the last rank's (by hand)
    for window, seq, cp, halo in [(64, 256, 2, 63), (64, 256, 8, 63), (6, 32, 8, 5), (1000, 64, 4, 48), (1, 64, 4, 0)]:
        assert flops.halo_length(window, seq, cp) == halo
    # docs/design.md's example: cp 8, seq 32, w 6: 4 keys from the neighbour, 1 from the next
    w = workload("model.seq_len=32", "model.window=6", "mesh.cp=8", "mesh.dp=1")
    assert traffic.halo_hops(w) == [4, 1]


def test_cp_bytes_are_the_halo_both_ways_and_the_gradients_all_reduce():
    """dp2 cp2 tp2, one microbatch: 4 sequences a rank, k/v 32 wide split over tp (16 a rank),
    bf16; the halo 63 positions; each layer sends it forward and its gradient back."""
    w = workload("mesh.dp=2", "mesh.cp=2", "mesh.tp=2")
    halo_per_layer_and_direction = 2 * 63 * 4 * 16 * 2  # k and v x positions x rows x width x bytes
    cp = traffic.cp_bytes(w, params=1000)
    assert cp["attention"] == 4 * 2 * halo_per_layer_and_direction  # 4 layers, both directions
    assert cp["gradients"] == 2 * (2 - 1) / 2 * 1000 * 4  # ring all-reduce of 1000 fp32 gradients over 2
    # full attention: k and v all-gathered over 2 ranks, (cp-1)/cp of the whole sequence each
    full = traffic.cp_bytes(workload("mesh.dp=2", "mesh.cp=2", "mesh.tp=2", "model.window=null"), params=1000)
    assert full["attention"] == 4 * 2 * 2 * (1 / 2) * 4 * 256 * 16 * 2
    # remat=full reruns the forward and its halo: three transfers a layer, not two
    remat = traffic.cp_bytes(workload("mesh.dp=2", "mesh.cp=2", "mesh.tp=2", "model.remat=full"), params=1000)
    assert remat["attention"] == 4 * 3 * halo_per_layer_and_direction
    # the dp axis reduces what it did before: 2(dp-1)/dp of the gradients, over dp only
    assert traffic.dp_bytes(w, params=1000) == {"gradients": 4000.0, "parameters": 0.0}
    # no cp, no cp bytes
    assert traffic.bytes_per_axis(workload("mesh.dp=4", "mesh.tp=2"))["cp"] == 0.0


@pytest.mark.parametrize("layout", [["mesh.dp=2", "mesh.cp=2", "mesh.tp=2"], ["mesh.dp=1", "mesh.cp=8", "mesh.tp=1",
                                                                            "model.window=24"],
                                    ["mesh.dp=1", "mesh.cp=4", "mesh.tp=2", "model.window=null"]])
def test_the_ideal_cp_bytes_are_the_collective_benchs(layout):
    """The bench's cp column (its own formula, measured at 0.999-1.00x on the compiled steps)."""
    cfg = load_config(None, [*SMALL, *layout], planning=True)
    held = 123_456
    assert traffic.ideal_bytes_per_axis(cfg, 8, held)["cp"] == pytest.approx(collective_bytes.cp_ideal_bytes(cfg, held))


def test_with_microbatches_the_gradients_cross_cp_once_a_step():
    """The accumulation is manual over cp (parallel/microbatches.py): one all-reduce of the
    gradients over cp a step, whatever the microbatches; a runtime that reduced inside the
    accumulation (`cp_reduce_per_microbatch`) pays it m times."""
    w = workload("mesh.dp=1", "mesh.cp=4", "mesh.tp=2", "parallel.microbatches=2")
    assert traffic.cp_bytes(w, params=1000)["gradients"] == 2 * 3 / 4 * 1000 * 4
    per_microbatch = dataclasses.replace(w, cp_reduce_per_microbatch=True)
    assert traffic.cp_bytes(per_microbatch, params=1000)["gradients"] == 2 * (2 * 3 / 4 * 1000 * 4)
    ideal = traffic.ideal_bytes_per_axis(load_config(None, [*SMALL, "mesh.dp=1", "mesh.cp=4", "mesh.tp=2",
                                                            "parallel.microbatches=2"], planning=True), 8, 1000)
    assert ideal["cp"] - traffic.cp_bytes(w, params=1000)["attention"] == 2 * 3 / 4 * 1000 * 4  # once a step


def test_a_cp_rank_computes_its_slice():
    """cp 4 over 8,192 positions: the GEMMs are those of 2,048 tokens (the same seconds as one
    sequence of 2,048 without cp), the elementwise passes 1/4. XLA's attention under a 512 window
    bands the queries in blocks of 512, each scored against 512 + 511 keys, on a cp rank's 2,048
    as on one device's 8,192; a 1,024 window leaves a rank's 2,048 queries unbanded (fewer than 4
    blocks of 1,024): scored against its 2,048 keys and the 1,023 of the halo."""
    one = workload("model.seq_len=8192", "model.window=512", "train.global_batch=1", "mesh.dp=1", gpus=1)
    four = workload("model.seq_len=8192", "model.window=512", "train.global_batch=1", "mesh.dp=1", "mesh.cp=4", gpus=4)
    wide = workload("model.seq_len=8192", "model.window=1024", "train.global_batch=1", "mesh.dp=1", "mesh.cp=4", gpus=4)
    short = workload("model.seq_len=2048", "model.window=512", "train.global_batch=1", "mesh.dp=1", gpus=1)
    t1, t4, tw, ts = (predict.layer_times(w, H100)["kind"] for w in (one, four, wide, short))
    assert t4["gemm"] == ts["gemm"] and t4["gemm wave quantization"] == ts["gemm wave quantization"]
    assert t4["elementwise"] == pytest.approx(t1["elementwise"] / 4, rel=1e-12)
    def attention(scores):  # forward, and a backward of twice its GEMMs and passes
        forward = 2 * costs.matmul_s(2 * 16 * scores, H100)  # q.k and p.v: a batched GEMM each, 2 x 16 FLOPs a score
        passes = costs.hbm_s(H100.elementwise_passes * scores * 2 * 2, H100)  # 2 values of 2 bytes a score
        return 3 * forward + 3 * passes

    # one sequence, 4 heads
    assert t4["attention"] == pytest.approx(attention(4 * 2048 * (512 + 511)), rel=1e-12)
    assert t1["attention"] == pytest.approx(attention(4 * 8192 * (512 + 511)), rel=1e-12)
    assert tw["attention"] == pytest.approx(attention(4 * 2048 * (2048 + 1023)), rel=1e-12)


def test_a_fused_kernel_on_a_cp_rank_is_priced_at_the_busiest_rank():
    """A fused kernel counts visible pairs: under a window every rank past the first has n x w of
    them (1/cp of the sequence's); under full causal attention the last rank has the most, its
    queries at positions 6,144-8,191 seeing 6,145-8,192 keys."""
    base = dataclasses.replace(workload("model.seq_len=8192", "train.global_batch=1", "mesh.dp=1", "mesh.cp=4",
                                        gpus=4), fused_attention=True)
    for window, pairs in [(512, 2048 * 512), (None, (6145 + 8192) * 2048 // 2)]:
        w = dataclasses.replace(base, window=window)
        kernel = costs.fused_attention_s(4 * 16 * 4 * pairs, 2048 * 4, H100)
        assert predict.layer_times(w, H100)["kind"]["attention"] == pytest.approx(costs.FLASH_FWD_BWD * kernel)


def test_the_halo_is_priced_on_the_link_the_cp_group_sits_on():
    """Window 64 over 256, cp 4 (64 positions a rank: one permute of 63 positions), exposed,
    forward and backward; tp 2 x cp 4 fit a node's NVLink, tp 4 x cp 4 do not: the NICs."""
    for tp, gpus, link in [(2, 8, H100.nvlink), (4, 16, H100.nic)]:
        w = workload("mesh.dp=1", "mesh.cp=4", f"mesh.tp={tp}", "model.heads=8", "model.kv_heads=8", gpus=gpus)
        positions = 2 * 63 * 8 * (8 * 8 // tp) * 2  # k and v x halo x 8 rows x kv width on the rank x bf16
        assert predict.cp_attention_s(w, H100) == pytest.approx(2 * (link.latency + positions / link.bandwidth))
    # a halo over two slices: two permutes, two latencies
    w = workload("model.seq_len=32", "model.window=6", "mesh.cp=8", "mesh.dp=1")
    k = 8 * 32 * 2  # one position of k: 8 rows x 32 wide x bf16
    assert predict.cp_attention_s(w, H100) == pytest.approx(
        2 * (2 * H100.nvlink.latency + 2 * (4 + 1) * k / H100.nvlink.bandwidth))


def test_the_gradients_are_reduced_over_dp_and_then_over_cp():
    """dp 2 x cp 4 on one node: the fp32 gradients of the stage's parameters, all-reduced over
    the 2 dp ranks and then over the 4 cp ranks, on NVLink. Parameters by hand: a layer holds its
    norm 128, q and o 2 x (64 x 64 + 64), k and v 2 x (64 x 32 + 32), MLP 64 x 256 + 256 + 256 x 64
    + 64; 4 layers and the embedding and head, 2 x 256 x 64."""
    layer = 128 + 2 * (64 * 64 + 64) + 2 * (64 * 32 + 32) + (64 * 256 + 256) + (256 * 64 + 64)
    grads = (4 * layer + 2 * 256 * 64) * 4
    w = workload("mesh.dp=2", "mesh.cp=4")
    expected = ring_all_reduce(grads, 2, H100.nvlink) + ring_all_reduce(grads, 4, H100.nvlink)
    assert predict.dp_s(w, H100, 0.0, 0.0) == pytest.approx(expected)
    assert predict.predict(w, H100).breakdown["dp"] == pytest.approx(expected)
    assert w.dp == 2 and w.microbatch_seqs == 4


def test_activation_memory_is_a_cp_ranks_slice_and_the_weights_do_not_shrink():
    """2 layers, 4 sequences of 1,024, window 128, XLA attention, bf16, one device's mesh
    against cp 4 (dp 1). Per layer: 15 values a token and d_model (`KEPT_VALUES_*`), the scores'
    2 values (one device's 1,024 queries banded in blocks of 128, each against 128 + 127 keys;
    each cp rank's 256 queries, too few to band, against its 256 + 127 keys), and at cp 4 the
    halo's k and v (127 positions x 64 wide); plus the fp32 logits (256 vocab) of the rank's tokens."""
    common = ["model.layers=2", "model.kv_heads=4", "model.seq_len=1024", "model.window=128", "train.global_batch=4",
              "mesh.dp=1"]
    one = flops.memory_estimate(load_config(None, [*SMALL, *common], planning=True))
    four = flops.memory_estimate(load_config(None, [*SMALL, *common, "mesh.cp=4"], planning=True))
    per_token_one, per_token_four = 4 * 1024 * 64 * 15, 4 * 256 * 64 * 15
    assert per_token_four * 4 == per_token_one
    scores_one, scores_four = 4 * 4 * 1024 * (128 + 127) * 2, 4 * 4 * 256 * (256 + 127) * 2
    halo = 2 * 4 * 127 * 64
    assert one["activations"] == 2 * (per_token_one + scores_one) * 2 + 4 * 1024 * 256 * 4
    assert four["activations"] == 2 * (per_token_four + scores_four + halo) * 2 + 4 * 256 * 256 * 4
    for part in ("parameters", "gradients", "optimizer"):
        assert four[part] == one[part]


def test_search_picks_cp_where_nothing_else_fits_and_not_for_a_short_sequence():
    """gpt_1b at 128k tokens (window 4,096, remat=full, XLA attention) on 8 H100s: on one device
    XLA scores 131,072 x (4,096 + 4,095) positions a head even banded (64 GiB a layer and
    sequence): cp = 1 fits only with the heads split (tp 4 or 8), and a cp layout ranks first. At
    2,048 tokens of full attention the best layout has no cp."""
    long = load_config(GPT_1B, LONG, planning=True)
    ranked = search(long, 8, H100)
    best = ranked[0]
    assert best.fits and best.cfg.mesh.cp > 1 and best.cfg.mesh.pp == 1
    assert all(p.cfg.mesh.tp >= 4 for p in ranked if p.cfg.mesh.cp == 1 and p.fits)
    short = load_config(GPT_1B, ["model.attention=xla", "train.global_batch=8", "parallel.microbatches=1"],
                        planning=True)
    ranked = search(short, 8, H100)
    assert ranked[0].fits and ranked[0].cfg.mesh.cp == 1
    assert any(p.cfg.mesh.cp > 1 for p in ranked)  # cp was a candidate, ranked lower
    # every candidate spans the 8 GPUs, and cp is tried with pipelines too (with tp as well)
    layouts = list(candidates(long, 8, 8))
    assert all(c.mesh.size == 8 for c in layouts) and {c.mesh.cp for c in layouts} == {1, 2, 4, 8}
    assert any(c.mesh.pp > 1 and c.mesh.cp > 1 and c.mesh.tp > 1 for c in layouts)


def test_the_plan_shows_cp_in_its_layout(capsys):
    code = plan.main(["--config", GPT_1B, "--gpus", "8", "--gpu", "h100-sxm", *LONG, "mesh.cp=8",
                      "parallel.microbatches=8", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["layout"] == "dp=1 pp=1 cp=8 tp=1 m=8" and data["fits"]
    assert data["breakdown"]["cp"] > 0
    assert sum(data["breakdown"].values()) == pytest.approx(data["iteration_s"])


BAD = [
    (["mesh.cp=3"], "model.seq_len=2048 must be divisible by mesh.cp=3"),
    (["mesh.cp=2", "model.attention=cudnn", "model.window=null"], "runs with model.attention=xla|pallas, not cudnn"),
    (["mesh.cp=4", "--gpus", "6"], "--gpus=6 is not divisible by mesh.tp x mesh.pp x mesh.cp = 1 x 1 x 4"),
    (["mesh.cp=4", "mesh.dp=4"], "mesh.dp=4 disagrees with --gpus=8 / (mesh.tp x mesh.pp x mesh.cp = 4) = 2"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[m.split()[0] for _, m in BAD])
def test_a_cp_the_trainer_refuses_is_one_line_and_exit_2(capsys, extra, message):
    gpus = [] if "--gpus" in extra else ["--gpus", "8"]
    code = plan.main(["--config", GPT_1B, "--gpu", "h100-sxm", *gpus, "model.attention=xla", *extra])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and message in lines[0], err
