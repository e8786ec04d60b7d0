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

No host synchronisation per tensor. A unit holds hundreds of tensors; a per-tensor ``int(...)`` /
``bool(...)`` / ``torch.equal`` on a GPU stalls the host until the device catches up, hundreds of times a
step (1,168 stalls a step of gpt_350m on an H100 before this was vectorised, the GPU busy 21% of the step).
So the per-tensor questions are answered for all tensors at once over segments (``fp8/segments.py``) --
the flat data cut into gap / tensor / gap / ... pieces, cached per layout (``_segments``): which tensors
are all zero, every tensor's re-cast factor spread over its elements, and the saturated count inside
tensors. Counts stay
device tensors (``_cast_gradient``, ``_reduce_scatter_fp8``); the caller reads them once a step. The public
``cast_gradient`` / ``reduce_scatter_fp8`` / ``all_reduce_fp8`` return Python ints, as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Sequence, Tuple, Union

import torch

from fp8.format import amax, format_max, quantize, scale_from_amax
from fp8.segments import Segments
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
    q, s, saturated = _cast_gradient(g, mu, fmt, margin, power_of_two)
    return q, s, int(saturated)


def _cast_gradient(g: torch.Tensor, mu: float, fmt: torch.dtype, margin: int = 0,
                   power_of_two: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cast_gradient`` with the saturated count left on the device (0-dim int64): no host synchronisation."""
    x = g.float()
    s = scale_from_amax(amax(x), fmt, margin, power_of_two)
    y = (x * s) * mu  # |x s| <= max: no fp32 overflow of s * mu for tiny tensors
    y = torch.where(torch.isinf(y), torch.full_like(y, float("nan")), y)  # the cast would clamp inf: keep it broken
    # beyond the maximum by more than fp32 rounding of amax * s (2**-8: far below half an FP8 step there)
    saturated = (~(y.abs() <= format_max(fmt) * (1 + 2.0 ** -8))).sum()
    return quantize(y, 1.0, fmt), s, saturated


def cast_gradients(acc: torch.Tensor, segments: Segments, mu: float, fmt: torch.dtype, margin: int = 0,
                   power_of_two: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_cast_gradient`` of every tensor of a flat fp32 buffer at once (``segments``: the tensors back to back):
    ``(q, scales, saturated)`` with ``q`` [numel] in ``fmt``, ``scales`` [T], ``saturated`` the total count (0-dim
    int64 on the device). The same bits as one ``_cast_gradient`` per tensor (the same operations, element for
    element) in a few whole-buffer kernels instead of ~25 per tensor; ``acc`` (fp32, or bf16 sums read as fp32) is
    consumed (an fp32 one is scaled in place).

    Traced (``train.compile``), the products are not written back into ``acc``: a compiled graph that mutates its
    input stores the new values into it (read in inductor's code: 4 bytes an element written for a buffer the
    caller drops next); the same products, so the same bits."""
    acc = acc.float()
    amaxes = segments.max(acc.abs())
    scales = scale_from_amax(amaxes, fmt, margin, power_of_two)
    if torch.compiler.is_compiling():  # (x * s) * mu, out of place
        acc = acc * segments.spread(scales) * mu
    else:
        views = [v for v, n in zip(acc.split(segments.lengths), segments.lengths) if n]
        if views:  # (x * s) * mu, as _cast_gradient computes it
            torch._foreach_mul_(views, [s for s, n in zip(scales.unbind(0), segments.lengths) if n])
        acc.mul_(mu)
    acc.masked_fill_(torch.isinf(acc), float("nan"))  # the cast would clamp inf: keep it broken
    saturated = (~(acc.abs() <= format_max(fmt) * (1 + 2.0 ** -8))).sum()
    return quantize(acc, 1.0, fmt), scales, saturated


@dataclass
class ReduceResult:
    """This rank's shard of an FP8 reduce-scatter."""

    sum: torch.Tensor
    """fp32 ``sum_i q'_i`` over the rank's shard (length S); value = sum / result_scale (the DP mean)."""
    shared_scale: torch.Tensor
    """[T] fp32 ``s'_g`` per tensor (identical on every rank)."""
    result_scale: torch.Tensor
    """[T] fp32 ``N s'_g``."""
    overflow: Union[int, torch.Tensor]
    """Elements of the shard (inside tensors) whose |sum| exceeds the format maximum, or is not finite (a
    0-dim device tensor from ``_reduce_scatter_fp8``, an int from ``reduce_scatter_fp8``)."""
    numel: int
    """Elements of the shard that belong to tensors (padding excluded)."""
    dtype: torch.dtype

    def fp8(self) -> torch.Tensor:
        """The shard cast back to the FP8 format (saturating), to be read with ``result_scale``."""
        return quantize(self.sum, 1.0, self.dtype)


@lru_cache(maxsize=1024)
def _segments(bounds: Tuple[Tuple[int, int], ...], lo: int, hi: int,
              device: torch.device) -> Tuple[Segments, torch.Tensor, torch.Tensor]:
    """The window ``[lo, hi)`` of a flat buffer cut into 2T+1 segments gap, tensor, gap, ..., tensor, gap, the
    tensors in buffer order (each clipped to the window; any segment may be empty). Returns the
    ``Segments`` (``fp8/segments.py``), and on ``device`` ``by_position`` (which tensor is k-th in the buffer)
    and ``position`` (where tensor i is: segment ``1 + 2 * position[i]``). Only these are cached (O(T)
    numbers a layout), never anything the size of the buffer. The tensors must be disjoint (every layout
    here is)."""
    order = sorted(range(len(bounds)), key=lambda i: bounds[i])
    lengths, cursor = [], lo
    for i in order:
        a, b = bounds[i]
        a, b = min(max(a, lo), hi), min(max(b, lo), hi)
        if b > a and a < cursor:
            raise ValueError(f"tensor bounds overlap: {bounds[i]} starts before {cursor}")
        a = max(a, cursor)
        b = max(b, a)
        lengths += [a - cursor, b - a]
        cursor = b
    lengths.append(hi - cursor)
    position = [0] * len(bounds)
    for k, i in enumerate(order):
        position[i] = k
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return Segments(lengths, device), as_tensor(order), as_tensor(position)


def _key(bounds: Bounds) -> Tuple[Tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in bounds)


def _shared_scales(data: torch.Tensor, scales: torch.Tensor, bounds: Bounds, group: Group) -> torch.Tensor:
    """MIN over ranks of each tensor's scale; ranks whose tensor is all zero offer +inf; 1 if all do."""
    segments, _, position = _segments(_key(bounds), 0, data.numel(), data.device)
    # a tensor is all zero when no element has magnitude bits (FP8 +-0 are 0x00 / 0x80; a NaN is not zero)
    nonzero = ((data.view(torch.uint8) & 0x7F) != 0).to(torch.float32)
    offer = _offer(segments.max(nonzero)[1::2][position] > 0, scales)
    comm.all_reduce(offer, group, op="min")
    return _shared(offer)


def _offer(any_nonzero: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What a rank offers to the MIN over ranks: each tensor's scale, +inf for a tensor that is all zero here."""
    return torch.where(any_nonzero, scales.float(), torch.full_like(scales, float("inf"), dtype=torch.float32))


def _shared(offer: torch.Tensor) -> torch.Tensor:
    """The shared scales from the MIN of the offers: 1 where every rank offered +inf (all zero everywhere)."""
    return torch.where(torch.isfinite(offer), offer, torch.ones_like(offer))


def _overflowing(total: torch.Tensor, segments: Segments, dtype: torch.dtype) -> torch.Tensor:
    """Elements of ``total`` inside tensors (the odd segments) beyond ``dtype``'s maximum or not finite, as a 0-dim
    int64 device tensor (float64 sums of 0/1 are exact counts)."""
    bad = (~(total.abs() <= format_max(dtype))).to(torch.float64)
    return segments.sum(bad)[1::2].sum().to(torch.int64)


def _recast(data: torch.Tensor, scales: torch.Tensor, shared: torch.Tensor, bounds: Bounds) -> None:
    """In place: every tensor's FP8 values from its own scale to the shared one (one pass over the buffer:
    each element times its tensor's ``shared / scale``, 1 between tensors; a factor of 1 changes nothing)."""
    segments, by_position, _ = _segments(_key(bounds), 0, data.numel(), data.device)
    factor = torch.ones(len(segments), dtype=torch.float32, device=data.device)
    factor[1::2] = (shared.float() / scales.float())[by_position]
    data.copy_(quantize(data.float() * segments.spread(factor), 1.0, data.dtype))


def _counts(total: torch.Tensor, offset: int, bounds: Bounds, dtype: torch.dtype) -> Tuple[torch.Tensor, int]:
    """(overflowing, counted) elements of ``total`` (a shard starting at flat ``offset``) inside ``bounds``; the
    first a 0-dim device tensor."""
    end = offset + total.numel()
    segments, _, _ = _segments(_key(bounds), offset, end, total.device)
    over = _overflowing(total, segments, dtype)
    numel = sum(max(0, min(hi, end) - max(lo, offset)) for lo, hi in bounds)
    return over, numel


def reduce_one_rank(data: torch.Tensor, scales: torch.Tensor, segments: Segments,
                    position: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_all_reduce_fp8`` over a group of one member without its exchange and its buffer-sized temporaries:
    ``(out, shared, overflow)`` with the bits of the general path (tested): the sum over one rank is the rank's
    own values (a -0 summed reads +0), the shared scale each tensor's own (1 for an all-zero tensor: its
    offered +inf), ``overflow`` the elements inside tensors that are not finite. ``segments`` / ``position``:
    ``_segments(bounds, 0, data.numel())``'s. A few fused kernels under ``train.compile`` (``fp8/zero.py``),
    where the general path's copies, float64 mask and per-tensor norms took ~40 eager kernels a unit."""
    total = data.float()
    total = torch.where(total == 0, 0.0, total)  # not `+ 0.0`: inductor drops an added zero
    peak = segments.max(total.abs())[1::2][position]  # NaN propagates: a NaN is not zero (its magnitude bits)
    shared = _shared(_offer(peak != 0, scales))
    return quantize(total, 1.0, data.dtype), shared, _overflowing(total, segments, data.dtype)


def reduce_scatter_fp8(data: torch.Tensor, scales: torch.Tensor, bounds: Bounds, group: Group) -> ReduceResult:
    """Sum FP8 ``data`` (flat, length N*S, tensor i at ``bounds[i]`` with scale ``scales[i]``) over ``group``;
    this rank keeps shard ``rank`` (elements ``rank*S .. (rank+1)*S``) as an fp32 sum. ``data`` is re-cast
    to the shared scales in place."""
    res = _reduce_scatter_fp8(data, scales, bounds, group)
    res.overflow = int(res.overflow)
    return res


def _reduce_scatter_fp8(data: torch.Tensor, scales: torch.Tensor, bounds: Bounds, group: Group) -> ReduceResult:
    """``reduce_scatter_fp8`` with the overflow count left on the device: no host synchronisation."""
    n = group.size
    if data.numel() % n:
        raise ValueError(f"FP8 reduce-scatter of {data.numel()} elements over {n} ranks: not divisible")
    shared = _shared_scales(data, scales, bounds, group)
    if n > 1:  # one rank: every factor is exactly 1 (its own scale, or a zero tensor), the re-cast an identity
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
    out, result_scale, overflow, numel = _all_reduce_fp8(data, scales, bounds, group)
    return out, result_scale, int(overflow), numel


def _all_reduce_fp8(data: torch.Tensor, scales: torch.Tensor, bounds: Bounds,
                    group: Group) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``all_reduce_fp8`` with the overflow count left on the device: no host synchronisation."""
    res = _reduce_scatter_fp8(data, scales, bounds, group)
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
