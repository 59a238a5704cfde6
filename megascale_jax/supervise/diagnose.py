"""`python -m megascale_jax.diagnose --nprocs N [--config YAML] [--redis URL] [overrides]`

Self-checks that find the faulty process (MegaScale §4.3), run on demand or by the supervisor
after a fault: N worker processes join through Redis like a training job and
* test every local device: a matmul against numpy's float64 result;
* test every mesh axis of size > 1 with known values (device value = 1 + its position in the
  mesh): all-reduce (psum), all-gather and a ring ppermute, and time an all-reduce of 1 MiB per
  device (bus bandwidth = 2(n-1)/n x bytes / time).
The all-gather and ppermute say *whose* contribution was wrong, so a corrupt rank is named by its
peers, not only by itself; a rank that reports nothing, fails its self-test or is more than
`SLOW_FACTOR` x slower than the median is named too. Prints a pass/fail and bandwidth table per
rank and axis; exit code 1 when a rank is faulty.

On a cluster the scheduler starts the workers (`--worker`, one per node, as in
configs/cluster/sbatch.sh) and `--collect JOB` reads their results from Redis afterwards (on
Kubernetes `python -m megascale_jax.preflight` runs them before training instead). With
`--excluded-hosts FILE` (RUN_DIR/excluded_hosts.txt) the faulty ranks' hosts are appended to FILE,
which the cluster recipes hand to the scheduler; `--hosts` names each rank's host (the node list)
so that a rank that never reported is still named. When no rank reported at all, nothing is
excluded: that is a broken diagnostics step (Redis, the launch), not evidence against every node.

Test-only: `MEGASCALE_DIAG_FAULT=<rank>[,<rank>...]` makes those ranks contribute wrong values to every
collective (the supervisor's `faulty` drill: supervise/drills.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import time

import redis

from megascale_jax import cli, run_dir as run_dirs
from megascale_jax.cluster import redis_auth, rendezvous
from megascale_jax.cluster.self_test import device_self_test, fastest_seconds
from megascale_jax.config import ConfigError, load_config
from megascale_jax.observe.hangs import describe_exit
from megascale_jax.supervise.workers import StandbyPool, WorkerGroup, per_process_overrides, worker_env

AXES = ("dp", "pp", "cp", "tp")  # parallel.mesh.AXES, not imported: the driver side never imports jax
FAULT_ENV = "MEGASCALE_DIAG_FAULT"
SLOW_FACTOR = 3.0
BANDWIDTH_BYTES = 1 << 20


# ============================================================================ worker side


def collective_checks(mesh, corrupt: bool) -> dict[str, dict]:
    """Per mesh axis of size > 1: correctness of psum/all_gather/ppermute on this process's
    devices (with the ranks whose contributions were wrong) and all-reduce bandwidth."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    spec = P(*AXES)
    values = np.arange(1, mesh.size + 1, dtype=np.float32).reshape(mesh.devices.shape)
    column = values[..., None]  # one value per device
    x = jax.make_array_from_callback(column.shape, NamedSharding(mesh, spec),
                                     lambda index: column[index] + (1000.0 if corrupt else 0.0))
    rank_of = np.vectorize(lambda d: d.process_index)(mesh.devices)
    results = {}
    for axis_index, axis in enumerate(AXES):
        n = mesh.shape[axis]
        if n == 1:
            continue
        ring = [(i, (i + 1) % n) for i in range(n)]

        def check(v, axis=axis, ring=ring):
            gathered = jax.lax.all_gather(v, axis, axis=len(AXES), tiled=True)  # (1, 1, 1, 1, n): slot i = member i
            return jax.lax.psum(v, axis), gathered, jax.lax.ppermute(v, axis, ring)

        sums, gathered, shifted = jax.jit(jax.shard_map(
            check, mesh=mesh, in_specs=spec, out_specs=(spec, P(*AXES, None), spec), check_vma=False))(x)
        errors, blamed = [], set()
        for s, g, p in zip(sums.addressable_shards, gathered.addressable_shards, shifted.addressable_shards):
            coord = tuple(sl.start or 0 for sl in s.index[:len(AXES)])
            group = [coord[:axis_index] + (i,) + coord[axis_index + 1:] for i in range(n)]
            if not np.isclose(float(np.asarray(s.data).ravel()[0]), sum(values[c] for c in group)):
                errors.append(f"psum at {coord}")
            for i, got in enumerate(np.asarray(g.data).ravel()):
                if got != values[group[i]]:
                    errors.append(f"all_gather slot {i} at {coord}")
                    blamed.add(int(rank_of[group[i]]))
            source = group[(coord[axis_index] - 1) % n]
            if float(np.asarray(p.data).ravel()[0]) != values[source]:
                errors.append(f"ppermute from {source} at {coord}")
                blamed.add(int(rank_of[source]))
        results[axis] = {"ok": not errors, "errors": errors[:5], "blamed_ranks": sorted(blamed),
                         **_allreduce_bandwidth(mesh, axis)}
    return results


def _allreduce_bandwidth(mesh, axis: str, reps: int = 3) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    n, width = mesh.shape[axis], BANDWIDTH_BYTES // 4
    spec = P(*AXES, None)
    buffer = jax.jit(lambda: jnp.ones((*mesh.devices.shape, width), jnp.float32),
                     out_shardings=NamedSharding(mesh, spec))()
    allreduce = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, axis), mesh=mesh, in_specs=spec, out_specs=spec,
                                      check_vma=False))
    allreduce(buffer).block_until_ready()
    seconds = fastest_seconds(lambda: allreduce(buffer).block_until_ready(), reps)
    return {"allreduce_ms": seconds * 1e3, "busbw_gbps": 2 * (n - 1) / n * BANDWIDTH_BYTES / seconds / 1e9}


def warm_up() -> None:
    """What a diagnostics worker imports only once it runs, imported ahead by a warm standby
    process (cluster/standby.py; the supervisor keeps one per active slot), so that diagnostics
    after a fault pay for no imports (`python -m bench.resilience.diagnose`). The backend is not started:
    the device count is still free."""
    import jax.numpy  # noqa: F401
    import jax.sharding  # noqa: F401

    import megascale_jax.parallel.mesh  # noqa: F401


def worker_main(args) -> int:
    """One diagnostics process: join, test, write the result to Redis."""
    import jax

    from megascale_jax.parallel.mesh import make_mesh, use_cpu_devices

    cfg = load_config(args.config, args.overrides)
    use_cpu_devices(cfg.mesh.cpu_devices_per_process(args.num_processes))
    member = rendezvous.join(args.redis, args.job, args.num_processes, args.process_id)
    if args.num_processes > 1:
        rendezvous.start_distributed(member.coordinator, args.num_processes, member.rank)
    corrupt = str(member.rank) in os.environ.get(FAULT_ENV, "").split(",")
    result = {"rank": member.rank, "host": socket.gethostname(), "pid": os.getpid(), "self_test": device_self_test(),
              "axes": collective_checks(make_mesh(cfg.mesh), corrupt)}
    rendezvous.connect(args.redis).set(rendezvous.key(args.job, "diag", member.rank), json.dumps(result),
                                       ex=rendezvous.KEY_TTL_S)
    return 0


# ============================================================================ driver side


@dataclasses.dataclass
class Report:
    nprocs: int
    results: dict[int, dict]  # rank -> its result; a rank that reported nothing is absent
    exits: dict[int, int]  # exit codes of the workers that ended
    duration_s: float

    def faulty(self) -> dict[int, str]:
        """Rank -> why it is suspect."""
        found: dict[int, str] = {}
        for rank in range(self.nprocs):
            if rank not in self.results:
                code = self.exits.get(rank)
                # No exit code: still running when the driver gave up, or started by a scheduler.
                found[rank] = "no result" + (f" ({describe_exit(code)})" if code is not None else "")
        for rank, result in self.results.items():
            if not result["self_test"]["ok"]:
                found[rank] = "device self-test (matmul) mismatch"
            for axis, check in result["axes"].items():
                for blamed in check["blamed_ranks"]:
                    found.setdefault(blamed, f"wrong values in collectives over {axis} (seen by rank {rank})")
        times = sorted(r["self_test"]["seconds"] for r in self.results.values())
        if len(times) > 1:
            median = times[len(times) // 2]
            for rank, result in self.results.items():
                ratio = result["self_test"]["seconds"] / median
                if ratio > SLOW_FACTOR:
                    found.setdefault(rank, f"{ratio:.1f}x slower than the median at the device self-test")
        return dict(sorted(found.items()))

    def table(self) -> str:
        axes = [a for a in AXES if any(a in r["axes"] for r in self.results.values())]
        header = f"{'rank':>4}  {'host':<14}{'matmul':<18}" + "".join(f"{a + ' all-reduce':<30}" for a in axes)
        lines = [header]
        for rank in range(self.nprocs):
            r = self.results.get(rank)
            if r is None:
                lines.append(f"{rank:>4}  FAIL: no result")
                continue
            st = r["self_test"]
            row = f"{rank:>4}  {r['host'][:13]:<14}" + f"{_verdict(st)} {st['gflops']:.1f} GF/s".ljust(18)
            for a in axes:
                c = r["axes"][a]
                row += f"{_verdict(c)} {c['busbw_gbps']:.3f} GB/s {c['allreduce_ms']:.1f} ms".ljust(30)
            lines.append(row)
        faulty = self.faulty()
        lines.append("verdict: " + ("; ".join(f"rank {r}: {why}" for r, why in faulty.items()) if faulty
                                    else "all ranks healthy"))
        return "\n".join(lines)


def _verdict(check: dict) -> str:
    return "ok" if check["ok"] else "FAIL"


def run(args: list[str], nprocs: int, redis_url: str, job: str, env: dict, log_dir: str,
        timeout_s: float = 180.0, grace_s: float = 15.0, pool: StandbyPool | None = None,
        slots: list[int] | None = None) -> Report:
    """Run the checks on `nprocs` processes (`args`: --config and per-process overrides); with a
    `pool` of warm processes (module megascale_jax.supervise.diagnose), rank i runs in slot
    `slots[i]`'s."""
    start = time.time()
    env = {**env, **redis_auth.credentials_env()}  # this process's way to the password (an `env` taken earlier lacks it)
    group = WorkerGroup("megascale_jax.diagnose", ["--worker", "--redis", redis_url, "--job", job,
                                                   "--num-processes", str(nprocs), *args],
                        nprocs, env, log_dir, "diagnose", header=f"diagnostics, job {job}", pool=pool, slots=slots)
    client = rendezvous.connect(redis_url, timeout_s=1.0)
    try:
        # A rank that fails leaves its peers blocked in a collective: give them `grace_s`, not the full timeout.
        first_failure = None
        while len(group.exit_codes()) < nprocs and time.time() - start < timeout_s:
            if all_reported(client, job, nprocs):
                break  # their exits (jax's distributed shutdown) would add ~0.8 s; stop() kills them
            if first_failure is None and any(group.exit_codes().values()):
                first_failure = time.time()
            if first_failure is not None and time.time() - first_failure > grace_s:
                break
            time.sleep(0.1)
        exits = group.exit_codes()
    finally:
        group.stop()  # its workers run in their own sessions: nothing else would stop them
    return collect(redis_url, job, nprocs, exits, start)


def all_reported(client: redis.Redis, job: str, nprocs: int) -> bool:
    try:
        return client.exists(*[rendezvous.key(job, "diag", r) for r in range(nprocs)]) == nprocs
    except redis.RedisError:
        return False  # read again by collect(), which reports the error


def collect(redis_url: str, job: str, nprocs: int, exits: dict[int, int] | None = None,
            start: float | None = None) -> Report:
    """The results the workers of `job` left in Redis."""
    start = time.time() if start is None else start
    client = rendezvous.connect(redis_url, timeout_s=5.0)
    raw = client.mget([rendezvous.key(job, "diag", r) for r in range(nprocs)])
    results = {rank: json.loads(value) for rank, value in enumerate(raw) if value is not None}
    return Report(nprocs, results, exits or {}, time.time() - start)


def faulty_hosts(report: Report, hosts: list[str] | None) -> list[str]:
    """The hosts of the faulty ranks: from `hosts` (rank order) if given, else what each rank
    reported; none at all when no rank reported (see the module docstring)."""
    if not report.results:
        return []
    named = {hosts[rank] if hosts else report.results.get(rank, {}).get("host") for rank in report.faulty()}
    return sorted(named - {None})


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m megascale_jax.diagnose", description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=1, help="processes sharing mesh.cpu_devices")
    parser.add_argument("--config", default=None, help="YAML config whose mesh is tested (default: tiny_cpu)")
    parser.add_argument("--redis", default=None, help="redis://[USER@]HOST:PORT or rediss://..., its password in "
                                                      f"${redis_auth.PASSWORD_FILE_ENV} or ${redis_auth.PASSWORD_ENV} "
                                                      "(default: an embedded server)")
    parser.add_argument("--run-dir", default=None, help="where the worker logs go (default: a temporary directory)")
    parser.add_argument("--collect", metavar="JOB", default=None,
                        help="only read the results of job JOB's --worker processes (started by a scheduler) "
                             "from --redis; --nprocs says how many")
    parser.add_argument("--hosts", default=None, help="comma-separated host of each rank, in rank order "
                                                      "(a cluster's node list); default: what each rank reported")
    parser.add_argument("--excluded-hosts", metavar="FILE", default=None,
                        help="append the faulty ranks' hosts to FILE (RUN_DIR/excluded_hosts.txt)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one diagnostics process
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. mesh.dp=4 mesh.tp=2")
    args = cli.parse(parser, argv)
    if args.worker:
        return worker_main(args)
    import tempfile

    from megascale_jax.supervise.redis_server import EmbeddedRedis

    try:
        if args.nprocs < 1:
            raise ConfigError(f"--nprocs={args.nprocs} must be >= 1")
        if args.redis:  # before anything starts: a password in the URL, a scheme that is not Redis's
            redis_auth.check_url(args.redis)
        hosts = args.hosts.split(",") if args.hosts else None
        if hosts is not None and len(hosts) != args.nprocs:
            raise ConfigError(f"--hosts names {len(hosts)} host(s) for --nprocs={args.nprocs}; give one per rank")
        if args.collect:
            if not args.redis:
                raise ConfigError("--collect reads the workers' results from Redis: give --redis redis://HOST:PORT")
            redis_auth.verify(rendezvous.connect(args.redis, timeout_s=5.0), args.redis)
            report = collect(args.redis, args.collect, args.nprocs)
            print(report.table())
            return _exclude(report, hosts, args.excluded_hosts)
        cfg = load_config(args.config, args.overrides)
        worker_args = ([] if args.config is None else ["--config", args.config]) + \
            per_process_overrides(cfg, args.overrides, args.nprocs)
    except (ConfigError, redis_auth.RedisAuthError) as e:
        return cli.user_error(e)
    except redis.RedisError as e:
        return cli.user_error(f"cannot read the diagnostics results from {redis_auth.redact(args.redis)}: {e}")
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="megascale-diagnose-")
    server = None if args.redis else EmbeddedRedis(run_dirs.redis_dir(run_dir))
    try:
        report = run(worker_args, args.nprocs, args.redis or server.url, f"diagnose-{os.getpid()}-{time.time():.0f}",
                     worker_env(), run_dirs.logs_dir(run_dir))
    finally:
        if server:
            server.stop()
    print(report.table())
    print(f"diagnostics took {report.duration_s:.1f}s; worker logs in {run_dirs.logs_dir(run_dir)}")
    return _exclude(report, hosts, args.excluded_hosts)


def _exclude(report: Report, hosts: list[str] | None, excluded_path: str | None) -> int:
    """Append the faulty ranks' hosts to `excluded_path`; 1 when a rank is faulty."""
    if excluded_path and report.faulty():
        if not report.results:
            print(f"no rank reported: the diagnostics did not run (Redis, the launch); {excluded_path} unchanged")
        elif named := faulty_hosts(report, hosts):
            run_dirs.append_lines(excluded_path, named)
            print(f"excluded from now on (appended to {excluded_path}): {', '.join(named)}")
    return 1 if report.faulty() else 0
