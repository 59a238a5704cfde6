"""The (dp, pp, cp, tp) device mesh.

Device order follows MegaScale's placement: tp is the innermost axis, so a tensor-parallel group
is made of consecutive devices of one host (NVLink), then cp, then pp, then dp across hosts.
Context parallelism (cp) sits next to tp, inside a host where it fits: it moves little (each
layer's window of keys/values from the neighbouring slice, forward and backward) but moves it in
every layer, on the critical path of attention, where pp moves one activation per microbatch
and stage, and dp one gradient reduction per step. The axis is always there (size 1 unless
`mesh.cp` says otherwise), so every layout names the same four axes. We build the
`Mesh` from an explicitly ordered device list instead of `jax.make_mesh`, whose topology-aware
reordering could split a tp group across hosts.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from megascale_jax.config import ConfigError, MeshConfig

AXES = ("dp", "pp", "cp", "tp")


def use_cpu_devices(count: int) -> None:
    """Ask XLA for `count` simulated CPU devices. Must run before the JAX backend starts."""
    jax.config.update("jax_num_cpu_devices", count)


def check_forced_cpu_devices(backend: str, count: int, xla_flags: str) -> None:
    """The mesh sets the number of simulated CPU devices (`jax_num_cpu_devices`), which wins over
    XLA_FLAGS' `--xla_force_host_platform_device_count`: a count there that disagrees would be
    ignored without a word, so it is a one-line error instead."""
    forced = re.findall(r"--xla_force_host_platform_device_count=(\d+)", xla_flags)
    if backend == "cpu" and forced and int(forced[-1]) != count:
        raise ConfigError(f"XLA_FLAGS sets --xla_force_host_platform_device_count={forced[-1]} but the mesh "
                          f"uses {count} CPU devices per process; drop the flag (the mesh sets the count) or "
                          "change mesh.dp/pp/tp or mesh.cpu_devices")


def mesh_devices(cfg: MeshConfig) -> list:
    """The devices the mesh uses, host-major and in id order within a host."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if jax.default_backend() == "cpu" and jax.process_count() == 1:
        devices = devices[: cfg.size]  # a test process may simulate more than it uses
    return devices


def process_device_coords(mesh: Mesh, process: int) -> list[tuple[int, dict[str, int]]]:
    """(device id, {axis: index}) of every device of `process` in `mesh`."""
    return [(d.id, dict(zip(mesh.axis_names, map(int, index))))
            for index, d in np.ndenumerate(mesh.devices) if d.process_index == process]


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """A classic GSPMD mesh (`AxisType.Auto`): shardings are constraints XLA propagates."""
    devices = mesh_devices(cfg) if devices is None else list(devices)
    shape = (cfg.dp, cfg.pp, cfg.cp, cfg.tp)
    if len(devices) != int(np.prod(shape)):
        raise ValueError(f"mesh {shape} needs {int(np.prod(shape))} devices, got {len(devices)}")
    grid = np.array(devices, dtype=object).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))
