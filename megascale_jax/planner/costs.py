"""The planner's cost models: one function each, its formula in its docstring.

Symbols: F FLOPs, B bytes, n members of a collective, β a link's achieved bandwidth per
direction (bytes/s), α the latency of one ring step, P a GPU's peak FLOP/s, W its HBM bandwidth.
"""

from __future__ import annotations

from megascale_jax import pipeline_schedule
from megascale_jax.planner.calibration import Gpu, Link, tile_wave_efficiency


def matmul_efficiency(flops: float, gpu: Gpu) -> float:
    """e(F) = e_max · F / (F + F_half): small GEMMs cannot fill the GPU (tail effects, launch and
    memory-bound edges); large ones approach the calibrated asymptote e_max."""
    return gpu.matmul_max_efficiency * flops / (flops + gpu.matmul_half_flops)


def matmul_s(flops: float, gpu: Gpu) -> float:
    """t = F / (P · e(F)) for one GEMM of F FLOPs."""
    return flops / (gpu.peak_flops * matmul_efficiency(flops, gpu)) if flops > 0 else 0.0


def wave_efficiency(rows: int, cols: int, gpu: Gpu) -> float:
    """Wave quantization (NVIDIA, Matrix Multiplication Background User's Guide, DU-09799-001,
    §3.2): a GEMM's rows × cols output is cut into tiles of a × b, one thread block per SM at a
    time, so it runs in ⌈T/S⌉ waves of S tiles (S = the GPU's SMs, T = ⌈rows/a⌉·⌈cols/b⌉); the
    last wave's idle SMs cost q = (T/S) / ⌈T/S⌉ of the peak. Of the two orientations of the tile
    (a × b, b × a) the better is taken, as cuBLAS's heuristic may pick either."""
    return tile_wave_efficiency(rows, cols, gpu.gemm_tile, gpu.sms)


def gemm_wave_loss_s(m: int, k: int, n: int, gpu: Gpu) -> float:
    """The part of `gemm_s` the last wave's idle SMs cost: t − t·q."""
    return gemm_s(m, k, n, gpu) * (1 - wave_efficiency(m, n, gpu)) if m > 0 and k > 0 and n > 0 else 0.0


def gemm_s(m: int, k: int, n: int, gpu: Gpu) -> float:
    """One GEMM (m × k) · (k × n), F = 2mkn: t = F / (P · e(F) · q(m, n)), the size curve
    `matmul_efficiency` times the wave quantization of its m × n output (`wave_efficiency`)."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0
    return matmul_s(2 * m * k * n, gpu) / wave_efficiency(m, n, gpu)


def linear_s(tokens: int, k: int, n: int, gpu: Gpu) -> dict[str, float]:
    """A linear layer x · W (x: tokens × k, W: k × n) in training: its forward GEMM (output
    tokens × n), and the backward's two, the input gradient dy · Wᵀ (output tokens × k) and the
    weight gradient xᵀ · dy (output k × n); each the same FLOPs, each its own wave quantization
    (whose seconds `*_wave_loss` gives apart, for `--explain`)."""
    data, weight = gemm_s(tokens, n, k, gpu), gemm_s(k, tokens, n, gpu)
    return {"forward": gemm_s(tokens, k, n, gpu), "backward": data + weight, "input_gradient": data,
            "forward_wave_loss": gemm_wave_loss_s(tokens, k, n, gpu),
            "backward_wave_loss": gemm_wave_loss_s(tokens, n, k, gpu) + gemm_wave_loss_s(k, tokens, n, gpu)}


# A FlashAttention-2 kernel's forward + backward FLOPs over its forward's: the backward recomputes
# the scores and takes four products to the forward's two, 2.5x the forward.
FLASH_FWD_BWD = 3.5


def visible_pairs(seq: int, window: int | None) -> int:
    """(query, key) pairs a causal attention over `seq` tokens computes, each query seeing the
    last `window` keys (itself included; all before it for window=None): i − w < j ≤ i."""
    w = seq if window is None else min(window, seq)
    return w * (w + 1) // 2 + (seq - w) * w


def fused_attention_s(forward_flops: float, query_rows: float, gpu: Gpu) -> float:
    """The forward of a fused (flash) attention kernel: t = F / (P · e_attn) + N_q · c_q / 3.5.

    F counts the visible (query, key) pairs only (4 · head_dim FLOPs each), N_q the query rows
    (queries × heads). c_q is what each query row costs the forward and backward together beyond
    its pairs' FLOPs (its Q, O, dO and dQ through HBM, the softmax statistics, the partly masked
    blocks at the window's edges), so short windows run below e_attn; the backward is 2.5× the
    forward (`FLASH_FWD_BWD`), hence 1/3.5 of c_q here. Both constants are fitted to this
    project's kernel bench on the GPU (`measured.attention_fit`)."""
    return forward_flops / (gpu.peak_flops * gpu.attention_efficiency) + query_rows * gpu.attention_query_s / FLASH_FWD_BWD


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


def held_sms_s(comm_s: float, overlapped_compute_s: float, gpu: Gpu) -> float:
    """The compute an NCCL transfer slows while both run. NCCL runs one thread block per channel,
    each holding a whole SM ("NCCL CTAs won't share an SM with compute kernels"; 16 SMs on a DGX,
    NVIDIA/nccl#689), so for min(t_comm, t_compute) the compute has k of its S SMs fewer:
    (k/S) · min(t_comm, t_compute)."""
    return gpu.collective_sm_share * min(comm_s, overlapped_compute_s)


def overlapped_s(comm_s: float, overlapped_compute_s: float, gpu: Gpu) -> float:
    """What an NCCL transfer overlapped with independent compute costs the step: its exposed part
    (`exposed_s`) plus the compute it slows while both run (`held_sms_s`)."""
    return exposed_s(comm_s, overlapped_compute_s) + held_sms_s(comm_s, overlapped_compute_s, gpu)


def bubble_fraction(schedule: str, p: int, v: int, m: int, forward: float = 1.0, backward: float = 2.0) -> float:
    """The idle share of a lockstep pipeline step, read off the schedule's own tick table
    (`pipeline_schedule.Schedule.bubble_fraction`), = (p−1)/(m·v+p−1) for every schedule here."""
    if p == 1:
        return 0.0
    return pipeline_schedule.build(schedule, p, v, m).bubble_fraction(forward, backward)
