"""The suite's own guard (conftest.py): a process a test leaves running is found, also when it was
orphaned, and ended."""

import subprocess
import time
from pathlib import Path

import psutil
import pytest


@pytest.fixture
def guard(request):
    """The suite's conftest.py module, as pytest loaded it (`import conftest` would name whichever
    of the suite's conftest files was imported last: tests/evaluation/ has one too)."""
    root = str(Path(__file__).with_name("conftest.py"))
    return next(p for p in request.config.pluginmanager.get_plugins() if getattr(p, "__file__", None) == root)


def test_an_orphaned_process_is_found_and_ended(guard):
    before = set(guard.started_here())
    # The shell starts `sleep` in the background and exits: the sleep is reparented away from us.
    subprocess.run(["sh", "-c", "sleep 300 & echo $! > /dev/null"], check=True)
    deadline = time.time() + 10
    while not (orphans := {p for p, c in guard.started_here().items() if p not in before and c == "sleep 300"}):
        assert time.time() < deadline, "the orphaned sleep was not found"
        time.sleep(0.05)
    (pid,) = orphans
    assert psutil.Process(pid).ppid() != psutil.Process().pid
    assert guard.end_left_behind(before, grace_s=0.2) == {pid: "sleep 300"}
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_process_that_exits_in_time_is_not_reported(guard):
    before = set(guard.started_here())
    subprocess.Popen(["sh", "-c", "sleep 0.2"])
    assert guard.end_left_behind(before, grace_s=5) == {}
