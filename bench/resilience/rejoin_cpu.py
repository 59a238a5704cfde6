"""Can the healthy processes of a CPU job outlive a peer's death and rejoin a re-formed job in
process (issue 64 item 2)? Three measurements on real processes, 2 CPU devices each, jax's gloo
collectives, `jax_enable_recoverability` on:

1. stuck: 3 processes sum an array sharded over all 6 devices; process 2 exits; the other two
   sum again. How long until that sum returns (bounded by `--wait-s`: it never does).
2. rejoin: a fresh process 2 joins the same coordination service (as JAX's fault tolerance would
   have a restarted task do) and sums with the survivors.
3. re-form: the two survivors leave the stuck sum behind (never waited on), keep the old runtime
   alive (the old client's heartbeats need their service), start a new 2-process runtime on a new
   port and sum there: time to the new runtime, and to the first result.

    python -m bench.resilience.rejoin_cpu   # writes bench/results/rejoin_cpu.json
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from bench.common import Bench, with_repo_on_path
from megascale_jax.cluster.rendezvous import free_port, wait_until_listening


def member(rank: int, port: int, role: str, wait_s: float) -> None:
    """One process of the experiment; prints one JSON line of what it saw."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax._src import distributed, xla_bridge
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.config.update("jax_enable_recoverability", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 3, rank, heartbeat_timeout_seconds=5)
    total = jax.jit(jnp.sum)

    def sharded_sum():
        mesh = jax.make_mesh((jax.device_count(),), ("d",))
        x = jax.make_array_from_callback((jax.device_count(), 4), NamedSharding(mesh, P("d")),
                                         lambda _: np.full((1, 4), rank + 1.0, np.float32))
        return total(x)

    seen = {"rank": rank, "role": role}
    if role == "joiner":  # a restarted process 2 on the survivors' service
        try:
            seen["sum"] = float(sharded_sum())
        except Exception as e:  # noqa: BLE001 — what the join ran into is the measurement
            seen["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[-300:]}"
        print(json.dumps(seen), flush=True)
        os._exit(0)
    seen["first_sum"] = float(sharded_sum())
    if role == "dies":
        time.sleep(0.3)
        os._exit(1)
    time.sleep(1.0)  # process 2 is gone
    stuck, start = sharded_sum(), time.perf_counter()
    while not stuck.is_ready() and time.perf_counter() - start < wait_s:
        time.sleep(0.01)
    seen["stuck_sum_returned"], seen["waited_s"] = stuck.is_ready(), round(time.perf_counter() - start, 2)
    # Leave it behind: the old client, its service (on rank 0) and the stuck array stay referenced
    # for good. jax.clear_backends() would wait for the stuck sum (its effects barrier), and an old
    # client whose service is gone ends its process ("detected fatal errors").
    leaked = [xla_bridge.get_backend(), stuck, distributed.global_state.client, distributed.global_state.service]
    distributed.global_state.client = distributed.global_state.service = None
    distributed.global_state.preemption_sync_manager = None
    from jax._src import pjit, util
    from jax._src.lib import _jax
    start = time.perf_counter()
    xla_bridge._clear_backends()
    util.clear_all_caches()
    pjit._cpp_pjit_cache_fun_only.clear()
    pjit._cpp_pjit_cache_explicit_attributes.clear()
    _jax.PjitFunctionCache.clear_all()
    if rank:  # as rendezvous.start_distributed: dialling before rank 0 listens costs gRPC's 1 s backoff
        wait_until_listening(f"127.0.0.1:{port + 1}")
    jax.distributed.initialize(f"127.0.0.1:{port + 1}", 2, rank, heartbeat_timeout_seconds=5)  # the 2 survivors
    seen["new_runtime_s"] = round(time.perf_counter() - start, 3)
    seen["new_devices"] = jax.device_count()
    seen["new_sum"] = float(sharded_sum())
    seen["new_first_result_s"] = round(time.perf_counter() - start, 3)
    seen["leaked"] = len(leaked)
    print(json.dumps(seen), flush=True)
    os._exit(0)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def experiment(wait_s: float) -> dict:
    env = with_repo_on_path({**os.environ, "JAX_PLATFORMS": "cpu"})
    port = free_port()
    while not _free(port + 1):  # the survivors' new runtime listens there
        port = free_port()

    def start(rank, role):
        return subprocess.Popen([sys.executable, "-m", __spec__.name, "--member", str(rank), "--port", str(port),
                                 "--role", role, "--wait-s", str(wait_s)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    survivors = [start(0, "survives"), start(1, "survives")]
    dies = start(2, "dies")
    dies.wait(timeout=120)
    time.sleep(1.0)
    joiner = start(2, "joiner")  # a replacement on the same service, while the survivors wait in the sum
    rows = []
    for process in [*survivors, joiner]:
        out, err = process.communicate(timeout=wait_s + 120)
        if not out.strip():
            raise SystemExit(f"a member printed nothing (exit {process.returncode}):\n{err[-2000:]}")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return {"survivors": rows[:2], "replacement": rows[2]}


def main() -> None:
    bench = Bench(__doc__, "rejoin_cpu")
    bench.add_argument("--wait-s", type=float, default=10.0, help="how long the survivors wait for the stuck sum")
    bench.add_argument("--member", type=int, help=argparse.SUPPRESS)
    bench.add_argument("--port", type=int, help=argparse.SUPPRESS)
    bench.add_argument("--role", help=argparse.SUPPRESS)
    args = bench.parse_args()
    if args.member is not None:
        return member(args.member, args.port, args.role, args.wait_s)
    bench.refuse_existing()
    result = experiment(args.wait_s)
    for row in result["survivors"]:
        print(f"survivor {row['rank']}: the sum with the dead peer returned: {row['stuck_sum_returned']} after "
              f"{row['waited_s']}s; new {row['new_devices']}-device runtime in {row['new_runtime_s']}s, first result "
              f"{row['new_sum']} after {row['new_first_result_s']}s")
    print(f"replacement on the old service: {result['replacement'].get('error') or result['replacement']}")
    bench.write(result)


if __name__ == "__main__":
    main()
