"""Hardware numbers for the planner, read from `configs/calibration.yaml` (data, not code).

Three kinds of value, each marked in the file:
* datasheet values (peak FLOP/s, HBM size and bandwidth, NVLink and NIC bandwidth);
* values taken from a named public model, paper or measurement (ring-step latencies as in
  Calculon's A100 system file; FlashAttention-2's reported efficiency; the NICs' and H100
  NVLink's achieved bandwidth and the SMs an NCCL collective holds, from NCCL's own issue threads);
* a priori estimates (the matmul efficiency curve, A100 NVLink's achieved share of its bandwidth, the
  elementwise HBM passes), written down before the planner was first compared with the published
  runs in tests/planner/published.py and not tuned to them since.
When this project measures a GPU (`python -m bench.campaign`), its numbers replace the estimates.
"""

from __future__ import annotations

import dataclasses
import math
import os

import yaml

DEFAULT_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "configs", "calibration.yaml")


@dataclasses.dataclass(frozen=True)
class Link:
    """One link tier as a collective sees it from one GPU: achieved bytes/s per direction, and the
    latency of one ring step."""

    bandwidth: float
    latency: float


@dataclasses.dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    gpus_per_node: int
    nvlink: Link
    nic: Link  # one GPU's share of the node's NICs
    matmul_max_efficiency: float  # the asymptote of the size curve, wave quantization taken out
    matmul_half_flops: float
    sms: int  # streaming multiprocessors: one wave of GEMM tiles (costs.wave_efficiency)
    gemm_tile: tuple[int, int]  # the GEMM output tile one SM computes at a time
    attention_efficiency: float
    elementwise_passes: float
    collective_sms: int = 0  # SMs an NCCL collective holds while it runs (`costs.overlapped_s`)
    attention_query_s: float = 0.0  # a fused attention's cost per query row, forward + backward (`costs.fused_attention_s`)
    fp32_gemm_flops: float = 0.0  # a float32 GEMM's measured rate (0: none measured; `predict.head_s`)
    hbm_copy_bandwidth: float = 0.0  # a device-to-device copy's measured bytes read + written per second (0: none)

    @property
    def hbm_stream_bandwidth(self) -> float:
        """What a streaming pass achieves: the measured copy rate, the datasheet's where none is."""
        return self.hbm_copy_bandwidth or self.hbm_bandwidth

    @property
    def collective_sm_share(self) -> float:
        return self.collective_sms / self.sms


def tile_wave_efficiency(rows: int, cols: int, tile: tuple[int, int], sms: int) -> float:
    """The share of SM time a rows × cols GEMM output keeps busy when cut into tiles of `tile`,
    one per SM at a time: (T/S) / ⌈T/S⌉, the better of the tile's two orientations
    (`costs.wave_efficiency`, which the planner prices with; here for the calibration itself)."""
    best = 0.0
    for a, b in (tile, tile[::-1]):
        waves = math.ceil(rows / a) * math.ceil(cols / b) / sms
        best = max(best, waves / math.ceil(waves))
    return best


def parse_nic(spec: str) -> tuple[int, float]:
    """'8x200' -> (8 NICs, 200 Gb/s each). Raises ValueError naming the expected form."""
    try:
        count, gbps = spec.lower().split("x")
        count, gbps = int(count), float(gbps)
    except ValueError:
        raise ValueError(f"--nic-gbps {spec!r} must look like 8x200 (NICs per node x Gb/s each)") from None
    if count < 1 or gbps <= 0:
        raise ValueError(f"--nic-gbps {spec!r} needs at least one NIC of positive speed")
    return count, gbps


def load(path: str = DEFAULT_FILE) -> dict[str, dict]:
    with open(path) as f:
        return yaml.safe_load(f)["gpus"]


def gpu(key: str, nic: str | None = None, path: str = DEFAULT_FILE, held_out: str | None = None) -> Gpu:
    """The calibrated GPU `key` (e.g. 'h100-sxm'), its NICs overridden by `nic` ('8x400').

    `held_out` names a validation source (`validation.SOURCES`) the caller will predict: the
    calibration must not have been fitted to it. Each GPU's `fitted_to` lists every source any of
    its values was fitted to; a calibration fitted to the held-out source is refused (ValueError),
    so a leave-one-source-out prediction can never silently use its own answers."""
    table = load(path)
    if key not in table:
        raise ValueError(f"--gpu {key!r} is not one of {', '.join(table)} (configs/calibration.yaml)")
    g = table[key]
    if held_out is not None and held_out in g.get("fitted_to", []):
        raise ValueError(f"the {key} calibration was fitted to {held_out!r}; it cannot predict it held out")
    count, gbps = parse_nic(nic or g["nic"])
    tile = tuple(g["gemm_tile"])
    half = g["matmul_half_gflop"] * 1e9
    e_max = g["matmul_max_efficiency"]
    if g.get("matmul_measured_at"):
        # The efficiency was measured on one square GEMM (n³): that run carried the size curve's
        # factor and its own wave quantization, which the planner applies per shape; take both out.
        n = g["matmul_measured_at"]
        flops = 2 * n**3
        waves = tile_wave_efficiency(n, n, tile, g["sms"])
        e_max = e_max / (flops / (flops + half)) / waves
    # The node's NIC bandwidth shared by its GPUs (each GPU drives its own rail in a DGX).
    nic_per_gpu = count * gbps / 8 * 1e9 / g["gpus_per_node"]
    return Gpu(
        key=key, name=g["name"], peak_flops=g["peak_tflops"] * 1e12, hbm_bytes=g["hbm_gib"] * 2**30,
        hbm_bandwidth=g["hbm_tbps"] * 1e12, gpus_per_node=g["gpus_per_node"],
        nvlink=Link(g["nvlink_gbps"] * 1e9 * g["nvlink_efficiency"], g["nvlink_latency_us"] * 1e-6),
        nic=Link(nic_per_gpu * g["nic_efficiency"], g["nic_latency_us"] * 1e-6),
        matmul_max_efficiency=e_max, matmul_half_flops=half, sms=g["sms"], gemm_tile=tile,
        attention_efficiency=g["attention_efficiency"], elementwise_passes=g["elementwise_passes"],
        collective_sms=g["collective_sms"], attention_query_s=g.get("attention_query_ns", 0.0) * 1e-9,
        fp32_gemm_flops=g.get("fp32_gemm_tflops", 0.0) * 1e12, hbm_copy_bandwidth=g.get("hbm_copy_tbps", 0.0) * 1e12)
