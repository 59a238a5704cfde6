"""configs/cluster/sbatch.sh under a real SLURM scheduler (issue 61), and what it found.

The `slurm` tests run wherever `sinfo` answers: `bash bench/cluster/local_slurm.sh up` makes a
one-node cluster on this machine (SLURM_CONF is taken from the environment, else that script's
/tmp/megascale-slurm/slurm.conf). The documented job is submitted as docs/supervision.md gives
it — `sbatch configs/cluster/sbatch.sh CONFIG overrides`, REDIS_URL to a Redis that requires a
password, MEGASCALE_REDIS_PASSWORD_FILE, RUN_DIR — with small command-line overrides of its
#SBATCH lines (one node, 2 tasks, no GPUs); its 2 `megascale_jax.train` tasks simulate one CPU
device each and find each other from SLURM's environment alone (rank SLURM_PROCID, job id
slurm-$SLURM_JOB_ID-0, the coordinator through the rendezvous). Their losses must equal those of
`python -m megascale_jax.launch --nprocs 2` on the same config, bitwise.

The other tests need no cluster: what the real scheduler showed, held where there is none.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import redis

from megascale_jax import train
from megascale_jax.config import ConfigError, MeshConfig, check_process_count

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SBATCH_SH = os.path.join(REPO, "configs", "cluster", "sbatch.sh")
LOCAL_SLURM = os.path.join(REPO, "bench", "cluster", "local_slurm.sh")
LOCAL_CONF = "/tmp/megascale-slurm/slurm.conf"  # local_slurm.sh's default

# A tiny model, a few steps: the job is about the scheduler, not the training.
CONFIG = os.path.join(REPO, "configs", "tiny_cpu.yaml")
OVERRIDES = ["train.steps=6", "model.layers=2", "model.d_model=64", "model.seq_len=64", "train.global_batch=8",
             "mesh.dp=2", "mesh.tp=1", "train.eval_every=0", "train.sample_at_end=0", "train.log_every=1"]
# The documented script's #SBATCH lines ask for 2 nodes of 8 GPUs; this is one node's CPUs.
# --no-requeue: a failure ends the test instead of requeueing (the script's own `scontrol requeue`
# is then refused) — the documented job requeues.
SBATCH_OVERRIDES = ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
                    "--time=10", "--no-requeue"]
JOB_TIMEOUT_S = 300


def slurm_env() -> dict:
    env = dict(os.environ)
    if "SLURM_CONF" not in env and os.path.exists(LOCAL_CONF):
        env["SLURM_CONF"] = LOCAL_CONF
    return env


def local_controller_down() -> bool:
    """local_slurm.sh's configuration is there but its slurmctld is not running: sinfo would spend
    ~9 s retrying the connection at every collection of this file."""
    if "SLURM_CONF" in os.environ or not os.path.exists(LOCAL_CONF):
        return False
    try:
        with open(os.path.join(os.path.dirname(LOCAL_CONF), "slurmctld.pid")) as f:
            os.kill(int(f.read().strip()), 0)
    except (OSError, ValueError):
        return True
    return False


def sinfo_answers() -> bool:
    if not shutil.which("sinfo") or local_controller_down():
        return False
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10, env=slurm_env())
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0 and bool(done.stdout.strip())


needs_slurm = pytest.mark.skipif(not sinfo_answers(), reason="no SLURM cluster answers sinfo "
                                 "(bash bench/cluster/local_slurm.sh up makes one on this machine)")


def losses(run_dir) -> list[tuple]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"], r.get("val_loss")) for r in map(json.loads, f) if "loss" in r]


@pytest.mark.slurm
@needs_slurm
def test_the_documented_sbatch_job_trains_as_the_local_launcher_does_bitwise(tmp_path):
    from megascale_jax.supervise.redis_server import EmbeddedRedis

    server = EmbeddedRedis(str(tmp_path / "redis"))  # a real redis-server with a password
    env = {**slurm_env(), **server.env, "REDIS_URL": server.url, "RUN_DIR": str(tmp_path / "slurm-run"),
           "JAX_PLATFORMS": "cpu", "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    env.pop("MEGASCALE_REDIS_PASSWORD", None)
    try:
        submitted = subprocess.run(["sbatch", "--parsable", "--wait", *SBATCH_OVERRIDES, SBATCH_SH, CONFIG, *OVERRIDES],
                                   capture_output=True, text=True, env=env, cwd=tmp_path, timeout=JOB_TIMEOUT_S)
        job_id = submitted.stdout.strip().split(";")[0]
        log = (tmp_path / f"megascale-jax-{job_id}.log").read_text()  # the script's --output, in the submission dir
        assert submitted.returncode == 0, submitted.stderr + log
        # Both tasks ran (srun --label) and met in the rendezvous under the job id SLURM's
        # environment gives them, each with the rank SLURM gave it.
        assert "0: " in log and "1: " in log, log
        members = redis.Redis.from_url(server.url, password=server.password).hgetall(
            f"megascale:slurm-{job_id}-0:members")
        assert sorted(members) == [b"0", b"1"], members
    finally:
        server.stop()
    launched = subprocess.run([sys.executable, "-m", "megascale_jax.launch", "--nprocs", "2", "--config", CONFIG,
                               "--run-dir", str(tmp_path / "launch-run"), *OVERRIDES],
                              capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert launched.returncode == 0, launched.stdout + launched.stderr
    under_slurm, local = losses(tmp_path / "slurm-run"), losses(tmp_path / "launch-run")
    assert len(under_slurm) == 6 and under_slurm == local  # floats from JSON: equal means bitwise


@pytest.mark.slurm
@needs_slurm
def test_a_task_count_the_mesh_cannot_split_is_one_line_before_any_task(tmp_path):
    """sbatch.sh checks the config against SLURM_NTASKS once, before srun: one line, exit 2, no
    task started, not requeued (a refused job step was diagnosed and requeued, forever)."""
    env = {**slurm_env(), "REDIS_URL": "redis://127.0.0.1:1", "MEGASCALE_REDIS_PASSWORD": "never-used",
           "RUN_DIR": str(tmp_path / "run"), "JAX_PLATFORMS": "cpu",
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    done = subprocess.run(["sbatch", "--parsable", "--wait", *SBATCH_OVERRIDES[:-1], SBATCH_SH, CONFIG,
                           *OVERRIDES, "mesh.dp=3", "train.global_batch=6"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=JOB_TIMEOUT_S)
    job_id = done.stdout.strip().split(";")[0]
    log = (tmp_path / f"megascale-jax-{job_id}.log").read_text()
    assert done.returncode == 2 and log.splitlines() == [
        "error: mesh dp*pp*tp=3*1*1=3 devices do not match 2 processes; choose a mesh divisible by 2"], log


# ============================================================================ no cluster needed


def test_jax_keeps_every_device_a_slurm_task_can_see():
    """Under SLURM, jax.distributed.initialize's cluster detection gave each process one GPU,
    [SLURM_LOCALID], though all of coordinator, count and rank were passed: sbatch.sh's one task
    per node of 8 GPUs saw GPU 0 alone. rendezvous.start_distributed turns detection off."""
    probe = ("import jax; from jax._src import xla_bridge as xb; from megascale_jax.cluster import rendezvous; "
             "rendezvous.start_distributed('127.0.0.1:%d' % rendezvous.free_port('127.0.0.1'), 1, 0); "
             "print(xb.CUDA_VISIBLE_DEVICES.value, jax.process_count())")
    slurm_task = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node0", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
                  "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "node0", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **slurm_task})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["all", "1"]


def test_the_task_count_is_checked_before_jax_starts(run_main):
    code, out, err = run_main(train.main, ["--num-processes", "2", "--print-config", "mesh.dp=3", "mesh.tp=1",
                                           "train.global_batch=6"], REPO)
    assert code == 2 and err.splitlines() == [
        "error: mesh dp*pp*tp=3*1*1=3 devices do not match 2 processes; choose a mesh divisible by 2"]
    with pytest.raises(ConfigError, match=r"^mesh dp\*pp\*tp=2\*1\*4=8 devices cannot be split evenly over 3 "
                                          r"processes \(--num-processes, the job's task count\)"):
        check_process_count(MeshConfig(dp=2, pp=1, tp=4), 3, None)  # a GPU job: devices unknown until JAX starts
    check_process_count(MeshConfig(dp=2, pp=1, tp=4), 2, None)


def test_local_slurm_without_slurm_or_apt_is_one_line(tmp_path):
    """No munge or slurmctld, and no apt-get to install them: the script's one line, exit 2."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id", "mkdir", "chmod", "hostname", "nproc", "awk", "cat"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    done = subprocess.run([str(bin_dir / "bash"), LOCAL_SLURM, "up"], capture_output=True, text=True, timeout=30,
                          env={"PATH": str(bin_dir), "MEGASCALE_SLURM_DIR": str(tmp_path / "slurm")})
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    if os.geteuid() == 0:
        assert done.stderr.startswith("error: SLURM is not installed and could not be: missing munged mungekey "
                                      "slurmctld slurmd sinfo sbatch"), done.stderr
    else:
        assert done.stderr == "error: local_slurm.sh up needs root (the SLURM daemons run as root)\n"
