"""The step-time model's formulas, each small enough to check by hand (tests/test_plan.py does).

  GEMM         roofline (fp32: the kind's fp32 peak): time = 2mnk / min(peak x ceiling, intensity x memory bandwidth), intensity = 2mnk /
               ((mk + kn + mn) bytes) -- a small or skinny GEMM is memory-bound, a large one at the ceiling
  attention    flash-style: 4 b s_q s_k' heads d FLOPs forward (s_k' the keys a query sees: half of them under the
               causal mask), backward 2.5x forward (FlashAttention-2's count: dQ, dK, dV and the recomputed
               scores), at ATTENTION_EFFICIENCY of the GEMM ceiling
  elementwise  bytes / (memory bandwidth x MEMORY_EFFICIENCY): norms, residual adds, activations, casts, the
               optimizer's update
  bubble       1F1B: (p - 1) / m of the ideal time; interleaved (v virtual stages): (p - 1) / (v m)
               (Narayanan et al. 2021, eq. for the interleaved schedule; SPEC §2)
  collective   a ring: the bytes a rank sends (parallel/volume.py's convention, (n-1)/n already in them) over
               the link's bandwidth, plus one latency per ring step ((n - 1) per all-gather or reduce-scatter)
  overlap      communication that the code overlaps with a window of compute hides a share of that window at
               most (the device's ``overlap``, devices.py):
               exposed = comm - min(comm, overlap x window); what the code does not overlap is all exposed
"""
from __future__ import annotations

from typing import Tuple

from training.plan.devices import Device

ATTENTION_EFFICIENCY = 0.6
"""Fused attention's rate as a fraction of the GEMM ceiling. Source: FlashAttention-2 (Dao, 2023) reaches 50-73%
of A100's peak forward and less backward, against ~80% for cuBLAS GEMMs: ~0.6 of the GEMM rate; an assumption
for the other kinds."""

MEMORY_EFFICIENCY = 0.90
"""Fraction of the datasheet memory bandwidth a memory-bound kernel reaches. Source: our measurement, a device
copy moved 3,005 GB/s on one H100 80GB HBM3 (3,350 GB/s datasheet), docs/benchmarks.md 'Kernel bandwidth (H100)'
(python scripts/bench_quant.py on the GPU)."""

BACKWARD_FACTOR = 2.0
"""A GEMM's backward is two GEMMs of the forward's size (input and weight gradients)."""

ATTENTION_BACKWARD_FACTOR = 2.5
"""FlashAttention-2's backward/forward FLOP ratio (the scores are recomputed)."""


def gemm_time(m: int, n: int, k: int, device: Device, fp8: bool = False, elem_bytes: int = 2) -> float:
    """Seconds of one [m, k] x [k, n] GEMM on ``device``: its FLOPs at the roofline's rate."""
    flops = 2.0 * m * n * k
    if flops == 0:
        return 0.0
    moved = (m * k + k * n + m * n) * (1 if fp8 else elem_bytes)
    ceiling = device.peak(fp8, elem_bytes == 4) * device.gemm_ceiling
    roof = flops / moved * device.memory_gbps * 1e9 * MEMORY_EFFICIENCY
    return flops / min(ceiling, roof)


def attention_time(b: int, s_q: int, s_k: float, heads: int, head_dim: int, device: Device,
                   fp32: bool = False) -> Tuple[float, float]:
    """(forward, backward) seconds of fused attention for ``b`` sequences of ``s_q`` queries that each see ``s_k``
    keys on average (causal: about half the keys), ``heads`` heads of ``head_dim`` on this rank."""
    flops = 4.0 * b * s_q * s_k * heads * head_dim
    rate = device.peak(False, fp32) * device.gemm_ceiling * ATTENTION_EFFICIENCY
    forward = flops / rate
    return forward, ATTENTION_BACKWARD_FACTOR * forward


def memory_time(nbytes: float, device: Device) -> float:
    """Seconds of a memory-bound kernel moving ``nbytes`` (read + written)."""
    return nbytes / (device.memory_gbps * 1e9 * MEMORY_EFFICIENCY)


def bubble_fraction(pp: int, virtual_stages: int, microbatches: int) -> float:
    """Idle share of the pipeline relative to the ideal (bubble-free) time: (p - 1) / (v m)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (virtual_stages * microbatches)


def ring_time(bytes_per_rank: float, bandwidth_Bps: float, steps: int, latency_s: float) -> float:
    """Seconds of a ring collective whose rank sends ``bytes_per_rank`` (the (n-1)/n factor already in them) over
    a link of ``bandwidth_Bps``, in ``steps`` steps of ``latency_s`` each."""
    if bytes_per_rank <= 0:
        return 0.0
    return bytes_per_rank / bandwidth_Bps + steps * latency_s


def all_gather_time(total_bytes: float, n: int, bandwidth_Bps: float, latency_s: float) -> float:
    """A ring all-gather of a ``total_bytes`` tensor over ``n`` ranks: each sends (n-1)/n of it, n-1 steps."""
    if n <= 1:
        return 0.0
    return ring_time((n - 1) / n * total_bytes, bandwidth_Bps, n - 1, latency_s)


def exposed(comm_s: float, window_s: float, overlap: float) -> float:
    """Communication left on the critical path when it runs beside ``window_s`` of compute: the window hides at
    most ``overlap`` of itself."""
    return comm_s - min(comm_s, overlap * max(window_s, 0.0))
