"""Randomized Hadamard rotation of quantization blocks (SDP4Bit's TLq-HS, SPEC §7).

A gradient block with one outlier quantizes badly: the outlier sets the scale and every other value of the
block lands on a few codes around zero. Rotating the block by an orthonormal Hadamard matrix first spreads
each value over the whole block (an outlier becomes B values of magnitude |outlier| / sqrt(B)), so the
block's absmax falls towards its root mean square and the quantization step with it. The rotation is undone
after dequantization; being orthonormal, it neither amplifies the quantization error nor changes its L2 norm.

For a block size B = 2**k, with H_B the Sylvester Hadamard matrix (entries +-1, H_B H_B = B I) and D a
diagonal of random signs (seeded, the same on every rank)::

    rotate(x)   = (x D) H_B / sqrt(B)        per block of B consecutive values
    unrotate(y) = (y H_B / sqrt(B)) D         its inverse: H_B / sqrt(B) is symmetric and orthogonal

The random signs decorrelate the rotation from structure in the data (a block that is itself a row of H_B
would otherwise concentrate into one value). Both are fp32 matrix products: exact up to fp32 rounding (the
round trip returns x within a few ulps, tested), and linear, so summing rotated copies and rotating the sum
back equals summing the originals (qgZ sums in the rotated domain and unrotates once).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

SIGN_SEED = 0x5D94B
"""Seed of the random signs D: a constant, so every rank (and every run) rotates the same way."""


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


@lru_cache(maxsize=16)
def _matrix(block: int, device_type: str, device_index) -> torch.Tensor:
    """D H_B / sqrt(B) as one fp32 matrix (rows scaled by the signs): rotate(x) = x @ M, unrotate(y) = y @ M.T."""
    if not is_power_of_two(block):
        raise ValueError(f"the Hadamard block must be a power of two, got {block!r}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(SIGN_SEED)
    signs = torch.randint(0, 2, (block,), generator=g).double() * 2 - 1
    m = signs[:, None] * h / math.sqrt(block)
    return m.to(torch.float32).to(torch.device(device_type, device_index))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.numel() % block:
        raise ValueError(f"{x.numel()} values are not a whole number of {block}-value blocks")
    return x.reshape(-1, block).to(torch.float32)


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """Rotate every block of ``block`` consecutive values of ``x`` (numel a multiple of ``block``): fp32, 1-D."""
    m = _matrix(block, x.device.type, x.device.index)
    return (_blocks(x, block) @ m).reshape(-1)


def unrotate(y: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of ``rotate``: fp32, 1-D."""
    m = _matrix(block, y.device.type, y.device.index)
    return (_blocks(y, block) @ m.T).reshape(-1)
