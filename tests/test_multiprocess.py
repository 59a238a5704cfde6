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

COMMON = ["train.steps=4", "train.eval_every=0", "model.layers=2", "model.d_model=64", "model.seq_len=32",
          "train.global_batch=8", "optim.warmup=1"]


def losses(run_dir) -> np.ndarray:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return np.array([json.loads(line)["loss"] for line in f])


def launch(args, **kwargs):
    # the job's key (job_key.py), as a user of a bare multi-process job sets it: without it
    # process 0 hands no executables to the others
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MEGASCALE_JOB_KEY": "the job's secret"}
    return subprocess.Popen([sys.executable, "-m", "megascale_jax.train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    mesh = ["mesh.dp=4", "mesh.tp=2"]  # dp spans both processes, tp stays inside one
    single = launch(["--run-dir", str(tmp_path / "single"), *COMMON, *mesh, "mesh.cpu_devices=8"])
    out, _ = single.communicate(timeout=600)
    assert single.returncode == 0, out

    address = f"127.0.0.1:{free_port()}"
    procs = [launch(["--run-dir", str(tmp_path / "multi"), "--coordinator", address, "--num-processes", "2",
                     "--process-id", str(i), *COMMON, *mesh, "mesh.cpu_devices=4"]) for i in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs

    np.testing.assert_allclose(losses(tmp_path / "multi"), losses(tmp_path / "single"), rtol=1e-5)
    # ... running what process 0 compiled: process 1 compiled none of the executables it keeps
    # (initialisation, train step, evaluation, checkpoint checksums), it loaded them all from process 0.
    kept = os.listdir(tmp_path / "multi" / "compile_cache" / "process-1")
    loaded = re.search(r"compilation cache: \d+ hits, \d+ misses \((\d+) loaded from process 0\)", outputs[1])
    assert len(kept) >= 3 and int(loaded.group(1)) == len(kept), (kept, outputs[1][-2000:])
