"""Rendezvous through Redis: the workers of one job register, learn their rank and the address
of the `jax.distributed` coordinator, and wait at barriers.

MegaScale replaced PyTorch's TCPStore with Redis to bring 2,048 GPUs up in seconds; here Redis
also carries the heartbeats (heartbeat.py), so a job needs exactly one external service. All
keys of a job live under `megascale:<job>:` and expire after a day, so stale jobs clean
themselves up. A job id is used by one set of workers only: the launcher gives every restart
attempt its own.

The coordinator record is verified, not trusted (Redis itself admits only holders of the job's
password: redis_auth.py). Every worker registers with a fresh random nonce; once all have, rank 0
signs {job, coordinator, every rank's nonce} with an HMAC-SHA256 keyed by the job's password and
hands one copy to each other rank. A rank accepts the record only if the HMAC verifies (not
forged by someone without the password), the job is its own (not another job's record copied
in) and its own nonce is in it at its rank (not a replay of an earlier join under the same job
id); anything else is refused in one line (`RendezvousRefused`; train exits 2, which the
supervisor counts as a fault at once rather than waiting for a hang).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import time
import urllib.parse
from typing import TYPE_CHECKING

from megascale_jax.cluster import redis_auth
from megascale_jax.config_checks import ConfigError
from megascale_jax.cluster.redis_auth import connect, redact  # noqa: F401 — rendezvous.connect is the client everyone uses

if TYPE_CHECKING:  # redis is imported where it is used: a trainer without --redis never loads it (~0.1-0.3 s)
    import redis

KEY_TTL_S = 24 * 3600


class RendezvousError(RuntimeError):
    """The job could not assemble (Redis unreachable or refusing us, too many workers, a barrier
    timed out)."""


class RendezvousRefused(RendezvousError):
    """The coordinator record read from Redis is not one this job's rank 0 wrote for this join."""


@dataclasses.dataclass(frozen=True)
class Membership:
    """What one worker learned at the rendezvous."""

    rank: int
    nprocs: int
    coordinator: str  # HOST:PORT of the jax.distributed service that rank 0 runs
    wait_s: float  # seconds between registering and the last worker's arrival


def key(job: str, *parts) -> str:
    return ":".join(["megascale", job, *map(str, parts)])


# A worker's heartbeat record (cluster/heartbeat.py writes it, the driver reads it): the fields
# the driver relies on, and its key. Here, beside the other key names, because the driver must
# not import the writer (jax).
HEARTBEAT_FIELDS = ("rank", "pid", "host", "seq", "time", "state", "step")


def heartbeat_key(job: str, rank: int) -> str:
    return key(job, "heartbeat", rank)


def job_id_from_env() -> str:
    """The job id a cluster scheduler gives all workers of one job attempt alike. A requeued SLURM
    job keeps its SLURM_JOB_ID and a restarted JobSet its name, so the restart count is part of
    the id (as in configs/cluster/): a new attempt never meets the old attempt's registrations."""
    env = os.environ
    if env.get("MEGASCALE_JOB"):
        return env["MEGASCALE_JOB"]
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_RESTART_COUNT') or 0}"
    if env.get("JOBSET_NAME"):
        return f"{env['JOBSET_NAME']}-{env.get('JOBSET_RESTART_ATTEMPT') or 0}"
    return "default"


def join(url: str, job: str, nprocs: int, rank: int | None = None, timeout_s: float = 300.0) -> Membership:
    """Register as one of `nprocs` workers of `job` and wait until all have.

    `rank` is the scheduler's process index when it has one (SLURM_PROCID, a JobSet completion
    index); without, ranks are handed out in order of arrival."""
    if not job or ":" in job:  # keys are megascale:<job>:...: a colon would reach into another job's keys
        raise RendezvousError(f"job id {job!r} must be non-empty and free of ':'")
    import redis

    try:
        client = connect(url)
        redis_auth.verify(client, url)
        secret = redis_auth.password()
    except redis_auth.RedisAuthError as e:
        raise RendezvousError(str(e)) from None
    except redis.RedisError as e:
        raise RendezvousError(f"cannot reach Redis at {redact(url)}: {e}; start it or fix --redis") from None
    if rank is None:
        rank = client.incr(key(job, "next_rank")) - 1
        client.expire(key(job, "next_rank"), KEY_TTL_S)
    if not 0 <= rank < nprocs:
        raise RendezvousError(f"job {job!r} has {nprocs} workers but this one got rank {rank}; "
                              "use a fresh job id for every launch")
    nonce = secrets.token_hex(16)
    client.hset(key(job, "members"), str(rank), json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "nonce": nonce}))
    client.expire(key(job, "members"), KEY_TTL_S)
    start = time.perf_counter()
    barrier(client, job, "joined", nprocs, timeout_s)
    if rank == 0:
        coordinator = f"{_advertised_host(url)}:{free_port()}"
        publish_coordinator(client, secret, job, nprocs, coordinator)
    else:
        popped = client.blpop([key(job, "coordinator")], timeout=timeout_s)
        if popped is None:
            raise RendezvousError(f"job {job!r}: rank 0 published no coordinator within {timeout_s:.0f}s")
        coordinator = verified_coordinator(popped[1], secret, job, rank, nonce)
    return Membership(rank=rank, nprocs=nprocs, coordinator=coordinator, wait_s=time.perf_counter() - start)


def publish_coordinator(client: redis.Redis, secret: str, job: str, nprocs: int, coordinator: str) -> None:
    """Rank 0, after every rank registered: the signed record, one copy per other rank (each
    takes one with BLPOP, so nobody polls)."""
    members = {int(r): json.loads(v) for r, v in client.hgetall(key(job, "members")).items()}
    record = {"job": job, "coordinator": coordinator, "nonces": [members.get(r, {}).get("nonce") for r in range(nprocs)]}
    if nprocs > 1:
        client.rpush(key(job, "coordinator"), *[json.dumps(sign(secret, record))] * (nprocs - 1))
        client.expire(key(job, "coordinator"), KEY_TTL_S)


def sign(secret: str, record: dict) -> dict:
    """`record` with its HMAC-SHA256 under `secret`, over its canonical JSON."""
    return {"record": record, "hmac": _mac(secret, record)}


def _mac(secret: str, record: dict) -> str:
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret.encode(), canonical, hashlib.sha256).hexdigest()


def verified_coordinator(raw: bytes, secret: str, job: str, rank: int, nonce: str) -> str:
    """The coordinator address of a record rank `rank` (registered with `nonce`) of `job` read
    from Redis, or RendezvousRefused saying why it is not to be trusted."""
    try:
        signed = json.loads(raw)
        record, mac = signed["record"], signed["hmac"]
        coordinator, nonces = record["coordinator"], record["nonces"]
        if not (isinstance(mac, str) and isinstance(coordinator, str) and isinstance(nonces, list)):
            raise TypeError
    except (ValueError, TypeError, KeyError):
        raise RendezvousRefused(f"the coordinator record of job {job!r} in Redis is malformed, not one a rank 0 "
                                "signs: someone else writes to this Redis; give the job a password of its own "
                                f"({redis_auth.PASSWORD_FILE_ENV})") from None
    if not hmac.compare_digest(mac, _mac(secret, record)):
        raise RendezvousRefused(f"the coordinator record of job {job!r} fails its HMAC (it points at "
                                f"{coordinator!r}): it was not signed with this job's Redis password; if another "
                                "job shares this Redis, give each job a password (ACL user) of its own")
    if record.get("job") != job:
        raise RendezvousRefused(f"the coordinator record read for job {job!r} belongs to job {record.get('job')!r}: "
                                "give every job its own id (--job) and its own Redis password")
    if rank >= len(nonces) or nonces[rank] != nonce:
        raise RendezvousRefused(f"the coordinator record of job {job!r} does not carry this rank's nonce: a replay "
                                "of an earlier join under the same job id; use a fresh job id for every launch")
    return coordinator


def start_distributed(coordinator: str, nprocs: int, rank: int) -> None:
    """`jax.distributed.initialize` for jobs of several processes (gloo collectives on the CPU).
    Ranks other than 0 first wait until rank 0's service listens: one that dials before is refused,
    and gRPC retries only after its initial reconnect backoff (1 s ±20%), a second every start and
    restart paid whenever a worker won that race.

    Cluster auto-detection is off: the coordinator, process count and rank are all given, and the
    one thing it would still fill in is wrong for our layout. Under SLURM (and Open MPI) it sets
    `local_device_ids=[SLURM_LOCALID]`, one GPU per process: configs/cluster/sbatch.sh runs one
    process per node over all the node's GPUs, and each saw GPU 0 alone (found under a real
    slurmctld, tests/cluster/test_slurm.py). A process uses every device it can see; to split a
    node among several tasks, give each its own (srun --gpus-per-task, or CUDA_VISIBLE_DEVICES).

    A hung process (SIGSTOP, a wedged host) is noticed, where no driver watches the Redis
    heartbeats (under SLURM or Kubernetes), only by JAX's coordination service: a process whose
    heartbeats to it stop for `heartbeat_timeout_seconds` ends every process of the job. gloo's and
    NCCL's collectives wait for a stopped peer without end (seen under SLURM: rank 0 waited in the
    step's all-reduce until the service's 100 s default ended it). The service's heartbeats come
    from a C++ thread, not the Python that compiles or steps, so a slow step is no hang;
    MEGASCALE_DISTRIBUTED_HEARTBEAT_TIMEOUT_S (configs/cluster/sbatch.sh: 30) sets it."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU-only runs
    if rank:
        wait_until_listening(coordinator)
    jax.distributed.initialize(coordinator, nprocs, rank, cluster_detection_method="deactivate",
                               heartbeat_timeout_seconds=distributed_heartbeat_timeout_s())


def distributed_heartbeat_timeout_s() -> int:
    """MEGASCALE_DISTRIBUTED_HEARTBEAT_TIMEOUT_S, else JAX's default of 100 s."""
    value = os.environ.get("MEGASCALE_DISTRIBUTED_HEARTBEAT_TIMEOUT_S", "100")
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"MEGASCALE_DISTRIBUTED_HEARTBEAT_TIMEOUT_S={value!r}: give a whole number of seconds >= 1")
    return int(value)


def wait_until_listening(address: str, timeout_s: float = 60.0) -> bool:
    """Whether something accepted a TCP connection at HOST:PORT within `timeout_s` (polled every
    10 ms). On a timeout the caller goes on and jax.distributed reports what is wrong."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)


def barrier(client: redis.Redis, job: str, name: str, nprocs: int, timeout_s: float) -> None:
    """Block until `nprocs` workers called barrier(name). The last to arrive pushes one token per
    waiter onto a list that the others wait on with BLPOP: no polling, one round trip each."""
    arrived = client.incr(key(job, "barrier", name))
    client.expire(key(job, "barrier", name), KEY_TTL_S)
    release = key(job, "barrier", name, "release")
    if arrived > nprocs:
        raise RendezvousError(f"more than {nprocs} workers reached barrier {name!r} of job {job!r}; "
                              "use a fresh job id for every launch")
    if arrived == nprocs:
        if nprocs > 1:
            client.rpush(release, *[1] * (nprocs - 1))
            client.expire(release, KEY_TTL_S)
        return
    if client.blpop([release], timeout=timeout_s) is None:
        count = int(client.get(key(job, "barrier", name)) or 0)
        raise RendezvousError(f"barrier {name!r} of job {job!r}: {count} of {nprocs} workers arrived "
                              f"within {timeout_s:.0f}s")


def _advertised_host(redis_url: str) -> str:
    """Workers reach the coordinator the way they reach Redis: over loopback when Redis is local,
    else at this host's address."""
    host = urllib.parse.urlparse(redis_url).hostname or "localhost"
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass  # a host name: not loopback
    return socket.gethostbyname(socket.gethostname())


def free_port(host: str = "") -> int:
    """A TCP port nobody listens on right now (on `host`; "" = every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
