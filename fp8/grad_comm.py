"""FP8 gradients and their data-parallel reduction, with the auto-scaling factor mu (FP8-LM §2.1, SPEC §4).

Summing FP8 tensors that carry different per-tensor scales is not defined, and
summing N of them in FP8 overflows. FP8-LM's answer, done here without a patched
NCCL (the bytes travel as uint8 through ``parallel/comm.py`` and the sum is fp32,
locally):

1. every rank casts ``g' = mu * g`` of each tensor with the scale s_i of g
   (``cast_gradient``: mu is what decides how close to the maximum the values sit);
2. the shared scale ``s'_g = min_i s_i`` is agreed per tensor (one fp32 MIN
   all-reduce of the T scales; a tensor that is all zero on a rank offers +inf,
   so it does not drag the others down);
3. each rank re-casts its tensors to ``s'_g`` (``q' = cast(q / s_i * s'_g)``,
   exact when the scales are powers of two) and the FP8 bytes are exchanged:
   an all-to-all for a reduce-scatter, plus an all-gather of the reduced FP8
   shards for an all-reduce;
4. the received pieces are summed in fp32: ``sum_i q'_i``. Read with the scale
   ``N s'_g`` that sum is the DP *mean* of g' (sum / (N s'_g)); cast back to FP8
   it saturates where ``|sum| > max`` -- the overflow that mu exists to prevent.

``AutoScale`` is mu's rule: halve when more than ``threshold`` of the
elements hit the FP8 maximum (NaN and inf count), double after ``interval``
consecutive clean steps. Saturation is counted where it loses information: at
each rank's cast (``cast_gradient``) and on the reduced sum (``ReduceResult``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from fp8.format import amax, format_max, quantize, scale_from_amax
from parallel import comm
from parallel.comm import Group

Bounds = Sequence[Tuple[int, int]]


def cast_gradient(g: torch.Tensor, mu: float, fmt: torch.dtype, margin: int = 0,
                  power_of_two: bool = False) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """``(q, s, saturated)``: ``q = cast(mu * g * s)`` with ``s`` from g's own amax (``max / amax(g) / 2**margin``).

    The scale is g's, not ``mu * g``'s: with mu = 1 the largest element lands on the format maximum (post-
    scaling: a sum over ranks overflows), with mu = 1/N every sum fits (pre-scaling: small values underflow);
    mu moves between the two. ``saturated`` counts elements that exceeded the maximum and were clamped, or
    are not finite. A tensor of zeros gets scale 1; a non-finite one scale 1, its inf turned into NaN (a
    saturating cast would make inf finite) so the step is seen as broken."""
    x = g.float()
    s = scale_from_amax(amax(x), fmt, margin, power_of_two)
    y = (x * s) * mu  # |x s| <= max: no fp32 overflow of s * mu for tiny tensors
    y = torch.where(torch.isinf(y), torch.full_like(y, float("nan")), y)  # the cast would clamp inf: keep it broken
    # beyond the maximum by more than fp32 rounding of amax * s (2**-8: far below half an FP8 step there)
    saturated = int((~(y.abs() <= format_max(fmt) * (1 + 2.0 ** -8))).sum())
    return quantize(y, 1.0, fmt), s, saturated


@dataclass
class ReduceResult:
    """This rank's shard of an FP8 reduce-scatter."""

    sum: torch.Tensor
    """fp32 ``sum_i q'_i`` over the rank's shard (length S); value = sum / result_scale (the DP mean)."""
    shared_scale: torch.Tensor
    """[T] fp32 ``s'_g`` per tensor (identical on every rank)."""
    result_scale: torch.Tensor
    """[T] fp32 ``N s'_g``."""
    overflow: int
    """Elements of the shard (inside tensors) whose |sum| exceeds the format maximum, or is not finite."""
    numel: int
    """Elements of the shard that belong to tensors (padding excluded)."""
    dtype: torch.dtype

    def fp8(self) -> torch.Tensor:
        """The shard cast back to the FP8 format (saturating), to be read with ``result_scale``."""
        return quantize(self.sum, 1.0, self.dtype)


def _shared_scales(data: torch.Tensor, scales: torch.Tensor, bounds: Bounds, group: Group) -> torch.Tensor:
    """MIN over ranks of each tensor's scale; ranks whose tensor is all zero offer +inf; 1 if all do."""
    offer = scales.float().clone()
    for i, (lo, hi) in enumerate(bounds):
        if not bool((data[lo:hi].float() != 0).any()):  # empty or all zero (a NaN is not zero)
            offer[i] = float("inf")
    comm.all_reduce(offer, group, op="min")
    return torch.where(torch.isfinite(offer), offer, torch.ones_like(offer))


def _recast(data: torch.Tensor, scales: torch.Tensor, shared: torch.Tensor, bounds: Bounds) -> None:
    """In place: every tensor's FP8 values from its own scale to the shared one."""
    for i, (lo, hi) in enumerate(bounds):
        if hi > lo and not torch.equal(scales[i], shared[i]):
            data[lo:hi] = quantize(data[lo:hi].float() * (shared[i] / scales[i]), 1.0, data.dtype)


def _counts(total: torch.Tensor, offset: int, bounds: Bounds, dtype: torch.dtype) -> Tuple[int, int]:
    """(overflowing, counted) elements of ``total`` (a shard starting at flat ``offset``) inside ``bounds``."""
    m = format_max(dtype)
    over = numel = 0
    end = offset + total.numel()
    for lo, hi in bounds:
        a, b = max(lo, offset), min(hi, end)
        if a < b:
            piece = total[a - offset:b - offset]
            over += int((~(piece.abs() <= m)).sum())
            numel += b - a
    return over, numel


def reduce_scatter_fp8(data: torch.Tensor, scales: torch.Tensor, bounds: Bounds, group: Group) -> ReduceResult:
    """Sum FP8 ``data`` (flat, length N*S, tensor i at ``bounds[i]`` with scale ``scales[i]``) over ``group``;
    this rank keeps shard ``rank`` (elements ``rank*S .. (rank+1)*S``) as an fp32 sum. ``data`` is re-cast
    to the shared scales in place."""
    n = group.size
    if data.numel() % n:
        raise ValueError(f"FP8 reduce-scatter of {data.numel()} elements over {n} ranks: not divisible")
    shared = _shared_scales(data, scales, bounds, group)
    _recast(data, scales, shared, bounds)
    size = data.numel() // n
    received = torch.empty_like(data)
    comm.all_to_all(received, data, group)
    total = received.view(n, size).float().sum(0)  # fixed order: rank 0's piece first, on every rank
    over, numel = _counts(total, group.rank * size, bounds, data.dtype)
    return ReduceResult(total, shared, shared * n, over, numel, data.dtype)


def all_reduce_fp8(data: torch.Tensor, scales: torch.Tensor, bounds: Bounds,
                   group: Group) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(out, result_scale, overflow, numel)``: the FP8 reduce-scatter, each shard cast back to FP8, and the
    FP8 shards all-gathered; ``out`` (FP8, like ``data``) read with ``result_scale = N s'_g`` is the DP mean.
    ``overflow``/``numel`` count this rank's shard only (summed over ranks they cover every element once)."""
    res = reduce_scatter_fp8(data, scales, bounds, group)
    out = torch.empty_like(data)
    comm.all_gather(out, res.fp8(), group)
    return out, res.result_scale, res.overflow, res.numel


class AutoScale:
    """The gradient factor mu: halve on overflow above ``threshold`` (a fraction), double after ``interval``
    clean steps in a row. Powers of two keep ``mu * g`` exact."""

    MIN, MAX = 2.0 ** -64, 2.0 ** 64

    def __init__(self, initial: float, threshold: float, interval: int):
        self.mu, self.threshold, self.interval = float(initial), float(threshold), int(interval)
        self.clean = 0
        self.changes = 0
        self.last_fraction = 0.0

    def update(self, overflow: int, numel: int) -> float:
        """Account one step's reduced gradients (``overflow`` of ``numel`` elements saturated); return the new mu."""
        self.last_fraction = overflow / max(numel, 1)
        if self.last_fraction > self.threshold:
            new = max(self.mu / 2, self.MIN)
            self.clean = 0
        else:
            self.clean += 1
            new = self.mu
            if self.clean >= self.interval:
                new, self.clean = min(self.mu * 2, self.MAX), 0
        if new != self.mu:
            self.mu, self.changes = new, self.changes + 1
        return self.mu

    def state_dict(self) -> Dict[str, float]:
        return {"mu": self.mu, "clean": self.clean, "changes": self.changes, "last_fraction": self.last_fraction}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        missing = {"mu", "clean", "changes"} - set(state)
        if missing:
            raise ValueError(f"FP8 auto-scale state lacks {sorted(missing)}")
        self.mu, self.clean, self.changes = float(state["mu"]), int(state["clean"]), int(state["changes"])
        self.last_fraction = float(state.get("last_fraction", 0.0))


__all__: List[str] = ["cast_gradient", "ReduceResult", "reduce_scatter_fp8", "all_reduce_fp8", "AutoScale"]
