"""FP8 linear: ``y = x Wᵀ + b`` with both GEMMs of the backward in FP8 too (SPEC §4, FP8-LM §2.3).

  forward   y  = x · Wᵀ        E4M3 x E4M3    (x: ``states.input``, W: ``states.weight``)
  backward  dx = dy · W        G    x E4M3    (dy: ``states.grad``, G = fp8.gradient_format, E5M2 default)
            dW = dyᵀ · x       G    x E4M3
            db = Σ dy          in the compute dtype (not a GEMM)

Each operand is cast with its role's scale (``fp8/scaling.py``), ``q = cast(v * s)``, and the GEMM
runs on the FP8 bytes through ``torch._scaled_mm(qa, qb, scale_a=1/sa, scale_b=1/sb)`` (the
dequantizing scales), accumulating in fp32 and returning the compute dtype: the autocast dtype
when autocast is on (bf16 in training), else the dtype of x. The backward keeps the FP8 operands of
the forward (1 byte an element instead of 2) and their scales.

Sequence-parallel FP8 gather (``sp_gather=True``): the input is this rank's sequence slice
``[s/tp, b, in]``; it is cast to E4M3 with the TP-shared scale (the input state reduces the amax
over TP, see ``fp8/scaling.py``) and the FP8 bytes are all-gathered along the sequence over TP:
half the bytes of the bf16 gather of Megatron's sequence parallelism. Its backward is the usual
reduce-scatter of dx along the sequence, in the compute dtype.

On CPU the FP8 product is, by default, the fp32 GEMM of the FP8 operands widened to fp32, times both
dequantizing scales (``cpu_fp32``): a product of two FP8 values is exact in fp32 and ``_scaled_mm``
accumulates in fp32 too, so the two differ only in summation order. torch's CPU ``_scaled_mm`` is
never faster and on some CPUs pathological: measured with torch 2.13 (one thread), 1.0-2.2x the fp32
route's time from 256x128x384 to 2048x512x1536 on an AVX-512 AMD EPYC, and 176x the fp32 GEMM's at
256x128x384 (1,783x at 1024x128x512, about 0.02 GFLOP/s) on an AVX-512/AMX Intel Xeon, where a 2-layer
FP8 training step took 158 s. ``GPT_CPU_FP8_GEMM=native``
calls ``_scaled_mm`` on CPU as well (``fp32`` or ``auto``, the default: the fp32 route). CUDA always
runs ``_scaled_mm``.

``emulate=True``: the same quantization, but the operands are dequantized to the compute dtype (bf16, or fp16
with ``fp8.gemm=fp16``) and multiplied there: FP8 numerics around the 16-bit GEMMs of GPUs without FP8 tensor
cores. Without emulation such GPUs run FP8-LM with plain 16-bit linears instead (``fp8.gemm``,
``fp8/device.py``): this module is then not used.

``_scaled_mm`` requirements: the CPU kernel accepts any shape and layout; CUDA needs compute
capability >= 8.9, a row-major first and a column-major second operand (always passed so here) and
every GEMM dimension divisible by 16 — tokens (s·b), in and out features — which is checked up
front with an error that names the dimension (no silent fallback).

Layout: sequence-first ``[s, b, in]`` (any leading dims; gathered along dim 0), weight ``[out, in]``.
"""
from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import torch

from fp8.format import dequantize
from fp8.scaling import Fp8States
from kernels import fp8_transpose
from parallel import comm
from parallel.comm import Group


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Dtype of the GEMM outputs: the autocast dtype where autocast is on, else x's dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (what ``_scaled_mm`` wants as its second operand)."""
    return t.t().contiguous().t()


CPU_FP8_GEMM_MODES = ("auto", "fp32", "native")


@functools.lru_cache(maxsize=None)
def cpu_fp32() -> bool:
    """Whether FP8 GEMMs on CPU run as fp32 GEMMs of the widened FP8 operands (``GPT_CPU_FP8_GEMM``, read once
    per process so every rank of a machine agrees; see the module docstring)."""
    mode = os.environ.get("GPT_CPU_FP8_GEMM", "auto")
    if mode not in CPU_FP8_GEMM_MODES:
        raise ValueError(f"GPT_CPU_FP8_GEMM must be one of {', '.join(CPU_FP8_GEMM_MODES)}, got {mode!r}")
    return mode != "native"


@torch.compiler.assume_constant_result
def _cpu_fp32() -> bool:
    """``cpu_fp32``, a constant of the process to ``torch.compile`` (called while tracing, never traced)."""
    return cpu_fp32()


def _widen(q: torch.Tensor) -> Tuple[torch.Tensor, float]:
    """``(w, k)``: an fp32 tensor with ``w * k == q`` exactly (k a power of two), made fast on CPU.

    torch's CPU E4M3 -> fp32 conversion is a scalar loop (3.3 ns an element here, 10x the rest of a cast).
    An E4M3 byte ``s eeee mmm`` placed in an fp16 as ``s 0eeee mmm0000000`` is the same number times 2**-8:
    both formats' exponent biases (7, 15) and subnormal exponents (-6, -14) differ by 8, so normals and
    subnormals alike map exactly, and fp16 -> fp32 is a vectorised conversion. E4M3's NaN code (``s 1111 111``)
    becomes fp16's NaN, so a broken operand still breaks the product. E5M2 is fp16's upper byte: torch
    converts it fast. In the GEMM every product is then scaled by a power of two >= 2**-16, exactly (no
    fp32 subnormals: the smallest nonzero product is 2**-34), so the sums are the unscaled ones times k."""
    if q.dtype == torch.float8_e4m3fn:
        v = q.view(torch.uint8).to(torch.int16)
        magnitude = v & 0x7F
        bits = torch.where(magnitude == 0x7F, 0x7E00, magnitude << 7)  # 0x7E00: fp16 NaN
        bits.bitwise_or_((v << 8).bitwise_and_(-0x8000))  # the sign
        return bits.view(torch.float16).float(), 256.0
    return q.float(), 1.0


def _mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype,
        emulate: bool) -> torch.Tensor:
    """``(a / sa) @ (b / sb)`` for FP8 ``a`` [m, k] and ``b`` [k, n] with their (quantizing) scales."""
    if emulate:
        with torch.autocast(a.device.type, enabled=False):  # the dtype is chosen here, not by autocast
            return dequantize(a, sa, out_dtype) @ dequantize(b, sb, out_dtype)
    if a.device.type == "cpu" and _cpu_fp32():
        # _scaled_mm's numerics: exact FP8 x FP8 products summed in fp32, then the dequantizing scales, one
        # rounding to out_dtype (the widening's powers of two are exact: see _widen)
        with torch.autocast("cpu", enabled=False):
            (wa, ka), (wb, kb) = _widen(a), _widen(b)
            y = torch.mm(wa, wb)
            return y.mul_(sa.reciprocal() * sb.reciprocal() * (ka * kb)).to(out_dtype)
    return torch._scaled_mm(a.contiguous(), _col_major(b), scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                            out_dtype=out_dtype)


@torch.compiler.assume_constant_result
def _capability(index: int) -> Tuple[int, int]:
    """The CUDA device's compute capability, a constant to ``torch.compile``."""
    return torch.cuda.get_device_capability(index)


def _check_device(x: torch.Tensor, tokens: int, in_features: int, out_features: int) -> None:
    if x.device.type != "cuda":
        return
    major, minor = _capability(x.device.index if x.device.index is not None else torch.cuda.current_device())
    if (major, minor) < (8, 9):
        raise RuntimeError(f"FP8 GEMMs (torch._scaled_mm) need compute capability >= 8.9 (Ada, Hopper); this GPU "
                           f"has {major}.{minor}: fp8.gemm=auto runs FP8-LM with 16-bit GEMMs here (fp8/device.py)")
    for what, n in (("tokens (sequence x micro-batch)", tokens), ("input features", in_features),
                    ("output features", out_features)):
        if n % 16:
            raise ValueError(f"FP8 GEMMs on CUDA need every dimension divisible by 16: {what} = {n} "
                             f"(fp8.gemm=bf16 or fp8.emulate=true avoid FP8 GEMMs; or change the shape)")


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, qw, sw, states: Fp8States, tp: Group, sp_gather: bool, emulate: bool,
                out_dtype: torch.dtype, record: bool):
        # qw, sw: the weight's E4M3 cast and scale, made by the caller (once a step where the step's copy is kept);
        # ``weight`` itself is here for its gradient
        in_features = x.shape[-1]
        qx, sx = states.input.cast(x, tp, record=record)
        if sp_gather:
            qx = qx.contiguous()
            gathered = qx.new_empty((qx.shape[0] * tp.size,) + tuple(qx.shape[1:]))
            comm.all_gather(gathered, qx, tp)
            qx = gathered
        lead = qx.shape[:-1]
        qx2 = qx.reshape(-1, in_features)
        y = _mm(qx2, sx, qw.t(), sw, out_dtype, emulate)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.save_for_backward(qx2, qw, sx, sw)
        ctx.states, ctx.tp, ctx.sp_gather, ctx.emulate, ctx.out_dtype = states, tp, sp_gather, emulate, out_dtype
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.view(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        qx2, qw, sx, sw = ctx.saved_tensors
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        # fp8.cast_transpose: dy's cast and its transpose in one pass, and x's transpose, by kernels/fp8_transpose.py
        kernel = ctx.states.cfg.cast_transpose and not ctx.emulate
        if kernel:
            qg, qgt, sg = ctx.states.grad.cast(g2, ctx.tp, transposed=True)
        else:
            qg, sg = ctx.states.grad.cast(g2, ctx.tp)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            gx = _mm(qg, sg, qw, sw, ctx.out_dtype, ctx.emulate)  # [tokens, in]
            gx = gx.view(*grad_y.shape[:-1], gx.shape[-1])
            if ctx.sp_gather:
                gx = gx.contiguous()
                out = gx.new_empty((gx.shape[0] // ctx.tp.size,) + tuple(gx.shape[1:]))
                comm.reduce_scatter(out, gx, ctx.tp)
                gx = out
            grad_x = gx.reshape(ctx.x_shape).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            # the GEMM writes the weight's dtype, rounding its fp32 sums once (an fp32 out cast afterwards cost an
            # [out, in] fp32 buffer per GEMM); emulated, the dequantized operands are multiplied in fp32
            out = torch.float32 if ctx.emulate else ctx.w_dtype
            if kernel:  # both operands K-major already: _mm's layout calls are no-ops on them
                grad_w = _mm(qgt, sg, fp8_transpose.transpose(qx2).t(), sx, out, False).to(ctx.w_dtype)
            else:
                grad_w = _mm(qg.t(), sg, qx2, sx, out, ctx.emulate).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            # (measured on an H200, gpt_1.3b: written as g2.sum(0, dtype=torch.float32), inductor dropped the fp32 copy
            # of dy from the fused gelu-backward kernel but recomputed that kernel's chain inside the sum: 2 ms slower)
            grad_b = g2.float().sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], states: Fp8States, tp: Group,
               *, sp_gather: bool, emulate: bool) -> torch.Tensor:
    """``x [.., in] · weight[out, in]ᵀ + bias`` with FP8 operands (see the module docstring).

    ``sp_gather``: x is this rank's sequence slice; its FP8 cast is all-gathered along dim 0 over ``tp``
    (the output covers the whole sequence). The scales used are the states' ``scale`` right after
    their casts (``states.input.scale``, ``states.weight.scale``, and ``states.grad.scale`` after the
    backward)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x [.., {x.shape[-1]}] does not match weight {tuple(weight.shape)}")
    if sp_gather and x.dim() < 2:
        raise ValueError("fp8_linear: sp_gather needs a sequence-first input [s, ..., in]")
    if not emulate:
        tokens = x.numel() // x.shape[-1] * (tp.size if sp_gather else 1)
        _check_device(x, tokens, weight.shape[1], weight.shape[0])
    # a forward without autograd (validation, generation) leaves the delayed-scaling amaxes alone
    record = torch.is_grad_enabled()
    qw, sw = states.weight_operand(weight, tp, record)
    return _Fp8Linear.apply(x, weight, bias, qw, sw, states, tp, sp_gather, emulate, compute_dtype(x), record)
