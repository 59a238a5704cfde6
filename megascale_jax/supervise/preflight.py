"""`python -m megascale_jax.preflight --redis URL --job JOB --num-processes N --process-id I
--host NODE --run-dir DIR [--exclude-command CMD] [--config YAML] [overrides]`

Diagnostics before training, for a job whose workers a scheduler starts with no driver process
to run them after a fault (a Kubernetes JobSet restarts its pods itself: configs/cluster/
jobset_worker.sh). Each worker, before it trains:
1. records its host in Redis, so that a worker that hangs in the checks is still named;
2. runs the diagnostics' checks as one of the job's N workers (`diagnose --worker`, in a child
   process: a hung peer must not hold this one in jax's shutdown barrier);
3. waits until all N have reported, at most --wait-s;
4. reads the report every worker reads, appends the faulty hosts RUN_DIR/excluded_hosts.txt does
   not list yet (with an `evict` event each in RUN_DIR/events.jsonl), and runs --exclude-command
   for each faulty host (`{host}` replaced; e.g. `kubectl label node --overwrite
   {host} megascale-jax/excluded=true`, which the JobSet's node affinity then avoids). Every
   worker that got this far does this, so the command must be idempotent: the faulty worker
   itself excludes its host before it exits, so its host is excluded before the scheduler
   restarts the job, whoever else is killed first;
5. exits 3 when its own host is faulty (the pod fails; the scheduler restarts the job elsewhere),
   0 when it is healthy. A host excluded_hosts.txt already lists exits 3 at once, without the
   checks.

Exit 1 when the checks could not run here (the rendezvous timed out, Redis is down): nobody is
blamed for that. Exit 2 for bad input, a Redis password that is missing or refused included.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import redis

from megascale_jax import cli, run_dir as run_dirs
from megascale_jax.cluster import redis_auth, rendezvous
from megascale_jax.config import ConfigError, load_config
from megascale_jax.supervise import diagnose
from megascale_jax.supervise.events import EventLog

FAULTY_EXIT = 3


def host_key(job: str, rank: int) -> str:
    return rendezvous.key(job, "preflight_host", rank)


def run_checks(args) -> subprocess.Popen:
    """This worker's diagnostics process, in its own session (stopped with its children)."""
    command = [sys.executable, "-m", "megascale_jax.diagnose", "--worker", "--redis", args.redis, "--job", args.job,
               "--num-processes", str(args.num_processes), "--process-id", str(args.process_id),
               *([] if args.config is None else ["--config", args.config]), *args.overrides]
    return subprocess.Popen(command, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def wait_for_reports(client: redis.Redis, args, checks: subprocess.Popen) -> None:
    """Until every worker reported, or --wait-s after this one's checks ended or reported (the
    rendezvous before the checks has its own timeout: a pod still being scheduled is not late)."""
    ours = rendezvous.key(args.job, "diag", args.process_id)
    ready_since = None
    while True:
        if diagnose.all_reported(client, args.job, args.num_processes):
            return
        if ready_since is None and (checks.poll() is not None or client.exists(ours)):
            ready_since = time.time()
        if ready_since is not None and time.time() - ready_since > args.wait_s:
            return
        time.sleep(0.2)


def exclude(found: dict[str, str], args) -> None:
    """`found`: faulty host -> why. Append the hosts excluded_hosts.txt lacks, with an event each,
    and run the exclude command for every one of them (it may have failed before)."""
    os.makedirs(args.run_dir, exist_ok=True)  # a first attempt's checks run before training creates it
    for host in run_dirs.append_new_lines(run_dirs.excluded_hosts_path(args.run_dir), list(found)):
        EventLog(args.run_dir).log("evict", f"{host} excluded for the rest of the job (pre-flight diagnostics): "
                                            f"{found[host]}", host=host, reason=found[host], source="preflight")
    for host in found:
        if not args.exclude_command:
            continue
        command = [part.replace("{host}", host) for part in shlex.split(args.exclude_command)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
            failure = None if done.returncode == 0 else (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        except (OSError, subprocess.TimeoutExpired) as e:
            failure = cli.one_line(e)
        if failure:
            print(f"warning: could not exclude {host} ({shlex.join(command)}: {failure}); the scheduler may "
                  "place the job on it again", flush=True)


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m megascale_jax.preflight", description=__doc__.splitlines()[0])
    parser.add_argument("--redis", required=True, help="redis://[USER@]HOST:PORT or rediss://..., its password in "
                                                       f"${redis_auth.PASSWORD_FILE_ENV} or ${redis_auth.PASSWORD_ENV}")
    parser.add_argument("--job", required=True, help="this check's job id, the same for all workers and new for "
                                                     "every attempt (not the training's)")
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True, help="this worker's rank (the pod's index)")
    parser.add_argument("--host", required=True, help="the node this worker runs on, as the scheduler names it")
    parser.add_argument("--run-dir", required=True, help="the training's run directory (shared by all workers): "
                                                          "excluded_hosts.txt and events.jsonl")
    parser.add_argument("--exclude-command", default=None, help="run for each faulty host, {host} replaced")
    parser.add_argument("--wait-s", type=float, default=120.0,
                        help="how long to wait for the other workers' results after this one's")
    parser.add_argument("--config", default=None, help="YAML config whose mesh is tested (default: tiny_cpu)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. mesh.dp=4 mesh.tp=2")
    args = cli.parse(parser, argv)
    if not 0 <= args.process_id < args.num_processes:
        return cli.user_error(f"--process-id={args.process_id} must be in [0, --num-processes={args.num_processes})")
    try:
        load_config(args.config, args.overrides)  # before the checks: a typo is the user's, not the node's
    except ConfigError as e:
        return cli.user_error(e)
    excluded_path = run_dirs.excluded_hosts_path(args.run_dir)
    if args.host in run_dirs.read_lines(excluded_path):
        print(f"preflight: {args.host} is listed in {excluded_path}: not training on it", flush=True)
        exclude({args.host: "listed before"}, args)
        return FAULTY_EXIT
    checks = None
    try:
        client = rendezvous.connect(args.redis, timeout_s=5.0)
        redis_auth.verify(client, args.redis)
        client.set(host_key(args.job, args.process_id), args.host, ex=rendezvous.KEY_TTL_S)
        checks = run_checks(args)
        wait_for_reports(client, args, checks)
        report = diagnose.collect(args.redis, args.job, args.num_processes, {})
        if not report.results:
            return cli.user_error("no worker reported (the rendezvous or Redis failed): nothing is excluded", 1)
        hosts = [None if h is None else h.decode() for h in
                 client.mget([host_key(args.job, r) for r in range(args.num_processes)])]
    except redis_auth.RedisAuthError as e:  # the job's credentials, not the node: fix them, nobody is blamed
        return cli.user_error(e)
    except redis.RedisError as e:
        return cli.user_error(f"preflight cannot use Redis at {redis_auth.redact(args.redis)}: {cli.one_line(e)}", 1)
    finally:
        if checks is not None:
            stop(checks)
    print(report.table(), flush=True)
    faulty = {hosts[rank]: f"rank {rank}: {why}" for rank, why in report.faulty().items() if hosts[rank]}
    print(f"preflight: faulty hosts: {', '.join(faulty) or 'none'}", flush=True)
    exclude(faulty, args)
    if args.host in faulty:
        print(f"preflight: {args.host} is faulty; excluded (listed in {excluded_path})", flush=True)
        return FAULTY_EXIT
    return 0
