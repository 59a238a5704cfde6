"""bench/'s shape: packages run as `python -m bench.<group>.<name>` from the checkout's root,
without editing sys.path, and every bench command the docs name is a module that exists. The
README and the docs/ pages name them in prose, where tests/test_readme.py does not run them, so a
bench moved without its docs would otherwise go unnoticed."""

import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(REPO))  # bench/ is not installed: it imports from the checkout's root, as `python -m bench...` runs

# `python -m bench.campaign`, `python -m bench.resilience.ettr --minutes 36 ...`; a placeholder
# such as `bench.<group>.<name>` reads as `bench`.
COMMAND = re.compile(r"python -m (bench(?:\.\w+)*)")


def documented_modules() -> set[str]:
    """The modules of every `python -m bench...` in the README, docs/ and bench's own docstrings."""
    texts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(BENCH.rglob("*.py"))]
    return {module for path in texts for module in COMMAND.findall(path.read_text())}


def test_every_documented_bench_command_names_a_module():
    modules = documented_modules()
    assert {"bench.campaign", "bench.resilience.ettr", "bench.planner.plan_validation"} <= modules  # the parser sees them
    missing = [m for m in sorted(modules) if importlib.util.find_spec(m) is None]
    assert not missing, f"documented but not a module: {missing}"


def test_bench_is_packages_that_leave_sys_path_alone():
    folders = {path.parent for path in BENCH.rglob("*.py")}
    assert [f for f in sorted(folders) if not (f / "__init__.py").is_file()] == []
    assert [str(p.relative_to(REPO)) for p in sorted(BENCH.rglob("*.py")) if "sys.path" in p.read_text()] == []
