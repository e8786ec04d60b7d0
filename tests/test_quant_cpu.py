"""kernels/quant_cpu.py (the fast CPU path) against kernels/quant.py (the references), bit for bit.

Every comparison is on bits: payload bytes, scale bit patterns (as int32, so NaN blocks compare and
the NaN written must be the reference's), dequantized values' bit patterns (NaN included), dtypes
and shapes. One differing bit anywhere fails the test. Inputs are random with the special blocks
the definition singles out: all-zero, NaN (with odd NaN bit patterns), ±inf, tiny values whose
scale is subnormal or underflows to ±0 (stored +0), fp16's largest value, ties +a/-a of the extreme,
values clipped beside it; ragged last blocks and empty input.
"""
import itertools

import pytest
import torch

from kernels import ops
from kernels import quant as ref
from kernels import quant_cpu as fast

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.uint8: torch.uint8, torch.int8: torch.int8, torch.int16: torch.int16}
KINDS = ["random", "zero", "nan", "+inf", "-inf", "subnormal_scale", "zero_scale", "fp16_max", "nan_inf",
         "one_big", "tie", "clipped"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.dtype])


def assert_same(got, want, what=""):
    """Same dtype, shape and bits (tuples element by element)."""
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{what}[{i}]")
        return
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    g, w = bits(got), bits(want)
    if not torch.equal(g, w):
        bad = (g != w).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"{what}: differs at {bad}: {got.flatten()[bad].tolist()} vs {want.flatten()[bad].tolist()}")


def make_input(numel: int, block: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``numel`` values of ``dtype``; block b is of kind KINDS[(b + seed) % len(KINDS)] (the non-finite kinds
    hold a few special values among normal ones)."""
    g = torch.Generator().manual_seed(seed * 7919 + numel * 31 + block)
    nb = -(-numel // block)
    x = torch.randn(nb, block, generator=g) * 10.0 ** (torch.rand(nb, 1, generator=g) * 8 - 4)
    kind = (torch.arange(nb) + seed) % len(KINDS)
    rows = {k: (kind == i).nonzero().flatten() for i, k in enumerate(KINDS)}
    pos = torch.randint(0, block, (nb,), generator=g)      # one special position per block
    pos2 = torch.randint(0, block, (nb,), generator=g)     # and another (may coincide)

    def put(k, where, value):
        r = rows[k]
        x[r, where[r]] = value

    x[rows["zero"]] = 0.0
    xi, r = x.view(torch.int32), rows["nan"]       # NaNs with a sign and a payload, a signalling one
    xi[r, pos[r]] = -4194303                       # 0xffc00001
    xi[r, pos2[r]] = 0x7F800001
    put("+inf", pos, float("inf"))
    put("+inf", pos2, float("inf"))
    put("-inf", pos, -float("inf"))
    put("nan_inf", pos, float("inf"))
    put("nan_inf", pos2, float("nan"))
    r = rows["subnormal_scale"]                    # extreme / 2**(bits-1) below 2**-126
    x[r] = torch.randn(len(r), block, generator=g) * 1e-38
    r = rows["zero_scale"]                         # extreme / 2**(bits-1) underflows to +0 or -0
    x[r] = torch.randn(len(r), block, generator=g) * 1e-44
    r = rows["fp16_max"]
    x[r] = torch.randint(-1, 2, (len(r), block), generator=g).float() * 65504.0
    put("fp16_max", pos, 3e4)
    r = rows["one_big"]                            # one large value: most codes round to 0 or +-1
    x[r, pos[r]] = x[r].abs().amax(dim=1) * 1000 + 1
    r = rows["tie"]                                # +a and -a are the extremes: +a wins
    a = x[r].abs().amax(dim=1) * 2
    x[r, pos[r]], x[r, pos2[r]] = a, -a
    r = rows["clipped"]                            # extreme -+a, values of the other sign above 0.99a
    a = x[r].abs().amax(dim=1, keepdim=True) * torch.where(torch.rand(len(r), 1, generator=g) < 0.5, 1, -1)
    x[r] = a * (0.99 + 0.01 * torch.rand(len(r), block, generator=g))
    x[r, pos[r]] = -a[:, 0] * 1.0001
    return x.reshape(-1)[:numel].to(dtype)


def numels(block: int):
    return sorted({0, 1, max(block - 1, 1), block, block + 1, 3 * block + 1, 2 * block + 3, 50_001})


def check_quantize(x: torch.Tensor, bits_: int, block: int) -> None:
    before = x.clone()
    want = ref.quantize_blockwise(x, bits_, block)
    got = fast.quantize_blockwise(x, bits_, block)
    tag = f"quantize {x.dtype} {tuple(x.shape)} bits={bits_} block={block}"
    assert_same(got, want, tag)
    assert_same(x, before, tag + " (input modified)")
    for dtype in DTYPES:
        d_want = ref.dequantize_blockwise(*want, bits_, block, x.numel(), dtype)
        d_got = fast.dequantize_blockwise(*want, bits_, block, x.numel(), dtype)
        assert_same(d_got, d_want, f"dequantize to {dtype} of {tag}")


# ----------------------------------------------------------------------------- blockwise
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits_,block", [(8, 1), (8, 2), (4, 2), (8, 7), (4, 8), (8, 8), (4, 128), (8, 128),
                                        (8, 999), (4, 1000), (8, 1000), (4, 4096), (8, 4096)])
def test_quantize_and_dequantize_grid(dtype, bits_, block):
    for n in numels(block):
        for seed in range(len(KINDS) if n <= 2 * block else 1):    # a lone block: every kind in turn
            check_quantize(make_input(n, block, dtype, seed), bits_, block)


@pytest.mark.parametrize("bits_", [4, 8])
def test_every_lane_sees_a_non_finite_value(bits_):
    """A block's NaN/inf is found wherever it sits (vector lanes and tails of the max reduction)."""
    g = torch.Generator().manual_seed(bits_)
    for dtype, block in itertools.product(DTYPES, [2, 6, 8, 16, 18, 32, 34, 64, 66, 128, 130, 256]):
        for value in (float("nan"), float("inf"), -float("inf")):
            x = torch.randn(block, block, generator=g).to(dtype)
            x[torch.arange(block), torch.arange(block)] = value   # block i: position i
            check_quantize(x, bits_, block)
            x = torch.randn(block + 1, block, generator=g).to(dtype)
            x[block, :] = 1.0                                     # and one finite block, last
            x[torch.arange(block), torch.arange(block)] = value
            check_quantize(x, bits_, block)


def test_shapes_strides_and_small_scale_extremes():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, generator=g)
    check_quantize(x, 8, 16)                      # 2-D input, flattened
    check_quantize(x.t(), 4, 16)                  # non-contiguous
    check_quantize(x[:, ::3], 8, 5)
    for e in range(-149, -110):                   # scales from 0 through subnormal to normal
        y = torch.randn(256, generator=g) * 2.0 ** e
        check_quantize(y, 8, 128)
        check_quantize(y, 4, 128)
    check_quantize(torch.full((64,), torch.finfo(torch.float32).max), 8, 32)   # fp32 max: comes back exactly


@pytest.mark.parametrize("bits_", [4, 8])
def test_finite_scales_whose_sum_overflows(bits_):
    """Blocks of fp32's largest values: their scales are finite, but their sum overflows; with a NaN block
    among them, and without."""
    top = torch.finfo(torch.float32).max
    x = torch.full((300, 4), top) * torch.tensor([1.0, -1.0, 0.5, -0.25])
    check_quantize(x, bits_, 4)
    x[7, 2] = float("nan")
    check_quantize(x, bits_, 4)


def test_int4_nibbles_of_every_byte():
    """All 256 code pairs through the 16-bit-lane pack and unpack (and the byte-at-a-time fallback that a
    big-endian machine would use)."""
    codes = torch.tensor([(((v & 15) ^ 8) - 8, ((v >> 4) ^ 8) - 8) for v in range(256)], dtype=torch.int8).view(-1)
    payload = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for pack, unpack in [(fast._pack_int4, fast._unpack_int4), (fast._pack_int4_bytes, fast._unpack_int4_bytes)]:
        assert_same(pack(codes), ref.pack_int4(codes))
        assert_same(pack(codes), payload)
        assert_same(unpack(payload).to(torch.int16), ref.unpack_int4(payload))
        assert_same(unpack(payload), codes)
    x = codes.float() / 8                         # every code in every position of a block of 16 and 512
    check_quantize(x, 4, 16)
    check_quantize(x, 4, 512)


# ----------------------------------------------------------------------------- qgZ
@pytest.mark.parametrize("X,Y,S", [(1, 1, 1), (2, 2, 1), (2, 2, 2), (4, 2, 3), (1, 4, 2), (3, 1, 2)])
@pytest.mark.parametrize("bits_,block", [(4, 2), (4, 128), (8, 3), (8, 128)])
def test_reorder_and_quantize(X, Y, S, bits_, block):
    P = X * Y
    unit = P * S * block
    for i, n in enumerate(sorted({0, 1, 7, unit - 1, unit, unit + 1, 3 * unit, 5 * unit + 13, 20_011})):
        dtype = DTYPES[i % 3]
        x = make_input(n, 64, dtype, seed=i)       # special kinds every 64 values, across slots
        before = x.clone()
        want = ref.reorder_and_quantize(x, X, Y, bits_, block, S)
        got = fast.reorder_and_quantize(x, X, Y, bits_, block, S)
        assert_same(got, want, f"reorder_and_quantize {dtype} numel={n} X={X} Y={Y} S={S} bits={bits_} "
                               f"block={block}")
        assert_same(x, before, "input modified")
    x = make_input(2 * unit, 64, torch.float32, seed=1).view(2, -1).t()     # non-contiguous, no padding
    assert_same(fast.reorder_and_quantize(x, X, Y, bits_, block, S),
                ref.reorder_and_quantize(x, X, Y, bits_, block, S), "non-contiguous")


def encoded_copies(k: int, numel: int, bits_: int, block: int, seed: int):
    """k quantized copies whose magnitudes differ (so the order of the sum matters)."""
    outs = []
    for c in range(k):
        x = make_input(numel, block, torch.float32, seed + c) * (10.0 ** (3 - 3 * c))
        outs.append(ref.quantize_blockwise(x, bits_, block))
    return outs


@pytest.mark.parametrize("bits_,out_bits,block", [(4, 4, 2), (4, 8, 128), (8, 4, 128), (8, 8, 7), (8, 8, 1000),
                                                 (4, 4, 4096)])
def test_dequant_sum_and_requant(bits_, out_bits, block):
    for k, n in itertools.product([1, 2, 3], sorted({0, 1, block - 1, block + 1, 4 * block, 50_001})):
        copies = encoded_copies(k, n, bits_, block, seed=k + n)
        for as_list in (False, True):
            payloads = [c[0] for c in copies] if as_list else torch.stack([c[0] for c in copies])
            scales = [c[1] for c in copies] if as_list else torch.stack([c[1] for c in copies])
            tag = f"bits={bits_} out_bits={out_bits} block={block} k={k} numel={n} list={as_list}"
            assert_same(fast.dequant_sum(payloads, scales, bits_, block, n),
                        ref.dequant_sum(payloads, scales, bits_, block, n), "dequant_sum " + tag)
            assert_same(fast.dequant_sum_requant(payloads, scales, bits_, block, n, out_bits),
                        ref.dequant_sum_requant(payloads, scales, bits_, block, n, out_bits),
                        "dequant_sum_requant " + tag)


def test_dequant_sum_order_is_checked():
    """Copies of different magnitudes make the order of the fp32 sum visible: the fast path must add in
    copy order, ((c0 + c1) + c2), as the reference does (c0 + (c1 + c2) differs)."""
    g = torch.Generator().manual_seed(0)
    p, s = zip(*[ref.quantize_blockwise(torch.randn(4096, generator=g) * 10.0 ** (3 - 3 * c), 8, 128)
                 for c in range(3)])
    want = ref.dequant_sum(list(p), list(s), 8, 128, 4096)
    other = ref.dequant_sum([p[1], p[2]], [s[1], s[2]], 8, 128, 4096) + ref.dequant_sum([p[0]], [s[0]], 8, 128, 4096)
    assert not torch.equal(bits(want), bits(other))
    assert_same(fast.dequant_sum(list(p), list(s), 8, 128, 4096), want)
    assert_same(fast.dequant_sum(torch.stack(p), torch.stack(s), 8, 128, 4096), want)


@pytest.mark.parametrize("bits_,block", [(8, 1), (8, 7), (4, 2), (4, 128), (8, 128), (4, 1000)])
def test_arbitrary_bytes_and_scales(bits_, block):
    """Decoding takes any payload bytes (codes -128 / -8 included, padding codes not 0) and any fp32 scales
    (0, subnormal, negative, inf, NaN with a payload), and the sums ignore the padding codes as the reference
    does."""
    g = torch.Generator().manual_seed(block)
    specials = torch.tensor([0, 1, 0x00012345, -2 ** 31, 0x7F800000, 0xFF800000 - 2 ** 32, 0x7FC00000,
                             0x7F800001, 0xFFC00001 - 2 ** 32, 0x3F800000], dtype=torch.int32).view(torch.float32)
    for n in sorted({1, max(block - 1, 1), block + 1, 3 * block + 1, 10_001}):
        nb = -(-n // block)
        for k in (1, 2, 3):
            payloads = torch.randint(0, 256, (k, nb * block * bits_ // 8), generator=g, dtype=torch.uint8)
            scales = torch.randn(k, nb, generator=g) * 10.0 ** (torch.rand(k, nb, generator=g) * 60 - 30)
            pick = torch.rand(k, nb, generator=g) < 0.2
            scales[pick] = specials[torch.randint(0, len(specials), (int(pick.sum()),), generator=g)]
            for dtype in DTYPES:
                assert_same(fast.dequantize_blockwise(payloads[0], scales[0], bits_, block, n, dtype),
                            ref.dequantize_blockwise(payloads[0], scales[0], bits_, block, n, dtype),
                            f"dequantize numel={n} {dtype}")
            assert_same(fast.dequant_sum(payloads, scales, bits_, block, n),
                        ref.dequant_sum(payloads, scales, bits_, block, n), f"dequant_sum numel={n} k={k}")
            for out_bits in ((4, 8) if block % 2 == 0 else (8,)):
                assert_same(fast.dequant_sum_requant(list(payloads), list(scales), bits_, block, n, out_bits),
                            ref.dequant_sum_requant(list(payloads), list(scales), bits_, block, n, out_bits),
                            f"dequant_sum_requant numel={n} k={k} out_bits={out_bits}")


# ----------------------------------------------------------------------------- validation
def test_same_errors_for_bad_arguments():
    x = torch.ones(8)
    p8, s8 = ref.quantize_blockwise(x, 8, 4)
    p4, s4 = ref.quantize_blockwise(x, 4, 4)
    calls = [
        lambda m: m.quantize_blockwise(x, 3, 4),
        lambda m: m.quantize_blockwise(x, 8, 0),
        lambda m: m.quantize_blockwise(x, 4, 3),
        lambda m: m.quantize_blockwise(x, True, 4),
        lambda m: m.quantize_blockwise(x.long(), 8, 4),
        lambda m: m.quantize_blockwise([1.0], 8, 4),
        lambda m: m.dequantize_blockwise(p8, s8, 3, 4, 8),
        lambda m: m.dequantize_blockwise(p4, s4, 4, 3, 8),
        lambda m: m.dequantize_blockwise(p8[:-1], s8, 8, 4, 8),
        lambda m: m.dequantize_blockwise(p8, s8, 4, 4, 8),            # wrong payload size for int4
        lambda m: m.dequantize_blockwise(p8.view(2, 4), s8, 8, 4, 8),
        lambda m: m.dequantize_blockwise(p8, s8.double(), 8, 4, 8),
        lambda m: m.dequantize_blockwise(p8, s8[:1], 8, 4, 8),
        lambda m: m.dequantize_blockwise(p8, s8, 8, 4, -1),
        lambda m: m.dequantize_blockwise(p8, s8, 8, 4, 8.0),
        lambda m: m.dequantize_blockwise(p8, s8, 8, 4, 8, torch.float64),
        lambda m: m.reorder_and_quantize(x, 0, 2, 8, 4),
        lambda m: m.reorder_and_quantize(x, 2, 2, 8, 4, 0),
        lambda m: m.reorder_and_quantize(x, 2, 2, 3, 4),
        lambda m: m.reorder_and_quantize(x, 2, 2, 4, 5),
        lambda m: m.reorder_and_quantize(x.int(), 2, 2, 8, 4),
        lambda m: m.dequant_sum([p8, p8], [s8], 8, 4, 8),
        lambda m: m.dequant_sum([p8], [s8], 3, 4, 8),
        lambda m: m.dequant_sum([p8], [s8], 8, 4, 9),
        lambda m: m.dequant_sum(p8, s8, 8, 4, 8),                      # 1-D, not k copies
        lambda m: m.dequant_sum([p8, p8[:-1].clone()], [s8, s8], 8, 4, 7),
        lambda m: m.dequant_sum_requant([p8], [s8], 8, 4, 8, 3),
        lambda m: m.dequant_sum_requant([p8], [s8], 8, 3, 8, 4),
        lambda m: m.dequant_sum_requant([p8], [s8], 8, 4, 9, 3),
        lambda m: m.dequant_sum_requant([p8], [s8.double()], 8, 4, 8, 8),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(Exception) as want:
            call(ref)
        with pytest.raises(Exception) as got:
            call(fast)
        assert (type(got.value), str(got.value)) == (type(want.value), str(want.value)), f"call {i}"


def test_shared_helpers_are_the_references():
    for name in ["n_blocks", "payload_nbytes", "qgz_slice_sizes", "qgz_slot", "reorder_for_hierarchical"]:
        assert getattr(fast, name) is getattr(ref, name), name


def test_quant_ops_picks_the_fast_path_on_cpu(monkeypatch):
    monkeypatch.delenv("ZEROPP_TRITON", raising=False)
    monkeypatch.delenv("ZEROPP_REFERENCE", raising=False)
    assert ops.quant_ops(torch.device("cpu")) is fast
    assert ops.quant_ops("cpu") is fast
    monkeypatch.setenv("ZEROPP_REFERENCE", "1")
    assert ops.quant_ops(torch.device("cpu")) is ref
    monkeypatch.setenv("ZEROPP_REFERENCE", "0")
    assert ops.quant_ops(torch.device("cpu")) is fast
