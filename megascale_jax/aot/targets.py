"""The GPUs `plan --compile` can compile for, as XLA describes them (a `GpuTargetConfig` text
proto), and the topology string for N of them.

The H100's description is what a real H100 SXM reports (jax-ml/jax#28376, `runtime_version` from
openxla/xla#25919); the H200's differs in memory size and bandwidth. The two targets' compiled
programs differ by 65 KB of buffers for the `gpt_1b` step. jax-free: `plan` validates a GPU name
before it starts the compile-only environment.

Memory a step may use: jax's allocator takes XLA_PYTHON_CLIENT_MEM_FRACTION (0.75) of what the
driver reports free after the CUDA context. On the H200 (2026-11-23 and 11-27) `bytes_limit` was
112,583,507,968 B = 0.75 × (150,754,820,096 − 643,476,139): the context's reservation, ~614 MiB,
is taken from the same measurement for the H100 (never measured on one).
"""

from __future__ import annotations

import dataclasses

ALLOCATOR_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION's default
CONTEXT_BYTES = 643_476_139  # device memory the CUDA context held before jax's allocator (H200, measured)
GPUS_PER_HOST = 8  # an HGX/DGX node


@dataclasses.dataclass(frozen=True)
class Target:
    key: str  # the name `--gpu` takes, as in configs/calibration.yaml
    description: str  # what the device reports as its kind
    memory_bytes: int
    memory_bandwidth: float  # bytes/s, the description's

    def limit_bytes(self, fraction: float = ALLOCATOR_FRACTION) -> float:
        """What jax's allocator lets a program use on this GPU (module docstring)."""
        return fraction * (self.memory_bytes - CONTEXT_BYTES)

    def proto(self) -> str:
        """XLA's GpuTargetConfig for this GPU (text format)."""
        return _PROTO.format(memory_bytes=self.memory_bytes, bandwidth=int(self.memory_bandwidth),
                             description=self.description)


TARGETS = {
    "h100-sxm": Target("h100-sxm", "NVIDIA H100 80GB HBM3", 84_929_347_584, 3_352_320_000_000),
    "h200": Target("h200", "NVIDIA H200", 150_754_820_096, 4_800_000_000_000),
}

_PROTO = """gpu_device_info {{
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: 233472  threads_per_core_limit: 2048  core_count: 132  fpus_per_core: 128
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}  l2_cache_size: 52428800  clock_rate_ghz: 1.98
  device_memory_size: {memory_bytes}  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 12 }}
runtime_version {{ major: 13 minor: 0 patch: 0 }}
device_description_str: "{description}"
"""


def target(name: str) -> Target:
    """The target called `name`; a ValueError naming the known ones otherwise."""
    if name not in TARGETS:
        raise ValueError(f"--gpu {name!r} cannot be compiled for; known GPUs: {', '.join(TARGETS)} "
                         "(the planner alone, without --compile, also prices a100-80g)")
    return TARGETS[name]


def topology(gpus: int, gpus_per_host: int = GPUS_PER_HOST) -> str:
    """jax's topology string (slices x hosts x GPUs per host) for `gpus` GPUs: one host up to
    `gpus_per_host`, else whole hosts; a ValueError for a count that fills no whole host."""
    if gpus < 1:
        raise ValueError(f"--gpus={gpus} must be >= 1")
    if gpus <= gpus_per_host:
        return f"1x1x{gpus}"
    if gpus % gpus_per_host:
        raise ValueError(f"--gpus={gpus} is more than one host of {gpus_per_host} and not whole hosts; use a "
                         f"multiple of {gpus_per_host} (or --gpus-per-host)")
    return f"1x{gpus // gpus_per_host}x{gpus_per_host}"
