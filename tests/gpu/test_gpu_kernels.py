"""The Triton kernels of ZeRO++ compiled for the GPU, bit for bit against the plain-torch references.

The references (``kernels/quant.py``) run on CPU; the kernels run on CUDA through ``kernels.ops.quant_ops``
(the door the ZeRO++ code uses). Equality is on bits: payload bytes, scale bit patterns, dequantized values
(NaN only has to be NaN). Sizes are those of real units (millions of elements, a 1.3B model's layer is ~50M),
with ragged tails, odd blocks, special values and ties, for int8 and int4 and the three input dtypes.
"""
from __future__ import annotations

import pytest
import torch

from kernels import quant as ref
from tests.test_quant_triton import DTYPES, assert_same_bits, halfway_values, special_values


def _ops():
    from kernels import quant_triton
    from kernels.ops import quant_ops

    ops = quant_ops(torch.device("cuda"))
    assert ops is quant_triton, "CUDA must run the Triton kernels"
    return ops


def _same(got, want, nan_any_bits: bool = False) -> None:
    assert got.device.type == "cuda", got.device
    assert_same_bits(got.cpu(), want, nan_any_bits=nan_any_bits)


def _check_quant(x: torch.Tensor, bits: int, block: int) -> None:
    qt = _ops()
    p_ref, s_ref = ref.quantize_blockwise(x, bits, block)
    p, s = qt.quantize_blockwise(x.cuda(), bits, block)
    _same(p, p_ref)
    _same(s, s_ref)
    pc, sc = p_ref.cuda(), s_ref.cuda()
    for dtype in DTYPES:
        want = ref.dequantize_blockwise(p_ref, s_ref, bits, block, x.numel(), dtype)
        _same(qt.dequantize_blockwise(pc, sc, bits, block, x.numel(), dtype), want, nan_any_bits=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_dequantize_realistic_sizes(bits, dtype):
    g = torch.Generator().manual_seed(bits)
    for numel, block in [(1 << 22, 128), ((1 << 22) + 37, 128), (3_000_001 + (bits == 4), 2048),
                         (1_000_003, 50), (999_999, 6 if bits == 4 else 7), (5, 128)]:
        x = (torch.randn(numel, generator=g) * 3).to(dtype)
        _check_quant(x, bits, block)


def test_quantize_a_whole_layer():
    """A gpt_1.3b layer's parameters in one unit: 50M bf16 values, int8 and int4, block 128."""
    x = (torch.randn(50_348_032, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    for bits in (8, 4):
        _check_quant(x, bits, 128)


@pytest.mark.parametrize("bits", [8, 4])
def test_special_values_and_ties(bits):
    for dtype in DTYPES:
        _check_quant(special_values(8).to(dtype), bits, 8)
        _check_quant(special_values(64).to(dtype), bits, 64)
    for scale in (0.125, 0.1):
        _check_quant(halfway_values(bits, 16, scale), bits, 16)
    for dtype in (torch.bfloat16, torch.float16):
        _check_quant(halfway_values(bits, 16, 0.25).to(dtype), bits, 16)


@pytest.mark.parametrize("x_size,y_size,stages", [(8, 2, 2), (4, 4, 1), (2, 2, 2), (3, 2, 1), (1, 8, 2), (8, 1, 1)])
def test_reorder_and_quantize(x_size, y_size, stages):
    qt = _ops()
    g = torch.Generator().manual_seed(x_size * 10 + y_size + 100 * stages)
    for bits, dtype, numel, block in [(4, torch.bfloat16, 2_000_003, 128), (8, torch.float32, 1_000_037, 2048),
                                      (4, torch.float16, 64 * x_size * y_size * stages, 64), (8, torch.bfloat16, 5, 6)]:
        x = torch.randn(numel, generator=g).to(dtype)
        x[numel // 3] = 0.0
        want = ref.reorder_and_quantize(x, x_size, y_size, bits, block, stages)
        got = qt.reorder_and_quantize(x.cuda(), x_size, y_size, bits, block, stages)
        _same(got[0], want[0])
        _same(got[1], want[1])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_dequant_sum_and_requant(k, bits):
    """qgZ's middle and last steps: k received copies summed in copy order (and requantized)."""
    qt = _ops()
    g = torch.Generator().manual_seed(k * 7 + bits)
    for block, numel in [(128, 1_000_003), (2048, 4_194_304), (6, 999)]:
        ps, ss = [], []
        for c in range(k):
            x = torch.randn(numel, generator=g) * (c + 1)
            x[:block] = 0.0 if c == 1 else x[:block]
            if c == 2:
                x[block + 1] = float("inf")
            p, s = ref.quantize_blockwise(x, bits, block)
            ps.append(p)
            ss.append(s)
        P, S = torch.stack(ps), torch.stack(ss)
        Pc, Sc = P.cuda(), S.cuda()
        _same(qt.dequant_sum(Pc, Sc, bits, block, numel), ref.dequant_sum(P, S, bits, block, numel),
              nan_any_bits=True)
        for out_bits in (8, 4):
            if block % 2:
                continue
            got = qt.dequant_sum_requant(Pc, Sc, bits, block, numel, out_bits)
            want = ref.dequant_sum_requant(P, S, bits, block, numel, out_bits)
            _same(got[0], want[0])
            _same(got[1], want[1])


def test_bad_arguments_raise_the_references_errors_on_cuda():
    """A bad call is a ValueError with the reference's message, never a CUDA assert; the device stays usable."""
    qt = _ops()
    x = torch.randn(10)
    p, s = ref.quantize_blockwise(x, 8, 4)
    xc, pc, sc = x.cuda(), p.cuda(), s.cuda()
    calls = [
        lambda m, x, p, s: m.quantize_blockwise(x, 3, 4),
        lambda m, x, p, s: m.quantize_blockwise(x, 4, 5),
        lambda m, x, p, s: m.quantize_blockwise(x.double(), 8, 4),
        lambda m, x, p, s: m.dequantize_blockwise(p, s, 8, 4, 13),
        lambda m, x, p, s: m.dequantize_blockwise(p, s, 8, 4, 10, torch.float64),
        lambda m, x, p, s: m.reorder_and_quantize(x, 2, 2, 4, 3),
        lambda m, x, p, s: m.dequant_sum([p, p], [s], 8, 4, 10),
        lambda m, x, p, s: m.dequant_sum_requant([p[:-1]], [s], 8, 4, 10, 4),
    ]
    for call in calls:
        with pytest.raises(ValueError) as want:
            call(ref, x, p, s)
        with pytest.raises(ValueError) as got:
            call(qt, xc, pc, sc)
        assert str(got.value) == str(want.value)
    torch.cuda.synchronize()
    assert float(torch.ones(4, device="cuda").sum()) == 4.0


def test_hadamard_rotation_on_cuda_matches_float64():
    """qgZ's Hadamard smoothing (an fp32 GEMM per block, no TF32) on CUDA against the float64 product with the
    same fp32 matrix; and the inverse. Bound: fp32 accumulation of B products, (B + 2) 2**-24 sum |x_i m_ij|."""
    from kernels import hadamard

    block = 128
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(5))
    x[3] = 300.0  # an outlier, what the rotation is for
    m = hadamard._matrix(block, "cpu", None).double()
    xb = x.double().view(-1, block)
    bound = (block + 2) * 2.0 ** -24 * (xb.abs() @ m.abs())
    got = hadamard.rotate(x.cuda(), block)
    err = (got.cpu().double().view(-1, block) - xb @ m).abs()
    assert (err <= bound).all(), float((err / bound).max())
    back = hadamard.unrotate(got, block).cpu().double().view(-1, block)
    yb = got.cpu().double().view(-1, block)
    err = (back - yb @ m.t()).abs()
    assert (err <= (block + 2) * 2.0 ** -24 * (yb.abs() @ m.t().abs())).all()
    assert float((back - xb).abs().max()) <= 1e-4 * 300.0
