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


# The zygote's tests run in a process of their own: a pool with a zygote makes its process a
# subreaper (supervise/zygote.py), which pytest's workers must not become for the tests after.
ZYGOTE_SCRIPT = """
import json, os, signal, sys, time
from megascale_jax.supervise.zygote import Zygote
from megascale_jax.supervise.workers import StandbyPool

tmp, env = sys.argv[1], {**os.environ, "STANDBY_TEST": "at import"}
zygote = Zygote("echo_worker", env)
pool = StandbyPool("echo_worker", env, 2, zygote)
facts = {"forked": [type(p).__name__ for p in pool.warm.values()]}
ran = pool.start(0, ["--process-id", "0"], f"{tmp}/a.log", {"STANDBY_TEST": "a"})
other = StandbyPool("json_echo", env, 1, zygote)  # a module the zygote did not preload
facts["exit"] = ran.wait(timeout=60)
facts["other_exit"] = other.start(0, ["x"], f"{tmp}/b.log", {}).wait(timeout=60)
victim = pool.warm[1]
os.kill(victim.pid, signal.SIGKILL)
facts["killed"] = victim.wait(timeout=60)
zygote.process.kill(); zygote.process.wait()
pool.refill([0])  # the zygote is gone: a cold standby
facts["after_zygote"] = type(pool.warm[0]).__name__
facts["cold_exit"] = pool.start(0, ["--process-id", "5"], f"{tmp}/c.log", {"STANDBY_TEST": "c"}).wait(timeout=60)
pool.close(); other.close(); zygote.close()
print(json.dumps(facts))
"""


def test_a_zygote_forks_standbys_whose_exit_codes_the_pool_reads(tmp_path):
    """Standbys forked by the zygote run their command lines (the preloaded module's warm_up ran
    once, in the zygote, before any command's environment) and another module's; the pool reads
    their exit codes (7, a SIGKILL's -9) as a subprocess's; with the zygote gone it starts cold
    standbys, which still run."""
    standby(tmp_path, "echo_worker", [])  # writes echo_worker.py
    (tmp_path / "json_echo.py").write_text("def main(argv):\n    print('json_echo', argv)\n    return 3\n")
    done = subprocess.run([sys.executable, "-c", ZYGOTE_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"})
    assert done.returncode == 0, done.stderr[-2000:]
    facts = json.loads(done.stdout.splitlines()[-1])
    assert facts == {"forked": ["Forked", "Forked"], "exit": 7, "other_exit": 3, "killed": -9,
                     "after_zygote": "Popen", "cold_exit": 7}
    # warm_up ran in the zygote, under the environment it was started with, once
    assert (tmp_path / "a.log").read_text().splitlines() == [
        "argv ['--process-id', '0'] env a warmed ['at import']", "to stderr"]
    assert (tmp_path / "b.log").read_text().splitlines() == ["json_echo ['x']"]
    assert (tmp_path / "c.log").read_text().startswith("argv ['--process-id', '5'] env c warmed ['at import']")


def test_a_zygote_whose_import_failed_forks_standbys_that_report_it(tmp_path):
    script = ("import sys\nfrom megascale_jax.supervise.zygote import Zygote\n"
              "from megascale_jax.supervise.workers import StandbyPool\n"
              "import os\nz = Zygote('no_such_worker_module', dict(os.environ))\np = StandbyPool('no_such_worker_module', dict(os.environ), 1, z)\n"
              "print(type(p.warm[0]).__name__, p.start(0, [], sys.argv[1], {}).wait(timeout=60))\n"
              "p.close(); z.close()\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "w.log")], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert done.stdout.split() == ["Forked", "1"], done.stderr[-2000:]
    assert "ModuleNotFoundError: No module named 'no_such_worker_module'" in (tmp_path / "w.log").read_text()
