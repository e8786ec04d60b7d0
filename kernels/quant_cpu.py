"""Fast CPU path for ZeRO++ quantized communication, bit-identical to ``kernels/quant.py``.

``kernels/quant.py`` stays the definition (read its docstring); this module computes the same
payload bytes, scale bits and dequantized values, for every input, in fewer and cheaper passes
of plain torch (no C extension). ``kernels.ops.quant_ops`` picks it for CPU tensors;
``tests/test_quant_cpu.py`` compares it with the references bit for bit. Same signatures, same
argument checks (the references' own, imported) in the same order, so the same errors.

Why each shortcut is exact:

* **No padded fp32 copy.** The reference copies ``x`` into a zero-padded fp32 buffer. Widening
  bf16/fp16 to fp32 is exact, so one ``to(float32)`` (or, for fp32 input, the division's own
  output) is the work buffer; only a ragged last block needs padding, and only then is the
  buffer allocated with a zeroed tail. Later steps run in place on that one buffer.
* **Scales.** ``amax`` and ``amin`` per block are exact (two vectorized reductions, no ``|x|``
  temporary; ``aminmax`` over a dim is far slower on CPU). ``top + bottom >= 0`` decides as
  ``top >= -bottom`` does (a rounded sum has the sign of the exact one, and x + (-x) is +0), so
  the ``where`` picks the reference's extreme. ``extreme * (1/lo)`` is ``extreme / lo`` bit for
  bit: 1/lo = -2**-(bits-1) is exact, so both round the same real number once (subnormal and
  underflowing results included). ``scale += 0.0`` turns a -0.0 scale into +0.0 and leaves
  every other value (NaN included) as it is.
* **Non-finite blocks.** torch's CPU max and min reductions propagate NaN (for every dtype,
  vector or tail lane: the tests check it), and a block holding ±inf and no NaN has an infinite
  max or min, hence a non-finite extreme; a finite block's scale is finite. So one sum over the
  scales finds whether any block is not finite (a sum that overflows only sends finite scales
  to the exact ``isfinite`` check), as the reference's ``isfinite(x).all(dim=1)``. Such a
  block's scale is then written as the NaN the reference writes (``float('nan')``,
  0x7fc00000), whatever NaN the input carried; its row is divided by that NaN and its codes
  are zeroed before the conversion.
* **Division, rounding, clamping** are the reference's fp32 ops (true division by the same
  per-block divisor, ``round`` half to even, clamp to [-m, m-1] with m = 2**(bits-1)) applied
  in place: the same IEEE operation gives the same result wherever it writes. A block whose scale is 0 divides
  by 1 as in the reference: its |x| <= m * 2**-150 < 1/2, so every code rounds to (±)0, which
  converts to the int 0 the reference stores. Only NaN-scale blocks are zeroed explicitly.
* **Conversion** to int8 happens once, on integral values in [-128, 127] (exact).
* **int4 packing** in 16-bit lanes: the int8 codes read as little-endian int16 pairs
  ``w = (hi << 8) | (lo & 0xff)``; ``((w >> 4) & 0xf0) | (w & 0x0f)`` is
  ``(lo & 0xf) | ((hi & 0xf) << 4)`` in [0, 255], the reference's byte. Unpacking sign-extends
  the byte to int16 ``w``: ``(w << 12) >> 12`` is the low nibble sign-extended (int16 shifts
  wrap), ``w >> 4`` the high one (arithmetic shift), and ``(hi << 8) | (lo & 0xff)`` read back as
  two int8 lanes is the code pair in element order, as the reference's ``unpack_int4``. (A
  big-endian machine packs one byte at a time instead: ``(lo & 0xf) | (hi << 4)`` in int8, whose
  ``hi << 4`` lies in [-128, 112], and ``((b & 0xf) ^ 8) - 8``, ``b >> 4`` to unpack.)
* **Dequantization**: int8 -> fp32 is exact, so ``fp32(q) * scale`` is the reference's one
  rounding, done in place; then one cast to the output dtype (the same ``to``).
* **reorder_and_quantize**: every slot is a whole number of blocks (``qgz_slice_sizes``), and
  quantization is blockwise, so quantizing the padded (unordered) buffer and then moving whole
  slots of payload bytes and scales (``bits/8`` bytes and 1/``block`` scales per element, a view
  permutation) gives the bytes of reorder-then-quantize. Input that needs no padding is
  quantized where it lies; otherwise the padding is written straight into the fp32 work buffer.
* **dequant_sum** accumulates into one fp32 buffer in copy order: ``total += c_i`` rounds as
  ``total = total + c_i`` does (products are rounded before the add: no fused multiply-add).
  ``dequant_sum_requant`` zeroes the padding tail of that buffer and quantizes it in place.
"""
from __future__ import annotations

import math
import sys
from typing import Optional, Tuple

import torch

from kernels.quant import (FLOAT_DTYPES, Copies, _check_block, _check_encoded, _check_x,  # noqa: F401
                           _code_range, _copies, n_blocks, payload_nbytes, qgz_slice_sizes, qgz_slot,
                           reorder_for_hierarchical)

__all__ = ["quantize_blockwise", "dequantize_blockwise", "reorder_and_quantize", "dequant_sum",
           "dequant_sum_requant", "n_blocks", "payload_nbytes", "qgz_slice_sizes", "qgz_slot",
           "reorder_for_hierarchical"]

_BIG_ENDIAN = sys.byteorder == "big"     # the 16-bit-lane int4 packing reads int8 pairs little-endian


# ----------------------------------------------------------------------------- helpers
def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7] (even count, contiguous) -> uint8, element 2i low nibble, 2i+1 high."""
    if _BIG_ENDIAN:
        return _pack_int4_bytes(codes)
    w = codes.view(torch.int16)            # (hi << 8) | (lo & 0xff), little-endian pairs
    out = w >> 4
    out &= 0xF0
    out |= w & 0x0F
    return out.to(torch.uint8)             # values in [0, 255]: exact


def _unpack_int4(payload: torch.Tensor) -> torch.Tensor:
    """uint8 payload -> int8 codes in [-8, 7], twice as many, in element order."""
    if _BIG_ENDIAN:
        return _unpack_int4_bytes(payload)
    w = payload.view(torch.int8).to(torch.int16)   # sign-extended byte
    lo = w << 12
    lo >>= 12                              # low nibble, sign-extended
    lo &= 0xFF
    hi = w >> 4                            # high nibble, sign-extended
    hi <<= 8
    hi |= lo
    return hi.view(torch.int8)             # little-endian: (lo, hi) per byte


def _pack_int4_bytes(codes: torch.Tensor) -> torch.Tensor:
    """``_pack_int4`` one byte at a time (any byte order; slower: strided lanes)."""
    pairs = codes.view(-1, 2)
    return ((pairs[:, 0] & 0x0F) | (pairs[:, 1] << 4)).view(torch.uint8)   # hi << 4 in [-128, 112]


def _unpack_int4_bytes(payload: torch.Tensor) -> torch.Tensor:
    """``_unpack_int4`` one byte at a time (any byte order; slower)."""
    b = payload.view(torch.int8)
    return torch.stack((((b & 0x0F) ^ 8) - 8, b >> 4), dim=1).view(-1)


def _scales(xb: torch.Tensor, lo: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """fp32 blocks (rows) -> (the scales as the reference stores them; each row's divisor: its scale, or 1
    where that is 0; the indices of the NaN-scale rows (None: none), whose codes the caller zeroes)."""
    top, bottom = xb.amax(dim=1), xb.amin(dim=1)
    scale = torch.where(top + bottom >= 0, top, bottom).mul_(1.0 / lo)   # the extreme / lo, bit for bit
    scale.add_(0.0)                                      # -0.0 + 0.0 = +0.0; nothing else changes
    bad = None
    if not math.isfinite(scale.sum().item()):           # some scale is not finite (or the sum overflowed)
        bad = (~torch.isfinite(scale)).nonzero().squeeze(1)
        scale.index_fill_(0, bad, float("nan"))
    return scale, scale.masked_fill(scale == 0, 1.0), bad


def _encode(x: torch.Tensor, owned: bool, bits: int, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat contiguous ``x`` of whole blocks. ``owned``: ``x`` is an fp32 scratch buffer
    that may be overwritten."""
    lo, hi = _code_range(bits)
    nb = x.numel() // block
    if nb == 0:
        return (torch.empty(0, dtype=torch.uint8, device=x.device),
                torch.empty(0, dtype=torch.float32, device=x.device))
    if x.dtype != torch.float32:
        x, owned = x.to(torch.float32), True
    xb = x.view(nb, block)
    scale, divisor, bad = _scales(xb, lo)
    if owned:
        work = xb.div_(divisor[:, None])
    else:
        work = torch.div(xb, divisor[:, None])
    work.round_().clamp_(lo, hi)
    if bad is not None:
        work.index_fill_(0, bad, 0.0)
    codes = work.view(-1).to(torch.int8)
    payload = codes.view(torch.uint8) if bits == 8 else _pack_int4(codes)
    return payload, scale


def _quantize_flat(flat: torch.Tensor, bits: int, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat contiguous tensor (not overwritten) of any length; a ragged last block is
    zero-padded in an fp32 copy."""
    numel = flat.numel()
    nb = n_blocks(numel, block)
    if numel == nb * block:
        return _encode(flat, False, bits, block)
    work = torch.empty(nb * block, dtype=torch.float32, device=flat.device)
    work[:numel].copy_(flat)
    work[numel:].zero_()
    return _encode(work, True, bits, block)


def _codes(payload: torch.Tensor, bits: int) -> torch.Tensor:
    """The int8 codes of one payload, in element order."""
    return payload.view(torch.int8) if bits == 8 else _unpack_int4(payload)


def _check_numel(numel) -> None:
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")


# ----------------------------------------------------------------------------- public API
def quantize_blockwise(x: torch.Tensor, bits: int, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (any shape, fp32/bf16/fp16; flattened) -> (uint8 payload, fp32 scales)."""
    _code_range(bits)
    _check_block(block, bits)
    _check_x(x)
    with torch.no_grad():
        return _quantize_flat(x.reshape(-1).contiguous(), bits, block)


def dequantize_blockwise(payload: torch.Tensor, scales: torch.Tensor, bits: int, block: int,
                         numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_blockwise``: exactly ``numel`` values of ``dtype`` (1-D)."""
    _code_range(bits)
    _check_block(block, bits)
    _check_numel(numel)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be float32/bfloat16/float16, got {dtype}")
    nb = _check_encoded(payload, scales, bits, block, numel)
    with torch.no_grad():
        values = _codes(payload, bits).to(torch.float32)
        values.view(nb, block).mul_(scales[:, None])
        return values[:numel].to(dtype)


def reorder_and_quantize(x: torch.Tensor, x_size: int, y_size: int, bits: int, block: int,
                         stages: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """qgZ steps 1-2: ``kernels.quant.reorder_and_quantize`` (same layout, same bytes), quantizing
    before moving whole slots."""
    _code_range(bits)
    _check_block(block, bits)
    _check_x(x)
    P = x_size * y_size
    numel = x.numel()
    shard, padded = qgz_slice_sizes(numel, x_size, y_size, block, stages)
    with torch.no_grad():
        flat = x.reshape(-1)
        if numel == P * padded:
            src, owned = flat.contiguous(), False
        else:   # pad straight into the fp32 work buffer: P rows of shard values, then zeros
            src, owned = torch.empty(P, padded, dtype=torch.float32, device=x.device), True
            full, rem = divmod(numel, shard)
            if full:
                src[:full, :shard].copy_(flat[:full * shard].view(full, shard))
            if rem:
                src[full, :rem].copy_(flat[full * shard:])
                src[full, rem:shard].zero_()
                full += 1
            src[full:, :shard].zero_()
            src[:, shard:].zero_()
            src = src.view(-1)
        payload, scales = _encode(src, owned, bits, block)
        if numel == 0:
            return payload, scales
        # fine slice i = p*stages + s, p = n*x_size + l -> slot s*P + l*y_size + n
        sub = padded // stages
        payload = payload.view(y_size, x_size, stages, sub * bits // 8).permute(2, 1, 0, 3).reshape(-1)
        scales = scales.view(y_size, x_size, stages, sub // block).permute(2, 1, 0, 3).reshape(-1)
        return payload, scales


def _sum(payloads: Copies, scales: Copies, bits: int, block: int, numel: int) -> torch.Tensor:
    """Checks as ``kernels.quant.dequant_sum`` (in its order); -> the fp32 sum, all n_blocks*block
    values (padding positions included)."""
    p, s = _copies(payloads, scales)
    _code_range(bits)
    _check_block(block, bits)
    _check_numel(numel)
    nb = 0
    for i in range(p.shape[0]):
        nb = _check_encoded(p[i], s[i], bits, block, numel)
    total = _codes(p[0], bits).to(torch.float32)
    total.view(nb, block).mul_(s[0][:, None])
    if p.shape[0] > 1:
        term = torch.empty_like(total)
        for i in range(1, p.shape[0]):
            term.copy_(_codes(p[i], bits))
            term.view(nb, block).mul_(s[i][:, None])
            total += term
    return total


def dequant_sum(payloads: Copies, scales: Copies, bits: int, block: int, numel: int) -> torch.Tensor:
    """Dequantize k received copies (a k x bytes tensor or a list of 1-D payloads) and sum
    them in fp32, strictly in copy order: ((c0 + c1) + c2) + ... Returns fp32 of numel."""
    with torch.no_grad():
        return _sum(payloads, scales, bits, block, numel)[:numel]


def dequant_sum_requant(payloads: Copies, scales: Copies, bits: int, block: int, numel: int,
                        out_bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """qgZ step 3: ``quantize_blockwise(dequant_sum(...), out_bits, block)`` (same blocks)."""
    _check_block(block, out_bits)
    with torch.no_grad():
        total = _sum(payloads, scales, bits, block, numel)
        _code_range(out_bits)
        _check_block(block, out_bits)
        total[numel:].zero_()                  # the padding the reference drops and re-pads
        return _encode(total, True, out_bits, block)
