"""kernels/quant_triton.py against the kernels/quant.py references, bit for bit.

The Triton kernels run on CPU in the Triton interpreter, which has to be chosen
before triton is imported: ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is
decorated, and triton's own library functions are decorated when triton is imported.
So the checks run in one child pytest process started with ``TRITON_INTERPRET=1``
(``test_triton_kernels_under_interpreter``, the only test collected in the parent);
the parent process never imports triton, and no other test module in the same
pytest(-xdist) worker, nor any subprocess they start, sees the variable.

Equality is on bits: payload bytes, scale bit patterns, dequantized values' bit
patterns (NaN only has to be NaN there: its sign and payload are not specified).
"""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from kernels import quant as ref

_CHILD_FLAG = "QUANT_TRITON_INTERPRETER_CHILD"
IN_CHILD = os.environ.get(_CHILD_FLAG) == "1"
ROOT = pathlib.Path(__file__).resolve().parents[1]

if IN_CHILD:
    assert os.environ.get("TRITON_INTERPRET") == "1", "the child must start with TRITON_INTERPRET=1"
    from kernels import quant_triton as qt


def test_triton_kernels_under_interpreter():
    """Run this module's checks in a child pytest under TRITON_INTERPRET=1 (see the docstring)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install -r requirements-dev.txt)")
    # xdist worker vars, addopts; the suite's clock (the child's time is this test's)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "GPT_SUITE_CLOCK"}
    env.update({"TRITON_INTERPRET": "1", _CHILD_FLAG: "1"})
    # numpy warns inside the interpreter about lanes that the kernels then discard (NaN casts).
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-W", "ignore::RuntimeWarning:triton.runtime.interpreter", str(pathlib.Path(__file__))]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"child pytest failed (rc={proc.returncode}):\n{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"
    print(proc.stdout.strip().splitlines()[-1])


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LO = {8: -128, 4: -8}          # the lowest code, -2**(bits-1); the highest is -LO - 1
TINY = 2.0 ** -149
FLT_MAX = torch.finfo(torch.float32).max


# ----------------------------------------------------------------------------- comparisons
def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, nan_any_bits: bool = False):
    assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device, \
        (got.dtype, want.dtype, got.shape, want.shape)
    if got.dtype == torch.uint8:
        assert torch.equal(got, want), (got, want)
        return
    if nan_any_bits:
        assert torch.equal(got.isnan(), want.isnan()), (got, want)
        got, want = got[~got.isnan()], want[~want.isnan()]
    assert torch.equal(_int_view(got), _int_view(want)), (got, want)


def check_quant(x: torch.Tensor, bits: int, block: int):
    """quantize_blockwise bits == reference; dequantize_blockwise bits == reference (3 dtypes)."""
    p_ref, s_ref = ref.quantize_blockwise(x, bits, block)
    p, s = qt.quantize_blockwise(x, bits, block)
    assert_same_bits(p, p_ref)
    assert_same_bits(s, s_ref)
    for dtype in DTYPES:
        want = ref.dequantize_blockwise(p_ref, s_ref, bits, block, x.numel(), dtype)
        got = qt.dequantize_blockwise(p_ref, s_ref, bits, block, x.numel(), dtype)
        assert_same_bits(got, want, nan_any_bits=True)
    return p, s


def special_values(block: int) -> torch.Tensor:
    """fp32 blocks of block values each: zeros, NaN, +-inf, half-way points, tiny and huge."""
    g = torch.Generator().manual_seed(block)
    rows = []
    rows.append(torch.zeros(block))                                   # all-zero block
    r = torch.randn(block, generator=g); r[block // 2] = float("nan"); rows.append(r)
    r = torch.randn(block, generator=g); r[0] = float("inf"); rows.append(r)
    r = torch.zeros(block); r[-1] = float("-inf"); rows.append(r)
    r = torch.randn(block, generator=g) * 1e-40; rows.append(r)      # subnormal inputs and scale
    r = torch.zeros(block); r[0] = 3 * TINY; rows.append(r)           # e/-m underflows to -0: scale +0
    r = torch.zeros(block); r[0] = 300 * TINY; r[-1] = -97 * TINY; rows.append(r)   # subnormal, negative
    r = torch.randn(block, generator=g).clamp(-1, 1) * 3e38; r[0] = FLT_MAX; rows.append(r)     # fp32 max
    r = -torch.zeros(block); r[1 % block] = -2.5; rows.append(r)     # negative zeros
    r = torch.randn(block, generator=g).clamp(-3, 3); r[0] = 4.0; r[-1] = -4.0; rows.append(r)   # tie: +4 wins
    r = torch.zeros(block); r[1] = -1.0; r[2:] = 0.99; rows.append(r)   # clipped by int4, beside the extreme
    return torch.cat(rows)


def halfway_values(bits: int, block: int, scale: float = 0.125) -> torch.Tensor:
    """Blocks that each start with the extreme -m*scale (so the stored scale is ``scale``; with scale a
    power of two x/scale is exact) followed by ties k + 0.5 (times scale): every tie -m+0.5 .. m-0.5."""
    m = -LO[bits]
    ties = torch.arange(-m, m, dtype=torch.float32) + 0.5
    per_block = block - 1
    nb = -(-ties.numel() // per_block)
    body = ties.repeat(-(-nb * per_block // ties.numel()))[:nb * per_block].view(nb, per_block)
    return torch.cat([torch.full((nb, 1), -m * 1.0), body], dim=1).reshape(-1) * scale


# ----------------------------------------------------------------------------- quantize / dequantize
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_numels_match_reference(bits, dtype):
    g = torch.Generator().manual_seed(bits)
    for block in (8, 6):
        numels = sorted({1, 7, block - 1, block, block + 1, 3 * block + 5})
        for numel in numels:
            x = (torch.randn(numel, generator=g) * 3).to(dtype)
            check_quant(x, bits, block)
    check_quant(torch.randn(2, 3, 5, generator=g).to(dtype), bits, 32)   # any shape; one ragged block
    check_quant(torch.randn(70, generator=g).to(dtype), bits, 50)        # block not a power of two
    check_quant(torch.randn(2049, generator=g).to(dtype), bits, 2048)    # a large block, 1-element tail


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_empty(bits):
    for dtype in DTYPES:
        p, s = qt.quantize_blockwise(torch.zeros(0, dtype=dtype), bits, 8)
        assert p.dtype == torch.uint8 and p.shape == (0,) and s.dtype == torch.float32 and s.shape == (0,)
        out = qt.dequantize_blockwise(p, s, bits, 8, 0, dtype)
        assert out.dtype == dtype and out.shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_special_blocks(bits, dtype):
    block = 8
    x = special_values(block)
    x_in = x.to(dtype)
    p, s = check_quant(x_in, bits, block)
    nb = x.numel() // block
    codes = p.view(nb, -1)
    assert s[0] == 0 and not s[0].signbit() and not codes[0].any()  # zeros: scale +0, q 0
    assert s[1].isnan() and not codes[1].any()                     # NaN block
    assert s[2].isnan() and s[3].isnan() and not codes[2:4].any()  # +-inf blocks
    if dtype == torch.float32:
        assert s[5] == 0 and not s[5].signbit() and not codes[5].any()   # scale underflows to +0
        assert -2.0 ** -126 < s[6] < 0                             # subnormal scale; positive extreme
    assert s[9] == -4.0 / -LO[bits] and s[10] == 1.0 / -LO[bits]
    out = qt.dequantize_blockwise(p, s, bits, block, x.numel())
    assert out.view(nb, block)[1:4].isnan().all()                  # non-finite stays non-finite
    assert torch.equal(out.view(nb, block)[0], torch.zeros(block))


@pytest.mark.parametrize("bits", [8, 4])
def test_halfway_points_round_half_even(bits):
    block = 16
    x = halfway_values(bits, block)
    m = -LO[bits]
    for sign in (1, -1):                      # extreme -m*0.125 (scale 0.125), and its negation (scale -0.125)
        p, s = check_quant(sign * x, bits, block)
        assert (s == sign * 0.125).all()
        codes = (ref.unpack_int4(p) if bits == 4 else p.view(torch.int8).to(torch.int16)).view(-1, block)
        assert (codes[:, 0] == -m).all()
        ties = (x / 0.125).view(-1, block)[:, 1:]
        assert (ties - ties.floor() == 0.5).all()
        top = ties == m - 0.5                 # rounds to m (even) and is clamped to m - 1
        assert torch.equal(codes[:, 1:].float(), torch.round(ties).clamp(max=m - 1))   # round: half to even
        assert top.any() and (codes[:, 1:][~top] % 2 == 0).all()   # every other tie went to the even code
    # Ties at a non power-of-two scale, and in bf16/fp16 inputs.
    check_quant(halfway_values(bits, block, scale=0.1), bits, block)
    for dtype in (torch.bfloat16, torch.float16):
        check_quant(halfway_values(bits, block, scale=0.25).to(dtype), bits, block)


def test_bf16_is_read_as_bf16():
    x = torch.tensor([1e30, -3e-39, 2.0, 1e-20, 0.0, -7.5], dtype=torch.bfloat16)   # not fp16 values
    p, s = check_quant(x, 8, 6)
    assert s[0] == torch.tensor(1e30, dtype=torch.bfloat16).float() / -128


def test_dequantize_padding_never_leaks():
    """Non-zero codes in the padding of a ragged last block are never returned."""
    for bits in (8, 4):
        block, numel = 8, 13
        p, s = ref.quantize_blockwise(torch.randn(numel), bits, block)
        p = p.clone()
        p[-(block - numel % block) * bits // 8:] = 0x77                       # garbage in the padding
        for dtype in DTYPES:
            got = qt.dequantize_blockwise(p, s, bits, block, numel, dtype)
            assert got.numel() == numel
            assert_same_bits(got, ref.dequantize_blockwise(p, s, bits, block, numel, dtype))
        ps, ss = torch.stack([p, p]), torch.stack([s, s])
        assert_same_bits(qt.dequant_sum(ps, ss, bits, block, numel), ref.dequant_sum(ps, ss, bits, block, numel))
        for out_bits in (8, 4):
            got = qt.dequant_sum_requant(ps, ss, bits, block, numel, out_bits)
            want = ref.dequant_sum_requant(ps, ss, bits, block, numel, out_bits)
            assert_same_bits(got[0], want[0])
            assert_same_bits(got[1], want[1])


@pytest.mark.parametrize("bits", [8, 4])
def test_error_bound_random_data(bits):
    """quant.py's bound, per finite block: |dq(q(x)) - x| <= max(|s|/2, |x| - (m-1)|s|) + 2**-23 a + m 2**-149,
    and within |s|/2 + those terms wherever x/s <= m - 1/2 (not clipped)."""
    m, block = -LO[bits], 32
    g = torch.Generator().manual_seed(11 + bits)
    mags = torch.tensor([1e-41, 1e-38, 1e-20, 1e-3, 1.0, 1e3, 1e30, 3e38])
    x = torch.randn(len(mags), block, generator=g) * mags[:, None]
    x = torch.cat([x.reshape(-1), torch.rand(3 * block + 9, generator=g) - 0.5])   # ragged tail
    x = x.clamp(-3.4e38, 3.4e38)                                   # randn * 3e38 may overflow
    p, s = qt.quantize_blockwise(x, bits, block)
    out = qt.dequantize_blockwise(p, s, bits, block, x.numel()).double()
    nb = s.numel()
    xd = torch.zeros(nb * block, dtype=torch.float64)
    xd[:x.numel()] = x.double()
    od = torch.zeros(nb * block, dtype=torch.float64)
    od[:x.numel()] = out
    err = (od - xd).abs().view(nb, block)
    a = xd.abs().view(nb, block).amax(dim=1, keepdim=True)
    step = s.double().abs()[:, None]
    rounding = 2.0 ** -23 * a + m * TINY
    assert torch.isfinite(s).all()
    assert (err <= torch.maximum(step / 2, xd.abs().view(nb, block) - (m - 1) * step) + rounding).all()
    clipped = xd.view(nb, block) / s.double()[:, None] > m - 0.5
    assert clipped.any() and (err[~clipped] <= (step / 2 + rounding).expand(-1, block)[~clipped]).all()


# ----------------------------------------------------------------------------- qgZ
@pytest.mark.parametrize("x_size,y_size,stages", [(2, 2, 1), (2, 2, 2), (3, 2, 1), (2, 3, 2), (1, 2, 1), (2, 1, 1)])
def test_reorder_and_quantize_matches_reference(x_size, y_size, stages):
    g = torch.Generator().manual_seed(x_size * 10 + y_size + 100 * stages)
    for bits, dtype, numel, block in [(8, torch.float32, 37, 4), (4, torch.bfloat16, 29, 2),
                                      (4, torch.float16, 8 * x_size * y_size * stages, 4), (8, torch.bfloat16, 5, 6)]:
        x = torch.randn(numel, generator=g).to(dtype)
        x[numel // 3] = 0.0
        want = ref.reorder_and_quantize(x, x_size, y_size, bits, block, stages)
        got = qt.reorder_and_quantize(x, x_size, y_size, bits, block, stages)
        assert_same_bits(got[0], want[0])
        assert_same_bits(got[1], want[1])
    x = torch.randn(3, 7, generator=g)
    x[1, 2] = float("nan")
    want = ref.reorder_and_quantize(x, x_size, y_size, 8, 4, stages)
    got = qt.reorder_and_quantize(x, x_size, y_size, 8, 4, stages)
    assert_same_bits(got[0], want[0])
    assert_same_bits(got[1], want[1])


def test_reorder_and_quantize_empty():
    p, s = qt.reorder_and_quantize(torch.zeros(0), 2, 2, 8, 4, 2)
    pr, sr = ref.reorder_and_quantize(torch.zeros(0), 2, 2, 8, 4, 2)
    assert p.shape == pr.shape and s.shape == sr.shape


def _copies(k: int, bits: int, block: int, numel: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ps, ss = [], []
    for c in range(k):
        x = torch.randn(numel, generator=g) * (c + 1)
        if c == 1:
            x[:block] = 0.0                          # a zero block in one copy
        if c == 2 and numel > 2 * block:
            x[block + 1] = float("inf")              # a non-finite block in one copy
        p, s = ref.quantize_blockwise(x, bits, block)
        ps.append(p)
        ss.append(s)
    return ps, ss


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_dequant_sum_and_requant_match_reference(k, bits):
    for block, numel in [(8, 27), (6, 6), (4, 1 if bits == 8 else 3)]:
        ps, ss = _copies(k, bits, block, numel, seed=k * 7 + bits + block)
        for payloads, scales in [(ps, ss), (torch.stack(ps), torch.stack(ss))]:
            assert_same_bits(qt.dequant_sum(payloads, scales, bits, block, numel),
                             ref.dequant_sum(payloads, scales, bits, block, numel), nan_any_bits=True)
        for out_bits in (4, 8):
            if block % 2:
                continue
            got = qt.dequant_sum_requant(ps, ss, bits, block, numel, out_bits)
            want = ref.dequant_sum_requant(ps, ss, bits, block, numel, out_bits)
            assert_same_bits(got[0], want[0])
            assert_same_bits(got[1], want[1])


def test_dequant_sum_is_in_copy_order():
    """((c0 + c1) + c2) differs from c0 + (c1 + c2) here; the kernels must give the former."""
    block = 2
    p = torch.tensor([1, 0], dtype=torch.uint8)                   # codes 1, 0: values = scales
    scales = [torch.tensor([2.0 ** 24]), torch.tensor([1.0]), torch.tensor([1.0])]
    ps = [p, p, p]
    want = ref.dequant_sum(ps, scales, 8, block, 2)
    assert want[0] == 2.0 ** 24                                   # (2**24 + 1) + 1 rounds twice
    assert_same_bits(qt.dequant_sum(ps, scales, 8, block, 2), want)
    for out_bits in (8, 4):
        got = qt.dequant_sum_requant(ps, scales, 8, block, 2, out_bits)
        assert_same_bits(got[1], ref.dequant_sum_requant(ps, scales, 8, block, 2, out_bits)[1])


# ----------------------------------------------------------------------------- drop-in module
def test_same_errors_as_reference():
    x = torch.randn(10)
    p, s = ref.quantize_blockwise(x, 8, 4)
    calls = [
        lambda m: m.quantize_blockwise(x, 3, 4),
        lambda m: m.quantize_blockwise(x, True, 4),
        lambda m: m.quantize_blockwise(x, 4, 5),
        lambda m: m.quantize_blockwise(x, 8, 0),
        lambda m: m.quantize_blockwise(x.double(), 8, 4),
        lambda m: m.quantize_blockwise([1.0], 8, 4),
        lambda m: m.dequantize_blockwise(p, s, 8, 4, -1),
        lambda m: m.dequantize_blockwise(p, s, 8, 4, 13),
        lambda m: m.dequantize_blockwise(p, s, 8, 4, 10, torch.float64),
        lambda m: m.dequantize_blockwise(p.view(torch.int8), s, 8, 4, 10),
        lambda m: m.dequantize_blockwise(p, s.double(), 8, 4, 10),
        lambda m: m.reorder_and_quantize(x, 0, 2, 8, 4),
        lambda m: m.reorder_and_quantize(x, 2, 2, 8, 4, stages=0),
        lambda m: m.reorder_and_quantize(x, 2, 2, 4, 3),
        lambda m: m.dequant_sum([p, p], [s], 8, 4, 10),
        lambda m: m.dequant_sum(p, s, 8, 4, 10),
        lambda m: m.dequant_sum([p], [s], 8, 4, 13),
        lambda m: m.dequant_sum_requant([p], [s], 8, 4, 10, 5),
        lambda m: m.dequant_sum_requant([p[:-1]], [s], 8, 4, 10, 4),
        lambda m: m.dequant_sum_requant([p], [s], 8, 4, 10, 8.0),
    ]
    for call in calls:
        with pytest.raises(ValueError) as want:
            call(ref)
        with pytest.raises(ValueError) as got:
            call(qt)
        assert str(got.value) == str(want.value)


def test_is_a_drop_in_module(monkeypatch):
    names = ["quantize_blockwise", "dequantize_blockwise", "reorder_and_quantize", "dequant_sum",
             "dequant_sum_requant", "n_blocks", "payload_nbytes", "qgz_slice_sizes", "qgz_slot",
             "reorder_for_hierarchical"]
    for name in names:
        assert callable(getattr(qt, name)), name
    for name in names[5:]:
        assert getattr(qt, name) is getattr(ref, name)
    from kernels import ops
    monkeypatch.setenv("ZEROPP_TRITON", "1")
    assert ops.quant_ops(torch.device("cpu")) is qt
    monkeypatch.delenv("ZEROPP_TRITON")
    from kernels import quant_cpu
    assert ops.quant_ops(torch.device("cpu")) is quant_cpu
    monkeypatch.setenv("ZEROPP_REFERENCE", "1")
    assert ops.quant_ops(torch.device("cpu")) is ref


def test_kernels_are_interpreted():
    from triton.runtime.interpreter import InterpretedFunction
    assert isinstance(qt._quantize_kernel, InterpretedFunction)


# The launcher is the parent's only test; in the child it is everything but the launcher.
for _name, _obj in list(globals().items()):
    if _name.startswith("test_") and callable(_obj):
        _obj.__test__ = (_name == "test_triton_kernels_under_interpreter") != IN_CHILD
