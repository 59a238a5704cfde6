"""JAX's persistent compilation cache (training/compile_cache.py): a restarted job loads every
executable its first attempt compiled, and a corrupt cache costs one warning line and a
recompilation, never the run. Counted through the line a run ends with (`compilation cache: H
hits, M misses`), never timed.

In a CPU job of several processes JAX's cache serves process 0 only (its keys differ by process);
the others load their own copies of the train step and evaluation (see the module's note).
"""

import glob
import os
import re
import subprocess
import sys

import jax
import pytest

from megascale_jax import cli
from megascale_jax.training import compile_cache

SMALL = ["model.layers=2", "model.d_model=64", "model.seq_len=64", "train.global_batch=8", "optim.warmup=1",
         "mesh.dp=2", "mesh.tp=1", "mesh.cpu_devices=2", "train.steps=12", "train.eval_every=4",
         "checkpoint.every=4", "supervisor.heartbeat_s=0.5", "supervisor.hang_timeout_s=6"]
COUNTS = re.compile(r"compilation cache: (\d+) hits, (\d+) misses")


def run_module(module, args, timeout=600):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def entries(run_dir) -> list[str]:
    return sorted(glob.glob(os.path.join(run_dir, "compile_cache", "*-cache")))


@pytest.mark.slow
def test_every_process_of_a_restarted_cpu_job_loads_its_train_step(tmp_path):
    """Two processes, kill -9 of rank 1 at step 6: in the restarted attempt process 0 loads
    everything from JAX's cache, and process 1 its own copies of the train step and evaluation
    (without them process 0 would wait in the first step while process 1 compiles)."""
    done = run_module("megascale_jax.launch", ["--nprocs", "2", "--run-dir", str(tmp_path), "--no-diagnose",
                                               "--drill", "kill:1@6", *SMALL])
    assert done.returncode == 0, done.stdout + done.stderr
    counts = []
    for rank in (0, 1):
        with open(tmp_path / "logs" / f"worker{rank}.log") as f:
            restarted = f.read().split("===== attempt ")[-1]
        counts.append(tuple(map(int, COUNTS.search(restarted).groups())))
    assert counts[0][1] == 0 and counts[0][0] > 0, counts  # every executable, the train step among them
    assert len(glob.glob(str(tmp_path / "compile_cache" / "jit_train_step-*-cache"))) == 1  # written once
    assert counts[1][0] == 2, counts  # its own train step and evaluation; the small ops it compiles
    assert len(glob.glob(str(tmp_path / "compile_cache" / "process-1" / "train_step-*"))) == 1


@pytest.mark.slow
def test_a_corrupt_cache_is_discarded_with_one_warning(tmp_path):
    """A run fills the cache; a second run of the same config on a copy whose every entry is
    garbage warns once, compiles everything, writes the cache anew and trains."""
    args = [*SMALL, "train.steps=2"]
    first = run_module("megascale_jax.train", ["--run-dir", str(tmp_path / "first"), *args])
    assert first.returncode == 0, first.stderr
    names = [os.path.basename(path) for path in entries(tmp_path / "first")]
    assert names
    garbage = {}
    os.makedirs(tmp_path / "second" / "compile_cache")
    for name in names:
        garbage[name] = os.urandom(os.path.getsize(tmp_path / "first" / "compile_cache" / name))
        (tmp_path / "second" / "compile_cache" / name).write_bytes(garbage[name])

    second = run_module("megascale_jax.train", ["--run-dir", str(tmp_path / "second"), *args])
    assert second.returncode == 0, second.stderr
    warned = [line for line in second.stderr.splitlines() if "compilation cache" in line]
    assert len(warned) == 1 and "discarded, compiling afresh" in warned[0], second.stderr
    assert second.stderr.count("persistent compilation cache") == 1  # JAX's own warnings are not repeated
    hits, misses = map(int, COUNTS.search(second.stdout).groups())
    assert hits == 0 and misses > 0
    rewritten = [os.path.basename(path) for path in entries(tmp_path / "second")]
    assert rewritten == names  # the same keys, written anew
    assert all((tmp_path / "second" / "compile_cache" / name).read_bytes() != garbage[name] for name in names)


def test_a_cache_path_that_is_no_directory_is_one_warning_and_no_cache(tmp_path, capsys):
    cli.setup_logging()
    (tmp_path / "compile_cache").write_text("not a directory")
    before = jax.config.jax_compilation_cache_dir
    with compile_cache.use(str(tmp_path)) as counts:
        assert counts is None
        assert jax.config.jax_compilation_cache_dir == before
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: compilation cache") and "not a readable, writable" in err[0]


def test_the_cache_is_set_for_the_block_only(tmp_path):
    """In-process callers (tests running train.main) get JAX's settings back afterwards."""
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    x = jax.numpy.arange(5.0)
    with compile_cache.use(str(tmp_path)) as counts:
        assert jax.config.jax_compilation_cache_dir == os.path.join(str(tmp_path), "compile_cache")
        jax.jit(lambda x: x * 3 + 1)(x).block_until_ready()
        assert (counts.hits, counts.misses) == (0, 1)
    assert (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs) == before
    assert len(entries(tmp_path)) == 1


def test_who_can_read_process_0s_entries():
    assert compile_cache.readable_by_every_process("cpu", 1)
    assert compile_cache.readable_by_every_process("gpu", 8)
    assert not compile_cache.readable_by_every_process("cpu", 2)
