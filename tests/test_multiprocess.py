"""Two real processes (4 simulated CPU devices each, gloo collectives) train exactly like one,
process 1 with the executables process 0 compiled.

Each process loads only the rows of the batch its devices hold, so equal losses show that the
per-process data slices assemble into the same global batch.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from megascale_jax.cluster.rendezvous import free_port

COMMON = ["train.sample_at_end=0", "train.steps=4", "train.eval_every=0", "model.layers=2", "model.d_model=64", "model.seq_len=32",
          "train.global_batch=8", "optim.warmup=1"]


def losses(run_dir) -> np.ndarray:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return np.array([json.loads(line)["loss"] for line in f])


def launch(args, env_extra=None, **kwargs):
    # the job's key (megascale_jax/job_key.py), as a user of a bare multi-process job sets it:
    # without it process 0 hands no executables to the others
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MEGASCALE_JOB_KEY": "the job's secret", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "megascale_jax.train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


MESH = ["mesh.dp=4", "mesh.tp=2"]  # dp spans both processes, tp stays inside one

# Both tests on one xdist worker (`--dist loadgroup`), so that the one-process run is made once.
pytestmark = pytest.mark.xdist_group("multiprocess-single")


@pytest.fixture(scope="module")
def single(tmp_path_factory, run_main):
    """The losses of the same run in one process: this one (its 8 CPU devices), which saves a
    process start and JAX's start-up; the losses are compared at rtol 1e-5, not bitwise."""
    from megascale_jax import train

    run_dir = tmp_path_factory.mktemp("single")
    code, out, err = run_main(train.main, ["--run-dir", str(run_dir), *COMMON, *MESH, "mesh.cpu_devices=8",
                                           "train.compile_cache=false"], run_dir)
    assert code == 0, out + err
    return losses(run_dir)


def two_processes(run_dir, keys=("the job's secret", "the job's secret")) -> list[str]:
    """The job on two processes, each with its MEGASCALE_JOB_KEY: their outputs."""
    address = f"127.0.0.1:{free_port()}"
    procs = [launch(["--run-dir", str(run_dir), "--coordinator", address, "--num-processes", "2",
                     "--process-id", str(i), *COMMON, *MESH, "mesh.cpu_devices=4"],
                    env_extra={"MEGASCALE_JOB_KEY": keys[i]}) for i in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    return outputs


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, single):
    outputs = two_processes(tmp_path / "multi")
    np.testing.assert_allclose(losses(tmp_path / "multi"), single, rtol=1e-5)
    # ... running what process 0 compiled: process 1 compiled none of the executables it keeps
    # (initialisation, train step, evaluation, checkpoint checksums), it loaded them all from process 0.
    # (its executables; beside them each process keeps the model's abstract parameters, a .pickle it makes itself)
    kept = [f for f in os.listdir(tmp_path / "multi" / "compile_cache" / "process-1") if not f.endswith(".pickle")]
    loaded = re.search(r"compilation cache: \d+ hits, \d+ misses \((\d+) loaded from process 0\)", outputs[1])
    assert len(kept) >= 3 and int(loaded.group(1)) == len(kept), (kept, outputs[1][-2000:])


@pytest.mark.slow
def test_executables_in_the_store_not_signed_with_the_jobs_key_are_never_run(tmp_path, single):
    """A live job whose process 1 finds every executable in jax.distributed's store signed with a
    key that is not its job's — what an outsider who can write the store would put there: it runs
    none of them (one warning each), compiles its own, and the job trains like the one-process run."""
    outputs = two_processes(tmp_path / "multi", keys=("the job's secret", "an outsider's secret"))
    np.testing.assert_allclose(losses(tmp_path / "multi"), single, rtol=1e-5)
    loaded = re.search(r"compilation cache: \d+ hits, \d+ misses \((\d+) loaded from process 0\)", outputs[1])
    refused = [line for line in outputs[1].splitlines() if "is not signed with the job's key" in line]
    assert int(loaded.group(1)) == 0 and len(refused) >= 3, outputs[1][-3000:]
    assert all("compiling it here" in line for line in refused)
