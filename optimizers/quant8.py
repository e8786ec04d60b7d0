"""Blockwise 8-bit quantization of optimizer states (the dynamic-tree maps of Dettmers et al., "8-bit Optimizers
via Block-wise Quantization", 2110.02861, as bitsandbytes' and torchao's 8-bit Adam use them).

A tensor is cut into blocks of ``block`` consecutive elements of its flattened order (the last block ragged). A
block keeps one fp32 scale, its absmax, and one uint8 code an element: the index of the map value nearest to
``x / scale``. 8-bit AdamW keeps its first moment with ``signed_map()`` and its second with ``unsigned_map()``:
1 byte an element each plus 4 bytes a block each (2.03 bytes an element for both moments at block 256).

The maps (256 fp32 values, ascending), built in float64 from the construction of bitsandbytes'
``create_dynamic_map``: decade ``i`` = 0..6 covers [10**(i-6) * 0.1, 10**(i-6)) with the means of ``n_i`` equal
intervals of [0.1, 1] scaled by 10**(i-6), ``n_i = 2**i`` (signed: each value also negated) or ``2**(i+1)``
(unsigned); then 0 and 1.0. That is 2 * 127 + 2 (signed) and 254 + 2 (unsigned) values. Two changes:
  * signed: the most negative value (-0.99297, the mean of decade 6's top interval) becomes -1.0, so that a block
    whose absmax element is negative maps it to itself, as +1.0 does for a positive one;
  * every value is rounded to 20 significant bits (within 2**-20 relative of bitsandbytes' fp32 entries). The
    exponents of two neighbours differ by at most 2, so their sum fits fp32's 24 bits and each midpoint
    ``(map[k] + map[k+1]) / 2`` is exact in fp32: comparing with the fp32 midpoints is exactly the nearest-value
    rule, with no midpoint rounding in between.
torchao's maps are bitsandbytes' (the signed one without -1.0). Other differences: torchao wants numel a multiple
of the block, and clips a zero absmax to 1e-12; here an all-zero block has scale 0.

Rules of ``quantize``:
  * ratio ``r = x / scale`` in fp32 (IEEE division); code = index of the map value nearest to ``r``. Ties (``r``
    exactly on a midpoint) go to the larger map value, as torchao's binary search does.
  * scale = the block's largest value the map can represent in magnitude: ``max |x|`` for a map whose first value
    is -1 (signed), ``max(x, 0)`` for one whose first value is 0 (unsigned: negative elements get code 0, value 0).
  * a block with scale below ``TINY`` = 2**-104 (all-zero blocks included) is stored as scale 0 and the zero code:
    above it every nonzero code times the scale is a normal fp32 number (the smallest nonzero map value is 3.25e-7
    > 2**-22). That is what makes the round trip exact: ``quantize(dequantize(codes, scales))`` returns the same
    codes and scales, bit for bit. The element at the absmax has ``r = ±1`` exactly and keeps the scale; every
    other ``map[c] * scale`` comes back as ``r`` within 2**-23 relative of ``map[c]``, far inside its interval (the
    narrowest half-gap is 0.0017 relative). Checkpoints hold the dequantized fp32 moments and re-quantize them on
    load: nothing drifts. Values below 2**-104 (~5e-32) are far below anything AdamW's eps lets matter.
  * NaN and ±inf propagate, without a host sync: a block holding one gets scale NaN and the zero code, and
    dequantizes to NaN, the whole block (a loss scaler skips such steps before they reach the optimizer).
"""
from __future__ import annotations

import functools
import math
from typing import List, Tuple

import torch
import torch.nn.functional as F

CODES = 256
MAP_BITS = 20  # significant bits of each map value (see above: makes every fp32 midpoint exact)
TINY = 2.0 ** -104  # smallest kept scale: TINY * (smallest nonzero map value) is a normal fp32 number


def _round_bits(v: float, bits: int) -> float:
    """``v`` rounded (half to even) to ``bits`` significant bits, in float64."""
    if v == 0.0:
        return 0.0
    m, e = math.frexp(v)
    return math.ldexp(round(m * 2 ** bits), e - bits)


def _build(signed: bool) -> List[float]:
    values = [0.0, 1.0]
    for i in range(7):
        n = 2 ** i if signed else 2 ** (i + 1)
        for k in range(n):
            v = 10.0 ** (i - 6) * (0.1 + 0.9 * (2 * k + 1) / (2 * n))
            values += [v, -v] if signed else [v]
    values.sort()
    if signed:
        values[0] = -1.0
    return [_round_bits(v, MAP_BITS) for v in values]


@functools.lru_cache(maxsize=None)
def _code_map(signed: bool, device: torch.device) -> torch.Tensor:
    """The map on ``device``, built once per process and device (shared: never write into it)."""
    t = torch.tensor(_build(signed), dtype=torch.float64).to(torch.float32)
    assert t.numel() == CODES and bool((t[1:] > t[:-1]).all()), "code map must be 256 ascending values"
    assert float(t[t != 0].abs().min()) * TINY >= 2.0 ** -126, "TINY * smallest code must be a normal fp32"
    return t.to(device)


def signed_map() -> torch.Tensor:
    """The 256-value map of the first moment: ascending, holds -1.0, 0 and 1.0 (fp32, CPU, a fresh copy)."""
    return _code_map(True, torch.device("cpu")).clone()


def unsigned_map() -> torch.Tensor:
    """The 256-value map of the second moment: ascending, from 0 to 1.0 (fp32, CPU, a fresh copy)."""
    return _code_map(False, torch.device("cpu")).clone()


def map_on(signed: bool, device: torch.device) -> torch.Tensor:
    """The signed or unsigned map on ``device``, cached (read-only by convention)."""
    return _code_map(signed, torch.device(device))


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` as (blocks, block), the ragged last block padded with zeros (a copy only if ragged)."""
    pad = num_blocks(flat.numel(), block) * block - flat.numel()
    return (F.pad(flat, (0, pad)) if pad else flat).view(-1, block)


def _check(code_map: torch.Tensor, block: int) -> None:
    if block < 1:
        raise ValueError(f"quant8: block must be >= 1, got {block}")
    if code_map.dim() != 1 or not 2 <= code_map.numel() <= CODES or code_map.dtype != torch.float32:
        raise ValueError(f"quant8: code_map must be 1-D float32 with 2..256 values, got {tuple(code_map.shape)} "
                         f"{code_map.dtype}")


@torch.no_grad()
def quantize(x: torch.Tensor, code_map: torch.Tensor, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` -> (uint8 codes shaped like ``x``, fp32 scales, one a block): the rules of the module docstring.

    ``code_map`` is ascending, holds 0 and 1.0, and starts at -1.0 (signed) or 0 (unsigned)."""
    _check(code_map, block)
    if x.dtype != torch.float32:
        raise ValueError(f"quant8: quantize takes float32, got {x.dtype}")
    blocks = _blocks(x.reshape(-1), block)
    # signed map (first value -1): max(x, -x) = |x|; unsigned (first value 0): max(x, 0)
    scales = torch.maximum(blocks, blocks * code_map[0]).amax(dim=1)
    finite = torch.isfinite(scales)
    keep = finite & (scales >= TINY)  # False for non-finite, tiny and zero blocks
    scales = torch.where(keep, scales, torch.where(finite, 0.0, math.nan))
    ratio = torch.where(keep[:, None], blocks / torch.where(keep, scales, 1.0)[:, None], 0.0)
    mids = (code_map[:-1] + code_map[1:]) * 0.5
    codes = torch.bucketize(ratio, mids, out_int32=True, right=True).to(torch.uint8)
    return codes.view(-1)[:x.numel()].view(x.shape), scales


@torch.no_grad()
def dequantize(codes: torch.Tensor, scales: torch.Tensor, code_map: torch.Tensor, block: int) -> torch.Tensor:
    """uint8 ``codes`` and their block ``scales`` -> fp32 ``map[code] * scale``, shaped like ``codes``."""
    _check(code_map, block)
    if codes.dtype != torch.uint8:
        raise ValueError(f"quant8: codes must be uint8, got {codes.dtype}")
    if scales.dim() != 1 or scales.numel() != num_blocks(codes.numel(), block):
        raise ValueError(f"quant8: {codes.numel()} codes in blocks of {block} need "
                         f"{num_blocks(codes.numel(), block)} scales, got {tuple(scales.shape)}")
    values = code_map.index_select(0, codes.reshape(-1).to(torch.int32))
    out = _blocks(values, block) * scales[:, None]
    return out.view(-1)[:codes.numel()].view(codes.shape)
