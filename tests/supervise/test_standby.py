"""Warm standby workers (cluster/standby.py): imports first, then one command line on stdin."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def standby(tmp_path, module: str, argv: list[str]):
    (tmp_path / "echo_worker.py").write_text(
        "import os, sys\n"
        "WARMED = []\n"
        "def warm_up():\n"
        "    WARMED.append(os.environ.get('STANDBY_TEST'))  # before the command line's env\n"
        "def main(argv):\n"
        "    print('argv', argv, 'env', os.environ.get('STANDBY_TEST'), 'warmed', WARMED, flush=True)\n"
        "    print('to stderr', file=sys.stderr, flush=True)\n"
        "    return 7\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"}
    line = json.dumps({"argv": argv, "log": str(tmp_path / "worker.log"), "env": {"STANDBY_TEST": "yes"}})
    done = subprocess.run([sys.executable, "-m", "megascale_jax.cluster.standby", module], input=line + "\n",
                          env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, (tmp_path / "worker.log").read_text()


def test_a_standby_runs_its_command_line_with_its_environment_into_its_log(tmp_path):
    code, log = standby(tmp_path, "echo_worker", ["--process-id", "3"])
    assert code == 7
    # warm_up() ran once, while standing by: before the command line's environment arrived.
    assert log.splitlines() == ["argv ['--process-id', '3'] env yes warmed [None]", "to stderr"]


def test_a_standby_whose_import_failed_reports_it_in_the_workers_log(tmp_path):
    code, log = standby(tmp_path, "no_such_worker_module", [])
    assert code == 1 and "ModuleNotFoundError: No module named 'no_such_worker_module'" in log


def test_a_released_standby_ends_quietly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "megascale_jax.cluster.standby", "json"], input="",
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0 and done.stdout == done.stderr == ""


def test_the_pool_refills_a_taken_slot_only_when_asked(tmp_path):
    """A taken slot stays empty until `refill` (the workers' imports must not compete with a
    restart); a slot started while empty gets a cold process that still runs its command."""
    from megascale_jax.supervise.workers import StandbyPool

    standby(tmp_path, "echo_worker", [])  # writes echo_worker.py
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"}
    pool = StandbyPool("echo_worker", env, 3)
    try:
        first = pool.start(0, ["--process-id", "0"], str(tmp_path / "a.log"), {"STANDBY_TEST": "a"})
        assert sorted(pool.warm) == [1, 2]
        cold = pool.start(0, ["--process-id", "0"], str(tmp_path / "b.log"), {"STANDBY_TEST": "b"})
        assert first.wait(timeout=60) == cold.wait(timeout=60) == 7
        assert (tmp_path / "b.log").read_text().startswith("argv ['--process-id', '0'] env b")
        pool.refill([0, 1])
        assert sorted(pool.warm) == [0, 1, 2]
    finally:
        pool.close()
    assert pool.warm == {}
