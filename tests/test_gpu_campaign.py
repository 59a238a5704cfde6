"""`python -m bench.campaign` on the CPU: `--dry-run` runs every section at tiny shapes, a failing
section records one line and the others still run, `--only` runs what it names and updates an
existing result, and user mistakes are one line and exit 2. No GPU number is checked here: the
dry run proves the campaign's plumbing; what it measures on a GPU is the GPU session's to read."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jaxlib
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")
sys.path.insert(0, REPO)  # bench/ is not installed: it imports from the checkout's root, as `python -m bench...` runs

from bench.campaign import claims as campaign_claims  # noqa: E402
from bench.campaign import ladder as campaign_ladder  # noqa: E402
from bench.campaign import levers as campaign_levers  # noqa: E402
from bench.campaign import model as campaign_model  # noqa: E402
from bench.campaign import profile as campaign_profile  # noqa: E402

SECTIONS = ["kernels", "mfu_ladder", "levers", "torch_peer", "checkpoints", "profiled_steps", "rates"]
LADDER_ROWS = ["serial_dense_adamw", "parallel_block", "sliding_window", "fused_attention", "fused_norm_gelu",
               "xla_flags", "remat", "lamb_4x_batch", "dense_twin"]
TIMED_CONTENDERS = {"xla_dense_causal", "xla_window", "pallas_window"}  # the ones that run on the CPU
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def campaign(*args: str, tmpdir=None) -> subprocess.CompletedProcess:
    """The campaign as a user runs it; `tmpdir`: its TMPDIR (to see what it leaves there)."""
    # PYTHONPATH: the bench imports this checkout's package, also where another copy is installed.
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])])}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run([sys.executable, "-m", "bench.campaign", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


def one_line(text) -> bool:
    return isinstance(text, str) and text.strip() != "" and "\n" not in text.strip()


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The full dry run: (completed process, result path, listing of bench/results before, what it
    left in its TMPDIR)."""
    tmp = tmp_path_factory.mktemp("campaign")
    before = sorted(os.listdir(RESULTS))
    path, tmpdir = tmp / "full" / "result.json", tmp / "full_tmpdir"
    tmpdir.mkdir()
    done = campaign("--dry-run", "--out", str(path), tmpdir=tmpdir)
    return done, path, before, os.listdir(tmpdir)


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    """A run without --out whose first section fails on purpose, then `--only` reruns of the
    section after it into the same file (refused, then with --overwrite). Its own xdist group, so
    that it runs beside the full dry run on the other worker. The failing section fails before it
    imports anything; the one that runs on after it, and is rerun, is the quickest (rates, ~3 s of
    CPU in the dry run)."""
    tmpdir = tmp_path_factory.mktemp("partial_tmpdir")
    failed = campaign("--dry-run", "--only", "checkpoints,rates", "--fail-section", "checkpoints", tmpdir=tmpdir)
    (folder,) = os.listdir(tmpdir)  # no --out: a new temporary directory, left for the user
    (name,) = [f for f in os.listdir(tmpdir / folder) if f.endswith(".json")]
    path = tmpdir / folder / name
    after_failure = path.read_text()
    refused = campaign("--dry-run", "--only", "rates", "--out", str(path))
    unchanged = path.read_text() == after_failure
    rerun = campaign("--dry-run", "--only", "rates", "--overwrite", "--out", str(path))
    return failed, json.loads(after_failure), refused, unchanged, rerun, path, tmpdir


@pytest.mark.slow
@pytest.mark.xdist_group("gpu-campaign")
def test_dry_run_runs_every_section_and_records_provenance(full):
    done, path, results_before, left_in_tmpdir = full
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(path.read_text())
    assert list(result["sections"]) == SECTIONS
    for name, section in result["sections"].items():
        assert section["status"] in ("ok", "skipped"), (name, section.get("reason"))
        assert section["seconds"] > 0
        if section["status"] != "ok":
            assert one_line(section["reason"]), (name, section)
    # Only the PyTorch peer may be skipped on the CPU, and only where torch is missing.
    torch_missing = any(result[p] is None for p in ("torch", "transformers"))
    assert [n for n, s in result["sections"].items() if s["status"] == "skipped"] == (
        ["torch_peer"] if torch_missing else [])
    assert result["device"] == "cpu" and result["backend"] == "cpu" and result["dry_run"] is True
    assert result["jax"] == jax.__version__ and result["jaxlib"] == jaxlib.__version__
    assert "torch" in result and "driver" in result
    assert result["command"] == f"python -m bench.campaign --dry-run --out {path}"
    assert sorted(os.listdir(RESULTS)) == results_before  # a dry run never writes there
    assert left_in_tmpdir == []  # run directories, checkpoints and section results are removed
    for name in SECTIONS:  # the summary table names every section with its status
        assert any(line.split()[:2] == [name, result["sections"][name]["status"]] for line in done.stdout.splitlines())


@pytest.mark.slow
@pytest.mark.xdist_group("gpu-campaign")
def test_dry_run_ladder_rows(full):
    """Every row in the dry run: one trained (the Pallas attention in interpret mode; the levers'
    base trains XLA's), the others validated (their configs checked, their estimates traced) or
    skipped, each saying why. Which row the ladder carries on is test_the_ladder_carries_*'s."""
    path = full[1]
    ladder = json.loads(path.read_text())["sections"]["mfu_ladder"]
    rows = ladder["rows"]
    assert [r["name"] for r in rows] == LADDER_ROWS
    by_name = {r["name"]: r for r in rows}
    # XLA:CPU ignores XLA:GPU's flags: the dry run does not rerun the row above for them
    assert by_name["xla_flags"]["skipped"].startswith("skipped in the dry run: XLA:CPU ignores XLA:GPU flags")
    for name in ("parallel_block", "sliding_window"):  # the levers' base runs their code
        assert by_name[name]["skipped"] == "skipped in the dry run: the levers' base runs this configuration's code"
    fused = by_name["fused_attention"]
    candidates = {c["name"]: c for c in fused["candidates"]}
    trained = [fused]
    for r in trained:
        assert r["tokens_per_s"] > 0 and math.isfinite(r["tokens_per_s"]), r
        # the tokens of one step over its median time (not a median of running averages)
        assert r["tokens_per_s"] == pytest.approx(r["global_batch"] * 64 / r["step_time_s"], rel=1e-12)
        assert "mfu" in r and r["mfu"] is None  # no known peak FLOP/s for the CPU
        assert 0 <= r["data_wait_s"] < r["step_time_s"]  # the loader's wait, measured (the planner charges 0)
        assert math.isfinite(r["final_loss"]) and r["steps_measured"] == campaign_ladder.STEPS[True][0] - 1
        assert r["estimate_bytes"] > 0 and r["batch"] == campaign_model.MAX_BATCH[True]
    assert candidates["fused_attention_cudnn"]["skipped"] == "skipped: needs a GPU"
    assert fused["config"]["model.attention"] == "pallas" and candidates["fused_attention_pallas"]["tokens_per_s"] > 0
    remat = by_name["remat"]
    tried = {c["name"]: c for c in remat["candidates"]}
    validated = {"serial_dense_adamw": "serial_dense_adamw", "fused_norm_gelu": "fused_norm_gelu", "remat_elementwise": "remat", "remat_dots": "remat",
                 "lamb_4x_batch": "lamb_4x_batch", "dense_twin": "dense_twin"}
    for name, why in validated.items():  # not trained: checked and estimated, and saying so
        r = by_name.get(name) or tried[name]
        assert "tokens_per_s" not in r and r["validated"] == campaign_ladder.VALIDATED, r
        assert r["skipped"] == f"skipped in the dry run: {campaign_ladder.CPU_VALIDATE[why]}"
        assert r["estimate_bytes"] > 0 and r["global_batch"] == r["batch"] * r["microbatches"]
    assert by_name["fused_norm_gelu"]["config"]["model.attention"] == "pallas"  # the next rows keep the winner
    assert by_name["fused_norm_gelu"]["batch"] == campaign_model.MAX_BATCH[True]  # the largest that fits
    assert by_name["xla_flags"]["xla_flags"] == list(campaign_ladder.TUNED_XLA_FLAGS)
    assert list(tried) == ["remat_elementwise", "remat_dots"]
    assert [c["config"]["model.remat"] for c in tried.values()] == ["elementwise", "dots"]
    assert remat["skipped"] == "skipped in the dry run: every candidate validated, none trained"
    # rows not trained are never kept: the configuration carried on is the attention row's
    assert [by_name[n]["kept"] for n in ("fused_norm_gelu", "xla_flags", "remat")] == [False, False, False]
    assert by_name["xla_flags"]["batch"] == fused["batch"] and remat["config"] == fused["config"]
    assert all(c["xla_flags"] == [] for c in tried.values())
    lamb = by_name["lamb_4x_batch"]
    assert lamb["xla_flags"] == [] and lamb["config"] == {**fused["config"], "optim.name": "lamb"}
    assert lamb["microbatches"] == 4 and lamb["global_batch"] == 4 * fused["global_batch"]
    # the best row (the fastest: no MFU on the CPU) again with full causal attention
    twin, best = by_name["dense_twin"], max(trained, key=lambda r: r["tokens_per_s"])
    assert twin["twin_of"] == best["name"] and twin["config"] == {**best["config"], "model.window": "null"}
    assert (twin["batch"], twin["microbatches"], twin["xla_flags"]) == (best["batch"], best["microbatches"], best["xla_flags"])


class MadeUpRows:
    """The ladder's row runner with made-up speeds (`tokens_per_s` by row name, MFU in proportion;
    a `largest` row gets 16 sequences, another 8 or its `batch`): `climb`'s choices without training."""

    dry_run, settings = False, {"device": {"backend": "gpu"}}

    def __init__(self, speeds):
        self.speeds = speeds

    def row(self, name, changes, microbatches=1, batch=None, xla_flags=(), largest=False, **why_not):
        batch = batch or (16 if largest else 8)
        return {"name": name, "config": dict(changes), "microbatches": microbatches, "batch": batch,
                "global_batch": batch * microbatches, "xla_flags": list(xla_flags),
                "tokens_per_s": self.speeds.get(name, 100.0), "mfu": self.speeds.get(name, 100.0) / 1000}


def test_the_ladder_carries_a_technique_on_only_where_its_row_was_faster():
    """Each of the fused kernels, the flags and remat is kept for the rows below only where its row
    beat the configuration carried so far; LAMB runs at the carried row's batch x 4; the dense twin
    repeats the best row. Both ways, with made-up speeds (the dry run trains two rows only)."""
    flags = list(campaign_ladder.TUNED_XLA_FLAGS)
    wins = {"fused_attention_cudnn": 120, "fused_attention_pallas": 110, "fused_norm_gelu": 130, "xla_flags": 140,
            "remat_elementwise": 150, "remat_dots": 145, "lamb_4x_batch": 160, "dense_twin": 90}
    rows = {r["name"]: r for r in campaign_ladder.climb(MadeUpRows(wins))["rows"]}
    assert list(rows) == LADDER_ROWS
    assert rows["fused_attention"]["config"]["model.attention"] == "cudnn"  # the faster candidate
    assert rows["fused_norm_gelu"]["kept"] and rows["fused_norm_gelu"]["batch"] == 16
    assert rows["xla_flags"]["kept"] and rows["xla_flags"]["batch"] == 16  # the carried row's batch
    assert rows["xla_flags"]["config"]["model.fused_norm"] == "true"
    remat = rows["remat"]
    assert remat["kept"] and remat["config"]["model.remat"] == "elementwise" and remat["xla_flags"] == flags
    assert [c["name"] for c in remat["candidates"]] == ["remat_elementwise", "remat_dots"]
    lamb = rows["lamb_4x_batch"]
    assert lamb["config"] == {**remat["config"], "optim.name": "lamb"} and lamb["xla_flags"] == flags
    assert (lamb["batch"], lamb["microbatches"]) == (remat["batch"], 4)
    twin = rows["dense_twin"]
    assert twin["twin_of"] == "lamb_4x_batch" and twin["config"] == {**lamb["config"], "model.window": "null"}
    assert (twin["batch"], twin["microbatches"], twin["xla_flags"]) == (16, 4, flags)

    loses = {"fused_attention_cudnn": 120, "fused_attention_pallas": 110, "fused_norm_gelu": 115, "xla_flags": 119,
             "remat_elementwise": 100, "remat_dots": 90, "lamb_4x_batch": 130}
    rows = {r["name"]: r for r in campaign_ladder.climb(MadeUpRows(loses))["rows"]}
    fused = rows["fused_attention"]
    assert [rows[n]["kept"] for n in ("fused_norm_gelu", "xla_flags", "remat")] == [False, False, False]
    assert rows["xla_flags"]["batch"] == fused["batch"] == 8  # judged against the attention row
    assert rows["xla_flags"]["config"] == fused["config"]  # not the fused kernels' that lost
    assert all(c["xla_flags"] == [] and c["config"]["model.fused_norm"] == "false" for c in rows["remat"]["candidates"])
    lamb = rows["lamb_4x_batch"]
    assert lamb["config"] == {**fused["config"], "optim.name": "lamb"} and lamb["xla_flags"] == []
    assert (lamb["batch"], lamb["microbatches"]) == (8, 4) and rows["dense_twin"]["twin_of"] == "lamb_4x_batch"


def test_a_validated_row_whose_config_the_checks_refuse_is_its_one_line_error():
    """A dry-run row that is not trained still has its overrides checked as the trainer would."""
    good = campaign_ladder.row_overrides(True, campaign_ladder.BASELINE) + ["train.global_batch=4"]
    assert campaign_ladder.validated(good, "why") == {"skipped": "skipped in the dry run: why",
                                                     "validated": campaign_ladder.VALIDATED}
    bad = campaign_ladder.validated([*good, "model.remat=sometimes"], "why")
    assert list(bad) == ["error"] and bad["error"].startswith("config check: ConfigError: ") and one_line(bad["error"])


@pytest.mark.slow
@pytest.mark.xdist_group("gpu-campaign")
def test_dry_run_levers_each_alone_against_one_base(full):
    """Issue 36, item 6's lever table: every lever a row of its own on the same base, its change
    against that base; the XLA:GPU flag rows say why they cannot run on the CPU."""
    section = json.loads(full[1].read_text())["sections"]["levers"]
    base, rows = section["base"], {r["name"]: r for r in section["rows"]}
    # what no other section measures first (a budget that ends the section keeps those), the
    # ladder's own configurations later, the float32 head (already timed in a profile) last
    assert list(rows) == ["triton_gemm_off", "fp8", "loss_chunks", "scan_rolled", "command_buffers_off", "cublaslt",
                          "remat_elementwise_same_batch", "no_donation", "half_batch", "xla_flags", "fused_norm_gelu",
                          "remat_elementwise", "remat_dots", "head_grad_float32"]
    assert base["tokens_per_s"] > 0 and base["xla_flags"] == []  # the tuned flags are a lever
    assert base["config"] == campaign_ladder.strongest_fixed({"dry_run": True, "device": {"backend": "cpu"}})[0]
    assert base["config"]["model.block"] == "parallel" and base["config"]["model.attention"] == "xla"
    assert rows["loss_chunks"]["config"]["model.loss_chunks"] == 8
    assert base["config"]["model.scan_unroll"] == 2  # the dry run's layers, unrolled
    assert rows["scan_rolled"]["config"]["model.scan_unroll"] == 1
    assert rows["remat_dots"]["config"]["model.remat"] == "dots"
    assert rows["remat_elementwise"]["config"]["model.remat"] == "elementwise"
    same = rows["remat_elementwise_same_batch"]
    assert same["config"]["model.remat"] == "elementwise" and same["batch"] == base["batch"]
    assert rows["half_batch"]["batch"] == base["batch"] // 2
    assert rows["xla_flags"]["xla_flags"] == list(campaign_ladder.TUNED_XLA_FLAGS)
    assert rows["no_donation"]["config"]["train.donate"] == "false"
    assert rows["cublaslt"]["xla_flags"] == ["--xla_gpu_enable_cublaslt=true"]
    assert rows["fp8"]["xla_flags"] == ["--xla_gpu_enable_triton_gemm=false"] and rows["fp8"]["config"]["model.fp8"] == "true"
    for name in ("xla_flags", "triton_gemm_off", "fp8", "command_buffers_off", "cublaslt"):
        assert rows[name]["skipped"] == "skipped: needs a GPU (XLA:GPU flags)"
    assert rows["head_grad_float32"]["config"]["model.head_grad_float32"] == "true"
    assert rows["head_grad_float32"]["skipped"].startswith("skipped in the dry run: on a CPU the head's backward")
    for name, why in campaign_levers.CPU_VALIDATE.items():  # checked and estimated, not trained
        r = rows[name]
        assert r["validated"] == campaign_ladder.VALIDATED and "delta_tokens_per_s" not in r, r
        assert r["skipped"] == f"skipped in the dry run: {why}" and r["estimate_bytes"] > 0
    assert set(campaign_levers.LADDER_RUNS) <= set(campaign_levers.CPU_VALIDATE)
    assert rows["half_batch"]["config"] == base["config"]
    assert base["steps_measured"] == campaign_ladder.STEPS[True][0] - 1 and math.isfinite(base["final_loss"])
    assert 0 <= base["data_wait_s"] < base["step_time_s"]
    assert base["tokens_per_s"] == pytest.approx(base["global_batch"] * 64 / base["step_time_s"], rel=1e-12)


def test_each_lever_rows_change_is_against_the_base(tmp_path):
    """Every measured lever row's change in tokens/s against the base of the same run; a row not
    measured has none. With made-up speeds (the dry run trains the base only)."""
    speeds = {"base": 100.0, "loss_chunks": 110.0, "half_batch": 80.0, "fp8": 125.0}
    runner = MadeUpRows(speeds)
    runner.settings = {"dry_run": False, "device": {"backend": "gpu"}}
    runner.work_dir = str(tmp_path)
    section = campaign_levers.measure(runner)
    rows = {r["name"]: r for r in section["rows"]}
    assert section["base"]["tokens_per_s"] == 100.0 and rows["half_batch"]["batch"] == 4
    for name, r in rows.items():
        assert r["delta_tokens_per_s"] == pytest.approx(speeds.get(name, 100.0) - 100.0), name
        assert r["delta_pct"] == pytest.approx(r["delta_tokens_per_s"]), name  # of a base of 100
    missing = MadeUpRows({})
    missing.settings, missing.work_dir = runner.settings, str(tmp_path)
    missing.row = lambda name, changes, **how: {"name": name, "config": dict(changes), "batch": 8,
                                                **({"tokens_per_s": 50.0} if name == "base" else {"error": "x"})}
    assert all("delta_tokens_per_s" not in r for r in campaign_levers.measure(missing)["rows"])


@pytest.mark.slow
@pytest.mark.xdist_group("gpu-campaign")
def test_dry_run_summary_has_exactly_the_claims_keys_read_off_its_rows(full):
    """Issue 36, item 7: the result's top-level summary, exactly its thirteen keys. On the CPU no
    row has an MFU and nothing runs cuDNN or saves 16 GB: those are None, not made up."""
    done, path = full[0], full[1]
    result = json.loads(path.read_text())
    summary, sections = result["summary"], result["sections"]
    assert list(summary) == ["device", "mfu_best", "tokens_per_s_best", "batch_best", "peer_same_work_tokens_per_s",
                             "ratio_vs_peer_same_work", "ratio_vs_peer_dense", "peak_bytes_ours", "peak_bytes_predicted",
                             "peak_bytes_peer", "attention_worst_ratio_vs_cudnn", "checkpoint_block_fraction_16gb",
                             "device_to_host_gb_per_s"]
    assert summary["device"] == result["device"] == "cpu"
    levers = sections["levers"]
    rows = [*sections["mfu_ladder"]["rows"], levers["base"], *levers["rows"]]
    fastest = max((r for r in rows if "tokens_per_s" in r and r["config"]["model.window"] == campaign_ladder.WINDOW[True]),
                  key=lambda r: r["tokens_per_s"])
    assert summary["mfu_best"] is None and summary["tokens_per_s_best"] == fastest["tokens_per_s"]
    assert summary["batch_best"] == fastest["batch"] * fastest["microbatches"]
    assert summary["attention_worst_ratio_vs_cudnn"] is None and summary["checkpoint_block_fraction_16gb"] is None
    largest = sections["checkpoints"]["background_sizes"][-1]
    copy_s = largest["saves"][0]["background_parts_s"]["device_to_host"]
    assert summary["device_to_host_gb_per_s"] == pytest.approx(largest["state_gb"] / copy_s)
    assert "summary (issue 36's claims)" in done.stdout


def test_claims_are_read_off_the_sections_rows():
    """Each key from hand-made rows: the best MFU row; the peer's sliding-window row against our
    fastest row of the same window, AdamW, one microbatch and batch (not the faster LAMB row, nor
    the dense one); the dense ratio at window=null; cuDNN over the faster of our kernels, worst
    (seq, window); the 16 GB background save; the largest background save's copy rate."""
    row = lambda name, window, optim, batch, micro, tps, mfu, peak: {
        "name": name, "config": {"model.window": window, "optim.name": optim}, "batch": batch,
        "microbatches": micro, "tokens_per_s": tps, "mfu": mfu, "peak_bytes_in_use": peak}
    ladder = {"status": "ok", "window": 512, "rows": [
        row("parallel_block", "null", "adamw", 8, 1, 40000.0, 0.40, 50e9),
        row("sliding_window", 512, "adamw", 8, 1, 42000.0, 0.38, 48e9),
        row("fused_attention", 512, "adamw", 8, 1, 60000.0, 0.52, 30e9),
        row("remat", 512, "adamw", 16, 1, 61000.0, 0.53, 40e9),
        row("lamb_4x_batch", 512, "lamb", 8, 4, 65000.0, 0.57, 31e9),
        row("dense_twin", "null", "lamb", 8, 4, 62000.0, 0.60, 31e9),  # a check, not the claim
        {"name": "does_not_fit", "config": {}, "error": "does not fit"}]}
    peer = {"status": "ok", "rows": [
        {"row": "serial_dense_adamw", "batch": 8, "tokens_per_s": 30000.0, "peak_bytes_in_use": 36e9},
        {"row": "parallel_block", "batch": 8, "tokens_per_s": 32000.0, "peak_bytes_in_use": 37e9},
        {"row": "sliding_window", "batch": 8, "tokens_per_s": 40000.0, "peak_bytes_in_use": 35e9}]}
    kernels = {"status": "ok", "attention": [
        {"contender": "cudnn_window", "seq": 2048, "window": 512, "ms": 1.0},
        {"contender": "pallas_window", "seq": 2048, "window": 512, "ms": 1.25},
        {"contender": "tokamax_window", "seq": 2048, "window": 512, "ms": 1.1},
        {"contender": "cudnn_window", "seq": 8192, "window": 4096, "ms": 4.0},
        {"contender": "pallas_window", "seq": 8192, "window": 4096, "ms": 5.0},
        {"contender": "tokamax_window", "seq": 8192, "window": 4096, "skipped": "skipped: not importable"},
        {"contender": "cudnn_window", "seq": 32768, "window": 4096, "error": "out of memory"}]}
    save = lambda gb, fraction, copies: {"state_gb": gb, "total_s": 10.0, "block_fraction": fraction,
                                          "saves": [{"background_parts_s": {"device_to_host": c, "orbax_save": 5.0}}
                                                    for c in copies]}
    checkpoints = {"status": "ok", "background_sizes": [save(1.0, 0.2, [0.1]), save(16.0, 0.04, [0.9, 0.8, 1.0])]}
    out = campaign_claims.summary("NVIDIA H100 80GB HBM3", {
        "mfu_ladder": ladder, "torch_peer": peer, "kernels": kernels, "checkpoints": checkpoints,
        "profiled_steps": {"status": "error", "reason": "x"}})
    assert out == {"device": "NVIDIA H100 80GB HBM3", "mfu_best": 0.57, "tokens_per_s_best": 65000.0, "batch_best": 32,
                   "peer_same_work_tokens_per_s": 40000.0, "ratio_vs_peer_same_work": 1.5,
                   "ratio_vs_peer_dense": 1.25, "peak_bytes_ours": 30e9, "peak_bytes_predicted": None,
                   "peak_bytes_peer": 35e9,
                   "attention_worst_ratio_vs_cudnn": 0.8, "checkpoint_block_fraction_16gb": 0.04,
                   "device_to_host_gb_per_s": 16.0 / 0.9}
    # a failed section's numbers are None, never borrowed from elsewhere
    failed = campaign_claims.summary("x", {"mfu_ladder": {"status": "error", "reason": "y"}})
    assert failed == {"device": "x", **dict.fromkeys(campaign_claims.KEYS[1:])}



def test_a_levers_only_campaign_claims_its_same_work_row_and_its_predicted_peak():
    """A call that ran the levers and the peer but no ladder (2026-11-28): the same-work claim is the
    fastest lever row at the peer's window, AdamW and batch (the unrolled scan here, not the row at
    another batch), with the peak the compile without a GPU predicted for that row."""
    config = {"model.window": 512, "optim.name": "adamw"}
    lever = lambda name, batch, tps, mfu, peak, predicted: {
        "name": name, "config": config, "batch": batch, "microbatches": 1, "tokens_per_s": tps, "mfu": mfu,
        "peak_bytes_in_use": peak, "peak_bytes_predicted": predicted}
    levers = {"status": "ok", "config": config, "base": lever("base", 8, 60000.0, 0.50, 48e9, 47e9), "rows": [
        lever("scan_unroll", 8, 66000.0, 0.55, 45e9, 44e9), lever("remat_dots", 30, 70000.0, 0.58, 84e9, 83e9),
        {"name": "horizontal_fusion_off", "config": config, "batch": 8, "error": "exit code 1"}]}
    peer = {"status": "ok", "rows": [{"row": "sliding_window", "batch": 8, "tokens_per_s": 60000.0,
                                      "peak_bytes_in_use": 50e9}]}
    out = campaign_claims.summary("NVIDIA H200", {"levers": levers, "torch_peer": peer})
    assert (out["ratio_vs_peer_same_work"], out["peak_bytes_ours"], out["peak_bytes_predicted"]) == (1.1, 45e9, 44e9)
    assert (out["mfu_best"], out["batch_best"]) == (0.58, 30)  # the best MFU at the window, any batch

@pytest.mark.slow
@pytest.mark.xdist_group("gpu-campaign")
def test_dry_run_kernels_have_every_contender_with_finite_times(full):
    path = full[1]
    kernels = json.loads(path.read_text())["sections"]["kernels"]
    windows = kernels["settings"]["windows"]
    rows = kernels["attention"]
    for seq in kernels["settings"]["seqs"]:
        dense = [r for r in rows if r["seq"] == seq and r["contender"] == "xla_dense_causal"]
        assert len(dense) == 1 and dense[0]["window"] is None  # measured once per seq
        for window in windows:
            here = {r["contender"]: r for r in rows if r["seq"] == seq and r["window"] == window}
            assert {"xla_window", "pallas_window", "cudnn_window", "tokamax_window"} <= set(here)
            assert here["cudnn_window"]["skipped"] == "skipped: needs a GPU"
            assert one_line(here["tokamax_window"]["skipped"])
            assert "bench/campaign/gpu_wheels.sh" in here["triton_window"]["skipped"]  # jax-triton: a GPU extra
            for row in [*dense, *(here[c] for c in TIMED_CONTENDERS - {"xla_dense_causal"})]:
                assert math.isfinite(row["ms"]) and row["ms"] > 0 and row["tflops"] > 0, row
                assert row["rel_err"] < 2e-2, row  # bf16 inputs against the float32 reference
            pallas = here["pallas_window"]
            assert [t["blocks"] for t in pallas["tried"]] == [list(b) for b in kernels["settings"]["blocks"]]
            assert pallas["ms"] == min(t["ms"] for t in pallas["tried"])
            assert pallas["stages"] == 2 and {t["stages"] for t in pallas["tried"]} == {2}  # no depths: interpret
            assert pallas["forward_ms"] > 0  # the best tile's forward alone: the backward is ms - forward_ms
    assert {(r["kernel"], r["impl"]) for r in kernels["fused"]} == {
        (k, i) for k in ("layer_norm_residual", "bias_gelu") for i in ("pallas", "xla")}
    assert all(math.isfinite(r["ms"]) and r["ms"] > 0 for r in kernels["fused"])


@pytest.mark.slow
@pytest.mark.xdist_group("gpu-campaign")
def test_dry_run_checkpoints_profile_and_pngs(full):
    path = full[1]
    result = json.loads(path.read_text())
    sizes = result["sections"]["checkpoints"]["sizes"]
    assert len(sizes) == 2 and all(0 < s["block_s"] <= s["total_s"] and s["restore_s"] > 0 for s in sizes)
    background = result["sections"]["checkpoints"]["background_sizes"]
    assert [s["state_gb"] for s in background] == [s["state_gb"] for s in sizes]
    assert all(s["background_host_copy"] and s["device_copy_s"] >= 0 and "error" not in s for s in background)
    assert all(s["block_s"] == s["host_block_s"] + s["device_copy_s"] <= s["total_s"] for s in background)
    profiled = result["sections"]["profiled_steps"]
    assert profiled["profiled_steps"] == [2, 4, 6] and profiled["devices"] == [0]
    assert all(s > 0 for s in profiled["device_compute_s"][0]) and len(profiled["device_collective_s"][0]) == 3
    # where the time goes (issue 36, item 6): parts named by the model's scopes, the top ops
    parts = {p: t for p, t in profiled["by_part"].items() if p != "total"}
    assert parts["attention"] > 0 and parts["LM head/loss"] > 0 and parts["optimizer"] > 0
    assert sum(parts.values()) == pytest.approx(profiled["by_part"]["total"])
    assert len(profiled["top_ops"]) == 15 and profiled["op_table"]["config"]["model.block"] == "parallel"
    # the half batch's table is the same process again (on a GPU; its split is test_the_op_table_*'s)
    assert "by_part_half_batch" not in profiled and profiled["batch_split"] == campaign_profile.HALF_NOT_IN_DRY_RUN
    assert "per step" in full[0].stdout
    assert "where the step's device time goes" in full[0].stdout
    stem = str(path)[:-len(".json")]
    assert result["pngs"] == [f"{stem}_{name}.png" for name in ("kernels", "ladder", "checkpoints", "device_heatmap")]
    assert result["png_problems"] == []
    for png in result["pngs"]:
        with open(png, "rb") as f:
            assert f.read(8) == PNG_MAGIC, png


@pytest.mark.slow
@pytest.mark.xdist_group("gpu-campaign")
def test_dry_run_rates_time_every_gemm_on_the_device_and_the_planner_fits_them(full):
    """Each GEMM shape's device time from the trace (FLOPs over it is its TFLOP/s), the stream's
    bytes over its time, and measured.gemm_fit reading the section as a GPU run would write it."""
    from megascale_jax.planner import measured

    rates = json.loads(full[1].read_text())["sections"]["rates"]
    assert [(r["m"], r["k"], r["n"]) for r in rates["gemms"]] == [(32, 32, 32), (64, 64, 64), (128, 64, 32)]
    for r in rates["gemms"]:
        assert r["seconds"] > 0 and r["tflops"] == pytest.approx(2 * r["m"] * r["k"] * r["n"] / r["seconds"] / 1e12)
    assert all(r["seconds"] > 0 and r["tb_per_s"] == pytest.approx(2 * r["bytes"] / r["seconds"] / 1e12)
               for r in rates["stream"])
    assert rates["concurrency"] == {"skipped": "skipped: needs a GPU (PyTorch's CUDA streams)"}
    # the model's layer GEMMs in FP8: on the CPU no cuBLASLt, so every row says its time is bf16's
    assert [r["which"] for r in rates["fp8_gemms"]] == ["forward", "input gradient", "weight gradient"]
    assert [r["formats"] for r in rates["fp8_gemms"]][1] == ["float8_e5m2", "float8_e4m3fn"]
    assert all(r["seconds"] > 0 and r["fp8_gemm"] is False and "did not make this an FP8 GEMM" in r["note"]
               for r in rates["fp8_gemms"])
    fit = measured.gemm_fit(str(full[1]), "h200")
    assert len(fit["rows"]) == 3 and all(math.isfinite(r["fitted_us"]) for r in fit["rows"])
    assert "GEMMs, bf16, device time per call" in full[0].stdout


@pytest.mark.slow
@pytest.mark.xdist_group("gpu-campaign-partial")
def test_a_failing_section_records_one_line_and_the_others_still_run(partial):
    failed, result, *_ = partial
    assert failed.returncode == 1  # a section failed: after everything was written
    assert list(result["sections"]) == ["checkpoints", "rates"]  # --only: nothing else ran
    checkpoints, rates = result["sections"]["checkpoints"], result["sections"]["rates"]
    assert checkpoints["status"] == "error" and one_line(checkpoints["reason"])
    assert "InjectedFailure: checkpoints failed on purpose" in checkpoints["reason"]
    assert rates["status"] == "ok" and len(rates["gemms"]) == 3  # the next section still ran
    assert "sections that failed: checkpoints" in failed.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("gpu-campaign-partial")
def test_dry_run_without_out_writes_into_a_new_temporary_directory(partial):
    failed, path, tmpdir = partial[0], partial[5], partial[6]
    assert path.parent.parent == tmpdir and path.parent.name.startswith("gpu-campaign-dry-run-")
    assert path.name.startswith("gpu_cpu_")
    assert failed.stdout.splitlines()[-1] == f"wrote {path}; sections that failed: checkpoints"
    assert os.listdir(tmpdir) == [path.parent.name]  # nothing else left in its TMPDIR


@pytest.mark.slow
@pytest.mark.xdist_group("gpu-campaign-partial")
def test_only_reruns_one_section_into_an_existing_result(partial):
    _, before, refused, unchanged, rerun, path, _ = partial
    assert refused.returncode == 2 and unchanged  # an existing result needs --overwrite
    assert refused.stderr.strip().splitlines() == [
        f"{os.path.relpath(path)} exists; pass --overwrite to replace it, or --out PATH to write elsewhere"]
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert [line for line in rerun.stdout.splitlines() if line.startswith("== ")] == [
        "== probe (limit 300 s)", "== rates (limit 300 s)"]
    after = json.loads(path.read_text())
    assert list(after["sections"]) == ["checkpoints", "rates"]
    assert after["sections"]["rates"]["status"] == "ok" and after["sections"]["rates"]["gemms"]
    assert after["sections"]["rates"]["finished"] >= before["sections"]["rates"]["finished"]
    assert "--overwrite" in after["sections"]["rates"]["command"]  # replaced by the rerun
    assert after["sections"]["checkpoints"] == before["sections"]["checkpoints"]  # kept as it was


@pytest.mark.slow
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Refused before anything runs (in this process: no section is started), and as a user runs
    it: no GPU here and no --dry-run, found by the probe's process."""
    from bench.campaign import __main__ as campaign_main

    monkeypatch.setattr(campaign_main, "run_piece", lambda *a, **k: pytest.fail("ran a piece"))
    for name in ("JAX_PLATFORMS", "XLA_FLAGS"):  # --dry-run sets them for its sections
        monkeypatch.setenv(name, os.environ.get(name, ""))
    for args, message in [
        (["--only", "kernels,nosuch"], "error: unknown section 'nosuch'; sections are " + ", ".join(SECTIONS)),
        (["--dry-run", "--out", os.path.join(RESULTS, "x.json")],
         "error: --dry-run measures nothing worth keeping; pass an --out outside bench/results/"),
        (["--tiny", "--out", os.path.join(RESULTS, "x.json")],
         "error: --tiny measures nothing worth keeping; pass an --out outside bench/results/"),
        (["--dry-run", "--batch", "0"], "error: --batch must be at least 1, got 0"),
        (["--dry-run", "--budget-s", "0"], "error: --budget-s must be positive, got 0"),
    ]:
        assert campaign_main.main(args) == 2, args
        assert capsys.readouterr().err.strip().splitlines() == [message]
    done = campaign("--out", str(tmp_path / "x.json"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: python -m bench.campaign needs a GPU (JAX backend is 'cpu'); run it on a GPU machine, "
        "or pass --dry-run to exercise every section at tiny shapes on the CPU"]
    assert not os.path.exists(os.path.join(RESULTS, "x.json")) and not os.listdir(tmp_path)


def test_a_missing_wheel_is_one_line_naming_the_script_before_anything_runs(monkeypatch, capsys, tmp_path):
    from bench.campaign import __main__ as campaign_main

    assert campaign_main.missing_wheels() == []  # the dev install has every one
    monkeypatch.setattr(campaign_main, "NEEDED_WHEELS", ("grain", "no_such_module_here", "redis"))
    monkeypatch.setattr(campaign_main, "run_piece", lambda *a, **k: pytest.fail("ran a section"))
    assert campaign_main.main(["--out", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: no_such_module_here not installed here: run `bash bench/campaign/gpu_wheels.sh` on a machine with "
        "network and install its wheels here (docs/gpu.md, 'On a lent GPU')"]
    assert not os.listdir(tmp_path)


def test_batch_is_the_largest_whose_estimate_fits():
    overrides = campaign_ladder.row_overrides(False, campaign_ladder.BASELINE)  # the 1.4B model, XLA attention
    estimate = lambda batch: campaign_model.estimate_bytes([*overrides, f"train.global_batch={batch}"])
    limit = (estimate(3) + estimate(4)) / 2 / campaign_model.HEADROOM  # between 3 and 4 sequences
    assert campaign_model.pick_batch(overrides, limit, dry_run=False) == (3, estimate(3))
    assert campaign_model.pick_batch(overrides, None, dry_run=False)[0] == campaign_model.MAX_BATCH[False]
    assert campaign_model.pick_batch(overrides, estimate(1) / 2, dry_run=False) == (None, estimate(1))


def test_a_row_that_cannot_fit_is_recorded_without_starting_it(tmp_path):
    settings = {"dry_run": False, "device": {"backend": "gpu", "memory_limit_bytes": 2 ** 30}}
    row = campaign_ladder.Ladder(settings, str(tmp_path)).row("serial_dense_adamw", campaign_ladder.BASELINE)
    needed = campaign_model.estimate_bytes(campaign_ladder.row_overrides(False, campaign_ladder.BASELINE)
                                           + ["train.global_batch=1"])
    assert row["batch"] is None and row["estimate_bytes"] == needed
    assert row["error"] == (f"does not fit: estimate {campaign_model.flops.format_bytes(needed)} > limit 921.6 MiB "
                            "(90% of 1.0 GiB)")
    assert not os.listdir(tmp_path)  # never started: no row result was written


def test_a_row_is_not_started_past_its_sections_deadline_and_is_logged(tmp_path):
    """Under --budget-s a row that could not finish is a "not started" row, never a killed one,
    and every row (run or not) lands in the section's progress file as it is decided."""
    progress = tmp_path / "rows.jsonl"
    settings = {"dry_run": True, "device": {"backend": "cpu", "memory_limit_bytes": None},
                "deadline": time.time() + campaign_ladder.MIN_ROW_S / 2, "progress_file": str(progress)}
    row = campaign_ladder.Ladder(settings, str(tmp_path / "rows")).row("parallel_block", campaign_ladder.BASELINE)
    assert "tokens_per_s" not in row and row["skipped"].startswith("skipped: not started, ")
    assert f"a row needs {campaign_ladder.MIN_ROW_S}" in row["skipped"]
    assert not (tmp_path / "rows").exists()  # never started
    assert [json.loads(line) for line in progress.read_text().splitlines()] == [row]


def test_a_failed_section_keeps_the_rows_it_finished(tmp_path):
    """A section that dies (here on purpose; on a GPU, its time limit) still reports the rows it
    had appended to its progress file; a last line cut off by the kill is left out."""
    from bench.campaign import __main__ as campaign_main

    rows = [{"name": "serial_dense_adamw", "tokens_per_s": 1.0}, {"name": "parallel_block", "tokens_per_s": 2.0}]
    (tmp_path / "levers.rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"name": "sli')
    settings = {"dry_run": True, "fail_sections": ["levers"]}
    record = campaign_main.run_piece("levers", settings, str(tmp_path), limit_s=120)
    assert record["status"] == "error" and "InjectedFailure" in record["reason"]
    assert record["rows_done"] == rows


@pytest.mark.xdist_group("gpu-campaign-partial")
def test_a_section_the_budget_cannot_fit_is_skipped_with_why(tmp_path):
    path = tmp_path / "result.json"
    done = campaign("--dry-run", "--only", "checkpoints", "--budget-s", "1", "--out", str(path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = json.loads(path.read_text())["sections"]["checkpoints"]
    assert section["status"] == "skipped"
    assert section["reason"] == "not started: 0 s of --budget-s left (a section needs 30)"
    assert done.stdout.splitlines()[-1] == f"wrote {path}; not started (--budget-s): checkpoints"


def test_an_error_whose_first_line_is_a_header_keeps_its_cause():
    """Triton's CompilationError starts "at 21:12:", then source, then the cause: the campaign's
    one line must name the cause (the H200 run recorded only "CompilationError: at 21:12:")."""
    from bench.campaign import process as campaign_process

    class CompilationError(Exception):
        pass

    triton = CompilationError("at 21:12:\n    acc = tl.dot(q, k)\n            ^\nValueError('shape mismatch: 64 vs 128')")
    assert campaign_process.one_line(triton) == \
        "CompilationError: at 21:12: ... ValueError('shape mismatch: 64 vs 128')"
    assert campaign_process.one_line(RuntimeError("out of memory\ndetails")) == "RuntimeError: out of memory"
    assert campaign_process.one_line(KeyError()) == "KeyError"


def test_merge_makes_one_result_of_several_calls_files(tmp_path):
    """A lent GPU keeps nothing between calls: each call's file comes back on its own, and
    `bench.campaign.merge` makes them one result whose summary is the whole campaign's. Split the
    committed H200 result into two calls' files: merged, its sections and summary are the file's."""
    from bench.campaign import merge

    committed = json.loads((Path(RESULTS) / "gpu_nvidia_h200_2026-11-27.json").read_text())
    header = {k: v for k, v in committed.items() if k not in ("sections", "summary", "calls", "pngs")}
    first = {**header, "command": "call 1", "sections": {k: committed["sections"][k] for k in ("mfu_ladder", "torch_peer")}}
    second = {**header, "command": "call 2",
              "sections": {k: committed["sections"][k] for k in ("checkpoints", "profiled_steps")}}
    stale = {**header, "command": "call 0", "sections": {"checkpoints": {"status": "error", "reason": "killed"}}}
    paths = []
    for name, result in (("call0", stale), ("call1", first), ("call2", second)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(result))
    out = tmp_path / "merged.json"
    assert merge.main([*map(str, paths), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert list(merged["sections"]) == ["mfu_ladder", "torch_peer", "checkpoints", "profiled_steps"]
    assert merged["sections"]["checkpoints"] == committed["sections"]["checkpoints"]  # the later call's
    assert merged["summary"] == committed["summary"]
    assert [c["command"] for c in merged["calls"]] == ["call 0", "call 1", "call 2"]
    assert {os.path.basename(p) for p in merged["pngs"]} == {"merged_ladder.png", "merged_checkpoints.png"}
    assert all(os.path.getsize(p) > 0 for p in merged["pngs"])

    # bad input: another device's file, or a dry run's, is one line and nothing is written
    (tmp_path / "other.json").write_text(json.dumps({**first, "device": "NVIDIA H100 80GB HBM3"}))
    (tmp_path / "dry.json").write_text(json.dumps({**first, "dry_run": True}))
    for bad, words in (("other.json", "different devices"), ("dry.json", "--dry-run")):
        done = subprocess.run([sys.executable, "-m", "bench.campaign.merge", str(paths[1]), str(tmp_path / bad),
                               "--out", str(tmp_path / "x.json")], capture_output=True, text=True, cwd=REPO)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and words in done.stderr, done.stderr
        assert not (tmp_path / "x.json").exists()


def test_with_a_batch_the_ladder_runs_a_dense_row_at_the_peers_batch():
    """--batch 8 and a best row at 19 sequences (remat): the dense twin runs at 19, so a second
    dense row runs the fastest AdamW row at 8 with window=null, and the summary's dense ratio has
    a row of ours at the dense peers' batch (on 2026-11-27 it was n/a for want of one)."""
    calls = []

    class Runner:
        settings = {"batch": 8}

        def row(self, name, changes, batch=None, xla_flags=(), **how):
            calls.append((name, dict(changes), batch, xla_flags))
            return {"name": name, "config": dict(changes), "batch": batch, "microbatches": 1,
                    "xla_flags": list(xla_flags), "tokens_per_s": 50.0, "mfu": 0.4}

    def row(name, batch, tokens_per_s, window=512, optim="adamw", microbatches=1):
        return {"name": name, "config": {"model.window": window, "optim.name": optim, "model.attention": "cudnn"},
                "batch": batch, "microbatches": microbatches, "xla_flags": [], "tokens_per_s": tokens_per_s, "mfu": 0.4}

    rows = [row("fused_attention", 8, 51.0), row("fused_norm_gelu", 15, 53.0), row("xla_flags", 8, 47.0),
            row("lamb_4x_batch", 8, 60.0, optim="lamb", microbatches=4), row("dense_twin", 19, 54.0, window="null")]
    extra = campaign_ladder.dense_at_batch(Runner(), rows)
    assert calls == [("dense_at_peer_batch", {"model.window": "null", "optim.name": "adamw", "model.attention": "cudnn"},
                      8, ())]
    assert extra["twin_of"] == "fused_attention"
    peers = {"status": "ok", "rows": [{"row": "parallel_block", "batch": 8, "tokens_per_s": 40.0},
                                      {"row": "sliding_window", "batch": 8, "tokens_per_s": 60.0}]}
    summary = campaign_claims.summary("gpu", {"mfu_ladder": {"status": "ok", "window": 512, "rows": [*rows, extra]},
                                              "torch_peer": peers})
    assert summary["ratio_vs_peer_dense"] == 50.0 / 40.0 and summary["ratio_vs_peer_same_work"] == 51.0 / 60.0
    # without --batch, or with the twin already at the batch, no second row
    assert campaign_ladder.dense_at_batch(type("R", (), {"settings": {}})(), rows) is None
    assert campaign_ladder.dense_at_batch(Runner(), [*rows[:-1], row("dense_twin", 8, 54.0, window="null")]) is None


def test_the_ladder_table_sets_each_peers_loss_beside_our_row_doing_its_work(capsys):
    """On 2026-11-27 our rows of the peers' names did not fit at 8 sequences: the window peer's
    loss is set beside our fastest row doing its work (window 512, 8 sequences), read off the
    committed result; a peer with no such row of ours says so."""
    from bench.campaign import summary

    result = json.loads((Path(RESULTS) / "gpu_nvidia_h200_2026-11-27.json").read_text())
    summary.ladder(result["sections"]["mfu_ladder"], result["sections"]["torch_peer"])
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("PyTorch peer on the same token rows"))
    ours = next(r for r in result["sections"]["mfu_ladder"]["rows"] if r["name"] == "fused_attention")
    assert f"sliding_window (gpt_neox, flex_attention): loss after 6 steps 6.9245, ours (fused_attention) " \
           f"{ours['final_loss']:.4f}" in line
    assert "parallel_block (gpt_neox, sdpa): loss after 6 steps 6.9311, ours (no row) n/a" in line


def test_on_a_gpu_the_pallas_kernels_fastest_tile_is_tried_at_each_pipelining_depth(monkeypatch):
    """The H200 ran the Pallas attention at Triton's num_stages=2 only; on a GPU the kernel bench
    now tries the fastest tile at 3 and 4 too and keeps the fastest try (times faked here)."""
    from bench.campaign import kernels

    times = {((128, 64), 2): 1.0, ((128, 128), 2): 1.2, ((128, 64), 3): 0.8, ((128, 64), 4): 0.9}

    def timed(row, fn, qkv, shape, reference):
        return {**row, "ms": times[(tuple(row["blocks"]), row["stages"])], "tflops": 1.0}

    monkeypatch.setattr(kernels, "timed", timed)
    shape = {"blocks": ((128, 64), (128, 128))}
    row = kernels.tuned_pallas(8192, 4096, None, shape, None, on_gpu=True)
    assert [(t["blocks"], t["stages"]) for t in row["tried"]] == [
        ([128, 64], 2), ([128, 128], 2), ([128, 64], 3), ([128, 64], 4)]
    assert (row["blocks"], row["stages"], row["ms"]) == ([128, 64], 3, 0.8)
    assert [t["stages"] for t in kernels.tuned_pallas(8192, 4096, None, shape, None)["tried"]] == [2, 2]


def test_batch_split_puts_each_parts_line_through_its_two_batches():
    """t(b) = per_step + b · per_sequence through the op table's seconds at two batches; a part
    only one table holds counts 0 s at the other."""
    from bench.campaign.profile import batch_split

    split = batch_split({"optimizer": 0.0105, "MLP": 0.0218}, 4, {"optimizer": 0.0105, "MLP": 0.0436, "other": 0.002}, 8)
    assert split["optimizer"] == {"per_sequence_s": pytest.approx(0.0), "per_step_s": pytest.approx(0.0105)}
    assert split["MLP"]["per_sequence_s"] == pytest.approx(0.00545) and split["MLP"]["per_step_s"] == pytest.approx(0.0)
    assert split["other"]["per_sequence_s"] == pytest.approx(0.0005) and split["other"]["per_step_s"] == pytest.approx(-0.002)


def test_hidden_share_is_what_running_both_at_once_saved_of_the_shorter():
    from bench.campaign.rates import hidden_share

    assert hidden_share(2.0, 1.0, 3.0) == 0.0  # as if one after the other
    assert hidden_share(2.0, 1.0, 2.0) == 1.0  # the softmax hidden whole behind the GEMM
    assert hidden_share(1.0, 3.0, 3.5) == pytest.approx(0.5)


def test_the_concurrency_row_runs_in_a_process_of_its_own_and_a_failure_there_is_one_line():
    """PyTorch's CUDA streams are measured away from JAX's process: here (no CUDA) that process
    fails, and the row is its one line, not the section's end."""
    from bench.campaign import rates

    row = rates.concurrency_in_process(True)
    assert set(row) == {"error"} and row["error"].startswith("exit code 1: ")  # no CUDA device here
    assert "\n" not in row["error"]
    assert "ModuleNotFoundError" not in row["error"]  # it got as far as PyTorch's CUDA
    assert rates.concurrency_in_process(False) == {"skipped": "skipped: needs a GPU (PyTorch's CUDA streams)"}


def test_the_concurrency_process_writes_its_row_and_refuses_bad_arguments(monkeypatch, tmp_path, capsys):
    """`python -m bench.campaign.rates --concurrency OUT`, the child side: the row as JSON in OUT;
    anything else is a usage line and exit 2."""
    from bench.campaign import rates

    row = {"gemm_s": 0.002, "softmax_s": 0.001, "both_s": 0.0025, "hidden_share": 0.5}
    monkeypatch.setattr(rates, "concurrency_row", lambda on_gpu: row if on_gpu else {})
    out = tmp_path / "concurrency.json"
    assert rates.main(["--concurrency", str(out)]) == 0 and json.loads(out.read_text()) == row
    assert rates.main(["--concurrency"]) == 2 and "usage:" in capsys.readouterr().err
