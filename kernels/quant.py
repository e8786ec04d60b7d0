"""Plain-torch references for ZeRO++ quantized communication (SPEC §3).

These functions *define* the semantics; a fast kernel must reproduce them bit
for bit. Every step is plain fp32 IEEE arithmetic with one rounding each:

Quantization (symmetric, blockwise, full range). Flatten ``x``, read it as fp32
(bf16 and fp16 widen exactly; bf16 is never read as fp16), zero-pad to whole blocks
of ``block`` elements. With m = 2**(bits-1) (128 for int8, 8 for int4), per block::

    e     = max(x) if max(x) >= -min(x) else min(x)   the extreme (exact; a tie +a/-a -> +a)
    scale = e / -m                                 fp32 division (the same as e * (-1/m): m is 2**k)
    q     = clamp(round(x / scale), -m, m - 1)     fp32 division, round half to even

The scale is signed: the extreme maps to code -m (exactly, whenever the scale is a
normal fp32) and all 2**bits codes are in use. Only a value on the other side of zero
from the extreme with magnitude above (1 - 2**-bits) |e|, i.e. x/scale > m - 1/2, is
clipped (to code m - 1). Dequantization: ``fp32(q) * scale`` (one fp32 rounding; code 0
under a negative scale gives -0.0), then one cast to the output dtype.

Special blocks. ``scale == 0`` (an all-zero block, or a block so tiny that e/-m
underflows) stores scale +0.0 (never -0.0) and q = 0 and dequantizes to exact zeros.
A block holding any NaN or ±inf stores scale = NaN and q = 0, so *every* value of that
block dequantizes to NaN: non-finite input is never turned into finite numbers.

Error bound. For a finite block with stored scale s and a = |e|, every element
satisfies, before the cast to the output dtype::

    |dequant(quant(x)) - x| <= |s|/2 + 2**-23 * a + m * 2**-149      (not clipped)
    |dequant(quant(x)) - x| <= |s|   + 2**-23 * a + m * 2**-149      (clipped)

and, with no case split, ``<= max(|s|/2, |x| - (m-1)|s|) + 2**-23 * a + m * 2**-149``
(a clipped value errs by |x| - (m-1)|s| in exact arithmetic). The fp32 terms, with
u = 2**-24, t = x/s exactly, y = fl(t) (|y - t| <= u|t|) and d = 2**-149:

* Normal scale (a >= m * 2**-126): dividing by a power of two is exact, so |s| = a/m,
  |t| <= m and e/s = -m exactly. Not clipped: |q - y| <= 1/2 (y >= -m; the tie
  y = m - 1/2 rounds to m and is clamped to m - 1), so |q*s - x| = |s| |q - t|
  <= |s|/2 + u*m*|s| = |s|/2 + u*a. Clipped: q = m - 1 < m - 1/2 < t <= m, so
  |q*s - x| = |x| - (m-1)|s| <= |s|. The product q*s rounds once, by at most
  u|q*s| <= u*a (it is 0 or at least |s| in magnitude: never subnormal).
* Subnormal scale (0 < |s| < 2**-126): x = k*d and s = j*d with integers |k| <= K = a/d
  and j = round(K/m) >= 1, so m*|s| <= a + m/2 * d. Not clamped: d |k - q*j|
  <= |s|/2 + u*a. Clamped to m - 1 (clipped): d (|k| - (m-1)j) = |x| - (m-1)|s|
  <= |s| + m/2 * d. Clamped to -m (j below K/m; the extreme's side): d (|k| - m*j)
  <= m/2 * d. The product q*s rounds by at most u*m*|s| <= u*a + m/2 * d.
* Zero scale (a/m rounds to 0): a <= m/2 * d, and the error is |x| <= a.

So m * 2**-149 only matters when the scale is subnormal or zero. With a normal scale every
dequantized value has magnitude at most m|s| = a, so nothing overflows: a block whose
extreme is the fp32 maximum gets that extreme back exactly. The cast to a bf16/fp16
output adds at most half an ulp of the result in that dtype.

Storage. ``payload`` is 1-D uint8 of ``n_blocks * block * bits // 8`` bytes:
int8 codes are the uint8 view of two's-complement int8; int4 packs element 2i
in the low nibble and 2i+1 in the high nibble of byte i (two's-complement
nibbles). Padding elements encode as 0 and are dropped by dequantize, which
returns exactly ``numel`` values. ``scales`` is 1-D fp32, one per block.

qgZ (hierarchical all-to-all reduce-scatter) over P = X*Y ranks, X per node,
rank p = node*X + local, in S pipeline stages: see ``qgz_slice_sizes``,
``qgz_slot`` and ``reorder_and_quantize``; the receiving side is
``dequant_sum_requant`` (after the intra-node hop) and ``dequant_sum`` (after
the inter-node hop). Dividing by P (the mean) is the caller's step 5.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Copies = Union[torch.Tensor, Sequence[torch.Tensor]]


def _code_range(bits: int) -> Tuple[int, int]:
    """(lowest, highest) code: (-2**(bits-1), 2**(bits-1) - 1) for bits 4 or 8."""
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def _check_block(block: int, bits: int) -> None:
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if bits == 4 and block % 2:
        raise ValueError(f"block must be even for bits=4 (two values a byte), got {block}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_x(x) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}")


def _check_encoded(payload: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int) -> int:
    """One encoded copy has the payload and scales ``numel`` values need; returns its block count."""
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    nb = n_blocks(numel, block)
    nbytes = nb * block * bits // 8
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != nbytes:
        raise ValueError(f"payload must be 1-D uint8 of {nbytes} bytes for numel={numel}, bits={bits}, "
                         f"block={block}; got {payload.dtype} of shape {tuple(payload.shape)}")
    if scales.dtype != torch.float32 or scales.dim() != 1 or scales.numel() != nb:
        raise ValueError(f"scales must be 1-D float32 of {nb} blocks; got {scales.dtype} "
                         f"of shape {tuple(scales.shape)}")
    return nb


def n_blocks(numel: int, block: int) -> int:
    """Blocks for ``numel`` values (the last one may be ragged, zero-padded)."""
    return -(-numel // block)


def payload_nbytes(numel: int, bits: int, block: int) -> int:
    """Bytes of the payload for ``numel`` values (padding to whole blocks included)."""
    _code_range(bits)
    _check_block(block, bits)
    return n_blocks(numel, block) * block * bits // 8


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Integer codes in [-8, 7] (even count) -> uint8, element 2i low nibble, 2i+1 high."""
    nib = (q.to(torch.int16) & 0xF).view(-1, 2)
    return (nib[:, 0] | (nib[:, 1] << 4)).to(torch.uint8)


def unpack_int4(payload: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: uint8 -> int16 codes in [-8, 7], twice as many."""
    b = payload.to(torch.int16)
    nib = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)
    return torch.where(nib >= 8, nib - 16, nib)


def quantize_blockwise(x: torch.Tensor, bits: int, block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (any shape, fp32/bf16/fp16; flattened) -> (uint8 payload, fp32 scales)."""
    lo, hi = _code_range(bits)
    _check_block(block, bits)
    _check_x(x)
    numel = x.numel()
    nb = n_blocks(numel, block)
    x32 = torch.zeros(nb * block, dtype=torch.float32, device=x.device)
    x32[:numel] = x.reshape(-1).to(torch.float32)
    x32 = x32.view(nb, block)
    top, bottom = x32.amax(dim=1), x32.amin(dim=1)
    extreme = torch.where(top >= -bottom, top, bottom)      # ties: the positive one
    scale = extreme / torch.full_like(extreme, lo)          # exact unless the result is subnormal
    scale = torch.where(scale == 0, torch.zeros_like(scale), scale)   # +0.0, never -0.0
    scale = torch.where(torch.isfinite(x32).all(dim=1), scale, torch.full_like(scale, float("nan")))
    usable = scale.abs() > 0                                # False for 0 and NaN
    divisor = torch.where(usable, scale, torch.ones_like(scale))
    q = torch.round(x32 / divisor[:, None]).clamp(lo, hi)
    q = torch.where(usable[:, None], q, torch.zeros_like(q)).reshape(-1)
    payload = q.to(torch.int8).view(torch.uint8) if bits == 8 else pack_int4(q)
    return payload, scale


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
    q = payload.view(torch.int8) if bits == 8 else unpack_int4(payload)
    values = q.to(torch.float32).reshape(nb, block) * scales[:, None]
    return values.reshape(-1)[:numel].to(dtype)


# ----------------------------------------------------------------------------- qgZ
def reorder_for_hierarchical(n_slices_x: int, n_slices_y: int) -> List[int]:
    """order[slot] = partition: [0, X, ..., (Y-1)X, 1, X+1, ..., YX-1] (paper eq. 2).

    Slots [l*Y, (l+1)*Y) hold partitions [l, X+l, ..., (Y-1)X+l]: the group that the
    intra-node all-to-all sends to local rank l.
    """
    _positive("n_slices_x", n_slices_x)
    _positive("n_slices_y", n_slices_y)
    return [j * n_slices_x + l for l in range(n_slices_x) for j in range(n_slices_y)]


def qgz_slot(slice_id: int, stages: int, node_size: int, nodes: int) -> int:
    """Paper Algorithm 2: fine slice id -> its slot in the reordered buffer.

    The buffer is cut into P = node_size*nodes partitions (partition p is DP rank p's
    shard) and each partition into ``stages`` equal sub-slices; fine slice id
    ``p*stages + s`` is sub-slice s of partition p. Its slot is
    ``s*P + (p % node_size)*nodes + p // node_size``: stage-major, and within a stage
    the eq. 2 order. (The extracted paper text prints line 5 as chunkID*nodeSize/nodeSize;
    it is chunkID // nodeSize, as in DeepSpeed's swizzled_quant kernel.)
    """
    _positive("stages", stages)
    _positive("node_size", node_size)
    _positive("nodes", nodes)
    total = node_size * nodes
    if not 0 <= slice_id < total * stages:
        raise ValueError(f"slice_id must be in [0, {total * stages}), got {slice_id}")
    stage, chunk = slice_id % stages, slice_id // stages
    return stage * total + (chunk % node_size) * nodes + chunk // node_size


def qgz_slice_sizes(numel: int, x_size: int, y_size: int, block: int, stages: int = 1) -> Tuple[int, int]:
    """Padding rule of ``reorder_and_quantize``: (shard, padded_shard) in elements.

    1. The buffer is zero-padded at its end to a multiple of P = x_size*y_size and cut
       into P equal shards of ``shard = ceil(numel / P)`` (ZeRO's equal padded shards:
       a buffer already of P*S elements is cut exactly at the ZeRO shard borders).
    2. Each shard is zero-padded at its end to ``padded_shard``, the next multiple of
       ``stages*block``, so every stage's sub-slice (padded_shard/stages elements) is a
       whole number of quantization blocks and no block straddles two destinations.
    Rank p's reduced result is the first ``shard`` elements of its padded shard.
    """
    _positive("x_size", x_size)
    _positive("y_size", y_size)
    _positive("block", block)
    _positive("stages", stages)
    shard = -(-numel // (x_size * y_size))
    return shard, -(-shard // (stages * block)) * stages * block


def qgz_padded_shards(x: torch.Tensor, x_size: int, y_size: int, block: int, stages: int = 1) -> torch.Tensor:
    """``x`` (flattened) padded by the ``qgz_slice_sizes`` rule: P = x_size*y_size rows, row p holding shard p
    and zeros up to ``padded_shard`` elements (``x``'s dtype, P x padded_shard)."""
    P = x_size * y_size
    shard, padded = qgz_slice_sizes(x.numel(), x_size, y_size, block, stages)
    flat = torch.zeros(P * shard, dtype=x.dtype, device=x.device)
    flat[:x.numel()] = x.reshape(-1)
    buf = torch.zeros(P, padded, dtype=x.dtype, device=x.device)
    buf[:, :shard] = flat.view(P, shard)
    return buf


def reorder_and_quantize(x: torch.Tensor, x_size: int, y_size: int, bits: int, block: int,
                         stages: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """qgZ steps 1-2 (before the intra-node all-to-all): pad, reorder, quantize.

    Pads by the ``qgz_slice_sizes`` rule, moves fine slice i to slot
    ``qgz_slot(i, stages, x_size, y_size)`` and quantizes the reordered buffer as one
    stream (blocks never cross a slot). Layout of the returned 1-D payload and scales,
    with sub = padded_shard/stages elements a slot, bytes_per_slot = sub*bits/8,
    blocks_per_slot = sub/block::

        [stage 0: dest 0 | dest 1 | ... | dest X-1][stage 1: ...] ...
        dest l = Y slots, partitions l, X+l, ..., (Y-1)X+l (each its stage-s sub-slice)

    so stage s, destination l is payload[(s*X+l)*Y*bytes_per_slot :][: Y*bytes_per_slot]
    (scales likewise with blocks_per_slot): one equal-split all-to-all over the X local
    ranks per stage.
    """
    _code_range(bits)
    _check_block(block, bits)
    _check_x(x)
    P = x_size * y_size
    buf = qgz_padded_shards(x, x_size, y_size, block, stages)
    fine = buf.view(P * stages, buf.shape[1] // stages)
    source = [0] * (P * stages)                           # source[slot] = fine slice id
    for i in range(P * stages):
        source[qgz_slot(i, stages, x_size, y_size)] = i
    reordered = fine[torch.tensor(source, dtype=torch.long, device=x.device)]
    return quantize_blockwise(reordered, bits, block)


def _copies(payloads: Copies, scales: Copies) -> Tuple[torch.Tensor, torch.Tensor]:
    p = payloads if isinstance(payloads, torch.Tensor) else torch.stack(list(payloads))
    s = scales if isinstance(scales, torch.Tensor) else torch.stack(list(scales))
    if p.dim() != 2 or s.dim() != 2 or p.shape[0] != s.shape[0] or p.shape[0] < 1:
        raise ValueError(f"payloads and scales must hold the same k >= 1 copies (k x bytes, k x blocks); "
                         f"got payloads {tuple(p.shape)}, scales {tuple(s.shape)}")
    return p, s


def dequant_sum(payloads: Copies, scales: Copies, bits: int, block: int, numel: int) -> torch.Tensor:
    """Dequantize k received copies (a k x bytes tensor or a list of 1-D payloads) and sum
    them in fp32, strictly in copy order: ((c0 + c1) + c2) + ... Returns fp32 of numel."""
    p, s = _copies(payloads, scales)
    total = dequantize_blockwise(p[0], s[0], bits, block, numel, torch.float32)
    for i in range(1, p.shape[0]):
        total = total + dequantize_blockwise(p[i], s[i], bits, block, numel, torch.float32)
    return total


def dequant_sum_requant(payloads: Copies, scales: Copies, bits: int, block: int, numel: int,
                        out_bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """qgZ step 3: ``quantize_blockwise(dequant_sum(...), out_bits, block)`` (same blocks)."""
    _check_block(block, out_bits)
    return quantize_blockwise(dequant_sum(payloads, scales, bits, block, numel), out_bits, block)
