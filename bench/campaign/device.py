"""What the campaign runs on: the accelerator as JAX sees it (`run`, the campaign worker's
"probe", in a child process), and the driver and library versions (`host_facts`, read without
starting any backend).

The probe runs in its own process because starting JAX's GPU backend reserves most of the GPU
memory (XLA_PYTHON_CLIENT_PREALLOCATE): the campaign process itself never starts one, so every
section gets the whole device.
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess


def run(settings: dict) -> dict:
    """The device kind, backend and the memory one device may use: on a GPU its allocator's
    bytes limit, on the CPU the RAM available (what `megascale_jax.train` checks against)."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        import psutil

        limit = psutil.virtual_memory().available
    else:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    return {"device_kind": device.device_kind, "backend": jax.default_backend(),
            "device_count": jax.device_count(), "memory_limit_bytes": limit}


def version(package: str) -> str | None:
    """An installed distribution's version, None if it is not installed (nothing is imported)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvidia_driver() -> str | None:
    """The NVIDIA driver version from nvidia-smi; None where there is no nvidia-smi or it fails."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def versions() -> dict:
    """The JAX, jaxlib and Python versions of this interpreter, without importing jax."""
    return {"jax": version("jax"), "jaxlib": version("jaxlib"), "python": platform.python_version()}


def host_facts() -> dict:
    return {"driver": nvidia_driver(),
            **{name: version(name) for name in ("torch", "transformers", "triton", "tokamax", "jax-triton")}}
