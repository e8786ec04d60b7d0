"""16-bit GEMMs (linears and attention) on CPUs without 16-bit matrix instructions: computed in fp32.

On an x86 CPU without AVX512-BF16 / AMX (an AVX2 AMD EPYC, for one), torch's bf16 and fp16 GEMMs fall back
to a slow reference kernel: measured on such a 2-core machine with torch 2.13, a linear's forward and
backward at the bench model's shapes took 50-60x as long in bf16 as in fp32 (162 ms against 3.3 ms for
256x256x768; 2.1 s against 36 ms for the 8000-row head), so a bf16 step ran ~6 s instead of ~0.4 s and
nothing else mattered.

The attention kernel (``attention``: SDPA's CPU flash kernel) took 4x as long in bf16 as in fp32 on the same
machine (8.4 ms against 2.2 ms forward + backward for 2 x 4 heads x 128 x 64); it runs on the fp32 upcasts of
its 16-bit operands and its output is rounded to 16 bits once (the 16-bit kernel accumulates in fp32 too).

``linear`` is ``F.linear`` except there: it multiplies the fp32 upcasts of the 16-bit operands and rounds
the product to the 16-bit dtype once, in forward and in both backward products. The 16-bit kernels also
accumulate in fp32 and round once, so the numerics are those of a 16-bit GEMM (only the summation order
differs). The 16-bit tensors are what autograd saves (no fp32 activations kept). Chosen once per process
from the CPU's flags (``/proc/cpuinfo``), so every rank of a machine agrees; ``GPT_CPU_GEMM=fp32`` or
``=native`` forces either (``auto``, the default, decides by the flags).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

_NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> Optional[frozenset]:
    """The CPU's feature flags (Linux x86), None where they cannot be read (then nothing is changed)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=None)
def upcasts(dtype: torch.dtype) -> bool:
    """Whether CPU GEMMs in ``dtype`` are computed in fp32 here."""
    mode = os.environ.get("GPT_CPU_GEMM", "auto")
    if mode not in ("auto", "fp32", "native"):
        raise ValueError(f"GPT_CPU_GEMM must be auto, fp32 or native, got {mode!r}")
    if dtype not in _NATIVE_FLAGS or mode == "native":
        return False
    if mode == "fp32":
        return True
    flags = _cpu_flags()
    return flags is not None and "avx2" in flags and not any(f in flags for f in _NATIVE_FLAGS[dtype])


class _UpcastLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.float()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g.reshape(-1, g.shape[-1]).t() @ x.float().reshape(-1, x.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b


def _upcast_dtype(*operands: torch.Tensor) -> Optional[torch.dtype]:
    """The 16-bit dtype a CPU GEMM of ``operands`` would run in, if it is one computed in fp32 here: CPU
    autocast's dtype when autocast is on (it casts every operand to it), else the operands' own dtype when
    they share one; None otherwise (the native kernel runs)."""
    if operands[0].device.type != "cpu":
        return None
    autocast = torch.is_autocast_enabled("cpu")
    dtype = torch.get_autocast_dtype("cpu") if autocast else operands[0].dtype
    same = all(t.dtype == dtype for t in operands)
    return dtype if dtype in _NATIVE_FLAGS and (autocast or same) and _upcasts(dtype) else None


@torch.compiler.assume_constant_result
def _upcasts(dtype: torch.dtype) -> bool:
    """``upcasts``, a constant of the process to ``torch.compile`` (called while tracing, never traced: it reads
    ``/proc/cpuinfo``)."""
    return upcasts(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; in fp32 (rounded once) for 16-bit CPU GEMMs where ``upcasts``: the
    operands' own 16-bit dtype, or under CPU autocast its dtype (the operands are cast to it first, as
    autocast would; autocast is then off inside, or it would cast the fp32 upcasts straight back)."""
    dtype = _upcast_dtype(x, weight)
    if dtype is not None:
        with torch.autocast("cpu", enabled=False):
            return _UpcastLinear.apply(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return F.linear(x, weight, bias)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)``; on the fp32 upcasts of 16-bit CPU operands (or of
    operands under CPU autocast, cast to its dtype first) where ``upcasts``, the output rounded back once."""
    dtype = _upcast_dtype(q, k, v)
    if dtype is not None:
        with torch.autocast("cpu", enabled=False):
            up = [t.to(dtype).float() for t in (q, k, v)]
            return F.scaled_dot_product_attention(*up, **kwargs).to(dtype)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)
