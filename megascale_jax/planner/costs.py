"""The planner's cost models: one function each, its formula in its docstring.

Symbols: F FLOPs, B bytes, n members of a collective, β a link's achieved bandwidth per
direction (bytes/s), α the latency of one ring step, P a GPU's peak FLOP/s, W its HBM bandwidth.
"""

from __future__ import annotations

from megascale_jax import pipeline_schedule
from megascale_jax.planner.calibration import Gpu, Link


def matmul_efficiency(flops: float, gpu: Gpu) -> float:
    """e(F) = e_max · F / (F + F_half): small GEMMs cannot fill the GPU (tail effects, launch and
    memory-bound edges); large ones approach the calibrated asymptote e_max."""
    return gpu.matmul_max_efficiency * flops / (flops + gpu.matmul_half_flops)


def matmul_s(flops: float, gpu: Gpu) -> float:
    """t = F / (P · e(F)) for one GEMM of F FLOPs."""
    return flops / (gpu.peak_flops * matmul_efficiency(flops, gpu)) if flops > 0 else 0.0


def fused_attention_s(flops: float, gpu: Gpu) -> float:
    """t = F / (P · e_attn): a fused (flash) kernel, F counting only the score blocks it computes."""
    return flops / (gpu.peak_flops * gpu.attention_efficiency)


def hbm_s(nbytes: float, gpu: Gpu) -> float:
    """t = B / W: a memory-bound pass (norms, GeLU, softmax, residual adds, the optimizer)."""
    return nbytes / gpu.hbm_bandwidth


def ring_all_reduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each of n GPUs sends in a ring all-reduce of B bytes: 2(n−1)/n · B."""
    return 2 * (n - 1) / n * nbytes


def ring_all_gather_bytes(nbytes: float, n: int) -> float:
    """Bytes each of n GPUs sends in a ring all-gather whose full result is B bytes (or a
    reduce-scatter whose full input is): (n−1)/n · B."""
    return (n - 1) / n * nbytes


def ring_all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of B bytes over n GPUs: t = 2(n−1)/n · B/β + 2(n−1)·α (0 for n = 1)."""
    if n <= 1:
        return 0.0
    return ring_all_reduce_bytes(nbytes, n) / link.bandwidth + 2 * (n - 1) * link.latency


def ring_all_gather_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) whose full result is B bytes: t = (n−1)/n · B/β + (n−1)·α."""
    if n <= 1:
        return 0.0
    return ring_all_gather_bytes(nbytes, n) / link.bandwidth + (n - 1) * link.latency


def p2p_s(nbytes: float, link: Link) -> float:
    """One point-to-point transfer: t = α + B/β."""
    return link.latency + nbytes / link.bandwidth


def exposed_s(comm_s: float, overlapped_compute_s: float) -> float:
    """Communication overlapped with independent compute hides up to that compute and no further:
    exposed = max(0, t_comm − t_compute)."""
    return max(0.0, comm_s - overlapped_compute_s)


def bubble_fraction(schedule: str, p: int, v: int, m: int, forward: float = 1.0, backward: float = 2.0) -> float:
    """The idle share of a lockstep pipeline step, read off the schedule's own tick table
    (`pipeline_schedule.Schedule.bubble_fraction`), = (p−1)/(m·v+p−1) for every schedule here."""
    if p == 1:
        return 0.0
    return pipeline_schedule.build(schedule, p, v, m).bubble_fraction(forward, backward)
