"""The cluster recipes hand excluded hosts to the scheduler (configs/cluster/)."""

import os
import re
import stat
import subprocess
import sys

import yaml

from megascale_jax import run_dir as run_dirs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fake(bin_dir, name, body):
    path = os.path.join(bin_dir, name)
    with open(path, "w") as f:
        f.write("#!/bin/bash\n" + body)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)


# The node list a fake `scontrol show hostnames` prints; rank i runs on NODES[i].
NODES = ["node0", "node1"]


# The password of a Redis the fakes never reach; tests of a real server pass its `env` instead.
UNUSED_PASSWORD = {"MEGASCALE_REDIS_PASSWORD": "never-sent"}


def sbatch(tmp_path, srun_exit: int, excluded: list[str] | None, srun: str | None = None,
           python: str | None = None, redis_url: str = "redis://r:6379", overrides=(), redis_env=UNUSED_PASSWORD):
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
    env = {**without_redis_credentials(os.environ), **redis_env, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "REDIS_URL": redis_url, "RUN_DIR": str(run_dir), "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "j",
           "SLURM_NTASKS": str(len(NODES)), "SLURM_JOB_NODELIST": "node[0-1]", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(["bash", os.path.join(REPO, "configs/cluster/sbatch.sh"), "configs/tiny_cpu.yaml",
                           *overrides], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    return done.returncode, calls.read_text().splitlines() if calls.exists() else [], done.stdout + done.stderr


def without_redis_credentials(env) -> dict:
    """`env` less what an embedded server of this test process exported: each test says its own."""
    return {k: v for k, v in env.items() if k not in ("MEGASCALE_REDIS_PASSWORD", "MEGASCALE_REDIS_PASSWORD_FILE")}


def test_sbatch_without_a_redis_password_stops_before_any_step(tmp_path):
    """Checked once, before srun: a failed step would be diagnosed and requeued over and over."""
    code, calls, out = sbatch(tmp_path, 0, None, srun="echo srun ran\n", redis_env={})
    assert code == 2 and out.strip().splitlines() == [
        "error: the job's Redis needs a password: set MEGASCALE_REDIS_PASSWORD_FILE to a file (chmod 600) holding it"]
    assert calls == []


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
    while [ "${{1#--}}" != "$1" ]; do shift; done  # srun's own options (--label --kill-on-bad-exit=0)
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
                                  redis_url=server.url, redis_env=server.env, overrides=["mesh.dp=2", "mesh.tp=1",
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
        code, calls, out = sbatch(tmp_path, 1, None, python=sys.executable, redis_url=server.url,
                                  redis_env=server.env)
    finally:
        server.stop()
    assert code == 1 and "FAIL: no result" in out and "unchanged" in out, out
    assert not (tmp_path / "run" / "excluded_hosts.txt").exists()
    assert calls == ["requeue 42"]


def jobset_documents() -> dict:
    with open(os.path.join(REPO, "configs/cluster/jobset.yaml")) as f:
        return {d["kind"]: d for d in yaml.safe_load_all(f)}


def test_the_jobset_keeps_pods_off_the_nodes_its_pods_label():
    """The label the pods' pre-flight sets is the one their node affinity avoids, and the pods'
    ServiceAccount may set it."""
    docs = jobset_documents()
    pod = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "megascale-jax/excluded", "operator": "DoesNotExist"} in terms[0]["matchExpressions"]
    with open(os.path.join(REPO, "configs/cluster/jobset_worker.sh")) as f:
        assert "kubectl label node --overwrite {host} megascale-jax/excluded=true" in f.read()
    container = pod["containers"][0]
    assert container["command"][:2] == ["bash", "configs/cluster/jobset_worker.sh"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NUM_PROCESSES"]["value"] == str(docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"])
    assert pod["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
    binding = docs["ClusterRoleBinding"]
    assert binding["subjects"][0]["name"] == docs["ServiceAccount"]["metadata"]["name"]
    assert binding["roleRef"]["name"] == docs["ClusterRole"]["metadata"]["name"]
    assert {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]} in docs["ClusterRole"]["rules"]


def test_the_cluster_recipes_reach_redis_with_a_password_from_a_secret_over_tls():
    """The examples a user copies: TLS with the CA named, a user but no password in the URL, the
    password a file on a Secret volume; SLURM's reads it from a file in the environment too."""
    import urllib.parse

    pod = jobset_documents()["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    url = urllib.parse.urlsplit(env["REDIS_URL"])
    assert url.scheme == "rediss" and url.username and url.password is None
    ca = urllib.parse.parse_qs(url.query)["ssl_ca_certs"][0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    secret = next(v for v in pod["volumes"] if "secret" in v)
    assert os.path.dirname(ca) == os.path.dirname(env["MEGASCALE_REDIS_PASSWORD_FILE"]) == mounts[secret["name"]]
    with open(os.path.join(REPO, "configs/cluster/sbatch.sh")) as f:
        text = f.read()
    assert "export REDIS_URL='rediss://" in text and "MEGASCALE_REDIS_PASSWORD_FILE=" in text


def jobset_pod_env(pod_index: int, node: str, restart_attempt: int = 0, job_index: int = 0) -> dict:
    """The environment jobset.yaml's container gets in pod `pod_index` of Job `job_index` on
    `node`, as a JobSet (v0.12.0) and Kubernetes make it: the JobSet controller labels and
    annotates the pod template (jobset.sigs.k8s.io/jobset-name, .../restart-attempt, ...), the
    Job controller of an Indexed Job adds JOB_COMPLETION_INDEX (a fieldRef to the annotation
    batch.kubernetes.io/job-completion-index) and the hostname <job>-<index> in the subdomain
    <jobset> (enableDNSHostnames, on by default), the scheduler sets spec.nodeName, and the
    kubelet resolves the container's `env` (values, and the downward API's fieldRefs)."""
    js = jobset_documents()["JobSet"]
    rjob = js["spec"]["replicatedJobs"][0]
    job = f"{js['metadata']['name']}-{rjob['name']}-{job_index}"  # placement.GenJobName
    stamped = {"jobset.sigs.k8s.io/jobset-name": js["metadata"]["name"],
               "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
               "jobset.sigs.k8s.io/restart-attempt": str(restart_attempt),
               "jobset.sigs.k8s.io/job-index": str(job_index),
               "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob["replicas"])}
    pod = {"metadata": {"name": f"{job}-{pod_index}-abcde", "namespace": "default",
                        "labels": {**stamped, "batch.kubernetes.io/job-completion-index": str(pod_index)},
                        "annotations": {**stamped, "batch.kubernetes.io/job-completion-index": str(pod_index)}},
           "spec": {"nodeName": node, "hostname": f"{job}-{pod_index}", "subdomain": js["metadata"]["name"]}}
    container = rjob["template"]["spec"]["template"]["spec"]["containers"][0]
    entries = [*container["env"], {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}]
    env = {"HOSTNAME": pod["spec"]["hostname"]}
    for entry in entries:
        env[entry["name"]] = entry["value"] if "value" in entry else downward(pod, entry["valueFrom"]["fieldRef"]["fieldPath"])
    return env


def downward(pod: dict, field_path: str) -> str:
    """A downward-API fieldRef of a container's env, as the kubelet resolves it (the paths env
    supports; anything else is refused by the API server, and here)."""
    keyed = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", field_path)
    if keyed:
        return pod["metadata"][keyed[1]].get(keyed[2], "")  # an absent key is an empty value
    plain = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"]["namespace"],
             "spec.nodeName": pod["spec"]["nodeName"]}
    assert field_path in plain, f"fieldRef {field_path!r}: not a path this test (or env's downward API) resolves"
    return plain[field_path]


def run_jobset_worker(tmp_path, pod_index: int, env: dict, config="configs/gpt_1b.yaml", overrides=()):
    """jobset_worker.sh with `env`, a fake `kubectl` and a `python` that records its arguments,
    one call a line (arguments NUL-separated); returns (exit code, output, the calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / f"python{pod_index}.calls"
    fake(bin_dir, "kubectl", f'echo "$@" >> {tmp_path}/kubectl.calls\n')
    fake(bin_dir, "python", f'printf "%s\\0" "$@" >> {calls}; echo >> {calls}\n')
    done = subprocess.run(["bash", os.path.join(REPO, "configs/cluster/jobset_worker.sh"), config, *overrides],
                          env={"PATH": f"{bin_dir}:{os.environ['PATH']}", **env}, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return done.returncode, done.stdout + done.stderr, [line.split("\0")[:-1] for line in lines]


def options(argv: list[str]) -> dict:
    return {a: argv[i + 1] for i, a in enumerate(argv) if a.startswith("--") and i + 1 < len(argv)}


def test_jobset_worker_starts_preflight_and_training_from_the_jobsets_environment(tmp_path):
    """Each pod, with the environment the JobSet gives it and nothing else: pre-flight, then
    training, as rank = its completion index of NUM_PROCESSES = the Job's parallelism, under a
    job id of the set's name and restart attempt (a restarted set never meets its old keys), with
    the Redis of jobset.yaml and no coordinator: rank 0 publishes its own address through Redis."""
    js = jobset_documents()["JobSet"]
    job_spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    command = job_spec["template"]["spec"]["containers"][0]["command"]
    config, overrides = command[2], command[3:]
    ranks = []
    for index, node in enumerate(NODES[:job_spec["parallelism"]]):
        env = jobset_pod_env(index, node, restart_attempt=2)
        assert env["HOSTNAME"] == f"megascale-jax-workers-0-{index}" and env["JOBSET_RESTART_ATTEMPT"] == "2"
        code, out, calls = run_jobset_worker(tmp_path, index, env, config, overrides)
        assert code == 0, out
        assert [c[:2] for c in calls] == [["-m", "megascale_jax.preflight"], ["-m", "megascale_jax.train"]], calls
        for argv, job in zip(calls, ["megascale-jax-2-preflight", "megascale-jax-2"]):
            assert argv[2:4 + len(overrides)] == ["--config", config, *overrides], argv
            opts = options(argv)
            assert opts["--job"] == job and opts["--redis"] == env["REDIS_URL"], argv
            assert opts["--num-processes"] == str(job_spec["parallelism"]) == str(job_spec["completions"]), argv
            assert opts["--run-dir"] == "/shared/runs/megascale-jax", argv
            assert "--coordinator" not in opts, argv
        assert options(calls[0])["--host"] == node, calls[0]  # what a faulty node is labelled by
        ranks.append(int(options(calls[1])["--process-id"]))
        assert options(calls[0])["--process-id"] == str(ranks[-1])
    assert ranks == list(range(job_spec["parallelism"]))
    assert not (tmp_path / "kubectl.calls").exists()  # nothing excluded: no node labelled


def test_rank_0_of_a_jobset_advertises_its_pods_address(monkeypatch):
    """The coordinator rank 0 publishes is the address its pod name resolves to in the pod (its
    /etc/hosts: the pod IP), which every other pod can reach; not the bare pod hostname, which
    resolves only as <hostname>.<subdomain> from other pods."""
    from megascale_jax.cluster import rendezvous

    env = jobset_pod_env(0, "node0")
    hosts = {env["HOSTNAME"]: "10.4.2.17"}  # the kubelet's /etc/hosts line for the pod
    monkeypatch.setattr(rendezvous.socket, "gethostname", lambda: env["HOSTNAME"])
    monkeypatch.setattr(rendezvous.socket, "gethostbyname", lambda name: hosts[name])
    assert rendezvous._advertised_host(env["REDIS_URL"]) == "10.4.2.17"


def test_jobset_worker_names_what_a_pod_lacks(tmp_path):
    """Without the Secret's password file in the environment: one line, exit 2, nothing started."""
    env = {k: v for k, v in jobset_pod_env(0, "node0").items() if k != "MEGASCALE_REDIS_PASSWORD_FILE"}
    code, out, calls = run_jobset_worker(tmp_path, 0, env)
    assert code == 2 and calls == [] and out.count("\n") == 1 and "MEGASCALE_REDIS_PASSWORD_FILE" in out, out


def jobset_pods(tmp_path, redis_url: str, excluded: list[str] | None = None, overrides=(), redis_env=UNUSED_PASSWORD):
    """Run configs/cluster/jobset_worker.sh as the JobSet's pods on NODES, all at once, with a fake
    `kubectl` (its calls recorded) and a `python` whose training only says it started; returns
    (exit code per pod, kubectl calls, output per pod, excluded_hosts.txt's lines)."""
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run"  # run_dir: created by the first write
    bin_dir.mkdir()
    calls = tmp_path / "kubectl.calls"
    fake(bin_dir, "kubectl", f'echo "$@" >> {calls}\n')
    fake(bin_dir, "python", f'case "$*" in *megascale_jax.train*) echo "training as rank $JOB_COMPLETION_INDEX"; '
                            f'exit 0 ;; esac\nexec {sys.executable} "$@"\n')
    if excluded is not None:
        run_dir.mkdir()
        (run_dir / "excluded_hosts.txt").write_text("".join(h + "\n" for h in excluded))
    pods = []
    for index, node in enumerate(NODES):
        env = {**without_redis_credentials(os.environ), **jobset_pod_env(index, node), **redis_env,
               "PATH": f"{bin_dir}:{os.environ['PATH']}", "REDIS_URL": redis_url, "RUN_DIR": str(run_dir),
               "JAX_PLATFORMS": "cpu",
               "MEGASCALE_DIAG_FAULT": "1"}  # node 1's device computes wrong values in every collective
        if "MEGASCALE_REDIS_PASSWORD" in redis_env:  # the jobset.yaml's Secret file is not here
            env.pop("MEGASCALE_REDIS_PASSWORD_FILE")
        pods.append(subprocess.Popen(["bash", os.path.join(REPO, "configs/cluster/jobset_worker.sh"),
                                      "configs/tiny_cpu.yaml", *overrides], env=env, cwd=REPO, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [pod.communicate(timeout=300)[0] for pod in pods]
    excluded_path = run_dir / "excluded_hosts.txt"
    return ([pod.returncode for pod in pods], calls.read_text().splitlines() if calls.exists() else [], outs,
            excluded_path.read_text().splitlines() if excluded_path.exists() else None)


SMALL = ["mesh.dp=2", "mesh.tp=1", "model.layers=2", "model.d_model=64"]


def test_jobset_pods_exclude_the_faulty_node_before_training(tmp_path):
    """The Kubernetes side of eviction: every pod runs the checks before training; the node with
    corrupt collectives is listed and labelled, its pod exits 3 (the JobSet restarts off it) and
    the healthy pod goes on to train."""
    from megascale_jax.supervise.redis_server import EmbeddedRedis

    server = EmbeddedRedis(str(tmp_path / "redis"))
    try:
        codes, calls, outs, excluded = jobset_pods(tmp_path, server.url, overrides=SMALL, redis_env=server.env)
    finally:
        server.stop()
    assert codes == [0, 3], outs
    assert "training as rank 0" in outs[0] and "training" not in outs[1], outs
    assert "faulty hosts: node1" in outs[0] and "node1 is faulty" in outs[1], outs
    assert excluded == ["node1"]
    assert set(calls) == {"label node --overwrite node1 megascale-jax/excluded=true"}, calls
    events = run_dirs.read_jsonl(str(tmp_path / "run" / "events.jsonl"))
    assert [(e["kind"], e["host"], e["source"]) for e in events] == [("evict", "node1", "preflight")], events
    assert events[0]["reason"] == "rank 1: wrong values in collectives over dp (seen by rank 0)"


def test_a_pod_on_a_listed_node_leaves_without_checks(tmp_path):
    """A node already in excluded_hosts.txt (found faulty by an earlier attempt, or on SLURM) is
    labelled again and its pod exits 3 at once; the other pod cannot assemble the checks and
    exits 1 without blaming anyone (the JobSet restarts the set)."""
    codes, calls, outs, excluded = jobset_pods(tmp_path, "redis://127.0.0.1:1", excluded=["node1"], overrides=SMALL)
    assert codes == [1, 3], outs
    assert "node1 is listed" in outs[1], outs
    assert outs[0].strip().splitlines()[-1].startswith("error: preflight cannot use Redis"), outs[0]
    assert excluded == ["node1"] and calls == ["label node --overwrite node1 megascale-jax/excluded=true"]


def test_preflight_refuses_bad_input_in_one_line(run_main, tmp_path):
    from megascale_jax.supervise.preflight import main

    base = ["--redis", "redis://127.0.0.1:1", "--job", "j", "--num-processes", "2", "--host", "n",
            "--run-dir", str(tmp_path)]
    code, out, err = run_main(main, [*base, "--process-id", "2"], REPO)
    assert code == 2 and err.count("\n") == 1 and "--process-id=2 must be in [0, --num-processes=2)" in err
    code, out, err = run_main(main, [*base, "--process-id", "0", "mesh.dp=banana"], REPO)
    assert code == 2 and err.count("\n") == 1 and "mesh.dp" in err, err
    assert list(tmp_path.iterdir()) == []


def test_collect_refuses_bad_input_in_one_line(run_main):
    from megascale_jax.supervise.diagnose import main

    code, out, err = run_main(main, ["--collect", "job", "--nprocs", "2"], REPO)
    assert code == 2 and err.count("\n") == 1 and "--collect reads the workers' results from Redis" in err
    code, out, err = run_main(main, ["--collect", "job", "--nprocs", "2", "--redis", "redis://r:1",
                                     "--hosts", "a,b,c"], REPO)
    assert code == 2 and err.count("\n") == 1 and "--hosts names 3 host(s) for --nprocs=2" in err


def test_preflight_names_a_peer_that_hangs_in_its_checks(tmp_path, monkeypatch, run_main):
    """A worker that hangs after it registered its host (a GPU stuck in a collective) never
    reports: after --wait-s the others name its host, from the registration, and go on; this
    worker's own checks process is stopped, not left behind."""
    import json

    from megascale_jax.cluster import rendezvous
    from megascale_jax.supervise import preflight
    from megascale_jax.supervise.redis_server import EmbeddedRedis

    server = EmbeddedRedis(str(tmp_path / "redis"))
    started = []

    def checks_that_report_then_linger(args):
        result = {"rank": 0, "host": "pod-0", "pid": 1, "axes": {},
                  "self_test": {"ok": True, "seconds": 0.1, "gflops": 1.0}}
        rendezvous.connect(args.redis).set(rendezvous.key(args.job, "diag", 0), json.dumps(result))
        started.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
        return started[-1]

    monkeypatch.setattr(preflight, "run_checks", checks_that_report_then_linger)
    monkeypatch.setenv("MEGASCALE_REDIS_PASSWORD_FILE", server.password_file)
    try:
        rendezvous.connect(server.url).set(preflight.host_key("j", 1), "node1")  # rank 1 registered, then hung
        excluded = tmp_path / "excluded_hosts.txt"
        code, out, err = run_main(preflight.main, ["--redis", server.url, "--job", "j", "--num-processes", "2",
                                                   "--process-id", "0", "--host", "node0", "--wait-s", "0.5",
                                                   "--run-dir", str(tmp_path),
                                                   "--exclude-command", f"bash -c 'echo {{host}} >> {tmp_path}/calls'"],
                                  REPO)
    finally:
        server.stop()
    assert code == 0, (out, err)
    assert "rank 1: no result" in out and "faulty hosts: node1" in out, out
    assert excluded.read_text().splitlines() == ["node1"]
    assert (tmp_path / "calls").read_text().splitlines() == ["node1"]
    assert started[0].poll() is not None  # killed
