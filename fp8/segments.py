"""Per-tensor operations over tensors stored back to back in one flat buffer ("segments").

FP8-LM keeps one scale per tensor, and a unit's tensors (hundreds of them) live back to back in flat
buffers: master weights, moments, gradients, the reduction layout. Asking each tensor separately costs a
handful of small kernels per tensor, which on a GPU is what an FP8 step spent its time on (~40,000
kernels a step of gpt_350m on an H100, the GPU busy 21% of the step). ``Segments`` answers the same
questions for all tensors at once:

  spread(v)   per-tensor values [T] repeated over each tensor's elements [numel]
  max(x)      per-tensor max of x [T] (0 for an empty tensor; NaN propagates)
  sum(x)      per-tensor sum of x [T] (0 for an empty tensor)

``max`` and ``sum`` have two implementations that give the same bits for ``max`` (an exact reduction). The
fused one, used on CUDA, is torch's multi-tensor ``_foreach_max`` / ``_foreach_norm`` over the segments' views
(a launch per ~100 tensors); the other a per-segment loop over views (``split``), used on CPU, where it is the
faster. ``sum`` may differ between the two in the last bits (summation order), as two devices' sums do anyway.

``spread`` fills each segment's view with its value: one fill kernel a segment, writing each element once.
Compiled (``train.compile``), it is a gather instead: each element finds its segment and reads the value. Its
segment is the count of segment ends at or below its position: for up to ``SEARCH_ABOVE`` segments (a
transformer block's unit has 12) by comparing the position with each end, constants of the graph (a few
integer operations an element, fused into the consuming kernel); above, by a binary search over the ends
(``bucketize``: a chain of dependent loads an element on a GPU, and on CPU inductor calls it as a separate op
that writes a 4-byte index an element: measured on this 2-core CPU, a 12.6M-element unit's compiled AdamW took
347 ms with the search for every unit and 98 ms with the compares, its bf16 working weights 48 and 11 ms). The
fills, traced, became one select per segment per element with the value's own arithmetic (a scale formula)
repeated in each, a compute-bound kernel: measured on an H200 (gpt_1.3b, fp8, 2026-11-27 second call), the
FP8 AdamW's and the re-quantizations' kernels took 0.9-1.2 ms each per 50M-element unit, 107 ms of the step.
Measured on an H200 (gpt_1.3b, fp8, 4 x 4 micro-batches, 2026-11-27): the other way, each element's segment
number built by a cumulative sum over boundary marks and then gathered (~20 bytes moved per element instead
of 4), took 118 ms of the step's 781 ms of GPU time in 260 calls; ``repeat_interleave``
(1.8 ms a call on an H100: it fills each segment from one thread) and ``segment_reduce`` (1.4 ms: one thread
block per segment, and an embedding is one segment) were slower still.
"""
from __future__ import annotations

import itertools
from typing import List, Optional, Sequence

import torch


SEARCH_ABOVE = 32
"""Compiled ``spread`` finds an element's segment by comparing its position with each segment end (constants of
the graph) up to this many segments, by a binary search over the ends (a tensor) above."""


class Segments:
    """T segments (any may be empty) covering ``[0, numel)`` of a flat buffer, in order."""

    def __init__(self, lengths: Sequence[int], device: torch.device, fused: Optional[bool] = None):
        self.lengths: List[int] = [int(n) for n in lengths]
        if any(n < 0 for n in self.lengths):
            raise ValueError(f"segment lengths must be >= 0, got {self.lengths[:8]}")
        self.numel = sum(self.lengths)
        self.device = torch.device(device)
        self.fused = self.device.type == "cuda" if fused is None else fused
        # made once, on the device (a host-to-device copy inside a step would synchronise): which segments hold
        # elements
        self._nonempty = [i for i, n in enumerate(self.lengths) if n]
        self._nonempty_index = torch.tensor(self._nonempty, dtype=torch.int64, device=self.device)
        # each segment's end (exclusive), for the compiled spread's search
        self._index_dtype = torch.int32 if self.numel < 2**31 else torch.int64
        self._end_list = list(itertools.accumulate(self.lengths))
        self._ends = torch.tensor(self._end_list, dtype=self._index_dtype, device=self.device)

    def __len__(self) -> int:
        return len(self.lengths)

    def _check(self, x: torch.Tensor, what: str, n: int) -> None:
        if x.dim() != 1 or x.numel() != n:
            raise ValueError(f"Segments.{what}: expected a flat tensor of {n} elements, got {tuple(x.shape)}")

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [T] repeated over the segments' elements: [numel], values' dtype."""
        self._check(values, "spread", len(self))
        if torch.compiler.is_compiling():  # see the module docstring
            position = torch.arange(self.numel, dtype=self._index_dtype, device=values.device)
            if len(self) <= SEARCH_ABOVE:  # the number of ends at or below the position: compares with constants
                segment = torch.zeros_like(position)
                for end in self._end_list[:-1]:
                    segment = segment + (position >= end).to(self._index_dtype)
            else:
                segment = torch.bucketize(position, self._ends, out_int32=self._index_dtype == torch.int32,
                                          right=True)
            return values[segment]
        out = torch.empty(self.numel, dtype=values.dtype, device=values.device)
        for piece, v in zip(out.split(self.lengths), values.unbind(0)):
            piece.fill_(v)  # a 0-dim device tensor: no host synchronisation
        return out

    def _per_nonempty(self, x: torch.Tensor, reduce) -> torch.Tensor:
        """[T]: ``reduce`` (a multi-tensor op: list of tensors -> list of 0-d results) of each non-empty
        segment's view of ``x``, 0 for the empty ones."""
        out = x.new_zeros(len(self))
        if self._nonempty:
            views = [v for v, n in zip(x.split(self.lengths), self.lengths) if n]
            out.index_copy_(0, self._nonempty_index, torch.stack(reduce(views)).to(x.dtype))
        return out

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """Per-segment max of ``x`` [numel] as [T] (0 for an empty segment; a NaN in a segment gives NaN).
        For amaxes: pass ``x.abs()`` (every value >= 0, so the empty segment's 0 is the identity)."""
        self._check(x, "max", self.numel)
        if self.fused and not torch.compiler.is_compiling():  # compiled: the loop's reductions are fused anyway
            return self._per_nonempty(x, torch._foreach_max)
        if not self.lengths:
            return x.new_zeros(0)
        zero = x.new_zeros(())
        return torch.stack([p.max() if p.numel() else zero for p in x.split(self.lengths)])

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-segment sum of ``x`` [numel] as [T] (0 for an empty segment). ``x`` must be >= 0 (squares,
        counts): the fused form is the 1-norm of each segment."""
        self._check(x, "sum", self.numel)
        if self.fused and not torch.compiler.is_compiling():
            return self._per_nonempty(x, lambda views: torch._foreach_norm(views, 1))
        return torch.stack([p.sum() for p in x.split(self.lengths)]) if self.lengths else x.new_zeros(0)
