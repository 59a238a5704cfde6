"""The cluster recipes hand excluded hosts to the scheduler (configs/cluster/)."""

import os
import stat
import subprocess
import sys

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fake(bin_dir, name, body):
    path = os.path.join(bin_dir, name)
    with open(path, "w") as f:
        f.write("#!/bin/bash\n" + body)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)


# The node list a fake `scontrol show hostnames` prints; rank i runs on NODES[i].
NODES = ["node0", "node1"]


def sbatch(tmp_path, srun_exit: int, excluded: list[str] | None, srun: str | None = None,
           python: str | None = None, redis_url: str = "redis://r:6379", overrides=()):
    """Run sbatch.sh with fake srun/scontrol (and, unless given, a fake `python` that does
    nothing); returns (exit code, scontrol calls other than `show hostnames`, stdout)."""
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    run_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    fake(bin_dir, "srun", srun or f"exit {srun_exit}\n")
    fake(bin_dir, "scontrol", f'if [ "$1" = show ]; then printf "%s\\n" {" ".join(NODES)}; exit; fi\n'
                              f'echo "$@" >> {calls}\n')
    fake(bin_dir, "python", f'exec {python} "$@"\n' if python else "exit 0\n")  # a symlink would leave the venv
    if excluded is not None:
        (run_dir / "excluded_hosts.txt").write_text("".join(h + "\n" for h in excluded))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "REDIS_URL": redis_url, "RUN_DIR": str(run_dir),
           "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "j", "SLURM_NTASKS": str(len(NODES)),
           "SLURM_JOB_NODELIST": "node[0-1]", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(["bash", os.path.join(REPO, "configs/cluster/sbatch.sh"), "configs/tiny_cpu.yaml",
                           *overrides], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    return done.returncode, calls.read_text().splitlines() if calls.exists() else [], done.stdout + done.stderr


def test_a_failed_job_is_requeued_without_the_excluded_hosts(tmp_path):
    code, calls, _ = sbatch(tmp_path, 1, ["node7", "node3", "node7"])
    assert code == 1
    assert calls == ["update JobId=42 ExcNodeList=node3,node7", "requeue 42"]


def test_a_failed_job_with_nothing_excluded_is_requeued_as_it_was(tmp_path):
    code, calls, _ = sbatch(tmp_path, 3, None)
    assert code == 3 and calls == ["requeue 42"]


def test_a_finished_job_is_not_requeued(tmp_path):
    code, calls, _ = sbatch(tmp_path, 0, ["node7"])
    assert code == 0 and calls == []


# srun: the training step fails; the diagnostics step runs its command once per node, as
# SLURM_PROCID 0..n-1, with node 1's device computing wrong values in every collective.
DIAGNOSING_SRUN = f"""case "$*" in
  *megascale_jax.diagnose*)
    shift  # --kill-on-bad-exit=0
    for rank in {" ".join(str(i) for i in range(len(NODES)))}; do
      SLURM_PROCID=$rank MEGASCALE_DIAG_FAULT=1 "$@" > "$RUN_DIR/diagnose$rank.log" 2>&1 &
    done
    wait
    exit 0 ;;
  *) exit 1 ;;
esac
"""


def test_a_failed_job_diagnoses_its_nodes_and_excludes_the_faulty_one_on_requeue(tmp_path):
    """The cluster side of eviction: after a failed step the diagnostics run on every node; the
    node whose collectives are wrong is appended to excluded_hosts.txt and kept out of the
    requeued allocation."""
    from megascale_jax.supervise.redis_server import EmbeddedRedis

    server = EmbeddedRedis(str(tmp_path / "redis"))
    try:
        code, calls, out = sbatch(tmp_path, 1, ["node7"], srun=DIAGNOSING_SRUN, python=sys.executable,
                                  redis_url=server.url, overrides=["mesh.dp=2", "mesh.tp=1",
                                                                   "model.layers=2", "model.d_model=64"])
    finally:
        server.stop()
    assert code == 1, out
    assert "verdict: rank 1: wrong values in collectives over dp" in out, out
    assert (tmp_path / "run" / "excluded_hosts.txt").read_text().splitlines() == ["node7", "node1"]
    assert calls == ["update JobId=42 ExcNodeList=node1,node7", "requeue 42"]


def test_diagnostics_that_could_not_run_exclude_no_node(tmp_path):
    """No node reported (the diagnostics step itself failed): every node would look faulty, so
    none is excluded and the job is requeued as it was."""
    from megascale_jax.supervise.redis_server import EmbeddedRedis

    server = EmbeddedRedis(str(tmp_path / "redis"))
    try:
        code, calls, out = sbatch(tmp_path, 1, None, python=sys.executable, redis_url=server.url)
    finally:
        server.stop()
    assert code == 1 and "FAIL: no result" in out and "unchanged" in out, out
    assert not (tmp_path / "run" / "excluded_hosts.txt").exists()
    assert calls == ["requeue 42"]


def test_the_jobset_keeps_pods_off_labelled_nodes():
    with open(os.path.join(REPO, "configs/cluster/jobset.yaml")) as f:
        jobset = yaml.safe_load(f)
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "megascale-jax/excluded", "operator": "DoesNotExist"} in terms[0]["matchExpressions"]


def test_collect_refuses_bad_input_in_one_line(run_main):
    from megascale_jax.supervise.diagnose import main

    code, out, err = run_main(main, ["--collect", "job", "--nprocs", "2"], REPO)
    assert code == 2 and err.count("\n") == 1 and "--collect reads the workers' results from Redis" in err
    code, out, err = run_main(main, ["--collect", "job", "--nprocs", "2", "--redis", "redis://r:1",
                                     "--hosts", "a,b,c"], REPO)
    assert code == 2 and err.count("\n") == 1 and "--hosts names 3 host(s) for --nprocs=2" in err
