"""parallel/cpu_gemm.py: 16-bit CPU GEMMs computed in fp32 and rounded once, against float64 references."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each value of ``t`` (float64)."""
    mant = {torch.bfloat16: 8, torch.float16: 11}[dtype]
    tiny = torch.finfo(dtype).tiny
    return torch.exp2(torch.floor(torch.log2(t.abs().clamp_min(tiny))) - (mant - 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_upcast_linear_is_the_float64_product_rounded_once(monkeypatch, dtype, bias):
    """Forward and both backward products (and the bias gradient) within one rounding of the float64 result:
    the fp32 accumulation error is far below half an ulp of a 16-bit value, so at most one ulp apart.
    3-D input (batch, sequence, features) as the model's linears see it."""
    from parallel import cpu_gemm

    monkeypatch.setenv("GPT_CPU_GEMM", "fp32")
    cpu_gemm.upcasts.cache_clear()
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 37, 48, generator=g).to(dtype).requires_grad_()
        w = (torch.randn(56, 48, generator=g) / 7).to(dtype).requires_grad_()
        b = torch.randn(56, generator=g).to(dtype).requires_grad_() if bias else None
        gy = torch.randn(2, 37, 56, generator=g).to(dtype)
        y = cpu_gemm.linear(x, w, b)
        y.backward(gy)
        assert y.dtype == x.grad.dtype == w.grad.dtype == dtype
        x64, w64, g64 = x.detach().double(), w.detach().double(), gy.double()
        want = {"y": x64 @ w64.t() + (b.detach().double() if bias else 0), "dx": g64 @ w64,
                "dw": g64.reshape(-1, 56).t() @ x64.reshape(-1, 48)}
        got = {"y": y, "dx": x.grad, "dw": w.grad}
        if bias:
            want["db"], got["db"] = g64.reshape(-1, 56).sum(0), b.grad
        for k in want:
            err = (got[k].double() - want[k]).abs()
            assert (err <= _ulp(want[k], dtype)).all(), (k, float((err / _ulp(want[k], dtype)).max()))
    finally:
        cpu_gemm.upcasts.cache_clear()


def test_native_and_upcast_agree_and_the_switch(monkeypatch):
    """The native 16-bit kernel and the upcast path give the same products to a 16-bit rounding; the mode
    is read from GPT_CPU_GEMM (a bad value is an error naming it); fp32 inputs never change path."""
    from parallel import cpu_gemm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=g).bfloat16()
    w = torch.randn(24, 32, generator=g).bfloat16()
    try:
        monkeypatch.setenv("GPT_CPU_GEMM", "native")
        cpu_gemm.upcasts.cache_clear()
        assert not cpu_gemm.upcasts(torch.bfloat16)
        native = cpu_gemm.linear(x, w)
        assert torch.equal(native, F.linear(x, w))
        monkeypatch.setenv("GPT_CPU_GEMM", "fp32")
        cpu_gemm.upcasts.cache_clear()
        assert cpu_gemm.upcasts(torch.bfloat16) and not cpu_gemm.upcasts(torch.float32)
        up = cpu_gemm.linear(x, w)
        assert torch.allclose(up.float(), native.float(), rtol=2 ** -7, atol=1e-2)
        monkeypatch.setenv("GPT_CPU_GEMM", "fast")
        cpu_gemm.upcasts.cache_clear()
        with pytest.raises(ValueError, match="GPT_CPU_GEMM must be auto, fp32 or native, got 'fast'"):
            cpu_gemm.linear(x, w)
    finally:
        cpu_gemm.upcasts.cache_clear()


def test_auto_follows_the_cpu_flags(monkeypatch):
    """auto: upcast on an AVX2 CPU without AVX512-BF16/AMX-BF16 (per dtype), never where the flags are unknown."""
    from parallel import cpu_gemm

    monkeypatch.setenv("GPT_CPU_GEMM", "auto")
    cases = [({"avx2", "fma"}, True, True), ({"avx2", "avx512_bf16"}, False, True),
             ({"avx2", "amx_bf16", "amx_fp16"}, False, False), (None, False, False)]
    try:
        for flags, bf16, fp16 in cases:
            monkeypatch.setattr(cpu_gemm, "_cpu_flags", lambda f=flags: None if f is None else frozenset(f))
            cpu_gemm.upcasts.cache_clear()
            assert (cpu_gemm.upcasts(torch.bfloat16), cpu_gemm.upcasts(torch.float16)) == (bf16, fp16), flags
    finally:
        cpu_gemm.upcasts.cache_clear()


def test_under_autocast_the_gemm_runs_in_fp32_on_the_autocast_rounded_operands(monkeypatch):
    """The trainer runs bf16 under CPU autocast (stage 0 keeps fp32 parameters; stage 3 bf16 ones). The
    operands are rounded to bf16 as autocast would, then multiplied in fp32 with autocast off: left on, it
    cast the fp32 upcasts straight back to bf16 and the slow kernel ran anyway (a bf16 DP step took 5.7 s
    instead of 0.6 s). Gradients reach fp32 parameters in fp32."""
    from parallel import cpu_gemm

    seen = []
    real = F.linear

    def spy(*args):
        seen.append((tuple(a.dtype for a in args if a is not None), torch.is_autocast_enabled("cpu")))
        return real(*args)

    monkeypatch.setenv("GPT_CPU_GEMM", "fp32")
    monkeypatch.setattr(cpu_gemm.F, "linear", spy)
    cpu_gemm.upcasts.cache_clear()
    try:
        g = torch.Generator().manual_seed(2)
        for x_dtype in (torch.float32, torch.bfloat16):  # the residual stream may already be bf16
            x = torch.randn(3, 40, 32, generator=g).to(x_dtype).requires_grad_()
            w = torch.randn(24, 32, generator=g).requires_grad_()  # an fp32 parameter
            b = torch.randn(24, generator=g).requires_grad_()
            seen.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = cpu_gemm.linear(x, w, b)
            assert seen == [((torch.float32,) * 3, False)], seen
            assert y.dtype == torch.bfloat16
            want = x.detach().bfloat16().double() @ w.detach().bfloat16().double().t() + b.detach().bfloat16().double()
            err = (y.double() - want).abs()
            assert (err <= _ulp(want, torch.bfloat16)).all()
            y.float().sum().backward()
            assert w.grad.dtype == b.grad.dtype == torch.float32 and x.grad.dtype == x_dtype
            assert torch.allclose(b.grad, torch.full_like(b, 120.0))
    finally:
        cpu_gemm.upcasts.cache_clear()


@pytest.mark.parametrize("under_autocast", [False, True])
def test_upcast_attention_is_the_float64_attention_rounded_once(monkeypatch, under_autocast):
    """Causal attention on bf16 operands (GQA too): the output within one bf16 rounding (plus the fp32 kernel's
    own error) of the float64 softmax(q k^T / sqrt(d)) v of the same operands; the kernel saw fp32 with
    autocast off; gradients come back in the operands' dtype."""
    from parallel import cpu_gemm

    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((tuple(a.dtype for a in args), torch.is_autocast_enabled("cpu")))
        return real(*args, **kwargs)

    monkeypatch.setenv("GPT_CPU_GEMM", "fp32")
    monkeypatch.setattr(cpu_gemm.F, "scaled_dot_product_attention", spy)
    cpu_gemm.upcasts.cache_clear()
    try:
        g = torch.Generator().manual_seed(4)
        q = torch.randn(2, 4, 33, 16, generator=g).bfloat16().requires_grad_()
        k = torch.randn(2, 2, 33, 16, generator=g).bfloat16().requires_grad_()
        v = torch.randn(2, 2, 33, 16, generator=g).bfloat16().requires_grad_()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if under_autocast else torch.autocast("cpu", enabled=False)
        with ctx:
            o = cpu_gemm.attention(q, k, v, is_causal=True, enable_gqa=True)
        assert seen == [((torch.float32,) * 3, False)] and o.dtype == torch.bfloat16
        q64, k64, v64 = (t.detach().double().repeat_interleave(r, 1) for t, r in ((q, 1), (k, 2), (v, 2)))
        s = q64 @ k64.transpose(-1, -2) / 4.0
        s = s.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
        want = s.softmax(-1) @ v64
        err = (o.double() - want).abs()
        assert (err <= _ulp(want, torch.bfloat16) + 1e-5).all(), float(err.max())
        o.float().sum().backward()
        assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16
        assert torch.isfinite(q.grad.float()).all() and k.grad.float().abs().sum() > 0
    finally:
        cpu_gemm.upcasts.cache_clear()
