"""What every bench shares: its command line's common part, and what its result records and where
it goes — the command, device and versions, as JSON under bench/results/.

The benches are modules of the `bench` package, run from the checkout's root as
`python -m bench.<group>.<name>` (bench/ is not installed with megascale_jax: it measures this
checkout). Each one's main() reads

    bench = Bench(__doc__, "tensor_parallel_<platform>")   # description, prog, --out/--overwrite
    bench.add_argument("--tp", type=int, default=8)
    args = bench.parse_args(argv)
    bench.refuse_existing(f"tensor_parallel_{jax.default_backend()}")   # before the run, not after it
    ...
    bench.write({"rows": rows})                             # + provenance; prints `wrote PATH`
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")


def invocation() -> str:
    """How this process was started, as a user types it: `python -m bench.parallel.train_step`
    for a module (`python -m bench.campaign` for a package's __main__), else `python PATH`."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name:
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return f"python {os.path.relpath(sys.argv[0])}"


def command_line() -> str:
    """This process's command line as a user types it (recorded with every result)."""
    return " ".join([invocation(), *sys.argv[1:]])


def python_module(module: str, *args: str) -> list[str]:
    """The command line that runs `python -m module` with this interpreter; give it the
    environment `with_repo_on_path` makes, so that `bench` (not installed) imports from any cwd."""
    return [sys.executable, "-m", module, *args]


def with_repo_on_path(env: dict) -> dict:
    """`env` with this checkout first on PYTHONPATH: a child `python -m bench....` imports this
    bench, and the megascale_jax beside it, whatever its cwd (its relative paths stay the user's)."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join([REPO, *(p for p in paths if p != REPO)])}


def add_output_flags(parser, default: str) -> None:
    """`--out PATH` and `--overwrite`, the same in every bench."""
    parser.add_argument("--out", default=None, help=f"result file (default bench/results/{default}.json)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the result file if it exists (committed results are kept otherwise)")


def result_path(name: str, path: str | None = None, overwrite: bool = False) -> str:
    """Where the result goes: `path`, else bench/results/<name>.json.

    An existing file is never replaced silently (bench/results/ holds committed measurements):
    without `overwrite` this exits 2 with one line. Benches call it first, so a long run is not
    wasted on a target it may not write, and `write_result` calls it again before writing."""
    path = path or os.path.join(RESULTS, f"{name}.json")
    if os.path.exists(path) and not overwrite:
        print(f"{os.path.relpath(path)} exists; pass --overwrite to replace it, or --out PATH to write elsewhere",
              file=sys.stderr)
        raise SystemExit(2)
    return path


def write_result(name: str, payload: dict, path: str | None = None, overwrite: bool = False) -> str:
    """Write `payload` plus provenance to bench/results/<name>.json (or `path`); returns the path.

    Refuses (exit 2, one line) to replace an existing file unless `overwrite` (`result_path`)."""
    path = result_path(name, path, overwrite)
    import jax
    import jaxlib

    result = {"command": command_line(),
              "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
              "backend": jax.default_backend(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
              "python": platform.python_version(), **payload}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


class Bench:
    """A bench's command line and its result file: the part of main() every bench shares.

    `result` names the result file (bench/results/<result>.json) where it is known before the
    arguments are; a placeholder such as "pipeline_<platform>" (shown in --help) where the name
    depends on them or on the device, given to `refuse_existing` once known."""

    def __init__(self, doc: str, result: str):
        self.parser = argparse.ArgumentParser(prog=invocation(), description=doc.strip().splitlines()[0])
        self.result = result
        self.args: argparse.Namespace | None = None

    def add_argument(self, *args, **kwargs):
        return self.parser.add_argument(*args, **kwargs)

    def parse_args(self, argv: list[str] | None = None, intermixed: bool = False) -> argparse.Namespace:
        """The arguments, --out and --overwrite last in --help. `intermixed`: positional
        key=value overrides may follow options, as in `megascale_jax.train`."""
        add_output_flags(self.parser, self.result)
        parse = self.parser.parse_intermixed_args if intermixed else self.parser.parse_args
        self.args = parse(argv)
        return self.args

    def refuse_existing(self, name: str | None = None) -> str:
        """Fix the result's name (default: the one given at construction) and exit 2 with one line
        now if its file exists without --overwrite, before the run rather than after it."""
        self.result = name or self.result
        return result_path(self.result, self.args.out, self.args.overwrite)

    def write(self, payload: dict) -> str:
        """Write `payload` plus provenance (`write_result`), print `wrote PATH`, return PATH."""
        path = write_result(self.result, payload, self.args.out, self.args.overwrite)
        print(f"wrote {path}")
        return path
