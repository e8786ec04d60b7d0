"""Triton kernels for ZeRO++ quantized communication, bit-identical to ``kernels/quant.py``.

``kernels/quant.py`` defines the semantics (read its docstring); every function here has
the same signature, the same argument checks (and messages) and returns the same
payload and scale bits. ``kernels/ops.py`` picks this module on CUDA; on CPU it runs
under the Triton interpreter (``TRITON_INTERPRET=1`` set before this module is
imported), which is how ``tests/test_quant_triton.py`` checks it.

Grid and layout. One program per quantization block: program ``b`` owns elements
``[b*block, (b+1)*block)`` of the (padded) stream, its ``block*bits/8`` payload bytes and
scale ``b``. A block is held as a vector of ``P2 = next_power_of_2(block)`` lanes; lanes
``>= block`` (and elements past ``numel``, the ragged tail) are masked, read as 0 and
never stored. int4 codes are packed/unpacked in-register: the P2 codes are viewed as
P2/2 (even, odd) pairs (``tl.reshape`` + ``tl.split`` / ``tl.interleave``), element 2i
in the low nibble of byte i.

  _quantize_kernel            quantize_blockwise
  _dequantize_kernel          dequantize_blockwise
  _reorder_quantize_kernel    reorder_and_quantize: output block b lies in slot
                              b // blocks_per_slot; the kernel inverts qgz_slot to find
                              the source partition and stage and reads the block straight
                              from x (padding read as 0): no reordered copy is built
  _dequant_sum_kernel         dequant_sum: k copies in a loop, summed in copy order
  _dequant_sum_requant_kernel dequant_sum_requant: the same sum, requantized in-register

Exact fp32 arithmetic (what makes the bits match the reference):

* scale = ``tl.div_rn(extreme, lo)`` and x/scale = ``tl.div_rn``: IEEE round-to-nearest
  division. Plain ``/`` may lower to an approximate fp32 division on GPU.
* the extreme is picked from ``tl.max`` and ``tl.min`` of the block (exact). Their NaN
  handling differs between GPU and interpreter and their sign of a zero result is not
  specified; neither matters: a block with NaN/inf is found by counting (``n_bad``), and
  the extreme is a signed zero only when the scale is 0, which is stored as +0.0 by a
  select (no ``x + 0.0`` trick that a signed-zero-unsafe optimizer may drop). Padding
  lanes read as 0 never change the extreme: a 0 becomes the max (min) only when no
  value is positive (negative), and then the extreme is the min (max), or the block is
  all zeros.
* round half to even is done explicitly (``_round_half_even``: floor, exact fraction,
  parity of the floor); libdevice ``rint`` has no interpreter implementation.
* every launch passes ``enable_fp_fusion=False`` so ``total + q*s`` is never contracted
  into one FMA (the reference rounds the product and the sum separately).
* bf16 is converted by integer ops on the bits, exact on GPU and in the interpreter
  (whose own casts, in triton 3.7/3.9, truncate fp32 -> bf16 and get bf16 subnormals
  wrong): input is widened by ``_load_fp32`` (bf16 is read as bf16, never as fp16),
  output rounded to nearest even by ``_fp32_to_bf16_bits``. fp16 uses ``.to`` both ways.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from kernels.quant import (FLOAT_DTYPES, Copies, _check_block, _check_encoded, _check_x,  # noqa: F401
                           _code_range, _copies, n_blocks, payload_nbytes, qgz_slice_sizes, qgz_slot,
                           reorder_for_hierarchical)

__all__ = ["quantize_blockwise", "dequantize_blockwise", "reorder_and_quantize", "dequant_sum",
           "dequant_sum_requant", "n_blocks", "payload_nbytes", "qgz_slice_sizes", "qgz_slot",
           "reorder_for_hierarchical", "FLOAT_DTYPES"]

# a global a @triton.jit function reads must be a tl.constexpr instance (triton 3.6 refuses an annotated float)
_FLT_MAX = tl.constexpr(3.4028234663852886e38)


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def _load_fp32(ptr, offsets, mask, IN_BF16: tl.constexpr):
    """Load x[offsets] as fp32 (masked lanes 0). bf16 arrives as its int16 bit view and is
    widened by shifting the bits (exact, subnormals included)."""
    if IN_BF16:
        bits = tl.load(ptr + offsets, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _round_half_even(y):
    """Round fp32 values (|y| < 2**22) to the nearest integer, ties to even; exact."""
    f = tl.floor(y)
    frac = y - f                                   # exact: y and f share the binade scale
    half = f * 0.5                                 # exact
    odd = tl.floor(half) != half
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _quantize_values(x, LO: tl.constexpr):
    """One block (padding lanes already 0) -> (fp32 integer codes in [LO, -LO-1], fp32 scale)."""
    top = tl.max(x, axis=0)
    bottom = tl.min(x, axis=0)
    extreme = tl.where(top >= -bottom, top, bottom)                 # ties: the positive one
    n_bad = tl.sum(tl.where(tl.abs(x) <= _FLT_MAX, 0, 1), axis=0)   # NaN and +-inf
    scale = tl.div_rn(extreme, LO * 1.0)                            # true fp32 division
    scale = tl.where(scale == 0, 0.0, scale)                        # +0.0, never -0.0
    scale = tl.where(n_bad > 0, float("nan"), scale)
    usable = tl.abs(scale) > 0                                      # False for 0 and NaN
    divisor = tl.where(usable, scale, 1.0)
    y = tl.div_rn(x, divisor)
    y = tl.minimum(tl.maximum(y, LO * 1.0), -LO - 1.0)              # integer bounds: clamp
    q = _round_half_even(y)                                         # before round is the same
    q = tl.where(usable, q, 0.0)
    return q, scale


@triton.jit
def _store_codes(payload_ptr, b, block, q, BITS: tl.constexpr, P2: tl.constexpr):
    """Write block ``b``'s codes (fp32 integers, P2 lanes) as int8 bytes or packed int4."""
    qi = q.to(tl.int32)
    if BITS == 8:
        offs = tl.arange(0, P2)
        tl.store(payload_ptr + b * block + offs, (qi & 0xFF).to(tl.uint8), mask=offs < block)
    else:
        lo, hi = tl.split(tl.reshape(qi, (P2 // 2, 2)))             # elements 2i, 2i+1
        byte = (lo & 0xF) | ((hi & 0xF) << 4)
        j = tl.arange(0, P2 // 2)
        tl.store(payload_ptr + b * (block // 2) + j, byte.to(tl.uint8), mask=j < block // 2)


@triton.jit
def _load_codes(payload_ptr, b, block, BITS: tl.constexpr, P2: tl.constexpr):
    """Block ``b``'s codes as fp32 integers in element order (P2 lanes, padding lanes 0)."""
    if BITS == 8:
        offs = tl.arange(0, P2)
        v = tl.load(payload_ptr + b * block + offs, mask=offs < block, other=0).to(tl.int32)
        q = tl.where(v >= 128, v - 256, v)
    else:
        j = tl.arange(0, P2 // 2)
        v = tl.load(payload_ptr + b * (block // 2) + j, mask=j < block // 2, other=0).to(tl.int32)
        lo = v & 0xF
        hi = (v >> 4) & 0xF
        lo = tl.where(lo >= 8, lo - 16, lo)
        hi = tl.where(hi >= 8, hi - 16, hi)
        q = tl.interleave(lo, hi)
    return q.to(tl.float32)


@triton.jit
def _dequant_block(payload_ptr, scales_ptr, b, block, BITS: tl.constexpr, P2: tl.constexpr):
    """fp32(q) * scale for block ``b`` (one fp32 rounding)."""
    return _load_codes(payload_ptr, b, block, BITS, P2) * tl.load(scales_ptr + b)


@triton.jit
def _fp32_to_bf16_bits(v):
    """fp32 -> bf16 bit pattern (int16), round to nearest even; NaN -> 0x7FC0 like torch."""
    u = v.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    bits = tl.where(v != v, 0x7FC0, rounded)
    return bits.to(tl.int16)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _quantize_kernel(x_ptr, payload_ptr, scales_ptr, numel, block,
                     BITS: tl.constexpr, LO: tl.constexpr, IN_BF16: tl.constexpr, P2: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, P2)
    idx = b * block + offs
    x = _load_fp32(x_ptr, idx, (offs < block) & (idx < numel), IN_BF16)
    q, scale = _quantize_values(x, LO)
    _store_codes(payload_ptr, b, block, q, BITS, P2)
    tl.store(scales_ptr + b, scale)


@triton.jit
def _dequantize_kernel(payload_ptr, scales_ptr, out_ptr, numel, block,
                       BITS: tl.constexpr, P2: tl.constexpr, OUT_BF16: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, P2)
    idx = b * block + offs
    v = _dequant_block(payload_ptr, scales_ptr, b, block, BITS, P2)
    if OUT_BF16:
        out = _fp32_to_bf16_bits(v)                  # out_ptr is the int16 view of the output
    else:
        out = v.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + idx, out, mask=(offs < block) & (idx < numel))


@triton.jit
def _reorder_quantize_kernel(x_ptr, payload_ptr, scales_ptr, numel, shard, sub, block,
                             blocks_per_slot, n_x, n_y, stages,
                             BITS: tl.constexpr, LO: tl.constexpr, IN_BF16: tl.constexpr,
                             P2: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    # Output block b -> slot; invert qgz_slot: slot = s*P + (p % X)*Y + p // X.
    slot = b // blocks_per_slot
    within = b % blocks_per_slot
    n_parts = n_x * n_y
    stage = slot // n_parts
    rest = slot % n_parts
    part = (rest % n_y) * n_x + rest // n_y          # node * X + local
    # Partition ``part``'s padded shard holds x[part*shard :][:shard], then zeros.
    offs = tl.arange(0, P2)
    pos = stage * sub + within * block + offs
    src = part * shard + pos
    valid = (offs < block) & (pos < shard) & (src < numel)
    x = _load_fp32(x_ptr, src, valid, IN_BF16)
    q, scale = _quantize_values(x, LO)
    _store_codes(payload_ptr, b, block, q, BITS, P2)
    tl.store(scales_ptr + b, scale)


@triton.jit
def _sum_copies(payloads_ptr, scales_ptr, k, payload_stride, scale_stride, b, block,
                BITS: tl.constexpr, P2: tl.constexpr):
    """Dequantize block ``b`` of k copies and sum in fp32, strictly ((c0 + c1) + c2) + ..."""
    total = _dequant_block(payloads_ptr, scales_ptr, b, block, BITS, P2)
    p_ptr = payloads_ptr
    s_ptr = scales_ptr
    for _ in range(1, k):
        p_ptr += payload_stride                      # pointer steps: no int32 overflow of c*stride
        s_ptr += scale_stride
        total = total + _dequant_block(p_ptr, s_ptr, b, block, BITS, P2)
    return total


@triton.jit
def _dequant_sum_kernel(payloads_ptr, scales_ptr, out_ptr, k, payload_stride, scale_stride,
                        numel, block, BITS: tl.constexpr, P2: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, P2)
    idx = b * block + offs
    total = _sum_copies(payloads_ptr, scales_ptr, k, payload_stride, scale_stride, b, block, BITS, P2)
    tl.store(out_ptr + idx, total, mask=(offs < block) & (idx < numel))


@triton.jit
def _dequant_sum_requant_kernel(payloads_ptr, scales_ptr, out_payload_ptr, out_scales_ptr, k,
                                payload_stride, scale_stride, numel, block,
                                BITS: tl.constexpr, OUT_BITS: tl.constexpr, OUT_LO: tl.constexpr,
                                P2: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, P2)
    idx = b * block + offs
    total = _sum_copies(payloads_ptr, scales_ptr, k, payload_stride, scale_stride, b, block, BITS, P2)
    total = tl.where((offs < block) & (idx < numel), total, 0.0)   # the reference re-pads with 0
    q, scale = _quantize_values(total, OUT_LO)
    _store_codes(out_payload_ptr, b, block, q, OUT_BITS, P2)
    tl.store(out_scales_ptr + b, scale)


# ----------------------------------------------------------------------------- wrappers
def _launch_opts(block: int) -> dict:
    p2 = triton.next_power_of_2(block)
    return dict(P2=p2, num_warps=min(8, max(1, p2 // 256)), enable_fp_fusion=False)


def _as_kernel_input(flat: torch.Tensor) -> torch.Tensor:
    """bf16 goes in as its int16 bit view (see ``_load_fp32``); fp32 and fp16 as they are."""
    return flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat


def quantize_blockwise(x: torch.Tensor, bits: int, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (any shape, fp32/bf16/fp16; flattened) -> (uint8 payload, fp32 scales)."""
    lo, _ = _code_range(bits)
    _check_block(block, bits)
    _check_x(x)
    flat = x.reshape(-1).contiguous()
    nb = n_blocks(flat.numel(), block)
    payload = torch.empty(nb * block * bits // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    if nb:
        _quantize_kernel[(nb,)](_as_kernel_input(flat), payload, scales, flat.numel(), block, BITS=bits,
                                LO=lo, IN_BF16=x.dtype == torch.bfloat16, **_launch_opts(block))
    return payload, scales


def dequantize_blockwise(payload: torch.Tensor, scales: torch.Tensor, bits: int, block: int,
                         numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_blockwise``: exactly ``numel`` values of ``dtype`` (1-D)."""
    _code_range(bits)
    _check_block(block, bits)
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be float32/bfloat16/float16, got {dtype}")
    nb = _check_encoded(payload, scales, bits, block, numel)
    out = torch.empty(numel, dtype=dtype, device=payload.device)
    if nb:
        bf16 = dtype == torch.bfloat16
        _dequantize_kernel[(nb,)](payload.contiguous(), scales.contiguous(),
                                  out.view(torch.int16) if bf16 else out, numel, block,
                                  BITS=bits, OUT_BF16=bf16, **_launch_opts(block))
    return out


def reorder_and_quantize(x: torch.Tensor, x_size: int, y_size: int, bits: int, block: int,
                         stages: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """qgZ steps 1-2: pad, reorder (slot ``qgz_slot(i, stages, x_size, y_size)``), quantize;
    layout as ``kernels.quant.reorder_and_quantize``. One fused kernel: each output block is
    read from its source position, no reordered copy of ``x`` is made."""
    lo, _ = _code_range(bits)
    _check_block(block, bits)
    _check_x(x)
    flat = x.reshape(-1).contiguous()
    shard, padded = qgz_slice_sizes(flat.numel(), x_size, y_size, block, stages)
    sub = padded // stages
    nb = x_size * y_size * padded // block
    payload = torch.empty(nb * block * bits // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    if nb:
        _reorder_quantize_kernel[(nb,)](_as_kernel_input(flat), payload, scales, flat.numel(), shard, sub,
                                        block, sub // block, x_size, y_size, stages, BITS=bits, LO=lo,
                                        IN_BF16=x.dtype == torch.bfloat16, **_launch_opts(block))
    return payload, scales


def _stacked(payloads: Copies, scales: Copies, bits: int, block: int, numel: int):
    p, s = _copies(payloads, scales)                 # the reference's order of checks
    _code_range(bits)
    _check_block(block, bits)
    nb = _check_encoded(p[0], s[0], bits, block, numel)
    return p.contiguous(), s.contiguous(), nb


def dequant_sum(payloads: Copies, scales: Copies, bits: int, block: int, numel: int) -> torch.Tensor:
    """Dequantize k copies (k x bytes tensor or list of 1-D payloads) and sum them in fp32,
    strictly in copy order ((c0 + c1) + c2) + ...; fp32 of ``numel``."""
    p, s, nb = _stacked(payloads, scales, bits, block, numel)
    out = torch.empty(numel, dtype=torch.float32, device=p.device)
    if nb:
        _dequant_sum_kernel[(nb,)](p, s, out, p.shape[0], p.stride(0), s.stride(0), numel, block,
                                   BITS=bits, **_launch_opts(block))
    return out


def dequant_sum_requant(payloads: Copies, scales: Copies, bits: int, block: int, numel: int,
                        out_bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """qgZ step 3, fused: ``quantize_blockwise(dequant_sum(...), out_bits, block)``."""
    _check_block(block, out_bits)
    p, s, nb = _stacked(payloads, scales, bits, block, numel)
    out_lo, _ = _code_range(out_bits)
    payload = torch.empty(nb * block * out_bits // 8, dtype=torch.uint8, device=p.device)
    out_scales = torch.empty(nb, dtype=torch.float32, device=p.device)
    if nb:
        _dequant_sum_requant_kernel[(nb,)](p, s, payload, out_scales, p.shape[0], p.stride(0), s.stride(0),
                                           numel, block, BITS=bits, OUT_BITS=out_bits, OUT_LO=out_lo,
                                           **_launch_opts(block))
    return payload, out_scales
