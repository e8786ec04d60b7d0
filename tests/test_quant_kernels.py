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
QMAX = {8: 127, 4: 7}


# ----------------------------------------------------------------------------- references
def ref_quant(x: torch.Tensor, bits: int, block: int):
    """-> (codes int64 [n_blocks*block], scales float32 [n_blocks]) in float64 math."""
    qmax = QMAX[bits]
    v = x.detach().reshape(-1).to(torch.float64).numpy()
    nb = -(-v.size // block)
    blocks = np.zeros(nb * block)
    blocks[:v.size] = v
    blocks = blocks.reshape(nb, block)
    finite = np.isfinite(blocks).all(axis=1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        absmax = np.where(finite, np.abs(np.where(np.isfinite(blocks), blocks, 0)).max(axis=1, initial=0.0), np.nan)
        scale = (absmax / qmax).astype(np.float32)
        s64 = scale.astype(np.float64)
        usable = s64 > 0
        quot = (blocks / np.where(usable, s64, 1.0)[:, None]).astype(np.float32).astype(np.float64)
        q = np.clip(np.rint(quot), -qmax - 1, qmax)
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
    return np.array_equal(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), equal_nan=True)


def check_exact(x, bits, block):
    """Codes, scales and dequantized values equal the float64 reference bit for bit."""
    payload, scales = quantize_blockwise(x, bits, block)
    q, s = ref_quant(x, bits, block)
    assert payload.dtype == torch.uint8 and payload.dim() == 1 and payload.numel() == q.size * bits // 8
    assert scales.dtype == torch.float32 and scales.numel() == s.size
    assert np.array_equal(decode(payload, bits), q)
    assert same(scales.numpy(), s)
    out = dequantize_blockwise(payload, scales, bits, block, x.numel(), x.dtype)
    assert out.dtype == x.dtype and out.shape == (x.numel(),)
    expect = torch.from_numpy(ref_dequant(q, s, block, x.numel())).to(x.dtype)
    assert same(out.double().numpy(), expect.double().numpy())
    return out, s


def bound(x64: np.ndarray, scales: np.ndarray, bits: int, block: int, dtype) -> np.ndarray:
    """Documented per-element bound: s/2 + 2^-22 a + (qmax+1) 2^-149 + half an ulp of dtype."""
    s = np.repeat(scales.astype(np.float64), block)[:x64.size]
    a = s * QMAX[bits]
    fin = torch.finfo(dtype)
    big = float(np.nextafter(np.float32(fin.max), np.float32(0))) if dtype == torch.float32 else fin.max  # see fp32_max test
    half_ulp = 0.5 * fin.eps * (np.abs(x64) + s) + 0.5 * fin.smallest_normal * fin.eps
    return s / 2 + 2.0 ** -22 * a + (QMAX[bits] + 1) * 2.0 ** -149 + half_ulp


# ----------------------------------------------------------------------------- hand examples
def test_int4_packing_by_hand():
    # codes [1, -2, 7, -8]: nibbles 1, E, 7, 8 -> bytes E1, 87 (low nibble first)
    assert pack_int4(torch.tensor([1, -2, 7, -8])).tolist() == [0xE1, 0x87]
    out = dequantize_blockwise(torch.tensor([0xE1, 0x87], dtype=torch.uint8), torch.tensor([1.0]), 4, 4, 4)
    assert out.tolist() == [1.0, -2.0, 7.0, -8.0]
    # absmax 7 -> scale exactly 1; -7 is nibble 9
    payload, scales = quantize_blockwise(torch.tensor([1.0, -2.0, 7.0, -7.0]), 4, 4)
    assert payload.tolist() == [0xE1, 0x97] and scales.tolist() == [1.0]
    # odd count: 3 values, block 4 -> 2 bytes, padding nibble is 0
    payload, scales = quantize_blockwise(torch.tensor([-14.0, 2.0, 4.0]), 4, 4)
    assert scales.tolist() == [2.0] and payload.tolist() == [0x19, 0x02]
    assert dequantize_blockwise(payload, scales, 4, 4, 3).tolist() == [-14.0, 2.0, 4.0]


def test_int8_and_half_steps_by_hand():
    payload, scales = quantize_blockwise(torch.tensor([127.0, -1.0, 0.0, -127.0]), 8, 4)
    assert payload.tolist() == [0x7F, 0xFF, 0x00, 0x81] and scales.tolist() == [1.0]
    # scale 1: half steps round to even
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -125.5])
    payload, _ = quantize_blockwise(x, 8, 8)
    assert payload.view(torch.int8).tolist() == [127, 0, 2, 2, 0, -2, 126, -126]
    # int4, scale 2 (absmax 14): x/scale = 0.5, 1.5, 2.5, 3.5 -> 0, 2, 2, 4
    payload, scales = quantize_blockwise(torch.tensor([14.0, 1.0, 3.0, 5.0, 7.0, -7.0]), 4, 6)
    assert scales.tolist() == [2.0] and decode(payload, 4).tolist() == [7, 0, 2, 2, 4, -4]


# ----------------------------------------------------------------------------- random data
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,block", [(1, 2), (7, 4), (1000, 64), (4099, 128), (257, 256), (33, 2)])
def test_random_exact_and_bound(dtype, bits, numel, block):
    g = torch.Generator().manual_seed(numel * 31 + block + bits)
    x = (torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel)[torch.randperm(numel, generator=g)]).to(dtype)
    out, s = check_exact(x, bits, block)
    x64 = x.double().numpy()
    err = np.abs(out.double().numpy() - x64)
    assert (err <= bound(x64, s, bits, block, dtype)).all()
    # the bound is tight: some element loses close to half a step of its block
    half = np.repeat(s.astype(np.float64), block)[:numel] / 2
    assert numel < 30 or (err / half).max() > 0.8


def test_int8_shape_agnostic_and_bf16_not_read_as_fp16():
    x = torch.tensor([[1e10, -1.5e10, -3e30], [2e30, 2.5e-30, 2e-30]], dtype=torch.bfloat16)  # outside fp16's range
    out, s = check_exact(x, 8, 2)
    assert s[1] == np.float32(np.float64(x[0, 2].float()) * -1 / 127)
    assert torch.isfinite(out).all() and torch.allclose(out.float(), x.reshape(-1).float(), rtol=0.02, atol=0)


# ----------------------------------------------------------------------------- adversarial data
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_adversarial(dtype, bits):
    qmax, block = QMAX[bits], 8
    g = torch.Generator().manual_seed(bits)
    fin = torch.finfo(dtype)
    big = float(np.nextafter(np.float32(fin.max), np.float32(0))) if dtype == torch.float32 else fin.max  # see fp32_max test
    cases = [
        (torch.arange(-8, 8) + 0.5) * (2.0 ** -3),                           # half steps of scale 1/8 (absmax 127/8 needs int8)
        torch.cat([torch.randn(7, generator=g), torch.tensor([float(fin.max) / 2])]).repeat(3),  # huge outlier per block
        torch.randn(24, generator=g) * fin.smallest_normal,                   # denormals of the input dtype
        torch.full((24,), fin.smallest_normal * fin.eps),                     # the smallest denormal everywhere
        torch.tensor([0.0] * 8 + [-0.0] * 8 + [3.0] * 8),                     # zero blocks, a constant block
        torch.tensor([big, -big, fin.tiny, 0.0] * 2),
    ]
    for x in cases:
        x = x.to(dtype)
        out, s = check_exact(x, bits, block)
        x64 = x.double().numpy()
        assert np.isfinite(out.double().numpy()).all()
        assert (np.abs(out.double().numpy() - x64) <= bound(x64, s, bits, block, dtype)).all()
    for x in [torch.tensor([3.0, -2.0, 1e-3]), torch.tensor([fin.tiny]), torch.tensor([-big])]:  # block of 1
        out, s = check_exact(x.to(dtype), bits, 2 if bits == 4 else 1)
        assert (np.abs(out.double().numpy() - x.to(dtype).double().numpy())
                <= bound(x.to(dtype).double().numpy(), s, bits, 2 if bits == 4 else 1, dtype)).all()


def test_zero_block_is_exact_zero_and_padding_stays_out():
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0, -5.0, 0.0])
    payload, scales = quantize_blockwise(x, 4, 4)
    assert scales.tolist() == [0.0, np.float32(5) / np.float32(7)] and payload.numel() == payload_nbytes(7, 4, 4) == 4
    assert decode(payload, 4).tolist() == [0, 0, 0, 0, 7, -7, 0, 0]
    out = dequantize_blockwise(payload, scales, 4, 4, 7)
    assert out.shape == (7,) and out[:4].tolist() == [0.0] * 4 and not torch.isnan(out).any()
    # fp32 underflow: absmax/127 rounds to 0 -> q = 0, no NaN, error <= absmax
    tiny = torch.tensor([1.4e-45, -1.4e-45, 0.0, 2.8e-45])
    payload, scales = quantize_blockwise(tiny, 8, 4)
    assert scales.tolist() == [0.0] and payload.tolist() == [0, 0, 0, 0]
    assert dequantize_blockwise(payload, scales, 8, 4, 4).tolist() == [0.0] * 4
    empty_p, empty_s = quantize_blockwise(torch.zeros(0), 8, 4)
    assert empty_p.numel() == 0 and dequantize_blockwise(empty_p, empty_s, 8, 4, 0).numel() == 0


@pytest.mark.parametrize("bits,k,code", [(8, 190, -128), (4, 10, -8)])
def test_subnormal_scale_reaches_the_lowest_code(bits, k, code):
    # absmax k*2^-149: k/qmax (1.496 or 1.43) rounds down to the subnormal 2^-149, so
    # -absmax/scale = -k clamps to -qmax-1 and +absmax to qmax; error stays <= (qmax+1)*2^-149
    d = 2.0 ** -149
    x = torch.tensor([-k * d, k * d], dtype=torch.float32)
    payload, scales = quantize_blockwise(x, bits, 2)
    assert scales.tolist() == [d] and decode(payload, bits).tolist() == [code, QMAX[bits]]
    out = dequantize_blockwise(payload, scales, bits, 2, 2)
    assert out.tolist() == [code * d, QMAX[bits] * d]
    assert ((out.double() - x.double()).abs() <= (QMAX[bits] + 1) * d).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_poisons_its_block_only(bits, bad):
    x = torch.tensor([1.0, 2.0, bad, 4.0, 1.0, -7.0, 0.5, 3.0])
    payload, scales = quantize_blockwise(x, bits, 4)
    assert math.isnan(scales[0].item()) and scales[1].item() == np.float32(7) / np.float32(QMAX[bits])
    out = dequantize_blockwise(payload, scales, bits, 4, 8)
    assert torch.isnan(out[:4]).all()
    assert (out[4:] - x[4:]).abs().max() <= 7.0 / QMAX[bits] / 2
    check_exact(x, bits, 4)


def test_fp32_max_is_the_documented_overflow():
    top = torch.finfo(torch.float32).max
    p, s = quantize_blockwise(torch.tensor([top, 1.0]), 8, 2)
    assert torch.isinf(dequantize_blockwise(p, s, 8, 2, 2)[0])
    below = torch.nextafter(torch.tensor(top), torch.tensor(0.0))
    p, s = quantize_blockwise(torch.stack([below, -below]), 8, 2)
    assert torch.isfinite(dequantize_blockwise(p, s, 8, 2, 2)).all()


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
    x = torch.tensor([1.0, -1.0, 2.0, 2.0, 3.0, 0.0, 4.0, -4.0]) * 127
    payload, scales = reorder_and_quantize(x, 2, 2, 8, 2)
    assert scales.tolist() == [1.0, 3.0, 2.0, 4.0]
    assert payload.view(torch.int8).tolist() == [127, -127, 127, 0, 127, 127, 127, -127]


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
    """Every (partition, stage) piece carries a distinct marker that quantizes losslessly."""
    P, c, block, numel = X * Y, QMAX[bits], 4, 6 * X * Y * S + 3   # ragged: pads by both rules
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


@pytest.mark.parametrize("X,Y,S,bits,out_bits", [(2, 2, 1, 4, 4), (2, 2, 2, 8, 8), (4, 2, 2, 4, 8), (2, 3, 3, 4, 4)])
def test_two_hop_random_mean(X, Y, S, bits, out_bits):
    P, block = X * Y, 32
    g = torch.Generator().manual_seed(X * 100 + Y * 10 + S)
    grads = [torch.randn(1000, generator=g).to(torch.bfloat16 if bits == 4 else torch.float32) for _ in range(P)]
    got, shard, _ = simulate_qgz(grads, X, Y, bits, block, S, out_bits)
    ref = torch.cat([sum(x.double() for x in grads), torch.zeros(P * shard - 1000, dtype=torch.float64)])
    amax = max(x.double().abs().max().item() for x in grads)
    node_max = max(sum(grads[n * X + l].double() for l in range(X)).abs().max().item() for n in range(Y))
    tol = P * amax / QMAX[bits] / 2 + Y * node_max / QMAX[out_bits] / 2 + 1e-5
    rel = []
    for p in range(P):
        mean, want = got[p].double() / P, ref[p * shard:(p + 1) * shard] / P   # step 5: divide by P once
        assert ((mean - want).abs() <= tol / P).all()
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
