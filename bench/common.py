"""What every bench result records and where it goes: the command, device and versions, as JSON
under bench/results/ (shared by the bench scripts; they run as `python bench/<name>.py`)."""

import json
import os
import platform
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


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

    result = {"command": " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
              "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
              "backend": jax.default_backend(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
              "python": platform.python_version(), **payload}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path
