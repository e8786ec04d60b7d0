"""FP8-LM AdamW (fp8/adam.py): tracks torch's AdamW within the formats' error, resumes bitwise, 5-7 bytes.

Gradients: the torch reference model computes each step's gradient from its own parameters and the
very same tensors are given to the FP8 model. Feeding both one gradient sequence makes the difference
a property of the optimizer's storage formats alone; gradients taken at each model's own weights would
add the loss surface's sensitivity, which no format argument bounds.
"""
import copy
import io
import math

import pytest
import torch
from torch import nn

from fp8.adam import Fp8AdamW, adamw_update, init_state, master_value, state_nbytes
from fp8.format import E4M3, dequantize, quantize, scale_from_amax, amax

STEPS, LR, BETAS, WD = 30, 1e-2, (0.9, 0.95), 0.1
P_MAX = 0.5
"""Bound on |param| along the trajectory (asserted), for the FP16 master's rounding term."""


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _groups(model, wd=WD):
    """Weight decay on weights only (biases exempt), as training/optim.py does."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": wd},
            {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0}]


def _grads(seed=100, steps=STEPS):
    """A fixed batch sequence for a linear-regression target."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 32, generator=g)
    xs = [torch.randn(16, 32, generator=g) for _ in range(steps)]
    return [(x, x @ w) for x in xs]


def _backward(model, batch):
    model.zero_grad(set_to_none=True)
    x, y = batch
    ((model(x) - y) ** 2).mean().backward()


def _follow(master_dtype, emulate_state_rounding=False, seed=0):
    """Step torch's AdamW (single-tensor) and Fp8AdamW side by side on the reference's gradients.

    With ``emulate_state_rounding`` the reference's exp_avg / exp_avg_sq are replaced after each step
    by their E4M3 / scaled-FP16 round trips (same scale rules): torch's arithmetic, Fp8AdamW's storage."""
    ref = _mlp(seed)
    fp8 = copy.deepcopy(ref)
    start = [p.detach().clone() for p in ref.parameters()]
    opt_ref = torch.optim.AdamW(_groups(ref), lr=LR, betas=BETAS, foreach=False)
    opt = Fp8AdamW(_groups(fp8), lr=LR, betas=BETAS, master_dtype=master_dtype)
    for batch in _grads(100 + seed):
        _backward(ref, batch)
        for a, b in zip(ref.parameters(), fp8.parameters()):
            b.grad = a.grad.clone()
        opt_ref.step()
        opt.step()
        if emulate_state_rounding:
            for p in ref.parameters():
                st = opt_ref.state[p]
                for key, dtype in (("exp_avg", E4M3), ("exp_avg_sq", torch.float16)):
                    s = scale_from_amax(amax(st[key]), dtype, power_of_two=True)
                    st[key].copy_(dequantize(quantize(st[key], s, dtype), s))
    return ref, fp8, start, opt_ref, opt


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_follows_torch_adamw_within_the_formats_error():
    """Fp8AdamW (FP16 master) stays within the E4M3 first moment's error of torch.optim.AdamW.

    Bound, in units of ``lr`` (Adam moves an element by about lr a step, |m_hat / sqrt(v_hat)| <~ 1):
      * m: E4M3 keeps 3 mantissa bits, so each stored m is off by at most half an ulp, 2**-4 relative.
        A rounding made at step s is carried into every later step with weight beta1**k: in all,
        beta1 / (1 - beta1) = 9 steps' worth. Roundings of different steps are independent with zero
        mean, so over T steps they add like a random walk: sqrt(T). -> lr * 2**-4 * 9 * sqrt(T).
      * v: FP16, 2**-11 relative, 2**-12 after the square root: 2**7 times smaller than m's, ignored.
      * master: FP16, at most 2**-11 of |p| lost a step, random walk -> sqrt(T) * 2**-11 * max|p|.
    With T = 30, lr = 1e-2 and max|p| < 0.5 this is 3.08 lr + 0.13 lr = 3.21e-2 (an estimate of the
    typical size, not a worst case: roundings aligned on every step could reach T * 2**-4 * 9 = 17 lr).
    Measured (seeds 0-4, power-of-two m scale): 1.51-2.02 lr, ~5-7 % of the largest movement (~28 lr);
    an FP32 master changes this by < 2 % (the E4M3 m dominates).
    """
    ref, fp8, start, _, _ = _follow("fp16")
    max_p = max(p.abs().max().item() for p in ref.parameters())
    assert max_p < P_MAX
    bound = LR * (2 ** -4 * BETAS[0] / (1 - BETAS[0]) * math.sqrt(STEPS)) + math.sqrt(STEPS) * 2 ** -11 * P_MAX
    err = _max_diff(ref.parameters(), fp8.parameters())
    movement = _max_diff(ref.parameters(), start)
    assert movement > 10 * LR  # the parameters did move: the comparison is not vacuous
    assert err <= bound, (err, bound, err / movement)
    assert err > 0  # it is not secretly an fp32 optimizer
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in fp8.parameters())


def test_fp32_master_is_torch_adamw_bitwise_given_the_same_state_rounding():
    """The arithmetic is torch's: with an FP32 master, and the reference's m / v passed through the same
    E4M3 / FP16 round trips, Fp8AdamW equals torch.optim.AdamW bitwise for 30 steps.

    m and v depend on the gradients alone, so with an FP16 master they stay bitwise equal to the emulated
    reference's and the parameters differ only by the master's roundings: at most half an FP16 ulp,
    2**-11 |p|, at initialisation and at each of the T steps (weight decay only shrinks an old error):
    |dp| <= (T + 1) * 2**-11 * max|p| = 7.6e-3, a worst case (measured, seeds 0-4: 0.87-1.02e-3, the
    random-walk size sqrt(T) * 2**-11 * max|p|). Without emulating the m / v rounding both master dtypes
    deviate from torch alike, since the E4M3 m dominates (see the test above)."""
    for master_dtype in ("fp32", "fp16"):
        ref, fp8, _, opt_ref, opt = _follow(master_dtype, emulate_state_rounding=True)
        for a, b in zip(ref.parameters(), fp8.parameters()):
            st_ref, st = opt_ref.state[a], opt.state[b]
            assert torch.equal(st_ref["exp_avg"], dequantize(st["m"], st["m_scale"]))
            assert torch.equal(st_ref["exp_avg_sq"], dequantize(st["v"], st["v_scale"]))
        err = _max_diff(ref.parameters(), fp8.parameters())
        if master_dtype == "fp32":
            assert err == 0
        else:
            assert 0 < err <= (STEPS + 1) * 2 ** -11 * P_MAX, err


def _run(model, opt, batches):
    for batch in batches:
        _backward(model, batch)
        opt.step()


def _state_tensors(opt):
    return [(k, t) for p in (q for g in opt.param_groups for q in g["params"])
            for k, t in sorted(opt.state[p].items()) if torch.is_tensor(t)]


def test_resume_is_bitwise():
    """save -> torch.save/load -> fresh model and optimizer -> step equals never stopping, bitwise,
    for both master dtypes: parameters, every state tensor and scale, and the step count."""
    batches = _grads(7, steps=12)
    for master_dtype in ("fp16", "fp32"):
        model = _mlp(3)
        opt = Fp8AdamW(_groups(model), lr=LR, betas=BETAS, master_dtype=master_dtype)
        _run(model, opt, batches[:6])
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        _run(model, opt, batches[6:])  # uninterrupted

        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        resumed = _mlp(99)  # different initial weights: everything must come from the checkpoint
        resumed.load_state_dict(saved["model"])
        opt2 = Fp8AdamW(_groups(resumed), lr=0.5, betas=(0.5, 0.5), master_dtype=master_dtype)
        opt2.load_state_dict(saved["opt"])
        _run(resumed, opt2, batches[6:])

        for a, b in zip(model.parameters(), resumed.parameters()):
            assert torch.equal(a, b)
        s1, s2 = _state_tensors(opt), _state_tensors(opt2)
        assert [k for k, _ in s1] == [k for k, _ in s2] and len(s1) > 0
        for (k, a), (_, b) in zip(s1, s2):
            assert a.dtype == b.dtype and torch.equal(a, b), k
        assert all(opt2.state[p]["step"] == 12 for g in opt2.param_groups for p in g["params"])
        assert opt2.param_groups[0]["lr"] == LR and opt2.param_groups[0]["betas"] == BETAS


def test_state_dict_is_a_snapshot_and_load_checks_dtypes():
    model = _mlp(1)
    opt = Fp8AdamW(_groups(model), lr=LR, betas=BETAS)
    batches = _grads(5, steps=2)
    _run(model, opt, batches[:1])
    sd = opt.state_dict()
    before = sd["state"][0]["m"].clone()
    _run(model, opt, batches[1:])
    assert torch.equal(sd["state"][0]["m"].view(torch.uint8), before.view(torch.uint8))
    sd["state"][0]["m"] = sd["state"][0]["m"].float()  # what torch's own loader would have done
    try:
        Fp8AdamW(_groups(_mlp(1)), lr=LR).load_state_dict(sd)
    except ValueError as e:
        assert "m is torch.float32" in str(e)
    else:
        raise AssertionError("a cast state tensor was accepted")


def test_bytes_per_parameter():
    """State bytes measured from the tensors: 2 + 1 + 2 = 5 (FP16 master) and 4 + 1 + 2 = 7 (FP32
    master) a parameter, plus 4-byte scales: 3 per tensor (2 with an FP32 master)."""
    for master_dtype, per_param, scales in (("fp16", 5, 3), ("fp32", 7, 2)):
        model = _mlp(0)
        opt = Fp8AdamW(_groups(model), lr=LR, master_dtype=master_dtype)
        _run(model, opt, _grads(1, steps=1))
        params = [p for g in opt.param_groups for p in g["params"]]
        n = sum(p.numel() for p in params)
        total = sum(state_nbytes(opt.state[p]) for p in params)
        assert total == per_param * n + 4 * scales * len(params), (master_dtype, total, n)


def test_weight_decay_exemption():
    """Zero gradients: a decayed group shrinks by exactly (1 - lr*wd) a step (up to the FP16 master's
    rounding), a group with wd 0 does not move at all -- bitwise, every step (power-of-two scales:
    an unchanged element re-rounds to itself, no drift)."""
    for master_dtype in ("fp16", "fp32"):
        torch.manual_seed(0)
        init = torch.randn(8, 8).half().float()  # representable in FP16: the master holds it exactly
        decayed, exempt = nn.Parameter(init.clone()), nn.Parameter(init.clone())
        opt = Fp8AdamW([{"params": [decayed], "weight_decay": WD}, {"params": [exempt], "weight_decay": 0.0}],
                       lr=LR, betas=BETAS, master_dtype=master_dtype)
        for step in range(1, 21):
            decayed.grad, exempt.grad = torch.zeros_like(init), torch.zeros_like(init)
            opt.step()
            assert torch.equal(exempt, init), step
            expected = init * (1 - LR * WD) ** step
            tol = 0 if master_dtype == "fp32" else step * 2 ** -11
            assert torch.allclose(decayed, expected, rtol=tol + 1e-6, atol=0), step
        assert decayed.abs().sum() < exempt.abs().sum()


def test_zero_gradients_and_zero_tensors_make_no_nan():
    """A zero tensor with zero gradients, and a tensor whose gradient becomes zero: finite, scales kept."""
    zero = nn.Parameter(torch.zeros(4, 4))
    live = nn.Parameter(torch.randn(4, 4))
    opt = Fp8AdamW([zero, live], lr=LR, betas=BETAS, weight_decay=WD)
    for step in range(10):
        zero.grad = torch.zeros(4, 4)
        live.grad = torch.randn(4, 4) if step < 3 else torch.zeros(4, 4)
        opt.step()
        for p in (zero, live):
            st = opt.state[p]
            assert torch.isfinite(p).all()
            for k in ("master_scale", "m_scale", "v_scale"):
                assert torch.isfinite(st[k]) and st[k] > 0, k
    assert torch.equal(zero, torch.zeros(4, 4))
    assert opt.state[zero]["m_scale"] == 1 and opt.state[zero]["v_scale"] == 1


def test_update_in_place_on_views_of_flat_buffers():
    """How a strategy calls it: views into flat shard buffers and a vector of scales, written in place;
    the result equals the same update on standalone tensors."""
    torch.manual_seed(0)
    a, b = torch.randn(6, 5) * 0.1, torch.randn(7) * 0.01
    sa, sb = init_state(a, "fp16"), init_state(b, "fp16")
    flat = {k: torch.cat([sa[k].flatten(), sb[k].flatten()]) for k in ("master", "m", "v")}
    scales = {k: torch.stack([sa[k], sb[k]]) for k in ("master_scale", "m_scale", "v_scale")}
    hp = dict(lr=LR, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=WD)
    for step in range(1, 4):
        ga, gb = torch.randn(6, 5), torch.randn(7)
        for st, g in ((sa, ga), (sb, gb)):
            adamw_update(*(st[k] for k in ("master", "master_scale", "m", "m_scale", "v", "v_scale")), g,
                         step=step, **hp)
        for i, (g, sl) in enumerate(((ga, slice(0, 30)), (gb, slice(30, 37)))):
            view = lambda t: t[sl].view(g.shape)  # noqa: E731
            adamw_update(view(flat["master"]), scales["master_scale"][i], view(flat["m"]), scales["m_scale"][i],
                         view(flat["v"]), scales["v_scale"][i], g, step=step, **hp)
    for i, st in enumerate((sa, sb)):
        sl = slice(0, 30) if i == 0 else slice(30, 37)
        for k in ("master", "m", "v"):
            assert torch.equal(flat[k][sl].float(), st[k].flatten().float()), k
        for k in ("master_scale", "m_scale", "v_scale"):
            assert torch.equal(scales[k][i], st[k]), k
        assert torch.allclose(master_value(st["master"], st["master_scale"]), master_value(
            flat["master"][sl], scales["master_scale"][i]).view(st["master"].shape), rtol=0, atol=0)
    # power-of-two scales everywhere; E4M3's amax lands in (224, 448], FP16's in (32752, 65504]
    for k in ("master_scale", "m_scale", "v_scale"):
        assert torch.equal(torch.log2(sa[k]).round(), torch.log2(sa[k])), k
    assert 224 <= sa["m"].float().abs().max() <= 448
    assert 32752 <= sa["master"].float().abs().max() <= 65504


def test_rejects_bad_inputs():
    st = init_state(torch.ones(3), "fp16")
    args = [st[k] for k in ("master", "master_scale", "m", "m_scale", "v", "v_scale")]
    hp = dict(step=1, lr=LR, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    bad = [
        (args[:1] + [None] + args[2:], torch.ones(3)),                    # FP16 master without its scale
        (args[:2] + [args[2].float()] + args[3:], torch.ones(3)),         # m not E4M3
        (args, torch.ones(3, dtype=torch.float16)),                       # grad not fp32
        (args, torch.ones(4)),                                            # shape mismatch
    ]
    for a, g in bad:
        try:
            adamw_update(*a, g, **hp)
        except (TypeError, ValueError):
            continue
        raise AssertionError("accepted bad input")
    for kwargs in ({"eps": 0.0}, {"master_dtype": "bf16"}):
        try:
            Fp8AdamW([nn.Parameter(torch.ones(2))], **kwargs)
        except ValueError:
            continue
        raise AssertionError(f"accepted {kwargs}")


def test_parameter_refreshed_in_its_own_dtype():
    """A bf16 parameter stays bf16 and holds the master's value rounded to bf16 after each step."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(5, 5).bfloat16())
    opt = Fp8AdamW([p], lr=LR, betas=BETAS)
    for _ in range(3):
        p.grad = torch.randn(5, 5).bfloat16()
        opt.step()
        st = opt.state[p]
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, master_value(st["master"], st["master_scale"]).bfloat16())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("fused", [False, True], ids=["cpu_loops", "fused_kernels"])
@pytest.mark.parametrize("master_dtype", ["fp16", "fp32"])
def test_packed_update_is_the_per_tensor_update_bit_for_bit(master_dtype, fused):
    """adamw_update_packed (what fp8/zero.py runs: one update for a unit's tensors back to back) against the
    per-tensor adamw_update on each tensor: sizes around the SIMD widths (tails), an empty and an all-zero
    tensor, exempt and decayed tensors, gradients from tiny to large, a NaN gradient in one tensor. Both
    segment implementations (the CPU loops and the fused kernels CUDA uses) are run here on CPU."""
    from fp8.adam import adamw_update_packed
    from fp8.segments import Segments

    g = torch.Generator().manual_seed(7)
    sizes = [1, 7, 8, 9, 15, 16, 17, 31, 33, 0, 100, 1000, 4099]
    values = [torch.randn(n, generator=g) * 10.0 ** (i % 4 - 2) for i, n in enumerate(sizes)]
    values[2] = torch.zeros(8)
    states = [init_state(x, master_dtype) for x in values]
    wds = [WD if i % 3 else 0.0 for i in range(len(sizes))]
    flat = {k: torch.cat([st[k].reshape(-1) for st in states]) for k in ("master", "m", "v")}
    scales = {k: torch.stack([st[k] if st[k] is not None else torch.ones(()) for st in states])
              for k in ("master_scale", "m_scale", "v_scale")}
    lengths, decay = Segments(sizes, "cpu", fused=fused), torch.tensor(wds, dtype=torch.float64)
    hp = dict(lr=LR, beta1=0.9, beta2=0.95, eps=1e-8)
    for step in range(1, 6):
        grads = [torch.randn(n, generator=g) * 10.0 ** (step - 3) for n in sizes]
        if step == 4:
            grads[5][3] = float("nan")
        for st, gr, wd in zip(states, grads, wds):
            adamw_update(*(st[k] for k in ("master", "master_scale", "m", "m_scale", "v", "v_scale")), gr,
                         step=step, weight_decay=wd, **hp)
        adamw_update_packed(flat["master"], scales["master_scale"] if master_dtype == "fp16" else None, flat["m"],
                            scales["m_scale"], flat["v"], scales["v_scale"], torch.cat(grads), lengths, decay,
                            step=step, **hp)
        for k in ("master", "m", "v"):
            want = torch.cat([st[k].reshape(-1) for st in states])
            assert torch.equal(_bits(flat[k]), _bits(want)), (step, k)
        for k in ("m_scale", "v_scale") + (("master_scale",) if master_dtype == "fp16" else ()):
            assert torch.equal(scales[k], torch.stack([st[k] for st in states])), (step, k)
    assert torch.isnan(flat["m"].float()).any()  # the NaN reached the state, as in the per-tensor update


@pytest.mark.parametrize("search", [False, True], ids=["compares", "binary_search"])
def test_compiled_spread_is_the_fills_gather(search, monkeypatch):
    """Segments.spread traced (train.compile: each element's segment found, then a gather; inductor's code on
    this CPU) gives the eager fills' values: empty first, middle and last segments, fp32 and float64 values. Both
    ways of finding the segment: compares with the segment ends (up to SEARCH_ABOVE segments) and a binary
    search over them (above)."""
    from fp8 import segments as segments_module
    from fp8.segments import Segments

    monkeypatch.setattr(segments_module, "SEARCH_ABOVE", 0 if search else 64)
    torch._dynamo.reset()  # the compiled graphs below are traced under this setting

    lengths = [0, 3, 0, 1, 17, 0, 64, 5, 0]
    seg = Segments(lengths, "cpu")
    want_of = lambda v: torch.cat([x.expand(n) for x, n in zip(v, lengths)])  # noqa: E731
    spread = torch.compile(lambda v: seg.spread(v * 2), backend="inductor", fullgraph=True)
    for dtype in (torch.float32, torch.float64):
        values = torch.randn(len(lengths), dtype=dtype)
        assert torch.equal(spread(values), want_of(values * 2))
        assert torch.equal(seg.spread(values), want_of(values))  # eager: the fills


@pytest.mark.parametrize("master_dtype", ["fp16", "fp32"])
def test_compiled_packed_update_tracks_the_eager_one(master_dtype):
    """The packed AdamW as train.compile runs it (traced: the compiled spread's gathers; aot_eager runs the traced
    graph with torch's kernels) against the eager packed update, NaN gradient and empty tensor included. Not bit
    for bit: traced, ``addcmul_`` becomes an explicit fused multiply-add (torch's rewrite), 1 ulp from the CPU
    kernel in places, which a requantization can turn into one step of the stored format; a wrong per-tensor
    scale (a power of two) or a value read from another tensor is far outside that."""
    from fp8.adam import adamw_update_packed
    from fp8.format import dequantize
    from fp8.segments import Segments

    g = torch.Generator().manual_seed(11)
    sizes = [1, 9, 0, 33, 100, 4099]
    values = [torch.randn(n, generator=g) * 10.0 ** (i % 4 - 2) for i, n in enumerate(sizes)]
    states = [init_state(x, master_dtype) for x in values]
    flat = {k: torch.cat([st[k].reshape(-1) for st in states]) for k in ("master", "m", "v")}
    scales = {k: torch.stack([st[k] if st[k] is not None else torch.ones(()) for st in states])
              for k in ("master_scale", "m_scale", "v_scale")}
    twin = ({k: v.clone() for k, v in flat.items()}, {k: v.clone() for k, v in scales.items()})
    seg, decay = Segments(sizes, "cpu", fused=False), torch.tensor([WD, 0.0] * 3, dtype=torch.float64)
    compiled = torch.compile(adamw_update_packed, backend="aot_eager")
    lr = torch.tensor(LR, dtype=torch.float64)
    for step in range(1, 4):
        grad = torch.randn(sum(sizes), generator=g) * 10.0 ** (step - 2)
        if step == 2:
            grad[50] = float("nan")
        for fn, (f, s) in ((adamw_update_packed, (flat, scales)), (compiled, twin)):
            fn(f["master"], s["master_scale"] if master_dtype == "fp16" else None, f["m"], s["m_scale"], f["v"],
               s["v_scale"], grad, seg, decay, step=step, lr=lr, beta1=0.9, beta2=0.95, eps=1e-8)
        for k, scale_key, step_size in (("master", "master_scale", 2 ** -10), ("m", "m_scale", 2 ** -3),
                                        ("v", "v_scale", 2 ** -10)):
            per_element = torch.cat([s.expand(n) for s, n in zip(scales[scale_key], sizes)])
            twin_scale = torch.cat([s.expand(n) for s, n in zip(twin[1][scale_key], sizes)])
            if k == "master" and master_dtype == "fp32":
                per_element = twin_scale = torch.ones(())
                step_size = 2 ** -22
            want = dequantize(flat[k], per_element, torch.float64)
            got = dequantize(twin[0][k], twin_scale, torch.float64)
            # one step of the format relative to the value, or to the tensor's largest (a difference of two close
            # values, master - update, keeps the update's absolute error)
            atol = step_size * float(want.nan_to_num(0.0).abs().max())
            torch.testing.assert_close(got, want, rtol=step_size, atol=atol, equal_nan=True)
    assert torch.isnan(flat["m"].float()).any() and torch.isnan(twin[0]["m"].float()).any()


def _unit_state(sizes, master_dtype, seed):
    """A unit's packed FP8 state (flat master / m / v, [T] scales) from random initial values."""
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(n, generator=g) * 10.0 ** (i % 4 - 2) for i, n in enumerate(sizes)]
    states = [init_state(x, master_dtype) for x in values]
    flat = {k: torch.cat([st[k].reshape(-1) for st in states]) for k in ("master", "m", "v")}
    scales = {k: torch.stack([st[k] if st[k] is not None else torch.ones(()) for st in states])
              for k in ("master_scale", "m_scale", "v_scale")}
    return flat, scales


def _unit_args(state, master_dtype, grad8, grad_scales, factor, seg, decays, scalars):
    f, s = state
    return (grad8, grad_scales, factor, f["master"], s["master_scale"] if master_dtype == "fp16" else None, f["m"],
            s["m_scale"], f["v"], s["v_scale"], seg, decays, scalars)


@pytest.mark.parametrize("master_dtype", ["fp16", "fp32"])
def test_unit_update_with_its_scalars_made_is_the_packed_update_bit_for_bit(master_dtype):
    """fp8/zero.py's unit update (the step's scalars made by the caller once a step, fp32 device scalars) gives
    adamw_update_packed's bits with a tensor learning rate (the form whose parameter step is the same product; with
    a float it is addcdiv, whose rounding order differs) and so the per-tensor update's (tested above): master, m,
    v and every scale, over steps with a NaN gradient, an empty and an all-zero tensor, decayed and exempt ones."""
    from fp8.adam import adamw_update_packed, bias_corrections
    from fp8.format import E5M2
    from fp8.segments import Segments
    from fp8.zero_unit import dequantize_segments, unit_update

    sizes = [1, 9, 0, 8, 33, 100, 4099]
    seg = Segments(sizes, "cpu", fused=False)
    decays = torch.tensor([i % 2 == 0 for i in range(len(sizes))])
    one, ref = (_unit_state(sizes, master_dtype, 3) for _ in range(2))
    for st in (one, ref):  # the all-zero tensor (the 8 elements after the empty one)
        st[0]["master"][10:18] = 0
    g = torch.Generator().manual_seed(5)
    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-8)
    factor = torch.tensor(0.5)
    for step in range(1, 5):
        lr = LR * step / 4
        grad = torch.randn(sum(sizes), generator=g) * 10.0 ** (step - 3)
        if step == 3:
            grad[40] = float("nan")
        grad_scales = torch.full((len(sizes),), 2.0 ** (3 - step))
        grad8 = quantize(grad, grad_scales[0], E5M2)
        step_size, bc2_sqrt = bias_corrections(step, lr, 0.9, 0.95)
        scalars = torch.tensor([step_size, bc2_sqrt, 1.0 - lr * WD], dtype=torch.float32)
        unit_update(*_unit_args(one, master_dtype, grad8, grad_scales, factor, seg, decays, scalars), **hyper)
        f, s = ref
        adamw_update_packed(f["master"], s["master_scale"] if master_dtype == "fp16" else None, f["m"], s["m_scale"],
                            f["v"], s["v_scale"], dequantize_segments(grad8, grad_scales, seg) * factor, seg,
                            decays.to(torch.float64) * WD, step=step, lr=torch.tensor(lr, dtype=torch.float64),
                            **hyper)
        for k in ("master", "m", "v"):
            assert torch.equal(_bits(one[0][k]), _bits(ref[0][k])), (step, k)
        for k in ("master_scale", "m_scale", "v_scale"):
            assert torch.equal(one[1][k], ref[1][k]), (step, k)
    assert torch.isnan(one[0]["m"].float()).any()


def test_compiled_unit_update_takes_its_scalars_made():
    """Compiled, the update's graph holds no float64 value and is not recompiled as the step advances: the step's
    scalars (step size, sqrt(bc2), decay) enter as fp32 device scalars made once a step. (Formed inside the graph
    from the step number and the learning rate, inductor recomputed them per element: two float64 pow, a sqrt and
    divisions an element, which made the 50M-element update kernel compute-bound on a GPU.) Inductor's code, on
    this CPU, also tracks the eager update."""
    from fp8.adam import bias_corrections
    from fp8.format import E5M2
    from fp8.segments import Segments
    from fp8.zero_unit import unit_update

    graphs = []

    def inductor_recording(gm, example_inputs):
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    update_fn = torch.compile(unit_update, backend=inductor_recording)
    sizes = [5, 0, 300, 64]
    seg = Segments(sizes, "cpu", fused=False)
    decays = torch.tensor([True, False, True, False])
    compiled, eager = _unit_state(sizes, "fp16", 9), _unit_state(sizes, "fp16", 9)
    g = torch.Generator().manual_seed(2)
    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-8)
    factor, scalars = torch.ones(()), torch.zeros(3)
    for step in range(1, 5):
        grad8 = (torch.randn(sum(sizes), generator=g) * 100).to(E5M2)
        grad_scales = torch.full((len(sizes),), 64.0)
        step_size, bc2_sqrt = bias_corrections(step, LR / step, 0.9, 0.95)
        for i, x in enumerate((step_size, bc2_sqrt, 1.0 - LR / step * WD)):
            scalars[i].fill_(x)
        args = _unit_args(compiled, "fp16", grad8, grad_scales, factor, seg, decays, scalars)
        with torch.no_grad():
            update_fn(*args, **hyper)
        unit_update(*_unit_args(eager, "fp16", grad8, grad_scales, factor, seg, decays, scalars), **hyper)
        for k, fmt_step in (("master", 2 ** -10), ("m", 2 ** -3), ("v", 2 ** -10)):
            scale = {"master": "master_scale", "m": "m_scale", "v": "v_scale"}[k]
            want = torch.cat([dequantize(q, s, torch.float64) for q, s in
                              zip(eager[0][k].split(sizes), eager[1][scale])])
            got = torch.cat([dequantize(q, s, torch.float64) for q, s in
                             zip(compiled[0][k].split(sizes), compiled[1][scale])])
            torch.testing.assert_close(got, want, rtol=fmt_step, atol=fmt_step * float(want.abs().max()))
    assert len(graphs) == 1, f"{len(graphs)} graphs over four steps: recompiled"
    for gm in graphs:
        for node in gm.graph.nodes:
            val = node.meta.get("example_value")
            assert not (isinstance(val, torch.Tensor) and val.dtype == torch.float64), (node.op, node.target)
            assert not isinstance(val, (torch.SymFloat, torch.SymInt)), (node.op, node.target)


def test_power_of_two_scale_is_the_exact_floor_for_one_or_many():
    """2**floor(log2(max / amax)) exactly (float64 math as the reference), the same bits whether the scales are
    computed one at a time or all at once; amax just above a power-of-two boundary included."""
    import math

    from fp8.format import E4M3, scale_from_amax

    boundaries = [65504 / 2.0 ** k for k in range(-3, 12)] + [448 / 2.0 ** k for k in range(-3, 12)]
    amaxes = []
    for b in boundaries:
        x = torch.tensor(b, dtype=torch.float32)
        amaxes += [x, torch.nextafter(x, torch.tensor(math.inf)), torch.nextafter(x, torch.tensor(0.0))]
    amaxes += [torch.tensor(v) for v in (1e-30, 3.0, 0.1, 12345.678)]
    a = torch.stack(amaxes)
    for dtype in (torch.float16, E4M3):
        many = scale_from_amax(a, dtype, power_of_two=True)
        for i, x in enumerate(amaxes):
            one = scale_from_amax(x, dtype, power_of_two=True)
            raw = float(torch.tensor(float(torch.finfo(dtype).max), dtype=torch.float32) / x)  # the fp32 quotient
            assert raw == float(torch.finfo(dtype).max) / float(x) or abs(raw / (float(torch.finfo(dtype).max) / float(x)) - 1) < 2 ** -24
            assert float(one) == 2.0 ** math.floor(math.log2(raw)) == float(many[i]), (dtype, float(x), float(one))
            assert float(x) * float(one) <= torch.finfo(dtype).max  # never scaled past the format's maximum


@pytest.mark.parametrize("fused", [False, True], ids=["cpu_loops", "fused_kernels"])
def test_segments_against_per_tensor_loops(fused):
    """fp8/segments.py against plain per-tensor torch: spread, max (NaN, empty, negative values) and sum."""
    from fp8.segments import Segments

    g = torch.Generator().manual_seed(3)
    lengths = [0, 3, 0, 1, 17, 0, 64, 5, 0]  # empty first, middle and last segments
    seg = Segments(lengths, "cpu", fused=fused)
    x = torch.randn(sum(lengths), generator=g)
    x[4] = float("nan")  # inside the fifth segment (elements 4..20)
    pieces = x.split(lengths)
    values = torch.randn(len(lengths), generator=g)
    assert torch.equal(seg.spread(values), torch.cat([v.expand(n) for v, n in zip(values, lengths)]))
    want_max = [float(p.abs().max()) if p.numel() else 0.0 for p in pieces]
    got_max = seg.max(x.abs()).tolist()
    assert [math.isnan(a) for a in got_max] == [math.isnan(b) for b in want_max] == [False] * 4 + [True] + [False] * 4
    assert [a for a in got_max if not math.isnan(a)] == [b for b in want_max if not math.isnan(b)]
    ints = torch.randint(0, 50, (sum(lengths),), generator=g).double()   # integers >= 0: any order is exact
    assert seg.sum(ints).tolist() == [float(p.sum()) for p in ints.split(lengths)]
    with pytest.raises(ValueError, match="expected a flat tensor of 90 elements"):
        seg.max(torch.zeros(89))
    assert Segments([], "cpu", fused=fused).max(torch.zeros(0)).numel() == 0
