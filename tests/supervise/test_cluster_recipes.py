"""The cluster recipes hand excluded hosts to the scheduler (configs/cluster/)."""

import os
import stat
import subprocess

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fake(bin_dir, name, body):
    path = os.path.join(bin_dir, name)
    with open(path, "w") as f:
        f.write("#!/bin/bash\n" + body)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)


def sbatch(tmp_path, srun_exit: int, excluded: list[str] | None):
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    run_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    fake(bin_dir, "srun", f"exit {srun_exit}\n")
    fake(bin_dir, "scontrol", f'echo "$@" >> {calls}\n')
    if excluded is not None:
        (run_dir / "excluded_hosts.txt").write_text("".join(h + "\n" for h in excluded))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "REDIS_URL": "redis://r:6379",
           "RUN_DIR": str(run_dir), "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "j"}
    done = subprocess.run(["bash", os.path.join(REPO, "configs/cluster/sbatch.sh"), "configs/tiny_cpu.yaml"],
                          env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, calls.read_text().splitlines() if calls.exists() else []


def test_a_failed_job_is_requeued_without_the_excluded_hosts(tmp_path):
    code, calls = sbatch(tmp_path, 1, ["node7", "node3", "node7"])
    assert code == 1
    assert calls == ["update JobId=42 ExcNodeList=node3,node7", "requeue 42"]


def test_a_failed_job_with_nothing_excluded_is_requeued_as_it_was(tmp_path):
    code, calls = sbatch(tmp_path, 3, None)
    assert code == 3 and calls == ["requeue 42"]


def test_a_finished_job_is_not_requeued(tmp_path):
    code, calls = sbatch(tmp_path, 0, ["node7"])
    assert code == 0 and calls == []


def test_the_jobset_keeps_pods_off_labelled_nodes():
    with open(os.path.join(REPO, "configs/cluster/jobset.yaml")) as f:
        jobset = yaml.safe_load(f)
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "megascale-jax/excluded", "operator": "DoesNotExist"} in terms[0]["matchExpressions"]
