"""The training CLI end to end, as a user runs it: `python -m megascale_jax.train ...` in a fresh process.

* Every config/data mistake ends with exit 2 and exactly one `error: ...` line on stderr naming the
  key or file (closest-key suggestion for typos), no traceback, before anything is compiled, and
  leaves no metrics.jsonl behind.
* A 5-step smoke run writes a schema-valid metrics.jsonl and the resolved config.yaml; a second
  run into the same --run-dir is refused without touching what is there.
* A diverging run stops with exit 3 and one line naming the step; the finite steps stay recorded.

Mistakes are checked through `train.main` in-process, and a few through the real command line\n(a fresh process imports JAX in ~2-4 s); the long runs go two at a time in a thread pool.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from megascale_jax.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
# Lines a JAX/XLA/absl logger may print on its own (glog/absl prefix, e.g. "W0101 12:00:00.000 ...");
# they are not the program's message. None are expected; anything else counts as output.
_LOGGER_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")


def run_cli(run_dir: Path, overrides: list[str], config: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megascale_jax.train", "--run-dir", str(run_dir)]
    if config is not None:
        cmd += ["--config", config]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(cmd + overrides, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def message_lines(stderr: str) -> list[str]:
    """Non-empty stderr lines that are not third-party logger chatter."""
    return [line for line in stderr.splitlines() if line.strip() and not _LOGGER_LINE.match(line)]


def strict_json(line: str) -> dict:
    """json.loads that rejects NaN/Infinity, which are not JSON."""
    def reject(token):
        raise ValueError(f"non-standard JSON constant {token} in {line!r}")
    return json.loads(line, parse_constant=reject)


# ============================================================================ validation errors


# (id, overrides, --config or None, substrings the one error line must contain). Paths under
# "{tmp}" are filled in with the fixture's directory, where the data files below are written.
ERROR_CASES = [
    # unknown keys / sections, with the closest suggestion
    ("unknown-key", ["model.layer=2"], None, ["model.layer", "did you mean model.layers"]),
    ("unknown-key-no-match", ["model.zzzzzz=1"], None, ["model.zzzzzz", "valid keys", "layers"]),
    ("unknown-section", ["modle.layers=2"], None, ["modle", "did you mean model"]),
    ("malformed-override", ["mesh.dp"], None, ["mesh.dp", "section.key=value"]),
    ("override-without-section", ["dp=2"], None, ["dp=2", "section.key=value"]),
    # wrong types and enums
    ("wrong-type-int", ["model.layers=abc"], None, ["model.layers", "integer", "abc"]),
    ("wrong-type-bool", ["parallel.zero1=maybe"], None, ["parallel.zero1", "true or false"]),
    ("wrong-type-number", ["optim.lr=fast"], None, ["optim.lr", "number"]),
    ("bad-enum", ["model.block=foo"], None, ["model.block", "foo", "parallel", "serial"]),
    # mesh and divisibility
    ("mesh-product-vs-devices", ["mesh.dp=2", "mesh.cpu_devices=8"], None,
     ["dp*pp*tp=2*1*2=4", "mesh.cpu_devices=8", "leave mesh.cpu_devices unset"]),
    ("does-not-fit-in-memory", ["model.seq_len=100000", "model.window=null"], None,
     ["estimated memory", "TiB", "activations", "available RAM", "train.memory_check=false"]),
    ("heads-vs-tp", ["model.heads=6", "model.d_model=96", "mesh.tp=4", "mesh.dp=2"], None,
     ["model.heads=6", "mesh.tp=4"]),
    ("kv-heads-vs-tp", ["model.heads=6", "model.kv_heads=3", "model.d_model=96"], None,
     ["model.kv_heads=3", "mesh.tp=2", "divide one another"]),
    ("layers-vs-pp", ["model.layers=3", "mesh.pp=2", "mesh.dp=2"], None, ["model.layers=3", "mesh.pp"]),
    ("stall-steps-not-a-multiple", ["supervisor.stall_steps=1"], None, ["supervisor.stall_steps=1.0", "> 1"]),
    ("layers-vs-pp-virtual", ["mesh.pp=2", "mesh.dp=2", "parallel.pp_schedule=interleaved_1f1b",
                              "parallel.pp_virtual=4", "parallel.microbatches=2"], None, ["model.layers=4", "pp_virtual"]),
    ("1f1b-too-few-microbatches", ["mesh.pp=2", "mesh.dp=2", "parallel.microbatches=1"], None,
     ["parallel.microbatches=1", "mesh.pp=2", "1f1b"]),
    ("interleaved-microbatches-multiple", ["mesh.pp=2", "mesh.dp=2", "parallel.pp_schedule=interleaved_1f1b",
                                           "parallel.pp_virtual=2", "parallel.microbatches=3",
                                           "train.global_batch=12"], None, ["parallel.microbatches=3", "multiple"]),
    ("virtual-needs-interleaved", ["mesh.pp=2", "mesh.dp=2", "parallel.pp_virtual=2", "parallel.microbatches=2"],
     None, ["pp_virtual=2", "interleaved_1f1b"]),
    ("global-batch-vs-dp-microbatches", ["train.global_batch=12", "parallel.microbatches=2"], None,
     ["train.global_batch=12", "mesh.dp", "parallel.microbatches"]),
    # model sizes
    ("window-zero", ["model.window=0"], None, ["model.window=0", ">= 1"]),
    ("seq-len-zero", ["model.seq_len=0"], None, ["model.seq_len=0"]),
    ("vocab-zero", ["model.vocab=0"], None, ["model.vocab=0"]),
    # tensor-parallel overlap and fused kernels
    ("sp-seq-not-divisible", ["parallel.sequence_parallel=true", "model.seq_len=127"], None,
     ["model.seq_len=127", "mesh.tp=2"]),
    ("collective-matmul-needs-sp", ["parallel.tp_overlap=collective_matmul"], None, ["sequence_parallel=true"]),
    ("collective-matmul-chunks", ["parallel.sequence_parallel=true", "parallel.tp_overlap=collective_matmul",
                                  "model.seq_len=126"], None, ["63", "tp_chunks=2"]),
    ("collective-matmul-odd-chunks", ["parallel.sequence_parallel=true", "parallel.tp_overlap=collective_matmul",
                                      "parallel.tp_chunks=3"], None, ["tp_chunks=3", "even"]),
    ("evict-stragglers-needs-timings", ["supervisor.evict_stragglers=true", "observe.timings=false"], None,
     ["supervisor.evict_stragglers=true", "observe.timings=true"]),
    ("fused-norm-rmsnorm", ["model.fused_norm=true", "model.norm=rmsnorm"], None, ["model.fused_norm", "layernorm"]),
    # features this build / platform cannot run
    ("cudnn-on-cpu", ["model.attention=cudnn"], None, ["model.attention=cudnn", "xla"]),
    # config files
    ("val-fraction-zero-with-validation", ["data.val_fraction=0"], None, ["data.val_fraction=0", "train.eval_batches=0"]),
    ("missing-config-file", [], "{tmp}/nope.yaml", ["nope.yaml", "--config"]),
    ("invalid-yaml-config", [], "{tmp}/broken.yaml", ["broken.yaml", "YAML", "line 2, column 1"]),
    ("non-mapping-config", [], "{tmp}/list.yaml", ["list.yaml", "mapping"]),
    # data
    ("files-glob-matches-nothing", ["data.source=files", "data.path={tmp}/nothing/*.txt"], None,
     ["data.path", "matches no files"]),
    ("files-all-empty", ["data.source=files", "data.path={tmp}/empty_texts/*.txt"], None,
     ["data.path", "empty"]),
    ("tokens-without-path", ["data.source=tokens"], None, ["data.path"]),
    ("tokens-missing-file", ["data.source=tokens", "data.path={tmp}/missing.bin"], None,
     ["data.path", "missing.bin"]),
    ("tokens-empty-file", ["data.source=tokens", "data.path={tmp}/empty.bin"], None,
     ["data.path", "empty.bin", "empty"]),
    ("tokens-odd-size", ["data.source=tokens", "data.path={tmp}/odd.bin"], None,
     ["odd.bin", "data.token_dtype"]),
    ("tokens-out-of-vocab", ["data.source=tokens", "data.path={tmp}/big_token.bin"], None,
     ["big_token.bin", "300", "model.vocab=256"]),
    ("tokens-too-few", ["data.source=tokens", "data.path={tmp}/few.bin"], None,
     ["model.seq_len", "train.global_batch"]),
]


def _write_inputs(tmp: Path) -> None:
    (tmp / "broken.yaml").write_text("mesh: [dp: 2\n")
    (tmp / "list.yaml").write_text("- mesh\n- model\n")
    (tmp / "empty_texts").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp / "empty_texts" / name).write_bytes(b"")
    (tmp / "empty.bin").write_bytes(b"")
    (tmp / "odd.bin").write_bytes(b"\x01\x00\x02")
    tokens = np.random.default_rng(0).integers(0, 256, size=20_000, dtype=np.uint16)
    tokens[12_345] = 300  # >= the default model.vocab=256
    tokens.tofile(tmp / "big_token.bin")
    np.arange(100, dtype=np.uint16).tofile(tmp / "few.bin")  # far less than one global batch


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli_inputs")
    _write_inputs(tmp)
    return tmp


def case_args(case, tmp: Path) -> tuple[list[str], str | None]:
    _, overrides, config, _ = case
    return [o.replace("{tmp}", str(tmp)) for o in overrides], (config.replace("{tmp}", str(tmp)) if config else None)


def assert_one_error_line(returncode: int, stdout: str, stderr: str, expected: list[str], run_dir: Path):
    assert "Traceback" not in stderr, stderr
    lines = message_lines(stderr)
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{stderr}"
    line = lines[0]
    assert line.startswith("error: "), line
    for part in expected:
        assert part in line, f"{part!r} missing from {line!r}"
    assert not re.search(r"=(\d+)=\1\b", line), f"a value printed twice: {line!r}"
    assert returncode == 2, (returncode, stderr)
    assert "compiled in" not in stdout, "the error must come before compilation"
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_user_mistake_is_one_line_and_exit_2_before_compiling(inputs, case, tmp_path, capsys, monkeypatch):
    """`train.main` in this process (a fresh process per case would cost ~4 s of JAX import each;
    the test below runs a few through the real command line)."""
    from megascale_jax import train

    jax.devices()  # the backend is up with the suite's 8 CPU devices before main() looks
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() may add flags; undone after

    def no_training(*args, **kwargs):
        raise AssertionError("the mistake was not caught before training started")

    monkeypatch.setattr(train, "train", no_training)
    overrides, config = case_args(case, inputs)
    argv = ["--run-dir", str(tmp_path / "run")] + (["--config", config] if config else []) + overrides
    returncode = train.main(argv)
    out = capsys.readouterr()
    assert_one_error_line(returncode, out.out, out.err, case[3], tmp_path / "run")


def test_options_and_overrides_mix_in_any_order(tmp_path, monkeypatch):
    """`train.steps=10 --run-dir D mesh.dp=8`: overrides after an option are overrides, in every CLI."""
    from megascale_jax.model import flops
    from megascale_jax.supervise import launch
    from megascale_jax import train

    jax.devices()
    seen = {}

    def capture(cfg, run_dir, *args, **kwargs):
        seen.update(cfg=cfg, run_dir=run_dir)

    monkeypatch.setattr(train, "train", capture)
    assert train.main(["model.layers=1", "--run-dir", str(tmp_path / "run"), "mesh.dp=8", "mesh.tp=1"]) == 0
    assert (seen["cfg"].model.layers, seen["cfg"].mesh.dp, seen["cfg"].mesh.tp) == (1, 8, 1)
    assert seen["run_dir"] == str(tmp_path / "run")
    args = launch.parse_args(["mesh.dp=2", "--nprocs", "2", "train.steps=3", "--run-dir", "r", "mesh.tp=1"])
    assert (args.nprocs, args.run_dir, args.overrides) == (2, "r", ["mesh.dp=2", "train.steps=3", "mesh.tp=1"])
    assert flops.main(["mesh.dp=8", "--config", str(REPO / "configs" / "gpt_175b.yaml"), "mesh.pp=8", "mesh.tp=8"]) == 0


def test_cpu_devices_follow_the_mesh_unless_given():
    from megascale_jax.config import check_runtime

    cfg = load_config(None, ["mesh.dp=2", "mesh.tp=2"])
    assert cfg.mesh.cpu_devices is None and cfg.mesh.cpu_devices_per_process() == 4
    check_runtime(cfg, "cpu", 4)  # no error: the simulated devices are the mesh's
    assert load_config(None, ["mesh.dp=4", "mesh.tp=2"]).mesh.cpu_devices_per_process(2) == 4  # per process
    with pytest.raises(ConfigError, match="mesh.cpu_devices=8"):
        check_runtime(load_config(None, ["mesh.dp=2", "mesh.tp=2", "mesh.cpu_devices=8"]), "cpu", 8)


def test_memory_check_refuses_only_what_cannot_fit():
    from megascale_jax.model import flops

    cfg = load_config(None, ["model.seq_len=4096"])
    total = flops.memory_estimate(cfg)["total"]
    flops.check_fits(cfg, 2 * total + 1, devices_sharing=2)  # fits: no error
    with pytest.raises(ConfigError, match="estimated memory"):
        flops.check_fits(cfg, 2 * total - 1, devices_sharing=2)
    flops.check_fits(load_config(None, ["model.seq_len=4096", "train.memory_check=false"]), 1.0)  # the override


SUBPROCESS_CASES = ("unknown-key", "cudnn-on-cpu", "tokens-missing-file")  # config, runtime, data


@pytest.mark.slow
def test_mistakes_through_the_real_command_line(inputs, tmp_path):
    """A fresh `python -m megascale_jax.train`, a few cases run side by side: exit code 2 and one
    line that is the whole of stderr (no JAX/absl logger chatter around it)."""
    cases = [c for c in ERROR_CASES if c[0] in SUBPROCESS_CASES]
    assert len(cases) == len(SUBPROCESS_CASES)

    def one(case):
        overrides, config = case_args(case, inputs)
        return run_cli(tmp_path / case[0], overrides, config)

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, cases))
    for case, result in zip(cases, results):
        assert_one_error_line(result.returncode, result.stdout, result.stderr, case[3], tmp_path / case[0])
        assert result.stderr.strip().splitlines() == message_lines(result.stderr)


# ============================================================================ smoke run


SMOKE = ["train.sample_at_end=0", "train.steps=5", "train.eval_every=0", "train.log_every=1", "model.layers=2", "model.d_model=64",
         "model.seq_len=64", "train.global_batch=8"]
REQUIRED = {"step": int, "loss": float, "grad_norm": float, "lr": float, "step_time_s": float,
            "tokens_per_s": float}

# Divergence: LAMB scales each update to lr * ||w|| (trust ratio), so lr=1e30 with no warmup
# turns the weights to ~1e30 after step 1 and step 2's loss is NaN — deterministically, on any
# seed/data, independent of clipping. A 1-device mesh keeps the compile cheap.
DIVERGE = ["optim.lr=1e30", "optim.warmup=0", "optim.clip=null", "train.steps=5", "train.eval_every=0",
           "mesh.dp=1", "mesh.tp=1", "mesh.cpu_devices=1", "model.layers=1", "model.d_model=32",
           "model.heads=2", "model.kv_heads=2", "model.seq_len=32", "train.global_batch=2"]


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory):
    """The smoke run and the diverging run, side by side: name -> (result, run_dir)."""
    tmp = tmp_path_factory.mktemp("cli_runs")
    jobs = {"smoke": (tmp / "smoke", SMOKE), "diverge": (tmp / "diverge", DIVERGE)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: (pool.submit(run_cli, run_dir, overrides), run_dir)
                   for name, (run_dir, overrides) in jobs.items()}
        return {name: (f.result(), run_dir) for name, (f, run_dir) in futures.items()}


@pytest.mark.slow
@pytest.mark.xdist_group("cli-long-runs")
def test_smoke_run_writes_schema_valid_metrics(long_runs):
    result, run_dir = long_runs["smoke"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [strict_json(line) for line in lines]
    assert len(records) == 5
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert isinstance(r, dict)
        for key, kind in REQUIRED.items():
            assert key in r, f"{key} missing from {r}"
            assert isinstance(r[key], kind) and not isinstance(r[key], bool), (key, r[key])
        assert "mfu" in r and r["mfu"] is None  # no known peak FLOP/s for the CPU
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["lr"] >= 0 and r["step_time_s"] > 0 and r["tokens_per_s"] > 0
    # eval_every=0: only the final step evaluates, and it always does.
    assert [("val_loss" in r) for r in records] == [False] * 4 + [True]
    assert isinstance(records[-1]["val_loss"], float) and math.isfinite(records[-1]["val_loss"])
    assert f"run directory: {run_dir}" in result.stdout
    # Not a terminal: no progress bar (its \r redraws), plain step lines instead, and one closing line.
    assert "\r" not in result.stderr and "step/s" not in result.stderr, result.stderr[-2000:]
    assert [line.split()[1] for line in result.stdout.splitlines() if line.startswith("step ")] == ["1", "2", "3", "4", "5"]
    done = [line for line in result.stdout.splitlines() if line.startswith("done: ")]
    assert len(done) == 1 and done[0].startswith("done: steps 1-5 in ") and "val_loss" in done[0], result.stdout
    # train.sample_at_end=0: no end-of-run sample, no header and no `| ` lines (the sample itself:
    # tests/training/test_sample_at_end.py)
    assert "sample: " not in result.stdout and not re.search(r"^\| ", result.stdout, re.MULTILINE), result.stdout


@pytest.mark.xdist_group("cli-long-runs")
def test_smoke_run_saves_the_resolved_config(long_runs):
    _, run_dir = long_runs["smoke"]
    with open(run_dir / "config.yaml") as f:
        saved = yaml.safe_load(f)
    expected = load_config(None, SMOKE).to_dict()
    # settings left to the devices are saved as decided for them (the run's CPU devices)
    assert expected["checkpoint"]["background_host_copy"] is None
    expected["checkpoint"]["background_host_copy"] = False
    assert saved == expected


@pytest.mark.xdist_group("cli-long-runs")
def test_second_run_into_the_same_run_dir_is_refused(long_runs):
    _, run_dir = long_runs["smoke"]
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    config_before = (run_dir / "config.yaml").read_bytes()
    result = run_cli(run_dir, SMOKE)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    lines = message_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "--run-dir" in lines[0] and str(run_dir) in lines[0]
    assert "compiled in" not in result.stdout
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before
    assert (run_dir / "config.yaml").read_bytes() == config_before


# ============================================================================ divergence


@pytest.mark.xdist_group("cli-long-runs")
def test_non_finite_loss_stops_the_run_naming_the_step(long_runs):
    result, run_dir = long_runs["diverge"]
    assert result.returncode == 3, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    # stderr also carries the tqdm progress bar (\r-updated); the message is its own line.
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    match = re.search(r"\bstep (\d+)\b", errors[0])
    assert match, errors[0]
    bad_step = int(match.group(1))
    assert bad_step == 2, errors[0]  # step 1's loss is computed before the first (huge) update
    assert "optim.lr" in errors[0]
    records = [strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, bad_step))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)


def test_logging_tags_ranks_only_in_multi_process_jobs_and_splits_streams(capsys):
    from megascale_jax import cli

    log = cli.get_logger("test")
    cli.setup_logging()
    log.info("step 1")
    log.warning("warning: disk slow")
    cli.setup_logging(rank=1, processes=4)
    log.info("step 2")
    cli.get_logger("test", tag="[supervisor] ").info("fault")
    cli.setup_logging(rank=2, processes=4, quiet=True)
    log.info("not shown")
    log.warning("shown")
    out, err = capsys.readouterr()
    assert out.splitlines() == ["step 1", "[rank 1] step 2", "[rank 1] [supervisor] fault"]
    assert err.splitlines() == ["warning: disk slow", "[rank 2] shown"]
    assert cli.user_error("mesh.pp=3 does not divide model.layers=8") == 2
    assert capsys.readouterr().err == "error: mesh.pp=3 does not divide model.layers=8\n"


@pytest.mark.parametrize("argv", [["--no-such-option"]])
@pytest.mark.parametrize("command", ["train", "launch", "report", "diagnose", "preflight", "flops", "pipeline_schedule"])
def test_every_cli_rejects_a_bad_command_line_with_exit_2(command, argv):
    r = subprocess.run([sys.executable, "-m", f"megascale_jax.{command}", *argv], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    # one line (cli.ArgumentParser), not argparse's usage block, naming where the options are listed
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("error: ") and line.endswith(f"(python -m megascale_jax.{command} --help lists the options)")


def test_ctrl_c_during_start_up_is_one_line_and_exit_130(run_main, monkeypatch, tmp_path, capsys):
    """Before the loop installs its own handler (training/interrupt.py), Ctrl-C is a
    KeyboardInterrupt wherever start-up is: one line and exit 130, no traceback, no run directory."""
    from megascale_jax import train
    from megascale_jax.training import data

    def pressed(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(data, "load_corpus", pressed)
    code, out, err = run_main(train.main, ["--run-dir", "run", "train.steps=2"], tmp_path)
    err += capsys.readouterr().err  # the logger's handler may hold the stderr of an earlier test
    assert code == 130
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].endswith("interrupted during start-up, before the first step; "
                                                 "nothing new was saved"), err
    assert "Traceback" not in out + err and not (tmp_path / "run").exists()


def test_the_resume_hint_adds_the_run_directory_only_where_the_user_named_none():
    from megascale_jax import cli

    argv = ["--nprocs", "2", "data.path=my corpus/*.txt"]
    assert cli.resume_command("megascale_jax.launch", argv, None, "runs/tiny_cpu-20261125-0310") == (
        "python -m megascale_jax.launch --nprocs 2 'data.path=my corpus/*.txt' --run-dir runs/tiny_cpu-20261125-0310")
    assert cli.resume_command("megascale_jax.train", ["--run-dir", "runs/a"], "runs/a", "runs/a") is None
    assert cli.interrupted(7, "python -m megascale_jax.train --run-dir runs/b") == (
        "interrupted at step 7; checkpoint saved — resume with: python -m megascale_jax.train --run-dir runs/b")
    assert cli.interrupted(7) == "interrupted at step 7; checkpoint saved — re-run the same command to resume"


def test_print_config_prints_the_resolved_yaml_and_runs_nothing(run_main, tmp_path):
    from megascale_jax import train

    code, out, err = run_main(train.main, ["--print-config", "mesh.dp=2", "mesh.tp=4", "train.steps=7"], REPO)
    assert code == 0, err
    printed = yaml.safe_load(out)
    default = yaml.safe_load((Path(REPO) / "configs" / "tiny_cpu.yaml").read_text())
    assert (printed["mesh"]["dp"], printed["mesh"]["tp"], printed["train"]["steps"]) == (2, 4, 7)
    assert printed["model"] == {**printed["model"], **default["model"]}  # the file's values, resolved
    assert set(printed) == {"mesh", "model", "parallel", "optim", "train", "data", "checkpoint", "supervisor",
                            "observe"}
    code, out, err = run_main(train.main, ["--print-config", "--run-dir", str(tmp_path / "run"), "mesh.dpp=2"], REPO)
    assert code == 2 and out == "" and err.strip().splitlines()[-1].endswith("unknown config key mesh.dpp; did you mean mesh.pp?")
    assert not (tmp_path / "run").exists()


def test_an_xla_flags_device_count_that_disagrees_with_the_mesh_is_one_line(run_main, monkeypatch, tmp_path):
    from megascale_jax import train

    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_force_host_platform_device_count=4")
    code, _, err = run_main(train.main, ["--run-dir", "run", "train.steps=1"], tmp_path)  # the mesh: dp4 x tp2
    assert code == 2 and err.strip().splitlines() == [
        "error: XLA_FLAGS sets --xla_force_host_platform_device_count=4 but the mesh uses 8 CPU devices per "
        "process; drop the flag (the mesh sets the count) or change mesh.dp/pp/tp or mesh.cpu_devices"], err
    assert not (tmp_path / "run").exists()
    from megascale_jax.parallel.mesh import check_forced_cpu_devices

    check_forced_cpu_devices("cpu", 8, "--xla_force_host_platform_device_count=8")  # agrees
    check_forced_cpu_devices("gpu", 8, "--xla_force_host_platform_device_count=4")  # not the devices trained on


@pytest.mark.slow
@pytest.mark.xdist_group("cli-long-runs")
def test_a_finished_run_continues_with_more_steps(long_runs, tmp_path):
    """5 -> 7 steps while the learning rate still warms up (optim.warmup=20): the schedule is the
    same, so nothing is said about it; the run goes on from its checkpoint to step 7."""
    _, finished = long_runs["smoke"]
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    result = run_cli(run_dir, [s for s in SMOKE if not s.startswith("train.steps=")] + ["train.steps=7"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [line for line in message_lines(result.stderr) if "schedule" in line], result.stderr[-2000:]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == list(range(1, 8))


def test_raising_train_steps_says_from_which_step_the_schedule_changes(tmp_path, capsys):
    from megascale_jax import cli, train

    from megascale_jax.config import save_config

    cli.setup_logging()
    save_config(load_config(None, ["train.steps=100", "optim.warmup=20", "optim.lr=1e-3"]), str(tmp_path / "config.yaml"))
    cfg = load_config(None, ["train.steps=200", "optim.warmup=20", "optim.lr=1e-3"])
    train.warn_if_the_schedule_changes(cfg, str(tmp_path), 100)
    (line,) = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    match = re.search(r"train\.steps 100 -> 200: the learning-rate schedule this run started with changes from "
                      r"step 101 on \(lr (\S+) there, (\S+) as planned\)$", line)
    assert match, line
    # Cosine decay after 20 warm-up steps (optax's convention: decay_steps counts the warm-up):
    # at count 100 the longer schedule is at 80/180 of its decay, the planned one at its end.
    lr, min_lr = 1e-3, 1e-3 * cfg.optim.min_lr_ratio
    expected = min_lr + (lr - min_lr) * 0.5 * (1 + np.cos(np.pi * 80 / 180))
    assert float(match[1]) == pytest.approx(expected, rel=5e-3) and float(match[2]) == pytest.approx(min_lr, rel=5e-3)
    cfg = load_config(None, ["train.steps=100", "optim.warmup=20", "optim.lr=1e-3"])
    train.warn_if_the_schedule_changes(cfg, str(tmp_path), 100)  # the same schedule: nothing to say
    assert capsys.readouterr().err.strip() == ""
    # another schedule kind given on resuming (the run started cosine): said, with what changed
    cfg = load_config(None, ["train.steps=100", "optim.warmup=20", "optim.lr=1e-3", "optim.schedule=wsd"])
    train.warn_if_the_schedule_changes(cfg, str(tmp_path), 50)
    (line,) = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert line.startswith("optim.schedule cosine -> wsd: the learning-rate schedule this run started with changes "
                           "from step 51 on"), line
