"""kernels/quant.py against independent references.

The reference quantizer below is float64 numpy: an fp32 division or product is
computed exactly (or correctly rounded) in float64 and rounded once to float32,
which equals the IEEE fp32 result, and np.rint rounds half to even. The payload
is decoded by hand here, never by the code under test.
"""
import math

import numpy as np
import pytest
import torch

from kernels.quant import (dequant_sum, dequant_sum_requant, dequantize_blockwise, pack_int4,
                           payload_nbytes, qgz_slice_sizes, qgz_slot, quantize_blockwise,
                           reorder_and_quantize, reorder_for_hierarchical)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LO = {8: -128, 4: -8}          # the lowest code, -2**(bits-1); the highest is -LO - 1
D = 2.0 ** -149                # the smallest fp32 subnormal


# ----------------------------------------------------------------------------- references
def padded_blocks(x: torch.Tensor, block: int) -> np.ndarray:
    """x as float64 blocks [n_blocks, block], zero-padded."""
    v = x.detach().reshape(-1).to(torch.float64).numpy()
    nb = -(-v.size // block)
    blocks = np.zeros(nb * block)
    blocks[:v.size] = v
    return blocks.reshape(nb, block)


def ref_quant(x: torch.Tensor, bits: int, block: int):
    """-> (codes int64 [n_blocks*block], scales float32 [n_blocks]) in float64 math."""
    lo = LO[bits]
    blocks = padded_blocks(x, block)
    finite = np.isfinite(blocks).all(axis=1)
    fin = np.where(np.isfinite(blocks), blocks, 0.0)
    top, bottom = fin.max(axis=1, initial=-np.inf), fin.min(axis=1, initial=np.inf)
    extreme = np.where(top >= -bottom, top, bottom)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        scale = (extreme / lo).astype(np.float32)            # exact in float64 (a power of two), rounded once
        scale = np.where(scale == 0, np.float32(0.0), scale)  # +0.0
        scale = np.where(finite, scale, np.float32(np.nan))
        s64 = scale.astype(np.float64)
        usable = np.abs(s64) > 0
        quot = (blocks / np.where(usable, s64, 1.0)[:, None]).astype(np.float32).astype(np.float64)
        q = np.clip(np.rint(quot), lo, -lo - 1)
    q = np.where(usable[:, None], q, 0).astype(np.int64)
    return q.reshape(-1), scale


def ref_dequant(q: np.ndarray, scale: np.ndarray, block: int, numel: int) -> np.ndarray:
    """fp32 result of q * scale (exact in float64, rounded once)."""
    with np.errstate(invalid="ignore", over="ignore"):
        out = (q.reshape(-1, block).astype(np.float64) * scale.astype(np.float64)[:, None]).astype(np.float32)
    return out.reshape(-1)[:numel]


def decode(payload: torch.Tensor, bits: int) -> np.ndarray:
    b = payload.numpy().astype(np.int64)
    if bits == 8:
        return np.where(b >= 128, b - 256, b)
    lo, hi = b & 0xF, b >> 4
    nib = np.stack([lo, hi], axis=1).reshape(-1)
    return np.where(nib >= 8, nib - 16, nib)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal values, NaN where NaN, and the same sign of every zero."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.array_equal(a, b, equal_nan=True) and np.array_equal(np.signbit(a) | np.isnan(a),
                                                                   np.signbit(b) | np.isnan(b))


def check_exact(x, bits, block):
    """Codes, scales and dequantized values equal the float64 reference bit for bit."""
    payload, scales = quantize_blockwise(x, bits, block)
    q, s = ref_quant(x, bits, block)
    assert payload.dtype == torch.uint8 and payload.dim() == 1 and payload.numel() == q.size * bits // 8
    assert scales.dtype == torch.float32 and scales.numel() == s.size
    assert np.array_equal(decode(payload, bits), q)
    assert np.array_equal(scales.numpy().view(np.int32), s.view(np.int32))     # NaN bits and zero signs too
    out = dequantize_blockwise(payload, scales, bits, block, x.numel(), x.dtype)
    assert out.dtype == x.dtype and out.shape == (x.numel(),)
    expect = torch.from_numpy(ref_dequant(q, s, block, x.numel())).to(x.dtype)
    assert same(out.double().numpy(), expect.double().numpy())
    return out, s


def check_bound(x: torch.Tensor, out: torch.Tensor, scales: np.ndarray, bits: int, block: int) -> np.ndarray:
    """quant.py's documented bound, per element of the finite blocks, before the cast to x's dtype plus half
    an ulp of it: |s|/2 (|s| when clipped) + 2**-23 a + m 2**-149, and max(|s|/2, |x| - (m-1)|s|) + the
    same terms. A clipped element is one whose fp32 x/s exceeds m - 1/2; it lies on the other side of zero
    from its block's extreme. Returns err / (|s|/2) of the elements not clipped in blocks of non-zero scale."""
    m, n = -LO[bits], x.numel()
    x64 = x.double().numpy()
    err = np.abs(out.double().numpy() - x64)
    signed = np.repeat(scales.astype(np.float64), block)[:n]
    fin = np.isfinite(signed)
    x64, err, signed = x64[fin], err[fin], signed[fin]
    s = np.abs(signed)
    a = np.repeat(np.abs(padded_blocks(x, block)).max(axis=1), block)[:n][fin]
    with np.errstate(invalid="ignore", divide="ignore"):
        quot = np.where(s > 0, (x64 / np.where(s > 0, signed, 1.0)).astype(np.float32), 0.0)
    clipped = quot > m - 0.5
    assert (x64[clipped] * signed[clipped] > 0).all()        # the scale's sign is the opposite of the extreme's
    rounding = 2.0 ** -23 * a + m * D
    split = np.where(clipped, s, s / 2) + rounding
    joint = np.maximum(s / 2, np.abs(x64) - (m - 1) * s) + rounding
    if x.dtype != torch.float32:
        fi = torch.finfo(x.dtype)
        cast = 0.5 * fi.eps * (np.abs(x64) + split) + 0.5 * fi.smallest_normal * fi.eps   # |out| <= |x| + err
        split, joint = split + cast, joint + cast
    assert (err <= split).all() and (err <= joint).all()
    return err[~clipped & (s > 0)] / (s[~clipped & (s > 0)] / 2)


# ----------------------------------------------------------------------------- hand examples
def test_int4_packing_by_hand():
    # codes [1, -2, 7, -8]: nibbles 1, E, 7, 8 -> bytes E1, 87 (low nibble first)
    assert pack_int4(torch.tensor([1, -2, 7, -8])).tolist() == [0xE1, 0x87]
    out = dequantize_blockwise(torch.tensor([0xE1, 0x87], dtype=torch.uint8), torch.tensor([1.0]), 4, 4, 4)
    assert out.tolist() == [1.0, -2.0, 7.0, -8.0]
    # extreme -8 -> scale exactly 1: every code comes back as it went in
    payload, scales = quantize_blockwise(torch.tensor([1.0, -2.0, 7.0, -8.0]), 4, 4)
    assert payload.tolist() == [0xE1, 0x87] and scales.tolist() == [1.0]
    # tie 8 / -8 -> the positive extreme, scale -1: 8 is code -8, -8 is clipped to code 7 (nibble 7)
    payload, scales = quantize_blockwise(torch.tensor([8.0, -2.0, 1.0, -8.0]), 4, 4)
    assert scales.tolist() == [-1.0] and payload.tolist() == [0x28, 0x7F]
    assert dequantize_blockwise(payload, scales, 4, 4, 4).tolist() == [8.0, -2.0, 1.0, -7.0]
    # odd count: 3 values, block 4 -> 2 bytes, padding nibble is 0
    payload, scales = quantize_blockwise(torch.tensor([-16.0, 2.0, 4.0]), 4, 4)
    assert scales.tolist() == [2.0] and payload.tolist() == [0x18, 0x02]
    assert dequantize_blockwise(payload, scales, 4, 4, 3).tolist() == [-16.0, 2.0, 4.0]


def test_int8_and_half_steps_by_hand():
    payload, scales = quantize_blockwise(torch.tensor([-128.0, 1.0, 0.0, 127.0]), 8, 4)
    assert payload.tolist() == [0x80, 0x01, 0x00, 0x7F] and scales.tolist() == [1.0]
    # positive extreme: scale -1, the same codes for the negated values; -128 clipped to 127, and code 0
    # times a negative scale is -0.0
    payload, scales = quantize_blockwise(torch.tensor([128.0, -1.0, 0.0, -128.0]), 8, 4)
    assert payload.tolist() == [0x80, 0x01, 0x00, 0x7F] and scales.tolist() == [-1.0]
    out = dequantize_blockwise(payload, scales, 8, 4, 4)
    assert out.tolist() == [128.0, -1.0, 0.0, -127.0] and torch.signbit(out[2])
    # scale 1: half steps round to even; the top tie 127.5 rounds to 128 and is clamped to 127
    x = torch.tensor([-128.0, 0.5, 1.5, 2.5, -0.5, -2.5, 127.5, -127.5])
    payload, _ = quantize_blockwise(x, 8, 8)
    assert payload.view(torch.int8).tolist() == [-128, 0, 2, 2, 0, -2, 127, -128]
    # int4, scale 2 (extreme -16): x/scale = 0.5, 1.5, 2.5, 3.5, -3.5 -> 0, 2, 2, 4, -4
    payload, scales = quantize_blockwise(torch.tensor([-16.0, 1.0, 3.0, 5.0, 7.0, -7.0]), 4, 6)
    assert scales.tolist() == [2.0] and decode(payload, 4).tolist() == [-8, 0, 2, 2, 4, -4]


# ----------------------------------------------------------------------------- random data
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,block", [(1, 2), (7, 4), (1000, 64), (4099, 128), (257, 256), (33, 2)])
def test_random_exact_and_bound(dtype, bits, numel, block):
    g = torch.Generator().manual_seed(numel * 31 + block + bits)
    x = (torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel)[torch.randperm(numel, generator=g)]).to(dtype)
    out, s = check_exact(x, bits, block)
    half_steps = check_bound(x, out, s, bits, block)
    assert numel < 30 or half_steps.max() > 0.8        # the bound is tight: some element loses close to |s|/2


def test_int8_shape_agnostic_and_bf16_not_read_as_fp16():
    x = torch.tensor([[1e10, -1.5e10, -3e30], [2e30, 2.5e-30, 2e-30]], dtype=torch.bfloat16)  # outside fp16's range
    out, s = check_exact(x, 8, 2)
    assert s[1] == np.float32(np.float64(x[0, 2].float()) / -128)      # the extreme -3e30 is the negative one
    assert torch.isfinite(out).all() and torch.allclose(out.float(), x.reshape(-1).float(), rtol=0.02, atol=0)


# ----------------------------------------------------------------------------- adversarial data
def clip_edge_blocks(bits: int, e: float) -> torch.Tensor:
    """Two blocks of 8 with extreme e and values of the other sign around the clip point (1 - 2**-bits)|e|."""
    m = -LO[bits]
    edge = torch.tensor(-e * (m - 0.5) / m, dtype=torch.float32)
    beyond = torch.nextafter(edge, torch.tensor(-e)).item()
    within = torch.nextafter(edge, torch.tensor(e)).item()
    edge = edge.item()
    return torch.tensor([e, edge, beyond, within, edge * 2 / 3, -beyond, -edge, -e * (m - 1) / m]
                        + [e, -beyond] + [-e * 0.999] * 6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_adversarial(dtype, bits):
    m, block = -LO[bits], 8
    g = torch.Generator().manual_seed(bits)
    fin = torch.finfo(dtype)
    big = fin.max
    cases = [
        (torch.arange(-8, 8) + 0.5) * (2.0 ** -3),                           # half steps of scale 1/8 (needs int8)
        torch.cat([torch.randn(7, generator=g), torch.tensor([big / 2])]).repeat(3),  # huge outlier per block
        torch.randn(24, generator=g) * fin.smallest_normal,                   # denormals of the input dtype
        torch.full((24,), fin.smallest_normal * fin.eps),                     # the smallest denormal everywhere
        torch.tensor([0.0] * 8 + [-0.0] * 8 + [3.0] * 8 + [-3.0] * 8),        # zero blocks, constant blocks
        torch.tensor([big, -big, fin.tiny, 0.0] * 2 + [-big, big / 2, 0.0, -fin.tiny] * 2),   # the dtype's maximum
        torch.tensor([3.0, -3.0, 1.0, -1.0, 2.9, -2.9, 0.0, 0.5] * 2),         # ties +a / -a: the positive wins
        torch.tensor([-3.0, 3.0, 0.25, -2.99, 2.999, 0.0, 1.0, -1.0]),
        clip_edge_blocks(bits, 1.0), clip_edge_blocks(bits, -1.0),            # both signs of the extreme
        clip_edge_blocks(bits, 3e-3), clip_edge_blocks(bits, -6e4),
        torch.randn(48, generator=g) * 2.0 ** -126,                           # subnormal scales (fp32)
        torch.tensor([1.5 * m - 1, -(1.5 * m - 1), 3, -1, 0, 5, -5, 1] * 2)  # scale -+D: clamped at both ends
        * torch.tensor([D, -D]).repeat_interleave(8),
        torch.tensor([m / 2 * D, -m / 2 * D, D, 0, 0, 0, 0, 0, m / 2 * D + D, 0, 0, 0, 0, 0, 0, -D]),  # e/-m
    ]                                                                         # underflows; rounds up to -D
    for x in cases:
        x = x.to(dtype)
        out, s = check_exact(x, bits, block)
        assert np.isfinite(out.double().numpy()).all()
        check_bound(x, out, s, bits, block)
    for x in [torch.tensor([3.0, -2.0, 1e-3]), torch.tensor([fin.tiny]), torch.tensor([-big])]:  # block of 1
        b = 2 if bits == 4 else 1
        out, s = check_exact(x.to(dtype), bits, b)
        check_bound(x.to(dtype), out, s, bits, b)


def test_zero_block_is_exact_zero_and_padding_stays_out():
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0, -5.0, 0.0])
    payload, scales = quantize_blockwise(x, 4, 4)
    assert scales.tolist() == [0.0, -0.625] and payload.numel() == payload_nbytes(7, 4, 4) == 4
    assert not torch.signbit(scales[0])                      # +0.0
    assert decode(payload, 4).tolist() == [0, 0, 0, 0, -8, 7, 0, 0]
    out = dequantize_blockwise(payload, scales, 4, 4, 7)
    assert out.shape == (7,) and out[:4].tolist() == [0.0] * 4 and not torch.signbit(out[:4]).any()
    assert not torch.isnan(out).any()
    # fp32 underflow: extreme/-128 rounds to -0 (positive extreme) or +0: stored +0.0, q = 0, exact zeros
    for tiny in (torch.tensor([1.4e-45, -1.4e-45, 0.0, 2.8e-45]), torch.tensor([-1.4e-45, 0.0, -0.0, -2.8e-45]),
                 torch.tensor([-0.0, -0.0, -0.0, -0.0])):
        payload, scales = quantize_blockwise(tiny, 8, 4)
        assert scales.tolist() == [0.0] and not torch.signbit(scales[0]) and payload.tolist() == [0, 0, 0, 0]
        out = dequantize_blockwise(payload, scales, 8, 4, 4)
        assert out.tolist() == [0.0] * 4 and not torch.signbit(out).any()
    empty_p, empty_s = quantize_blockwise(torch.zeros(0), 8, 4)
    assert empty_p.numel() == 0 and dequantize_blockwise(empty_p, empty_s, 8, 4, 0).numel() == 0


@pytest.mark.parametrize("bits", [8, 4])
def test_subnormal_scale_clamps_within_the_bound(bits):
    # extreme k*2^-149 with k = 1.5m - 1: k/m rounds down to 1, scale -2^-149 (the positive extreme wins the
    # tie). The extreme divides to -k and is clamped to -m (error (m/2 - 1) 2^-149 <= m/2 2^-149, not clipped),
    # its negation to k, clamped to m - 1 (clipped: error |s| + (m/2 - 1) 2^-149), as quant.py derives
    m = -LO[bits]
    k = 1.5 * m - 1
    x = torch.tensor([k * D, -k * D], dtype=torch.float32)
    payload, scales = quantize_blockwise(x, bits, 2)
    assert scales.tolist() == [-D] and decode(payload, bits).tolist() == [-m, m - 1]
    out = dequantize_blockwise(payload, scales, bits, 2, 2)
    assert out.tolist() == [m * D, -(m - 1) * D]
    assert ((out.double() - x.double()).abs() / D).tolist() == [m / 2 - 1, m / 2]
    check_bound(x, out, scales.numpy(), bits, 2)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_poisons_its_block_only(bits, bad):
    m = -LO[bits]
    x = torch.tensor([1.0, 2.0, bad, 4.0, 1.0, -7.0, 0.5, 3.0])
    payload, scales = quantize_blockwise(x, bits, 4)
    assert math.isnan(scales[0].item()) and scales[1].item() == 7.0 / m
    out = dequantize_blockwise(payload, scales, bits, 4, 8)
    assert torch.isnan(out[:4]).all()
    assert (out[4:] - x[4:]).abs().max() <= 7.0 / m / 2
    check_exact(x, bits, 4)


def test_fp32_max_comes_back_exactly():
    top = torch.finfo(torch.float32).max
    for bits in (8, 4):                 # the extreme is code -m, times scale -e/m: e exactly, no overflow
        for x, extreme in [([top, 1.0], 0), ([-top, 1.0], 0), ([top, -top], 0), ([-top, top], 1)]:
            x = torch.tensor(x)
            p, s = quantize_blockwise(x, bits, 2)
            out = dequantize_blockwise(p, s, bits, 2, 2)
            assert torch.isfinite(out).all() and out[extreme] == x[extreme]


def test_argument_validation():
    x = torch.ones(8)
    with pytest.raises(ValueError, match="bits"):
        quantize_blockwise(x, 6, 4)
    with pytest.raises(ValueError, match="block"):
        quantize_blockwise(x, 8, 0)
    with pytest.raises(ValueError, match="block must be even"):
        quantize_blockwise(x, 4, 3)
    with pytest.raises(ValueError, match="x must be"):
        quantize_blockwise(x.long(), 8, 4)
    p, s = quantize_blockwise(x, 8, 4)
    with pytest.raises(ValueError, match="payload"):
        dequantize_blockwise(p[:-1], s, 8, 4, 8)
    with pytest.raises(ValueError, match="payload"):
        dequantize_blockwise(p.view(2, 4), s, 8, 4, 8)
    with pytest.raises(ValueError, match="scales"):
        dequantize_blockwise(p, s.double(), 8, 4, 8)
    with pytest.raises(ValueError, match="numel"):
        dequantize_blockwise(p, s, 8, 4, -1)
    with pytest.raises(ValueError, match="payloads and scales"):
        dequant_sum([p, p], [s], 8, 4, 8)
    with pytest.raises(ValueError, match="x_size"):
        reorder_and_quantize(x, 0, 2, 8, 4)
    with pytest.raises(ValueError, match="stages"):
        qgz_slot(0, 0, 2, 2)


# ----------------------------------------------------------------------------- qgZ
def test_reorder_by_hand():
    assert reorder_for_hierarchical(2, 2) == [0, 2, 1, 3]
    assert reorder_for_hierarchical(4, 2) == [0, 4, 1, 5, 2, 6, 3, 7]
    assert reorder_for_hierarchical(2, 3) == [0, 2, 4, 1, 3, 5]
    # S=2, X=2, Y=2: slice i = (partition i//2, stage i%2), worked out by hand
    assert [qgz_slot(i, 2, 2, 2) for i in range(8)] == [0, 4, 2, 6, 1, 5, 3, 7]
    assert qgz_slice_sizes(10, 2, 2, 4) == (3, 4) and qgz_slice_sizes(10, 2, 2, 4, stages=2) == (3, 8)
    assert qgz_slice_sizes(512, 2, 2, 128) == (128, 128)


@pytest.mark.parametrize("X,Y", [(1, 1), (2, 2), (4, 2), (2, 3), (3, 1), (1, 3)])
def test_slot_is_a_permutation_and_s1_is_the_plain_reorder(X, Y):
    P = X * Y
    plain = reorder_for_hierarchical(X, Y)
    assert [plain[qgz_slot(p, 1, X, Y)] for p in range(P)] == list(range(P))
    for S in (1, 2, 3, 4):
        slots = [qgz_slot(i, S, X, Y) for i in range(P * S)]
        assert sorted(slots) == list(range(P * S))
        for i, slot in enumerate(slots):   # stage-major; within a stage, the plain order
            assert slot // P == i % S and plain[slot % P] == i // S


def test_reorder_and_quantize_layout_by_hand():
    # X=2, Y=2, block 2, 8 values: shards [0,1] [2,3] [4,5] [6,7]; order 0, 2, 1, 3
    x = torch.tensor([-1.0, 0.5, -2.0, -2.0, -3.0, 0.0, 4.0, -2.0]) * 128
    payload, scales = reorder_and_quantize(x, 2, 2, 8, 2)
    assert scales.tolist() == [1.0, 3.0, 2.0, -4.0]
    assert payload.view(torch.int8).tolist() == [-128, 64, -128, 0, -128, -128, -128, 64]


def simulate_qgz(grads, X, Y, bits, block, S, out_bits):
    """Single-process two-hop all-to-all over X*Y fake ranks (rank = node*X + local)."""
    P = X * Y
    shard = -(-grads[0].numel() // P)
    sub = -(-shard // (S * block)) * block           # rule: shard padded to S*block, cut in S
    nbytes, nsc = sub * bits // 8, sub // block
    sent = [reorder_and_quantize(g, X, Y, bits, block, S) for g in grads]
    pieces = [[None] * S for _ in range(P)]
    for s in range(S):
        hop1 = {}
        for node in range(Y):                          # intra-node all-to-all, then dequant-sum-requant
            for l in range(X):
                o = (s * X + l) * Y                    # first slot of stage s, destination l
                recv_p = [sent[node * X + src][0][o * nbytes:(o + Y) * nbytes] for src in range(X)]
                recv_s = [sent[node * X + src][1][o * nsc:(o + Y) * nsc] for src in range(X)]
                hop1[node, l] = dequant_sum_requant(recv_p, recv_s, bits, block, Y * sub, out_bits)
        nb2 = sub * out_bits // 8
        for j in range(Y):                             # inter-node all-to-all: slot j goes to node j
            for l in range(X):
                recv_p = torch.stack([hop1[src, l][0][j * nb2:(j + 1) * nb2] for src in range(Y)])
                recv_s = torch.stack([hop1[src, l][1][j * nsc:(j + 1) * nsc] for src in range(Y)])
                pieces[j * X + l][s] = dequant_sum(recv_p, recv_s, out_bits, block, sub)
    return [torch.cat(pieces[p])[:shard] for p in range(P)], shard, sub


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("X,Y,S", [(1, 1, 1), (2, 2, 1), (2, 2, 2), (4, 2, 3), (2, 3, 2), (3, 1, 1), (1, 3, 2)])
def test_two_hop_exact_placement(bits, X, Y, S):
    """Every (partition, stage) piece carries a distinct marker that quantizes losslessly (a block of one
    value v and padding zeros: v is the extreme, code -m, scale -v/m exact)."""
    P, c, block, numel = X * Y, 3, 4, 6 * X * Y * S + 3   # ragged: pads by both rules
    shard = -(-numel // P)
    sub = -(-shard // (S * block)) * block
    i = torch.arange(numel)
    marker = 1 + (i // shard) * S + (i % shard) // sub              # 1 + p*S + s
    grads = [(c * marker * (r + 1)).float() for r in range(P)]
    got, shard_, _ = simulate_qgz(grads, X, Y, bits, block, S, bits)
    total = sum(g.double() for g in grads)
    total = torch.cat([total, torch.zeros(P * shard - numel, dtype=torch.float64)])
    assert shard_ == shard
    for p in range(P):
        assert torch.equal(got[p].double(), total[p * shard:(p + 1) * shard])


def quant_error_bound(v: torch.Tensor, bits: int, block: int, err=0.0) -> torch.Tensor:
    """quant.py's bound max(|s|/2, |w| - (m-1)|s|) + 2**-23 a + m 2**-149 on |dequant(quant(w)) - w|, per
    element, for every fp32 w with |w - v| <= err (float64, blocks from index 0). |s| = a/m and the block
    absmax a of |w| lies between those of |v| - err and |v| + err."""
    m = -LO[bits]

    def block_absmax(u):
        return torch.from_numpy(padded_blocks(u, block).max(axis=1)).repeat_interleave(block)[:u.numel()]

    a_hi, a_lo = block_absmax(v.abs() + err), block_absmax(v.abs() - err).clamp(min=0)
    return torch.maximum(a_hi / (2 * m), v.abs() + err - (m - 1) * a_lo / m) + 2.0 ** -23 * a_hi + m * D


@pytest.mark.parametrize("X,Y,S,bits,out_bits", [(2, 2, 1, 4, 4), (2, 2, 2, 8, 8), (4, 2, 2, 4, 8), (2, 3, 3, 4, 4)])
def test_two_hop_random_mean(X, Y, S, bits, out_bits):
    P, block = X * Y, 32
    g = torch.Generator().manual_seed(X * 100 + Y * 10 + S)
    grads = [torch.randn(1000, generator=g).to(torch.bfloat16 if bits == 4 else torch.float32) for _ in range(P)]
    got, shard, _ = simulate_qgz(grads, X, Y, bits, block, S, out_bits)
    parts = [torch.cat([x.double(), torch.zeros(P * shard - 1000, dtype=torch.float64)]).view(P, shard)
             for x in grads]                          # parts[r][p]: rank r's values of partition p
    rel = []
    for p in range(P):
        want = sum(part[p] for part in parts)
        first = [quant_error_bound(part[p], bits, block) for part in parts]     # each rank's quantization
        bound = sum(first) + 1e-5                     # + the fp32 sums' rounding
        for n in range(Y):                            # each node's re-quantization of its dequantized sum
            node = range(n * X, (n + 1) * X)
            bound = bound + quant_error_bound(sum(parts[r][p] for r in node), out_bits, block,
                                              sum(first[r] for r in node) + 1e-5)
        mean, want = got[p].double() / P, want / P    # step 5: divide by P once
        assert ((mean - want).abs() <= bound / P).all()
        rel.append(((mean - want).norm() / want.norm()).item())
    assert max(rel) < (0.02 if min(bits, out_bits) == 8 else 0.3)


def test_dequant_sum_order_and_requant():
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(50, generator=g) * 10 ** k for k in (0, 6, -3)]
    qs = [quantize_blockwise(x, 8, 16) for x in xs]
    got = dequant_sum([q[0] for q in qs], [q[1] for q in qs], 8, 16, 50)
    acc = None
    for x in xs:                                      # fp32, strictly in copy order
        q, s = ref_quant(x, 8, 16)
        d = ref_dequant(q, s, 16, 50)
        acc = d if acc is None else (acc + d).astype(np.float32)
    assert got.dtype == torch.float32 and same(got.numpy(), acc)
    p2, s2 = dequant_sum_requant(torch.stack([q[0] for q in qs]), torch.stack([q[1] for q in qs]), 8, 16, 50, 4)
    q_ref, s_ref = ref_quant(torch.from_numpy(acc), 4, 16)
    assert np.array_equal(decode(p2, 4), q_ref) and same(s2.numpy(), s_ref)
