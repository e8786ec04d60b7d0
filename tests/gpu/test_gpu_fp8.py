"""FP8 linears on CUDA tensor cores against the float64 product of the same dequantized operands.

``tests/test_fp8_linear.py``'s ``_case`` builds the layer, runs forward and backward, and checks every
output (y, dx, dW, db) against float64 matmuls of the hand-quantized full operands and every scale
against max(format) / amax. Here the layer runs on CUDA (``torch._scaled_mm`` on Hopper's FP8 tensor
cores) in every TP mode one GPU can hold (column, fused column, row, and their sequence-parallel forms
at TP size 1), both scalings, fp32 and bf16, at the test's small shape and at transformer-sized ones.

Tolerance: the CPU tests' bound with the accumulator's unit roundoff raised from 2**-23 to
``HOPPER_ACC`` = 2**-13: Hopper's FP8 tensor cores add products inside one MMA chunk with about 14
significant bits before cuBLAS promotes the partial sums to fp32 (DeepSeek-V3 §3.3.2). That is still
far below the FP8 quantization error (2**-4 relative for E4M3), so a wrong format, scale or operand fails.
"""
from __future__ import annotations

import pytest
import torch

from tests.test_fp8_linear import TP_MODES, _assert_results, _case, _cfg, _group

HOPPER_ACC = 2.0 ** -13


def _run(modes, dims, dtype, emulations=(False, True)):
    res = {"checks": {}, "scales": {}}
    for label, mode in modes.items():
        for scaling in ("current", "delayed"):
            for emulate in emulations:
                out = _case(_group(), label, scaling=scaling, emulate=emulate, dtype=dtype, dims=dims,
                            device="cuda", acc_unit=HOPPER_ACC, **mode)
                res["checks"].update(out["checks"])
                res["scales"].update(out["scales"])
    return res


def _worst(res) -> float:
    """Largest error / tolerance over every checked element (printed: how much room the bound leaves)."""
    return max(float(((a - e).abs() / t.clamp_min(1e-300)).max()) for a, e, t in res["checks"].values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dims", [(8, 2, 32, 16), (512, 4, 1024, 3072), (2048, 1, 2048, 512)],
                         ids=["small", "1k", "2k"])
def test_fp8_linear_on_cuda_matches_the_dequantized_float64_reference(dims, dtype):
    small = dims[0] * dims[1] <= 16
    modes = TP_MODES if small else {k: TP_MODES[k] for k in ("column", "row")}  # float64 references cost
    res = _run(modes, dims, dtype, (False, True) if small else (False,))
    print(f"fp8 linear {dims} {dtype}: worst error / tolerance {_worst(res):.3f}")
    _assert_results(res, f"cuda {dims}")


def test_fp8_is_really_in_the_loop_on_cuda():
    """The CUDA output is the FP8 product, not the unquantized one (and not the emulated one bit for bit)."""
    from fp8.linear import fp8_linear
    from fp8.scaling import Fp8States

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 256, generator=g).cuda()
    w = torch.randn(128, 256, generator=g).cuda()
    y = fp8_linear(x, w, None, Fp8States(_cfg(scaling="current")), _group(), sp_gather=False, emulate=False)
    exact = x.double() @ w.double().t()
    rel = float((y.double() - exact).norm() / exact.norm())
    assert 1e-3 < rel < 0.1, rel   # E4M3 operands: a few percent, never exact


@pytest.mark.parametrize("tokens,inf,outf,bad", [(24, 64, 64, "tokens"), (32, 40, 64, "input features"),
                                                  (32, 64, 24, "output features")])
def test_shapes_not_multiple_of_16_are_a_clear_error_not_a_cuda_assert(tokens, inf, outf, bad):
    from fp8.linear import fp8_linear
    from fp8.scaling import Fp8States

    x = torch.randn(tokens, 1, inf, device="cuda")
    w = torch.randn(outf, inf, device="cuda")
    with pytest.raises(ValueError, match=f"divisible by 16: {bad}"):
        fp8_linear(x, w, None, Fp8States(_cfg()), _group(), sp_gather=False, emulate=False)
    # emulation has no shape rule and the device is still healthy
    y = fp8_linear(x, w, None, Fp8States(_cfg()), _group(), sp_gather=False, emulate=True)
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()


def test_fp8_gemm_path_of_this_gpu_follows_its_capability():
    """fp8.gemm=auto on the real device: FP8 GEMMs from 8.9, bf16 on 8.x, fp16 below; the 16-bit ones forced."""
    from config import Fp8Config
    from fp8.device import resolve_gemm

    cap = torch.cuda.get_device_capability()
    want = "fp8" if cap >= (8, 9) else "bf16" if cap >= (8, 0) else "fp16"
    gemm, why = resolve_gemm(torch.device("cuda"), Fp8Config())
    assert gemm == want and f"{cap[0]}.{cap[1]}" in why, (gemm, why)
    for forced in ("bf16", "fp16"):
        assert resolve_gemm(torch.device("cuda"), Fp8Config(gemm=forced))[0] == forced


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(8192, 8192), (8192, 2048), (2048, 6144), (100, 3000), (3, 5)])
def test_cast_transpose_kernels_on_cuda_are_the_reference(shape, dtype, fmt):
    """kernels/fp8_transpose.py's Triton kernels on CUDA (the GPU's own fp32 -> FP8 conversion) against the
    plain-torch reference on CPU, byte for byte (a NaN only has to be a NaN), at gpt_1.3b's operand shapes and
    ragged ones, with the special values of tests/test_fp8_transpose.py."""
    from kernels.fp8_transpose import cast_transpose, reference_cast_transpose, transpose
    from tests.test_fp8_transpose import _bytes_equal, _special

    if shape == (8192, 8192) and dtype == torch.float32:
        pytest.skip("the largest shape in bf16 only (training's dtype; the CPU reference takes a while)")
    x = _special(fmt, dtype, *shape, seed=shape[0] + shape[1])
    for scale in (0.75, 2.0 ** 10):  # 0.75: the product rounds in fp32
        s = torch.tensor(scale)
        q, qt = cast_transpose(x.cuda(), s.cuda(), fmt)
        want_q, want_qt = reference_cast_transpose(x, s, fmt)
        _bytes_equal(q.cpu(), want_q)
        _bytes_equal(qt.cpu(), want_qt)
        # the transpose moves q's bytes, NaNs as they are (a NaN's sign is the conversion's choice: from bf16 NaNs
        # the CPU reference writes 0xFF where the GPU writes 0x7F, which _bytes_equal accepts; seen on an H200)
        assert torch.equal(transpose(q).cpu().view(torch.uint8), q.cpu().view(torch.uint8).t())


def test_fp8_linear_with_cast_transpose_kernels_on_cuda():
    """fp8.cast_transpose=true on CUDA against the default: output and input/bias gradients bit for bit, the weight
    gradient within the FP8 GEMM's accumulation (its operands come from other layouts)."""
    from fp8.linear import fp8_linear
    from fp8.scaling import Fp8States

    g = torch.Generator().manual_seed(3)
    x0, w0, b0 = (torch.randn(*s, generator=g) for s in ((512, 4, 1024), (3072, 1024), (3072,)))
    dy = torch.randn(512, 4, 3072, generator=g).cuda().bfloat16()
    out = []
    for on in (False, True):
        x, w, b = (t.cuda().bfloat16().requires_grad_() for t in (x0, w0, b0))
        y = fp8_linear(x, w, b, Fp8States(_cfg(scaling="delayed", cast_transpose=on)), _group(), sp_gather=False,
                       emulate=False)
        y.backward(dy)
        out.append((y.detach(), x.grad, w.grad, b.grad))
    for k in (0, 1, 3):
        assert torch.equal(out[0][k], out[1][k]), k
    torch.testing.assert_close(out[1][2].float(), out[0][2].float(), rtol=2.0 ** -7,
                               atol=2.0 ** -7 * float(out[0][2].float().abs().max()))
