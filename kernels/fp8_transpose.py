"""FP8 GEMM operands with their transposes in one pass (Transformer Engine's ``cast_transpose``).

Hopper's FP8 GEMMs take both operands K-major (``torch._scaled_mm``: a row-major first and a column-major second
operand), so the weight-gradient GEMM of a linear layer, ``dW = dyᵀ · x``, contracting over the tokens, needs
``dy`` and ``x`` transposed, while the input-gradient GEMM ``dx = dy · W`` needs ``dy`` as it is. Two operations:

  cast_transpose(x, scale, fmt) -> (q, qT)   q = quantize(x, scale, fmt) ([M, N], row-major) and its transpose
                                             qT = q.t().contiguous() ([N, M]): x is read once
  transpose(q) -> qT                          the transpose of an FP8 matrix (bytes moved, nothing cast)

``quantize`` is ``fp8/format.py``'s: ``(x.float() * scale).clamp(-max, max).to(fmt)``, NaN kept. The references
(``reference_cast_transpose``, ``reference_transpose``) are those plain-torch forms; they are also what CPU runs.
On CUDA the Triton kernels below run: one program per [BM, BN] tile, loaded along rows, cast in fp32 (a product
and a clamp: the same roundings as the reference) and stored twice, the second time through ``tl.trans`` so that
both stores are coalesced (Triton moves the tile through shared memory). On a GPU they are ops
(``torch.library.triton_op``): under ``torch.compile`` inductor launches the kernels as they are, fusing nothing
into them.

Why (``docs/benchmarks.md``, "Where an fp8 step goes"): traced by inductor, the cast of ``dy`` and its transposed
copy fuse into the kernel that makes ``dy`` (the GELU backward of fc2's gradient, say), which then writes five
outputs in two layouts: 356 us a call on an H200 at [8192, 8192], 34 ms of a gpt_1.3b step. Used by ``fp8/linear.py``
where ``fp8.cast_transpose`` is on (off by default until a GPU run has timed it against inductor's form).

Under ``TRITON_INTERPRET=1`` (set before Triton is imported) the kernels run on CPU tensors: how the tests check
them (``tests/test_fp8_transpose.py``).
"""
from __future__ import annotations

import os
from typing import Tuple

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK = 64  # tile side: 64 x 64 elements (8 KiB of bf16 in, 2 x 4 KiB of FP8 out)


def _check(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"{what}: expected a contiguous 2-D tensor, got shape {tuple(x.shape)}, "
                         f"strides {tuple(x.stride())}")


def reference_cast_transpose(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The plain-torch ``cast_transpose`` (the semantics; what CPU runs)."""
    dtype = FORMATS[fmt]
    m = float(torch.finfo(dtype).max)
    q = (x.float() * scale).clamp_(-m, m).to(dtype)
    return q, q.t().contiguous()


def reference_transpose(q: torch.Tensor) -> torch.Tensor:
    """The plain-torch ``transpose``."""
    return q.t().contiguous()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton: the references serve every CPU tensor
    triton = None

if triton is not None:
    @triton.jit
    def _fp8_bits_by_integer_ops(v, E5M2: tl.constexpr):
        """The FP8 byte of fp32 ``v`` (finite, |v| <= the format's max: saturated before), rounded to nearest even,
        by exact fp32 and integer steps: what the GPU's conversion does, written out for the Triton interpreter,
        whose own fp32 -> fp8 conversion rounds wrongly (triton 3.7: ties up, and some exponents off)."""
        M: tl.constexpr = 2 if E5M2 else 3                  # mantissa bits
        BIAS: tl.constexpr = 15 if E5M2 else 7
        u = v.to(tl.uint32, bitcast=True)
        sign = (u >> 31).to(tl.uint32)
        a = tl.abs(v)
        # normal: round fp32's mantissa to M bits (to nearest, ties to even; a carry moves into the exponent),
        # then rebias the exponent field from 127 to BIAS
        mag = u & 0x7FFFFFFF
        half = (1 << (22 - M)) - 1 + ((mag >> (23 - M)) & 1)
        normal = ((mag + half) >> (23 - M)) - ((127 - BIAS) << M)
        # subnormal (below 2**(1 - BIAS)): the count of 2**(1 - BIAS - M) steps, rounded to nearest even by fp32
        # addition of 2**23 (exact for the range), the same field layout (a count of 2**M is the smallest normal)
        steps = a * (2.0 ** (M + BIAS - 1))
        sub = ((steps + 8388608.0) - 8388608.0).to(tl.uint32)
        bits = tl.where(a < 2.0 ** (1 - BIAS), sub, normal.to(tl.uint32))
        return ((sign << 7) | bits).to(tl.uint8)

    @triton.jit
    def _cast_transpose_kernel(x_ptr, scale_ptr, q_ptr, qt_ptr, M, N, fmax, CAST: tl.constexpr,
                               E5M2: tl.constexpr, SOFT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        inside = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=inside)
        if CAST:
            v = x.to(tl.float32) * tl.load(scale_ptr)
            # NaN by its bits (the interpreter folds `v != v` to false)
            nan = (v.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
            # saturate (tl.minimum / tl.maximum may return the non-NaN operand: NaN is handled below)
            v = tl.minimum(tl.maximum(v, -fmax), fmax)
            if SOFT:
                q = _fp8_bits_by_integer_ops(v, E5M2)
            elif E5M2:
                q = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
            else:
                q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            # a NaN stays a NaN (0x7F in both formats); written out, not left to the conversion (the interpreter's
            # turns it into a number)
            q = tl.where(nan, 0x7F, q).to(tl.uint8).to(q_ptr.dtype.element_ty, bitcast=True)
            tl.store(q_ptr + rm[:, None] * N + rn[None, :], q, mask=inside)
        else:
            q = x
        tl.store(qt_ptr + rn[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(inside))

    def _launch(x: torch.Tensor, scale: torch.Tensor, q: torch.Tensor, qt: torch.Tensor, cast: bool,
                fmt: str, wrap) -> None:
        M, N = x.shape
        grid = (triton.cdiv(M, BLOCK), triton.cdiv(N, BLOCK))
        fmax = float(torch.finfo(FORMATS[fmt]).max)
        wrap(_cast_transpose_kernel)[grid](x, scale, q, qt, M, N, fmax, CAST=cast, E5M2=fmt == "e5m2",
                                          SOFT=_interpreting(), BM=BLOCK, BN=BLOCK, num_warps=4)

    def triton_cast_transpose(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """``cast_transpose`` by the Triton kernel, called directly (CUDA, or CPU tensors under the interpreter)."""
        return _kernel_cast_transpose(x, scale, fmt, wrap=lambda k: k)

    def triton_transpose(q: torch.Tensor) -> torch.Tensor:
        """``transpose`` by the Triton kernel, called directly."""
        return _kernel_transpose(q, wrap=lambda k: k)

    def _kernel_cast_transpose(x, scale, fmt, wrap):
        _check(x, "fp8 cast_transpose")
        dtype = FORMATS[fmt]
        q = torch.empty(x.shape, dtype=dtype, device=x.device)
        qt = torch.empty((x.shape[1], x.shape[0]), dtype=dtype, device=x.device)
        if x.numel():
            _launch(x, scale, q, qt, True, fmt, wrap)
        return q, qt

    def _kernel_transpose(q, wrap):
        _check(q, "fp8 transpose")
        qt = torch.empty((q.shape[1], q.shape[0]), dtype=q.dtype, device=q.device)
        if q.numel():  # loaded and stored as they are: nothing is converted
            _launch(q, q, q, qt, False, "e4m3", wrap)
        return qt

    from torch.library import triton_op, wrap_triton

    @triton_op("gpt::fp8_cast_transpose", mutates_args={})
    def _cast_transpose_op(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
        return _kernel_cast_transpose(x, scale, fmt, wrap=wrap_triton)

    @triton_op("gpt::fp8_transpose", mutates_args={})
    def _transpose_op(q: torch.Tensor) -> torch.Tensor:
        return _kernel_transpose(q, wrap=wrap_triton)


def _on_gpu(t: torch.Tensor) -> bool:
    if t.device.type == "cpu":
        return False
    if triton is None:
        raise RuntimeError(f"fp8 cast_transpose on {t.device} needs Triton (pip install -r requirements-gpu.txt)")
    return True


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q, qT)`` (see the module docstring): the Triton kernel on a GPU (an opaque op to torch.compile), the
    reference on CPU (plain torch ops, which a compiled graph fuses as it likes)."""
    _check(x, "fp8 cast_transpose")
    if _on_gpu(x):
        return torch.ops.gpt.fp8_cast_transpose(x, scale, fmt)
    return reference_cast_transpose(x, scale, fmt)


def transpose(q: torch.Tensor) -> torch.Tensor:
    """``qT`` (see the module docstring): the Triton kernel on a GPU, the reference on CPU."""
    _check(q, "fp8 transpose")
    if _on_gpu(q):
        return torch.ops.gpt.fp8_transpose(q)
    return reference_transpose(q)


__all__ = ["cast_transpose", "transpose", "reference_cast_transpose", "reference_transpose", "FORMATS"]
