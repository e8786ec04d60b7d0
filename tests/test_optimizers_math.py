"""The per-tensor math of optimizers/: Adafactor and Muon against torch.optim's, 8-bit quantization and 8-bit AdamW
against float64 re-implementations written here from the documented rules (and against fp32 AdamW, loosely).

Tolerances and why:
  * Adafactor: bit for bit with torch.optim.Adafactor (same ops, same order).
  * Muon: each step's update within 3e-2 relative (Frobenius) of torch.optim.Muon's. Newton-Schulz runs in bf16
    (2**-8 = 3.9e-3 a rounding); on an AVX2 CPU our GEMMs are fp32 GEMMs of the bf16 values rounded once, which
    differ from torch's bf16 kernel in summation order: ~1e-4 of the roundings flip, and the iteration grows that
    to at most ~1.2% of the result (measured over 120 matrices, median 0). Newton-Schulz against float64
    arithmetic of the same iteration on the same bf16 input: 3e-2 (measured 1.4-1.8% for ours and torch's alike).
  * quant8: codes bit for bit with a float64 nearest-value rule; the round trip exact.
  * 8-bit AdamW against float64, one step from the same state, 12 steps: params within 1e-6 relative + 1e-5 * lr,
    codes equal except next to a midpoint (the fp32 and float64 moments differ by ~1e-7 relative).
  * 8-bit AdamW against fp32 AdamW, 10 steps: displacement within 5e-2 relative (Frobenius), 0.2 * lr * steps
    elementwise (measured over 5 seeds: 1.7-1.9% and 0.04-0.06): the moments carry an 8-bit error of up to half a
    code gap (0.35% of the block absmax near it, relatively more for elements far below it), so from step 2 each
    update differs by a few percent on some elements.
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction

import pytest
import torch

from optimizers import muon as muon_mod
from optimizers import quant8
from optimizers.adafactor import adafactor_state, adafactor_step
from optimizers.adamw8bit import adamw8bit_state, adamw8bit_step, dequantized_moments, load_moments
from optimizers.muon import muon_apply, muon_step, newton_schulz


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---- Adafactor -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adafactor_matches_torch_bit_for_bit(wd):
    gen = _gen()
    for shape, lr in (((16, 24), 0.01), ((7,), 0.01), ((24, 16), 0.3), ((2, 5, 6), 0.01)):
        p0 = torch.randn(shape, generator=gen)
        ours, ref = p0.clone(), torch.nn.Parameter(p0.clone())
        opt = torch.optim.Adafactor([ref], lr=lr, weight_decay=wd, foreach=False)
        state = adafactor_state(shape, torch.device("cpu"))
        for step in range(1, 13):
            g = torch.randn(shape, generator=gen) * (10.0 if step == 3 else 1.0)  # one step gets clipped
            ref.grad = g.clone()
            opt.step()
            adafactor_step(ours, g, state, step, lr, wd)
        assert torch.equal(ours, ref.detach()), shape
        assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in opt.state[ref].items() if k != "step"}
        for k, v in state.items():
            assert torch.equal(v, opt.state[ref][k]), (shape, k)


# ---- Muon ------------------------------------------------------------------------------------------------------
def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_torch(adjust, nesterov):
    gen = _gen(1)
    for shape in ((32, 48), (48, 32)):
        p0 = torch.randn(shape, generator=gen)
        ours, buf, ref = p0.clone(), torch.zeros(shape), torch.nn.Parameter(p0.clone())
        opt = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust)
        for _ in range(12):
            g = torch.randn(shape, generator=gen)
            before_ours, before_ref = ours.clone(), ref.detach().clone()
            ref.grad = g.clone()
            opt.step()
            muon_step(ours, g, buf, 0.02, 0.1, momentum=0.9, nesterov=nesterov, adjust=adjust)
            assert _rel(ours - before_ours, ref.detach() - before_ref) <= 3e-2
        assert torch.equal(buf, opt.state[ref]["momentum_buffer"])
        assert _rel(ours - p0, ref.detach() - p0) <= 3e-2


def _ns_float64(u, coefficients=muon_mod.COEFFICIENTS, steps=5, eps=1e-7):
    a, b, c = coefficients
    x = u.to(torch.bfloat16).double()
    x = x.T if u.size(0) > u.size(1) else x
    x = x / max(x.norm().item(), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if u.size(0) > u.size(1) else x


@pytest.mark.parametrize("emulate", [True, False])
def test_newton_schulz(monkeypatch, emulate):
    """Both CPU paths (fp32 GEMMs of bf16 values; torch's bf16 kernels) against torch's function and float64."""
    monkeypatch.setattr(muon_mod, "upcasts", lambda dtype: emulate)
    gen = _gen(2)
    for shape in ((32, 48), (48, 32), (40, 40)):
        u = torch.randn(shape, generator=gen).to(torch.bfloat16)
        u0 = u.clone()
        out = newton_schulz(u)
        assert torch.equal(u, u0) and out.dtype == torch.bfloat16 and out.shape == u.shape  # input untouched
        torch_out = torch.optim._muon._zeropower_via_newtonschulz(u, muon_mod.COEFFICIENTS, 5, 1e-7)
        assert _rel(out, torch_out) <= (0.0 if not emulate else 3e-2)  # the native path is torch's, op for op
        assert _rel(out, _ns_float64(u)) <= 3e-2


def test_muon_apply_on_pieces_uses_the_whole_shape():
    gen = _gen(3)
    p, o = torch.randn(48, 32, generator=gen), torch.randn(48, 32, generator=gen)
    whole = p.clone()
    muon_apply(whole, o, 0.02, 0.1, "match_rms_adamw", (48, 32))
    for dim in (0, 1):
        pieces = [x.clone() for x in p.chunk(2, dim)]
        for x, y in zip(pieces, o.chunk(2, dim)):
            muon_apply(x, y, 0.02, 0.1, "match_rms_adamw", (48, 32))
        assert torch.equal(torch.cat(pieces, dim), whole)


# ---- quant8 ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _map_float64(signed):
    """The documented construction in exact rationals, each value rounded to 20 significant bits."""
    vals = [Fraction(0), Fraction(1)]
    for i in range(7):
        n = 2 ** i if signed else 2 ** (i + 1)
        for k in range(n):
            v = Fraction(10) ** (i - 6) * (Fraction(1, 10) + Fraction(9, 10) * Fraction(2 * k + 1, 2 * n))
            vals += [v, -v] if signed else [v]
    vals.sort()
    if signed:
        vals[0] = Fraction(-1)
    exps = [math.frexp(float(v))[1] for v in vals]  # |v| = m * 2**e, m in [0.5, 1) (no value is near a power of 2)
    return torch.tensor([float(round(v * Fraction(2) ** (20 - e)) * Fraction(2) ** (e - 20)) for v, e in
                         zip(vals, exps)], dtype=torch.float64)


def _bnb_map(signed):
    """bitsandbytes' create_dynamic_map(signed) (max_exponent_bits=7, total_bits=8), verbatim in arithmetic."""
    data = []
    for i in range(7):
        n = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        b = torch.linspace(0.1, 1, n, dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist() + ((-(10 ** (-6 + i)) * means).tolist() if signed else [])
    return torch.tensor(sorted(data + [0, 1.0]), dtype=torch.float32)


@pytest.mark.parametrize("signed", [True, False])
def test_maps(signed):
    m = quant8.signed_map() if signed else quant8.unsigned_map()
    assert m.dtype == torch.float32 and m.shape == (256,) and bool((m[1:] > m[:-1]).all())
    assert 0.0 in m.tolist() and m[-1] == 1.0 and m[0] == (-1.0 if signed else 0.0)
    assert torch.equal(m.double(), _map_float64(signed))
    mids = (m.double()[:-1] + m.double()[1:]) / 2
    assert torch.equal(mids.float().double(), mids)  # every fp32 midpoint exact
    bnb = _bnb_map(signed)
    rel = ((m.double() - bnb.double()).abs() / bnb.double().abs().clamp(min=1e-30))[1 if signed else 0:]
    assert rel.max() <= 2.0 ** -20 and (not signed or bnb[0] > -0.9931)


def _quantize_float64(x, code_map, block, fp32_ratio=True):
    """The documented rule in float64: scale = representable absmax, flush below 2**-104, r = fp32(x / scale),
    nearest map value with ties to the larger. ``fp32_ratio`` False: r in float64, also returned."""
    m = code_map.double()
    flat = x.double().reshape(-1)
    nb = -(-flat.numel() // block)
    blocks = torch.nn.functional.pad(flat, (0, nb * block - flat.numel())).view(nb, block)
    scales = (blocks.abs() if m[0] < 0 else blocks.clamp(min=0)).amax(1)
    scales = torch.where(scales >= 2.0 ** -104, scales, 0.0)
    r = torch.where(scales[:, None] > 0, blocks / scales[:, None], 0.0)  # scale 0: the zero code
    r = r.float().double() if fp32_ratio else r
    dist = (r[..., None] - m).abs()
    codes = 255 - dist.flip(-1).argmin(-1)  # argmin takes the first: flipped, the largest value on a tie
    codes = codes.reshape(-1)[:flat.numel()].view(x.shape).to(torch.uint8)
    return (codes, scales.float()) if fp32_ratio else (codes, scales, r.reshape(-1)[:flat.numel()].view(x.shape))


def _adversarial(gen):
    q = quant8.signed_map()
    mids = (q[:-1] + q[1:]) / 2
    return [
        torch.randn(1000, generator=gen),  # ragged last block (1000 = 3 * 256 + 232)
        torch.randn(37, 11, generator=gen) * torch.exp(4 * torch.randn(37, 11, generator=gen)),  # heavy tails
        torch.zeros(300),
        torch.cat([torch.ones(1), mids, -mids, torch.zeros(2)]),  # exact ties at s = 1
        torch.cat([torch.full((3,), -7.5), torch.rand(200, generator=gen)]),  # negative absmax
        torch.cat([torch.full((1,), 2.0 ** -104), torch.rand(255, generator=gen) * 2.0 ** -104,  # at the threshold
                   torch.rand(256, generator=gen) * 2.0 ** -105,  # flushed
                   torch.full((1,), 3e38), torch.randn(255, generator=gen) * 1e37,  # near fp32 max
                   torch.full((1,), 1e-30), torch.rand(255, generator=gen) * 1e-38]),  # subnormal elements
    ]


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("block", [256, 64, 7])
def test_quantize_codes_and_round_trip(signed, block):
    code_map = quant8.map_on(signed, torch.device("cpu"))
    for x in _adversarial(_gen(4)):
        codes, scales = quant8.quantize(x, code_map, block)
        ref_codes, ref_scales = _quantize_float64(x, code_map, block)
        assert codes.shape == x.shape and scales.shape == (-(-x.numel() // block),)
        assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
        y = quant8.dequantize(codes, scales, code_map, block)
        codes2, scales2 = quant8.quantize(y, code_map, block)  # what a checkpoint load does
        assert torch.equal(codes2, codes) and torch.equal(scales2, scales)
        assert torch.equal(quant8.dequantize(codes2, scales2, code_map, block), y)
        if not signed:
            assert bool((y >= 0).all())


def test_ties_go_to_the_larger_value_and_zeros_stay_zero():
    code_map = quant8.map_on(True, torch.device("cpu"))
    x = torch.cat([torch.ones(1), (code_map[:-1] + code_map[1:]) / 2])
    codes, _ = quant8.quantize(x, code_map, 256)
    assert codes[1:].tolist() == list(range(1, 256))
    codes, scales = quant8.quantize(torch.zeros(2, 300), code_map, 256)
    assert scales.tolist() == [0.0, 0.0, 0.0] and bool((codes == 127).all()) and code_map[127] == 0
    y = quant8.dequantize(codes, scales, code_map, 256)
    assert bool((y == 0).all()) and not bool(torch.signbit(y).any())


def test_non_finite_propagates_to_the_whole_block():
    code_map = quant8.map_on(True, torch.device("cpu"))
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.randn(600, generator=_gen(5))
        x[300] = bad
        codes, scales = quant8.quantize(x, code_map, 256)
        assert math.isnan(scales[1]) and bool(torch.isfinite(scales[[0, 2]]).all())
        assert bool((codes[256:512] == 127).all())
        y = quant8.dequantize(codes, scales, code_map, 256)
        assert bool(y[256:512].isnan().all()) and bool(torch.isfinite(y[:256]).all() and torch.isfinite(y[512:]).all())
        codes2, scales2 = quant8.quantize(y, code_map, 256)
        assert torch.equal(codes2, codes) and torch.equal(scales2.nan_to_num(), scales.nan_to_num())
    with pytest.raises(ValueError):
        quant8.quantize(torch.zeros(4, dtype=torch.float64), code_map, 256)


# ---- 8-bit AdamW -----------------------------------------------------------------------------------------------
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _dequantize_float64(codes, scales, m, block):
    flat = m[codes.reshape(-1).long()]
    nb = scales.numel()
    out = torch.nn.functional.pad(flat, (0, nb * block - flat.numel())).view(nb, block) * scales.double()[:, None]
    return out.reshape(-1)[:codes.numel()].view(codes.shape)


def _adamw8bit_float64(p, g, state, step, block, lr, beta1, beta2, eps, weight_decay):
    """One step from ``state`` in float64: dequantize, torch.optim.AdamW's arithmetic, requantize (float64 ratios)."""
    sm, um = _map_float64(True), _map_float64(False)
    m = _dequantize_float64(state["exp_avg_codes"], state["exp_avg_scales"], sm, block)
    v = _dequantize_float64(state["exp_avg_sq_codes"], state["exp_avg_sq_scales"], um, block)
    p, g = p.double() * (1 - lr * weight_decay), g.double()
    m = m + (g - m) * (1 - beta1)
    v = v * beta2 + (1 - beta2) * g * g
    p = p - lr / (1 - beta1 ** step) * m / (v.sqrt() / math.sqrt(1 - beta2 ** step) + eps)
    return p, _quantize_float64(m, sm.float(), block, False), _quantize_float64(v, um.float(), block, False)


def _check_codes(codes, ref, code_map):
    """Codes equal to float64's except next to a midpoint (fp32 and float64 moments differ by ~1e-7 relative)."""
    ref_codes, ref_scales, r = ref
    bad = codes != ref_codes
    if bad.any():
        lo = torch.minimum(codes[bad], ref_codes[bad]).long()
        mid = (code_map.double()[lo] + code_map.double()[lo + 1]) / 2
        assert bool(((codes[bad].long() - ref_codes[bad].long()).abs() == 1).all())
        assert bool(((r[bad] - mid).abs() <= 1e-5 * mid.abs() + 1e-12).all())
    return int(bad.sum())


@pytest.mark.parametrize("shape,block", [((33, 50), 256), ((33, 50), 64), ((300,), 256)])
def test_adamw8bit_against_float64(shape, block):
    gen = _gen(6)
    p = torch.randn(shape, generator=gen)
    state = adamw8bit_state(shape, torch.device("cpu"), block)
    flips = 0
    for step in range(1, 13):
        g = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, generator=gen)).view(-1, *(1,) *
                                                                                                      (len(shape) - 1))
        ref_p, ref_m, ref_v = _adamw8bit_float64(p, g, state, step, block, **HP)
        adamw8bit_step(p, g, state, step, HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], block)
        assert torch.allclose(p.double(), ref_p, rtol=1e-6, atol=1e-5 * HP["lr"])
        for k, ref, signed in (("exp_avg", ref_m, True), ("exp_avg_sq", ref_v, False)):
            assert torch.allclose(state[k + "_scales"].double(), ref[1], rtol=1e-6, atol=0)
            flips += _check_codes(state[k + "_codes"], ref, quant8.map_on(signed, torch.device("cpu")))
    assert flips <= 1e-3 * 2 * 12 * p.numel()


def _run_fp32_and_8bit(shape, steps, gen, opt_cls=torch.optim.AdamW, **kw):
    p0 = torch.randn(shape, generator=gen)
    ours, ref = p0.clone(), torch.nn.Parameter(p0.clone())
    lr = 1e-3
    opt = opt_cls([ref], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, **kw)
    state = adamw8bit_state(shape, torch.device("cpu"), 256)
    for step in range(1, steps + 1):
        g = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, generator=gen))
        ref.grad = g.clone()
        opt.step()
        adamw8bit_step(ours, g, state, step, lr, 0.9, 0.999, 1e-8, 0.1, 256)
    return p0, ours, ref.detach(), lr, state


def test_adamw8bit_against_fp32_adamw_and_checkpoint_round_trip():
    p0, ours, ref, lr, state = _run_fp32_and_8bit((64, 96), 10, _gen(7), foreach=False)
    assert _rel(ours - p0, ref - p0) <= 5e-2
    assert (ours - ref).abs().max() <= 0.2 * lr * 10
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert nbytes == 64 * 96 * 2 + (64 * 96 // 256) * 8  # 2.03 bytes an element
    m, v = dequantized_moments(state, (64, 96), 256)
    fresh = adamw8bit_state((64, 96), torch.device("cpu"), 256)
    load_moments(fresh, m, v, 256)
    assert all(torch.equal(fresh[k], state[k]) for k in state)
    with pytest.raises(ValueError):
        load_moments(fresh, m, -v - 1, 256)
    with pytest.raises(ValueError):
        load_moments(fresh, m[:10], v[:10], 256)


def test_adamw8bit_against_torchao():
    pytest.importorskip("torchao")
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        from torchao.prototype.low_bit_optim import AdamW8bit
    # 64 x 64 = 4096 elements: torchao keeps smaller tensors in fp32; its maps differ from ours in one code
    p0, ours, ref, lr, _ = _run_fp32_and_8bit((64, 64), 10, _gen(8), AdamW8bit, block_size=256)
    assert _rel(ours - p0, ref - p0) <= 5e-2


# ---- 8-bit AdamW compiled (train.compile) -------------------------------------------------------------------
def _adamw8bit_step_with_python_floats(p, g, state, step, block, lr, beta1, beta2, eps, weight_decay):
    """The eager step as it was before its scalars became tensors (Python floats into the kernels): the bits the
    tensor-scalar update must keep."""
    maps = quant8.map_on(True, p.device), quant8.map_on(False, p.device)
    m, v = dequantized_moments(state, p.shape, block)
    if weight_decay:
        p.mul_(1.0 - lr * weight_decay)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / math.sqrt(1.0 - beta2 ** step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1.0 - beta1 ** step))
    for k, x, code_map in (("exp_avg", m, maps[0]), ("exp_avg_sq", v, maps[1])):
        codes, scales = quant8.quantize(x, code_map, block)
        state[k + "_codes"].copy_(codes)
        state[k + "_scales"].copy_(scales)


def _same_bits(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape,block", [((33, 50), 256), ((4, 512), 256)], ids=["ragged", "multi_block"])
def test_compiled_adamw8bit_update_is_the_eager_step(shape, block):
    """``adamw8bit_update`` as train.compile runs it (one graph, ``fullgraph``, static shapes; the ``aot_eager``
    backend runs the traced graph with torch's kernels: seconds on a CPU, no C++ build) against the eager step with
    Python-float scalars, over 7 steps with a changing learning rate, a decayed and an exempt tensor of the same
    shape and a NaN gradient at the last step: bit for bit (parameters, codes, scales), and one frame compiled
    for the shape (the step count, the learning rate and the decay are tensor values, not graph constants).
    ``(33, 50)``: 1650 elements, blocks of 256, the last one ragged (114); ``(4, 512)``: 8 whole blocks.

    Bit for bit, not within a tolerance: traced, the graph keeps ``lerp_``, ``addcmul_`` (no ``value``: dynamo
    rewrites an ``addcmul_`` with one into an fma of another product, 1 ulp from CPU's kernel) and the division
    order of ``addcdiv``, so aot_eager runs the eager kernels. Inductor generates its own kernels (fma contraction):
    there the scales and parameters are ~1 ulp apart (measured on CPU), which this test does not cover."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from optimizers.adamw8bit import adamw8bit_update, fill_step_scalars, moment_maps

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(adamw8bit_update, backend=counter, fullgraph=True, dynamic=False)
    gen, cpu = _gen(12), torch.device("cpu")
    hp = dict(beta1=0.9, beta2=0.95, eps=1e-8)
    runs = []  # (weight decay, reference param and state, eager, compiled)
    for wd in (0.1, 0.0):
        p = torch.randn(shape, generator=gen)
        runs.append((wd, *[(p.clone(), adamw8bit_state(shape, cpu, block)) for _ in range(3)]))
    scalars = torch.zeros(3)
    for step in range(1, 8):
        lr = 1e-2 * (0.5 + 0.1 * step)
        for wd, (ref_p, ref_s), (p, s), (cp, cs) in runs:
            g = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, generator=gen))
            if step == 7:
                g.view(-1)[block + 3] = float("nan")
            _adamw8bit_step_with_python_floats(ref_p, g, ref_s, step, block, lr, weight_decay=wd, **hp)
            adamw8bit_step(p, g, s, step, lr, hp["beta1"], hp["beta2"], hp["eps"], wd, block)
            compiled(cp, g, cs, fill_step_scalars(scalars, step, lr, hp["beta1"], hp["beta2"], wd), moment_maps(cpu),
                     hp["beta1"], hp["beta2"], hp["eps"], block)
            for got_p, got_s in ((p, s), (cp, cs)):
                _same_bits(got_p, ref_p)
                for k in ref_s:
                    _same_bits(got_s[k], ref_s[k])
        assert counter.frame_count == 1, f"step {step}: {counter.frame_count} frames compiled for one shape"
    assert bool(cs["exp_avg_scales"].isnan().any()) and not bool(cp.isnan().all())  # the NaN reached its block


def _compiled_trainer_worker(steps):
    """One process: the trainer with train.optimizer=adamw8bit eager, then compiled; losses of each."""
    from tests.parallel_utils import batch_fn, build_engine, tiny_config

    out = {}
    for flag in ("false", "true"):
        engine = build_engine(tiny_config("train.optimizer=adamw8bit", "precision=fp32", f"train.compile={flag}"))
        out[flag] = ([engine.train_step(batch_fn(engine, s))["loss"] for s in range(steps)], engine.dp.rules.compiled)
    return out


def test_compiled_adamw8bit_in_the_trainer_equals_eager():
    """train.compile=true (aot_eager: the trainer's compiled blocks and loss, and the 8-bit update compiled by
    optimizers/tensor_rules.py) against the eager run, 3 steps in one process: losses within 1e-5 relative
    (measured: equal). ~15 s on a 2-core CPU, mostly tracing."""
    from tests.dist_harness import run_world

    out = run_world(_compiled_trainer_worker, 1, 3, env={"GPT_COMPILE_BACKEND": "aot_eager"}, timeout=300)[0]
    (eager, eager_compiled), (comp, comp_compiled) = out["false"], out["true"]
    assert not eager_compiled and comp_compiled
    assert comp == pytest.approx(eager, rel=1e-5), (comp, eager)
