"""Which data-parallel rank owns which bytes of a flat buffer (ZeRO's shard layout).

A *unit* (a transformer block, the embedding, ...) keeps its tensors in one flat
buffer of ``world * shard_size`` elements; DP rank r owns ``[r*S, (r+1)*S)``.
Every shard has the same padded size, so one all-gather / reduce-scatter path
serves both kinds of layout:

``flat``          the tensors back to back, cut into equal contiguous shards (ZeRO's);
                  a tensor may straddle shards. S is rounded up to ``ALIGN`` elements.
``whole_tensor``  every tensor lives whole on one rank (FP8-LM: a per-tensor scale
                  cannot be split): largest first, to the rank with the fewest
                  elements so far, ties to the lowest rank; S = the largest load,
                  rounded up to ``ALIGN``. Ranks may hold nothing but padding.

``ALIGN`` = 128 elements keeps every shard (and so every all-gather piece) a whole
number of int4 pairs, 16-byte vectors and quantisation blocks of up to 128, so a
"numel % 8" failure of later quantised paths cannot happen.

Padding elements are zero in every buffer and never read as data. The layout is
a pure function of (sizes, world, kind), so the memory estimator and the analytic
communication volume use the very same rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

ALIGN = 128
KINDS = ("flat", "whole_tensor")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class ShardLayout:
    numels: Tuple[int, ...]
    """Elements of each tensor, in unit order."""
    world: int
    kind: str
    shard_size: int
    """S: elements of every rank's shard (padding included)."""
    offsets: Tuple[int, ...]
    """Start of each tensor in the gathered buffer of ``world * S`` elements."""

    @property
    def padded_size(self) -> int:
        return self.world * self.shard_size

    def owned(self, rank: int) -> List[Tuple[int, int, int, int]]:
        """Pieces of tensors in rank's shard: (tensor index, start, end within the tensor, start in the shard)."""
        lo, hi = rank * self.shard_size, (rank + 1) * self.shard_size
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                out.append((i, a - off, b - off, a - lo))
        return out

    def owner(self, index: int) -> int:
        """The rank holding the first element of tensor ``index``."""
        return self.offsets[index] // self.shard_size if self.shard_size else 0


def shard_layout(numels: Sequence[int], world: int, kind: str = "flat", align: int = ALIGN,
                 first: int = 0) -> ShardLayout:
    """``first`` (whole_tensor only): the rank that wins ties, the others following in rank order mod world,
    so that units of one big tensor each (embedding, head) need not all land on rank 0."""
    numels = tuple(int(n) for n in numels)
    if kind not in KINDS:
        raise ValueError(f"unknown ZeRO partition kind {kind!r}; expected one of {list(KINDS)}")
    if world < 1 or any(n < 0 for n in numels):
        raise ValueError(f"bad shard layout request: world={world}, numels={numels}")
    if kind == "flat":
        shard = _round_up(-(-sum(numels) // world), align) if sum(numels) else align
        offsets, at = [], 0
        for n in numels:
            offsets.append(at)
            at += n
        return ShardLayout(numels, world, kind, shard, tuple(offsets))
    # whole_tensor: greedy longest-processing-time assignment
    load = [0] * world
    where: List[Tuple[int, int]] = [(0, 0)] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world), key=lambda r: (load[r], (r - first) % world))
        where[i] = (r, load[r])
        load[r] += numels[i]
    shard = _round_up(max(load), align) if max(load, default=0) else align
    return ShardLayout(numels, world, kind, shard, tuple(r * shard + at for r, at in where))
