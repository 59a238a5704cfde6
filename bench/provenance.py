"""What every bench result records and where it goes: the command, device and versions, as JSON
under bench/results/ (shared by the bench scripts; they run as `python bench/<name>.py`)."""

import json
import os
import platform
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_result(name: str, payload: dict, path: str | None = None) -> str:
    """Write `payload` plus provenance to bench/results/<name>.json (or `path`); returns the path."""
    import jax
    import jaxlib

    result = {"command": " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
              "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
              "backend": jax.default_backend(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
              "python": platform.python_version(), **payload}
    path = path or os.path.join(RESULTS, f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path
