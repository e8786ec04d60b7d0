"""kernels/fp8_transpose.py: the Triton cast-and-transpose kernels against the plain-torch references, bit for bit,
and the registered ops (what fp8/linear.py calls) on CPU, eager and traced.

The kernels run on CPU in the Triton interpreter, chosen before triton is imported, so those checks run in one
child pytest started with ``TRITON_INTERPRET=1`` (as tests/test_quant_triton.py does; read its docstring).
Equality is on bytes, except that a NaN only has to be a NaN (its sign bit is not specified).
"""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch

_CHILD_FLAG = "FP8_TRANSPOSE_INTERPRETER_CHILD"
IN_CHILD = os.environ.get(_CHILD_FLAG) == "1"
ROOT = pathlib.Path(__file__).resolve().parents[1]
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def test_triton_kernels_under_interpreter():
    """Run this module's kernel checks in a child pytest under TRITON_INTERPRET=1 (see the docstring)."""
    if IN_CHILD:
        pytest.skip("(the parent's launcher)")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install -r requirements-dev.txt)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "GPT_SUITE_CLOCK"}
    env.update({"TRITON_INTERPRET": "1", _CHILD_FLAG: "1"})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "kernel_",
           "-W", "ignore::RuntimeWarning:triton.runtime.interpreter", str(pathlib.Path(__file__))]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child pytest failed (rc={proc.returncode}):\n{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"
    assert " passed" in proc.stdout.strip().splitlines()[-1], proc.stdout[-2000:]


def _bytes_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])


def _special(fmt: str, dtype: torch.dtype, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random values over the format's whole range, then the edge cases: NaN, +-inf, -0, the format's max and
    just past it, halfway points between FP8 neighbours (round half to even), subnormals of the format."""
    g = torch.Generator().manual_seed(seed)
    top = float(torch.finfo(FORMATS[fmt]).max)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-20, 12, (rows, cols), generator=g).float())
    flat = x.view(-1)
    edge = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, top, -top, top * 1.01, -top * 1.5,
            1.0 + 2.0 ** -4, 1.0 + 3 * 2.0 ** -4, 2.0 ** -7 * 1.5, 2.0 ** -9, -(2.0 ** -9) * 3, 2.0 ** -17, 1.125]
    n = min(len(edge), flat.numel())
    flat[:n] = torch.tensor(edge[:n])
    return x.to(dtype)


@pytest.mark.skipif(not IN_CHILD, reason="runs in the interpreter child")
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(64, 64), (70, 130), (1, 200), (129, 1), (3, 5)])
def test_kernel_cast_transpose_is_the_reference(fmt, dtype, shape):
    from kernels.fp8_transpose import reference_cast_transpose, triton_cast_transpose

    x = _special(fmt, dtype, *shape, seed=sum(shape))
    for scale in (1.0, 0.75, 2.0 ** 10):  # 0.75: not a power of two, the product rounds in fp32
        s = torch.tensor(scale)
        q, qt = triton_cast_transpose(x, s, fmt)
        want_q, want_qt = reference_cast_transpose(x, s, fmt)
        _bytes_equal(q, want_q)
        _bytes_equal(qt, want_qt)


@pytest.mark.skipif(not IN_CHILD, reason="runs in the interpreter child")
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(64, 128), (70, 130), (1, 3)])
def test_kernel_transpose_moves_the_bytes(fmt, shape):
    from kernels.fp8_transpose import triton_transpose

    q = _special(fmt, torch.float32, *shape, seed=7).clamp(-200, 200).to(FORMATS[fmt])
    qt = triton_transpose(q)
    assert qt.dtype == q.dtype and qt.is_contiguous()
    assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t())


@pytest.mark.skipif(IN_CHILD, reason="the parent's tests")
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cpu_path_eager_and_traced(fmt):
    """kernels.fp8_transpose.cast_transpose / transpose on CPU (the references), eagerly and traced by
    torch.compile, with their argument checks."""
    from kernels.fp8_transpose import cast_transpose, reference_cast_transpose, transpose

    x = _special(fmt, torch.bfloat16, 48, 80, seed=1)
    s = torch.tensor(0.5)
    want_q, want_qt = reference_cast_transpose(x, s, fmt)
    assert torch.equal(want_qt.view(torch.uint8), want_q.view(torch.uint8).t())

    def f(x, s):
        q, qt = cast_transpose(x, s, fmt)
        return q, qt, transpose(q)

    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        q, qt, qtt = fn(x, s)
        _bytes_equal(q, want_q)
        _bytes_equal(qt, want_qt)
        assert torch.equal(qtt.view(torch.uint8), qt.view(torch.uint8))
    with pytest.raises(ValueError, match="contiguous 2-D"):
        cast_transpose(x.t(), s, fmt)
    with pytest.raises(ValueError, match="contiguous 2-D"):
        transpose(want_q.view(-1))
