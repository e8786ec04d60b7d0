"""Per-tensor operations over tensors stored back to back in one flat buffer ("segments").

FP8-LM keeps one scale per tensor, and a unit's tensors (hundreds of them) live back to back in flat
buffers: master weights, moments, gradients, the reduction layout. Asking each tensor separately costs a
handful of small kernels per tensor, which on a GPU is what an FP8 step spent its time on (~40,000
kernels a step of gpt_350m on an H100, the GPU busy 21% of the step). ``Segments`` answers the same
questions for all tensors at once:

  spread(v)   per-tensor values [T] repeated over each tensor's elements [numel]
  max(x)      per-tensor max of x [T] (0 for an empty tensor; NaN propagates)
  sum(x)      per-tensor sum of x [T] (0 for an empty tensor)

Each has two implementations that give the same bits for ``spread`` and ``max`` (copies and an exact
reduction): the fused one (``repeat_interleave`` / ``segment_reduce``: a few kernels whatever T is), used on
CUDA, and a per-segment loop over views (``split``), used on CPU, where it is several times faster
(``repeat_interleave`` builds an index and gathers; ``segment_reduce`` runs one thread). ``sum`` may differ
between the two in the last bits (summation order), as two devices' sums do anyway.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch


class Segments:
    """T segments (any may be empty) covering ``[0, numel)`` of a flat buffer, in order."""

    def __init__(self, lengths: Sequence[int], device: torch.device, fused: Optional[bool] = None):
        self.lengths: List[int] = [int(n) for n in lengths]
        if any(n < 0 for n in self.lengths):
            raise ValueError(f"segment lengths must be >= 0, got {self.lengths[:8]}")
        self.numel = sum(self.lengths)
        self.device = torch.device(device)
        self.fused = self.device.type == "cuda" if fused is None else fused
        # the lengths on the device, made once (a host-to-device copy inside a step would synchronise)
        self._device_lengths = torch.tensor(self.lengths, dtype=torch.int64, device=self.device)

    def __len__(self) -> int:
        return len(self.lengths)

    def _check(self, x: torch.Tensor, what: str, n: int) -> None:
        if x.dim() != 1 or x.numel() != n:
            raise ValueError(f"Segments.{what}: expected a flat tensor of {n} elements, got {tuple(x.shape)}")

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [T] repeated over the segments' elements: [numel], values' dtype."""
        self._check(values, "spread", len(self))
        if self.fused:
            return torch.repeat_interleave(values, self._device_lengths, output_size=self.numel)
        out = torch.empty(self.numel, dtype=values.dtype, device=values.device)
        for piece, v in zip(out.split(self.lengths), values):
            piece.fill_(v)
        return out

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """Per-segment max of ``x`` [numel] as [T] (0 for an empty segment; a NaN in a segment gives NaN).
        For amaxes: pass ``x.abs()`` (every value >= 0, so the empty segment's 0 is the identity)."""
        self._check(x, "max", self.numel)
        if self.fused:
            return torch.segment_reduce(x, "max", lengths=self._device_lengths, unsafe=True, initial=0.0)
        if not self.lengths:
            return x.new_zeros(0)
        zero = x.new_zeros(())
        return torch.stack([p.max() if p.numel() else zero for p in x.split(self.lengths)])

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-segment sum of ``x`` [numel] as [T] (0 for an empty segment)."""
        self._check(x, "sum", self.numel)
        if self.fused:
            return torch.segment_reduce(x, "sum", lengths=self._device_lengths, unsafe=True, initial=0.0)
        return torch.stack([p.sum() for p in x.split(self.lengths)]) if self.lengths else x.new_zeros(0)
