"""The package layout's rules: the driver never imports jax, no import circles, the entry points.

Subpackages, lowest first: config / run_dir / cli / pipeline_schedule -> parallel, model -> training
-> observe -> cluster -> supervise; `megascale_jax.train` composes the loop at the top, and
`python -m megascale_jax.<cmd>` entry modules sit beside it.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megascale_jax"
ENTRY_POINTS = ("train", "launch", "report", "diagnose", "preflight", "flops", "pipeline_schedule", "plan", "tokenize", "export_hf", "sample",
                "evaluate")
# What the driver (launch and supervisor) runs in its own process, which must outlive workers
# whose jax crashed: the straggler statistic and hang analysis read the run's files there too.
DRIVER = ("megascale_jax.launch", "megascale_jax.diagnose", "megascale_jax.preflight", "megascale_jax.supervise.preflight",
          "megascale_jax.supervise.launch",
          "megascale_jax.supervise.supervisor", "megascale_jax.supervise.detect", "megascale_jax.supervise.policy",
          "megascale_jax.supervise.transport", "megascale_jax.supervise.events", "megascale_jax.supervise.workers",
          "megascale_jax.supervise.redis_server", "megascale_jax.supervise.diagnose",
          "megascale_jax.supervise.drills", "megascale_jax.supervise.placement", "megascale_jax.supervise.watch",
          "megascale_jax.observe.stragglers", "megascale_jax.observe.hangs", "megascale_jax.observe.timings",
          "megascale_jax.run_dir")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports anywhere in it (deferred imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megascale_jax"):
            base = node.module
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found & modules


def test_driver_side_never_imports_jax():
    code = f"import sys; import {', '.join(DRIVER)}; print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'orbax')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_no_import_circles():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: imported_modules(p, set(files)) - {m} for m, p in files.items()}
    # A package's __init__ is imported with each of its modules: not an edge of its own.
    graph = {m: {d for d in deps if not (files[d].name == "__init__.py")} for m, deps in graph.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


LEVELS = {"config": 0, "config_checks": 0, "run_dir": 0, "cli": 0, "job_key": 0, "pipeline_schedule": 0, "parallel": 1, "model": 1,
          "training": 2, "evaluation": 2, "planner": 2, "observe": 3, "interop": 3, "cluster": 4, "supervise": 5}
# train.py and the entry points sit on top of all of them (but pipeline_schedule: pure tables config checks with).


def level(module: str) -> int:
    parts = module.split(".")
    return LEVELS.get(parts[1], 6) if len(parts) > 1 else 6


def test_imports_point_down_never_up():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    upward = [(m, d) for m, p in files.items() for d in imported_modules(p, set(files)) if level(d) > level(m)]
    assert upward == []


@pytest.mark.parametrize("command", ENTRY_POINTS)
def test_entry_points_answer_help(command):
    r = subprocess.run([sys.executable, "-m", f"megascale_jax.{command}", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: python -m megascale_jax.{command}"), r.stdout[:200]


def test_tests_mirror_the_packages():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} | {"kernels"}
    assert {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and p.name[0] not in "._"} <= packages


def test_no_private_jax_imports():
    """`jax._src` is JAX's private implementation: it changes without notice between releases
    (the GPU machines run another jax than CI). Only public APIs are imported."""
    private = []
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "pallas_kernels").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            private += [f"{path.relative_to(REPO)}: {n}" for n in names if n.startswith("jax._src")]
    assert private == []


RUN_DIR_ENTRIES = {"config.yaml", "metrics.jsonl", "checkpoints.jsonl", "events.jsonl", "timings", "tensorboard",
                   "profiles", "logs", "redis", "report", "checkpoints", "tokenizer", "excluded_hosts.txt",
                   "compile_cache", ".lock"}


def test_run_directory_paths_are_joined_in_run_dir_only():
    """One module owns the run directory's layout: nobody else joins a path to one of its entries."""
    joined = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "run_dir.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join":
                names = {a.value for a in node.args if isinstance(a, ast.Constant)}
                joined += [f"{path.relative_to(REPO)}:{node.lineno}" for _ in names & RUN_DIR_ENTRIES]
    assert joined == []


def test_test_modules_have_names_of_their_own():
    """pytest imports test modules by their file name (no packages under tests/): two of one name in
    different folders fail to collect ("import file mismatch"), on whichever worker meets both."""
    names = [p.name for p in (REPO / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
