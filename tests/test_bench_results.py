"""Benches never replace a result file silently: bench/results/ holds committed measurements."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # bench/ is not installed: it imports from the checkout's root, as `python -m bench...` runs

from bench import common as provenance  # noqa: E402


def test_write_result_refuses_an_existing_file_with_one_line(tmp_path, capsys):
    target = tmp_path / "result.json"
    provenance.write_result("unused", {"x": 1}, str(target))
    assert json.loads(target.read_text())["x"] == 1
    before = target.read_bytes()
    with pytest.raises(SystemExit) as e:
        provenance.write_result("unused", {"x": 2}, str(target))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists" in err[0] and "--overwrite" in err[0] and "--out" in err[0]
    assert target.read_bytes() == before  # untouched
    provenance.write_result("unused", {"x": 3}, str(target), overwrite=True)
    assert json.loads(target.read_text())["x"] == 3


def test_result_path_defaults_under_bench_results(tmp_path):
    assert provenance.result_path("no_such_result_xyz") == os.path.join(provenance.RESULTS, "no_such_result_xyz.json")
    assert provenance.result_path("x", str(tmp_path / "new.json")) == str(tmp_path / "new.json")


def test_a_bench_refuses_its_committed_result_before_running():
    committed = os.path.join(REPO, "bench", "results", "tensor_parallel_cpu.json")
    digest = hashlib.sha256(open(committed, "rb").read()).hexdigest()
    r = subprocess.run([sys.executable, "-m", "bench.parallel.tensor_parallel", "--steps", "1"], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "bench/results/tensor_parallel_cpu.json exists; pass --overwrite to replace it, or --out PATH to write elsewhere"]
    assert "block" not in r.stdout  # refused before the table: nothing was measured
    assert hashlib.sha256(open(committed, "rb").read()).hexdigest() == digest
