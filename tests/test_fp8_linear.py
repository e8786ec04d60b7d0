"""Tests for fp8/linear.py and the FP8 path of parallel/tensor_parallel.py's linear layers.

Reference: the test re-quantizes x, W and the output gradient dy by hand (``cast(v * s)`` saturating, E4M3
for x and W, E5M2 for dy, or E4M3 with ``fp8.gradient_format=e4m3``) with the scales the layer used,
dequantizes them to float64 and does every matmul in float64 on the FULL tensors, then takes this
rank's slice the way tests/test_tensor_parallel.py does (column: weight rows; row: weight columns; SP: a
rank holds rows ``rank*s/tp ..`` of dim 0). The scales themselves are checked against
``max(format) / amax(full tensor)``, computed here from the full tensors (every TP rank must use the scale
of the whole logical tensor).

Tolerance, elementwise, with ``P = |a|·|b|`` (the float64 matmul of the absolute dequantized operands,
``+|bias|`` where a bias is added) and K the reduction length of the GEMM:

    |actual - reference| <= (K + 9) · 2**-23 · P  +  u · |reference|      (+ 2 u · P when emulating in bf16)

``(K + 8) · 2**-23 · P`` covers fp32 accumulation of K exact FP8 products and the rounding of each
dequantized operand (``q · (1/s)``: reciprocal and product rounded, 2 ulp); one more ``2**-23 · P`` covers
the fp32 TP reduction of partial outputs (TP runs are fp32); ``u · |reference|`` is the final rounding to
the output dtype (u = 2**-24 fp32, 2**-8 bf16). Emulation in bf16 dequantizes each operand to bf16 first
(one bf16 rounding each: ``2 u · P``). The forward output is rounded twice, the GEMM result and then
the sum with the bias, so its last term is ``u · (|reference| + P)``. For fp32 this is ~1e-5 relative
while the FP8 quantization error itself is ~2**-4, so a wrong format, scale or operand fails. The bias
gradient (not a GEMM, a sum of the unquantized dy) is checked the same way with ``P = Σ|dy|``.
"""
from __future__ import annotations

from typing import Dict

import pytest
import torch

from tests.dist_harness import run_world

S, B, IN, OUT = 8, 2, 32, 16  # s and every split dim divisible by 2
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMT_MAX = {E4M3: 448.0, E5M2: 57344.0}
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _rand(seed: int, *shape, dtype=torch.float32) -> torch.Tensor:
    """Normal values, rounded to ``dtype`` and returned in float64 (exactly what the layer sees)."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return t.to(dtype).double()


def _group(rank: int = 0, size: int = 1, pg=None):
    from parallel.comm import Group, Ledger

    return Group(name="tp", pg=pg, ranks=list(range(size)), rank=rank, link="intra", ledger=Ledger())


def _sl(n: int, rank: int, size: int) -> slice:
    k = n // size
    return slice(rank * k, (rank + 1) * k)


def _deq(v: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 operand as the GEMM sees it, by hand: saturating cast of v*s, divided by s, in float64."""
    m = FMT_MAX[dtype]
    return (v.float() * s.float()).clamp(-m, m).to(dtype).double() / s.double()


def _hand_scale(v: torch.Tensor, dtype: torch.dtype) -> float:
    return FMT_MAX[dtype] / float(v.abs().max())


def _cfg(**kw):
    from config import Fp8Config

    return Fp8Config(**kw)


def _gemm_tol(P: torch.Tensor, ref: torch.Tensor, K: int, out_dtype: torch.dtype, emulate: bool,
              acc_unit: float = 2.0 ** -23) -> torch.Tensor:
    """The tolerance of the module docstring (``acc_unit``: the accumulator's unit roundoff, 2**-23 for fp32;
    tests/gpu passes the coarser one of Hopper's FP8 tensor cores)."""
    u = UNIT[out_dtype]
    extra = 2 * u if (emulate and out_dtype != torch.float32) else 0.0
    # below 2**-14 fp16's rounding is absolute: half the spacing of its subnormals (bf16 and fp32: far below)
    subnormal = 2.0 ** -25 if out_dtype == torch.float16 else 0.0
    return ((K + 9) * acc_unit + extra) * P + u * ref.abs() + subnormal


def _case(group, label: str, kind: str, *, sp: bool = False, fused: int = 1, sp_fp8: bool = True,
          scaling: str = "current", emulate: bool = False, dtype: torch.dtype = torch.float32,
          grad_format: str = "e5m2", dims: tuple = (S, B, IN, OUT), device: str = "cpu",
          acc_unit: float = 2.0 ** -23) -> Dict[str, tuple]:
    """One layer, forward and backward; returns name -> (actual, reference, tolerance) and the scale checks.

    ``dims`` = (s, b, in, out); ``device``: where the layer runs (the float64 reference is on CPU);
    ``acc_unit``: see ``_gemm_tol``."""
    from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    S, B, IN, OUT = dims  # noqa: N806 - the module's names, for other shapes
    r, g = group.rank, group.size
    cfg = _cfg(scaling=scaling, emulate=emulate, sequence_parallel_fp8=sp_fp8, gradient_format=grad_format)
    G = {"e5m2": E5M2, "e4m3": E4M3}[grad_format]
    column = kind == "column"
    lead = (fused,) if fused > 1 else ()
    W = _rand(1, *lead, OUT, IN, dtype=dtype)
    b = _rand(2, *lead, OUT, dtype=dtype)
    x = _rand(3, S, B, IN, dtype=dtype)
    R = _rand(4, S, B, fused * OUT, dtype=dtype) * 1e-3  # the output gradient; a power-of-two factor would do too
    R = R.to(dtype).double()
    seq = _sl(S, r, g) if sp else slice(None)
    if column:
        cols = _sl(OUT, r, g)
        layer = ColumnParallelLinear(IN, OUT, group, sequence_parallel=sp, bias=True, fused=fused, fp8=cfg)
        shard_w, shard_b = W[..., cols, :], b[..., cols]
        xin = x[seq]
        # output: the whole sequence (gathered under SP), this rank's columns of each fused matrix
        take_out = lambda full: full.view(S, B, fused, OUT)[..., cols].reshape(S, B, -1)  # noqa: E731
        take_dx = lambda full: full[seq]  # noqa: E731
        take_dw = lambda full: full.view(*lead, OUT, IN)[..., cols, :]  # noqa: E731
        take_db = lambda full: full.view(*lead, OUT)[..., cols]  # noqa: E731
        grad_out = take_out(R)
    else:
        feats = _sl(IN, r, g)
        layer = RowParallelLinear(IN, OUT, group, sequence_parallel=sp, bias=True, fp8=cfg)
        shard_w, shard_b = W[:, feats], b
        xin = x[..., feats]
        take_out = lambda full: full[seq]  # noqa: E731
        take_dx = lambda full: full[..., feats]  # noqa: E731
        take_dw = lambda full: full[:, feats]  # noqa: E731
        take_db = lambda full: full
        grad_out = R[seq]
    layer = layer.to(device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(shard_w)
        layer.bias.copy_(shard_b)
    xl = xin.to(device=device, dtype=dtype).clone().requires_grad_()
    y = layer(xl)
    y.backward(grad_out.to(device=device, dtype=y.dtype))
    st = layer.fp8_states
    si, sw, sg = st.input.scale.cpu(), st.weight.scale.cpu(), st.grad.scale.cpu()
    y, xl_grad = y.detach().cpu(), xl.grad.cpu()
    w_grad, b_grad = layer.weight.grad.cpu(), layer.bias.grad.cpu()
    # the scales used are those of the full tensors (TP-reduced amax), whatever this rank holds
    scales = {"input": (float(si), _hand_scale(x, E4M3)), "weight": (float(sw), _hand_scale(W, E4M3)),
              "grad": (float(sg), _hand_scale(R, G))}
    # float64 reference on the full, hand-quantized operands
    xq, wq, gq = _deq(x, si, E4M3), _deq(W, sw, E4M3).reshape(-1, IN), _deq(R, sg, G)
    bias = b.reshape(-1)
    y_ref = xq @ wq.t() + bias
    P_y = xq.abs() @ wq.abs().t() + bias.abs()
    dx_ref, P_dx = gq @ wq, gq.abs() @ wq.abs()
    g2, x2 = gq.reshape(-1, gq.shape[-1]), xq.reshape(-1, IN)
    dw_ref, P_dw = g2.t() @ x2, g2.abs().t() @ x2.abs()
    full_db = R.reshape(-1, R.shape[-1]).sum(0)
    P_db = R.reshape(-1, R.shape[-1]).abs().sum(0)
    tag = f"{label}/{scaling},emulate={emulate},{str(dtype)[6:]},{grad_format}"
    acc = 2.0 ** -23 if emulate else acc_unit  # emulation multiplies in the compute dtype, accumulating in fp32
    res = {
        f"{tag}/out": (y.double(), take_out(y_ref),
                       _gemm_tol(take_out(P_y), take_out(y_ref.abs() + P_y), IN, dtype, emulate, acc)),
        f"{tag}/dx": (xl_grad.double(), take_dx(dx_ref),
                      _gemm_tol(take_dx(P_dx), take_dx(dx_ref), fused * OUT, dtype, emulate, acc)),
        f"{tag}/dW": (w_grad.double(), take_dw(dw_ref),
                      _gemm_tol(take_dw(P_dw), take_dw(dw_ref), S * B, dtype, emulate, acc)),
    }
    if column or not sp:
        res[f"{tag}/db"] = (b_grad.double(), take_db(full_db),
                            _gemm_tol(take_db(P_db), take_db(full_db), S * B, dtype, False))
    else:  # sequence-parallel row bias: each rank saw its sequence slice only (summed over TP by the trainer)
        part = R[seq].reshape(-1, OUT)
        res[f"{tag}/db"] = (b_grad.double(), part.sum(0),
                            _gemm_tol(part.abs().sum(0), part.sum(0), S * B, dtype, False))
    assert y.dtype == dtype and xl_grad.dtype == dtype and w_grad.dtype == dtype
    return {"checks": res, "scales": {f"{tag}/{k}": v for k, v in scales.items()}}


TP_MODES = {
    "column": dict(kind="column"),
    "column_sp_fp8_gather": dict(kind="column", sp=True),  # FP8 sequence-parallel gather
    "column_sp_bf16_gather": dict(kind="column", sp=True, sp_fp8=False),  # bf16 gather, then cast
    "column_fused3": dict(kind="column", fused=3),
    "column_fused2_sp": dict(kind="column", fused=2, sp=True),
    "row": dict(kind="row"),
    "row_sp": dict(kind="row", sp=True),
}


def _all_modes(group, modes: dict) -> dict:
    checks, scales = {}, {}
    for label, mode in modes.items():
        for scaling in ("current", "delayed"):
            for emulate in (False, True):
                out = _case(group, label, scaling=scaling, emulate=emulate, **mode)
                checks.update(out["checks"])
                scales.update(out["scales"])
    return {"checks": checks, "scales": scales}


def _assert_results(res: dict, where: str) -> None:
    assert res["checks"] and res["scales"]
    for name, (actual, expected, tol) in res["checks"].items():
        assert actual.shape == expected.shape, f"{where} {name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        err = (actual - expected).abs()
        bad = err > tol
        assert not bad.any(), (f"{where} {name}: {int(bad.sum())} elements off, worst error {float(err.max()):.3g} "
                               f"(tolerance there {float(tol.flatten()[err.flatten().argmax()]):.3g})")
    for name, (used, hand) in res["scales"].items():
        assert abs(used - hand) <= 3e-7 * hand, f"{where} {name}: scale {used} != max/amax = {hand}"


# ---- single process ----------------------------------------------------------------------------------------

@pytest.fixture(params=["auto", "native"])
def cpu_fp8_gemm(request, monkeypatch):
    """Both CPU routes of the FP8 GEMM (fp8/linear.py): ``auto``, the fp32 GEMM of the widened FP8 operands
    (``torch._scaled_mm`` must not be called), and ``native``, ``torch._scaled_mm`` itself (it must be)."""
    import fp8.linear as fl

    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setenv("GPT_CPU_FP8_GEMM", request.param)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    fl.cpu_fp32.cache_clear()
    yield request.param
    fl.cpu_fp32.cache_clear()
    assert bool(calls) == (request.param == "native"), (request.param, len(calls))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_single_process_fp8_linear_matches_the_dequantized_float64_reference(dtype, cpu_fp8_gemm) -> None:
    """fp16: the layer under precision=fp8 with fp8.gemm=fp16 and fp8.emulate=true (FP8 numerics around a V100's
    fp16 GEMMs), and the FP8 product returned in fp16."""
    res = {"checks": {}, "scales": {}}
    for label, mode in (("column", dict(kind="column")), ("column_fused2", dict(kind="column", fused=2)),
                        ("row", dict(kind="row"))):
        for scaling in ("current", "delayed"):
            for emulate in (False, True):
                out = _case(_group(), label, scaling=scaling, emulate=emulate, dtype=dtype, **mode)
                res["checks"].update(out["checks"])
                res["scales"].update(out["scales"])
    # fp8.gradient_format=e4m3: the output gradient in E4M3 instead of E5M2
    for emulate in (False, True):
        out = _case(_group(), "column_e4m3_grad", kind="column", emulate=emulate, dtype=dtype, grad_format="e4m3")
        res["checks"].update(out["checks"])
        res["scales"].update(out["scales"])
    _assert_results(res, "tp1")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_fp32_route_equals_scaled_mm_up_to_summation_order(out_dtype, monkeypatch) -> None:
    """The CPU route (fp32 GEMM of the widened FP8 operands, then both dequantizing scales) against
    ``torch._scaled_mm`` on the same bytes, at the layer's operand layouts (a transposed view as the first
    operand, as dW's GEMM passes it), both formats, shapes that are not multiples of 16. Both sum exact
    products in fp32, so they may differ by the summation order only: ``2 K 2**-24 P`` (P: the product of the
    absolute dequantized operands), plus one rounding of the output dtype each."""
    import fp8.linear as fl

    monkeypatch.delenv("GPT_CPU_FP8_GEMM", raising=False)
    fl.cpu_fp32.cache_clear()
    assert fl.cpu_fp32()
    g = torch.Generator().manual_seed(11)
    for (m, k, n), fa, fb, transposed in (((7, 33, 5), E4M3, E4M3, False), ((48, 64, 40), E5M2, E4M3, False),
                                          ((24, 200, 16), E5M2, E4M3, True), ((1, 5, 1), E4M3, E4M3, False)):
        a = (torch.randn(k, m, generator=g) * 30).to(fa)
        a = a.t() if transposed else a.reshape(m, k)
        b = (torch.randn(k, n, generator=g) * 30).to(fb)
        sa, sb = torch.tensor(3.7), torch.tensor(0.019)
        ours = fl._mm(a, sa, b, sb, out_dtype, emulate=False)
        native = torch._scaled_mm(a.contiguous(), fl._col_major(b), scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                                  out_dtype=out_dtype)
        assert ours.dtype == native.dtype == out_dtype and ours.shape == native.shape == (m, n)
        ref = (a.double() @ b.double()) / (3.7 * 0.019)
        P = (a.double().abs() @ b.double().abs()) / (3.7 * 0.019)
        u = UNIT[out_dtype]
        tol = 2 * k * 2.0 ** -24 * P + 2 * u * ref.abs()
        err = (ours.double() - native.double()).abs()
        assert (err <= tol).all(), (m, k, n, float(err.max()))
        # and both are the float64 product up to fp32 accumulation and the output rounding
        assert ((ours.double() - ref).abs() <= (k + 2) * 2.0 ** -23 * P + u * ref.abs()).all(), (m, k, n)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cpu_widening_is_exact_for_every_fp8_code(fmt) -> None:
    """fp8/linear.py's fast widening against torch's own conversion, on all 256 bytes of the format (zeros,
    subnormals, the largest values, NaN), stored transposed as the backward passes them."""
    from fp8.linear import _widen

    codes = torch.arange(256, dtype=torch.uint8).view(fmt).reshape(16, 16).t()
    w, k = _widen(codes)
    assert w.dtype == torch.float32 and k in (1.0, 256.0)
    ref = codes.float()
    assert torch.equal(torch.isnan(w), torch.isnan(ref)) and int(torch.isnan(ref).sum()) > 0
    finite = ~torch.isnan(ref)
    assert torch.equal(w[finite] * k, ref[finite])


def test_cpu_fp8_gemm_switch_rejects_an_unknown_mode(monkeypatch) -> None:
    import fp8.linear as fl

    monkeypatch.setenv("GPT_CPU_FP8_GEMM", "fast")
    fl.cpu_fp32.cache_clear()
    try:
        with pytest.raises(ValueError, match="GPT_CPU_FP8_GEMM must be one of auto, fp32, native, got 'fast'"):
            fl.cpu_fp32()
    finally:
        fl.cpu_fp32.cache_clear()


def test_fp8_linear_function_directly_and_its_scales() -> None:
    """fp8_linear itself: states' scales after the casts are the ones used; the output is not the bf16 one."""
    from fp8.linear import fp8_linear
    from fp8.scaling import Fp8States

    st = Fp8States(_cfg(scaling="delayed"))
    x = _rand(5, S, B, IN).float().requires_grad_()
    w = _rand(6, OUT, IN).float().requires_grad_()
    y = fp8_linear(x, w, None, st, _group(), sp_gather=False, emulate=False)
    dy = _rand(7, S, B, OUT).float()
    y.backward(dy)
    xq, wq = _deq(x.detach().double(), st.input.scale, E4M3), _deq(w.detach().double(), st.weight.scale, E4M3)
    gq = _deq(dy.double(), st.grad.scale, E5M2)
    g2, x2 = gq.reshape(-1, OUT), xq.reshape(-1, IN)
    for actual, a, b, K in ((y, xq, wq.t(), IN), (x.grad, gq, wq, OUT), (w.grad, g2.t(), x2, S * B)):
        # fp32 output: the bound of the module docstring, taken at its largest element
        atol = (K + 9) * 2.0 ** -23 * float((a.abs() @ b.abs()).max())
        torch.testing.assert_close(actual.detach().double(), a @ b, rtol=2.0 ** -24, atol=atol)
    # FP8 is really in the loop: far from the unquantized product
    exact = x.detach().double() @ w.detach().double().t()
    assert float((y.detach().double() - exact).abs().max()) > 1e-3
    # the state records the operands' amax for the next delayed update
    assert float(st.input.pending) == float(x.detach().abs().max())
    assert float(st.grad.pending) > 0


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cast_transpose_kernels_give_the_same_gradients(dtype, traced) -> None:
    """fp8.cast_transpose=true (the backward operands cast and transposed by kernels/fp8_transpose.py: on CPU its
    plain-torch path) against the default: the same output and the same input, weight and bias gradients, with
    delayed and current scaling; traced by torch.compile too (aot_eager) where train.compile would put it. The
    weight-gradient GEMM reads its operands from other layouts, so its sums may be grouped otherwise: within the
    fp32 accumulation bound, every other result bit for bit."""
    from fp8.linear import fp8_linear
    from fp8.scaling import Fp8States

    results = []
    for scaling in ("delayed", "current"):
        for on in (False, True):
            st = Fp8States(_cfg(scaling=scaling, cast_transpose=on))
            x = _rand(5, S, B, IN, dtype=dtype).requires_grad_()
            w = _rand(6, OUT, IN, dtype=dtype).requires_grad_()
            b = _rand(8, OUT, dtype=dtype).requires_grad_()

            def run(x, w, b, st=st):
                return fp8_linear(x, w, b, st, _group(), sp_gather=False, emulate=False)

            fn = torch.compile(run, backend="aot_eager") if traced else run
            y = fn(x, w, b)
            y.backward(_rand(7, S, B, OUT, dtype=dtype))
            results.append((scaling, on, y.detach(), x.grad, w.grad, b.grad, st.grad.pending.clone()))
    for i in (0, 2):
        off, on = results[i], results[i + 1]
        assert off[0] == on[0] and not off[1] and on[1]
        for k in (2, 3, 5, 6):  # y, dx, db, the recorded amax of dy
            assert torch.equal(off[k], on[k]), (off[0], k)
        K = S * B
        atol = (K + 9) * 2.0 ** -23 * float(off[4].abs().max()) * 4 + (2.0 ** -8 * float(off[4].abs().max())
                                                                      if dtype == torch.bfloat16 else 0.0)
        torch.testing.assert_close(on[4], off[4], rtol=2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20,
                                   atol=atol)


def test_te_backend_is_refused_by_the_layers() -> None:
    from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for cls in (ColumnParallelLinear, RowParallelLinear):
        with pytest.raises(NotImplementedError, match="fp8.backend=te is not implemented"):
            cls(IN, OUT, _group(), sequence_parallel=False, fp8=_cfg(backend="te"))
        assert cls(IN, OUT, _group(), sequence_parallel=False).fp8_states is None


def test_gpt_blocks_use_fp8_linears_and_train_close_to_bf16() -> None:
    """Wiring: attention qkv/proj and MLP up/down are FP8, embedding/norms (and the head unless asked) are not;
    an FP8 model's loss is within FP8 error of the same model without FP8, and its gradients are finite."""
    from config import load_config
    from fp8.scaling import is_fp8_linear
    from model.gpt import GPTChunk
    from model.init import init_parameters
    from model.layers import TPContext
    from parallel.random import RNGTracker

    mcfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=16",
                              "model.vocab_size=64", "model.ffn_hidden=64"]).model
    seq = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    losses = {}
    for name, fp8 in (("bf16", None), ("fp8", _cfg()), ("fp8_head", _cfg(output_head=True))):
        ctx = TPContext(_group(), False, RNGTracker(torch.device("cpu"), 1, 0, 0, 0), fp8=fp8)
        chunk = GPTChunk(mcfg, ctx, range(2), first=True, last=True)
        init_parameters(chunk, 1234, 0, 1)
        fp8_names = {n for n, m in chunk.named_modules() if is_fp8_linear(m)}
        if fp8 is None:
            assert fp8_names == set()
        else:
            want = {f"layers.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")}
            assert fp8_names == want | ({"head"} if fp8.output_head else set())
        loss = chunk(seq[:, :-1], seq[:, 1:])
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in chunk.parameters())
        if fp8 is not None:
            assert bool(chunk.layers["0"].mlp.down.fp8_states.grad.initialized)
        losses[name] = float(loss.detach())
    assert abs(losses["fp8"] - losses["bf16"]) < 0.02 * losses["bf16"]
    assert abs(losses["fp8_head"] - losses["bf16"]) < 0.02 * losses["bf16"]
    assert losses["fp8"] != losses["bf16"]


def test_activation_checkpointing_recomputes_the_same_fp8_casts() -> None:
    """Recomputation casts again with the same scales: gradients and scaling state bitwise as without it."""
    from config import load_config
    from fp8.scaling import Fp8Scaling
    from model.gpt import GPTChunk
    from model.init import init_parameters
    from model.layers import TPContext
    from parallel.random import RNGTracker

    seq = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    for scaling in ("delayed", "current"):
        runs = {}
        for ckpt in ("none", "full", "selective"):
            mcfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=16",
                                      "model.vocab_size=64", "model.ffn_hidden=64",
                                      f"model.activation_checkpointing={ckpt}"]).model
            cfg = _cfg(scaling=scaling)
            ctx = TPContext(_group(), False, RNGTracker(torch.device("cpu"), 1, 0, 0, 0), fp8=cfg)
            chunk = GPTChunk(mcfg, ctx, range(2), first=True, last=True)
            init_parameters(chunk, 1234, 0, 1)
            sc = Fp8Scaling(cfg, _group(), _group()).attach([chunk])
            for _ in range(2):  # the second step runs on updated delayed scales
                chunk.zero_grad()
                chunk(seq[:, :-1], seq[:, 1:]).backward()
                sc.update()
            runs[ckpt] = ({n: p.grad.clone() for n, p in chunk.named_parameters()}, sc.state_dict())
        for ckpt in ("full", "selective"):
            for i in range(2):
                for k, v in runs["none"][i].items():
                    assert torch.equal(runs[ckpt][i][k], v), (scaling, ckpt, k)


# ---- 2 TP ranks ----------------------------------------------------------------------------------------------

def _gather_bytes(group, fp8, sp_fp8: bool) -> int:
    """all_gather bytes on the TP ledger of one forward of a sequence-parallel column layer in bf16."""
    from parallel.tensor_parallel import ColumnParallelLinear

    cfg = None if fp8 is None else _cfg(sequence_parallel_fp8=sp_fp8)
    layer = ColumnParallelLinear(IN, OUT, group, sequence_parallel=True, bias=False, fp8=cfg).to(torch.bfloat16)
    x = _rand(9, S // group.size, B, IN).to(torch.bfloat16)
    group.ledger.reset()
    with torch.no_grad():
        layer(x)
    return sum(n for (kind, _, _), n in group.ledger.bytes.items() if kind == "all_gather")


def tp_worker() -> dict:
    import torch.distributed as dist

    group = _group(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
    out = _all_modes(group, TP_MODES)
    out["gather_bytes"] = {"bf16": _gather_bytes(group, None, True), "fp8": _gather_bytes(group, "fp8", True),
                           "fp8_no_sp_fp8": _gather_bytes(group, "fp8", False)}
    return out


@pytest.fixture(scope="module")
def tp_world():
    return run_world(tp_worker, 2, timeout=120)


@pytest.mark.parametrize("mode", list(TP_MODES))
def test_tp2_fp8_linear_matches_the_dequantized_float64_reference(tp_world, mode: str) -> None:
    prefix = mode + "/"
    for rank, res in enumerate(tp_world):
        sel = {"checks": {k: v for k, v in res["checks"].items() if k.startswith(prefix)},
               "scales": {k: v for k, v in res["scales"].items() if k.startswith(prefix)}}
        assert len(sel["checks"]) == 4 * 4, (prefix, list(res["checks"])[:4])  # 2 scalings x 2 emulate x 4 checks
        _assert_results(sel, f"tp2 rank{rank}")


def test_sequence_parallel_fp8_gather_moves_half_the_bytes_of_bf16(tp_world) -> None:
    g = 2
    for res in tp_world:
        b = res["gather_bytes"]
        assert b["bf16"] == (g - 1) * (S // g) * B * IN * 2
        assert b["fp8"] * 2 == b["bf16"]
        assert b["fp8_no_sp_fp8"] == b["bf16"]  # sequence_parallel_fp8=false gathers the bf16 input
