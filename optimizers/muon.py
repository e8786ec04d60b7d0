"""Muon for one weight matrix: torch.optim.Muon's arithmetic, split where a tensor-parallel caller needs it split.

Muon (Keller Jordan, 2024; "Muon is Scalable for LLM Training", 2502.16982) updates a 2-D weight with the
orthogonalised momentum of its gradient:
  buf    = lerp(buf, g, 1 - momentum)                      ``momentum_update`` (elementwise)
  u      = lerp(g, buf, momentum) if nesterov else buf
  O      = NewtonSchulz5(u)  ~ U V^T of u = U S V^T        ``newton_schulz`` (needs the WHOLE matrix)
  param *= 1 - lr * weight_decay; param -= adjusted_lr * O  ``muon_apply`` (elementwise, lr from the whole shape)
``muon_step`` is the one-process composition; a tensor-parallel caller runs the momentum on its piece, gathers
``u`` whole, orthogonalises it and applies its own piece of ``O`` with the whole matrix's shape.

Newton-Schulz is torch's ``_zeropower_via_newtonschulz``: in bf16, the matrix transposed when it has more rows than
columns, divided by its Frobenius norm (clamped at eps), then ``steps`` quintic iterations
  A = X X^T;  B = b A + c A A;  X = a X + B X.
On CUDA, and on CPUs with native bf16 GEMMs, it runs torch's bf16 ops as they are. On an x86 CPU without them
(``parallel.cpu_gemm.upcasts``: AVX2 without AVX512-BF16/AMX) torch's bf16 GEMMs are ~50x slower than fp32, so each
product is computed as an fp32 GEMM of the bf16 values and rounded to bf16 once (``addmm``: beta*C + alpha*(A@B)
in fp32, one rounding). The bf16 kernel also accumulates in fp32 and rounds once, so the two differ only in
summation order: measured on a 2-core AVX2 EPYC (torch 2.13), ~1e-4 of the bf16 roundings fall the other way, and
the iteration (slope 3.4 at small singular values) grows those to at most ~1.2% of the result (median 0: most
matrices agree bit for bit); either is ~1.5% from float64 arithmetic of the same iteration.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch

from parallel.cpu_gemm import upcasts

try:  # torch's own constants, where this torch has Muon
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS
except ImportError:  # Keller Jordan's values, as torch has them
    DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS = 3.4445, -4.7750, 2.0315, 5, 1e-7

COEFFICIENTS: Tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
STEPS = DEFAULT_NS_STEPS
ADJUST = ("original", "match_rms_adamw")


def momentum_update(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Advance the momentum buffer in place and return the update to orthogonalise (``buf`` itself without
    nesterov: do not write into the result). Elementwise: a tensor-parallel piece is fine."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def _mm(a: torch.Tensor, b: torch.Tensor, emulate: bool) -> torch.Tensor:
    return (a.float() @ b.float()).to(torch.bfloat16) if emulate else a @ b


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, alpha: float,
           emulate: bool) -> torch.Tensor:
    if emulate:  # as the bf16 kernel: alpha * (A @ B) and beta * C each in fp32, their sum rounded to bf16 once
        return (beta * c.float() + alpha * (a.float() @ b.float())).to(torch.bfloat16)
    return torch.addmm(c, a, b, beta=beta, alpha=alpha)


@torch.no_grad()
def newton_schulz(update: torch.Tensor, coefficients: Sequence[float] = COEFFICIENTS, steps: int = STEPS,
                  eps: float = EPS) -> torch.Tensor:
    """The bf16 orthogonalisation of the 2-D ``update`` (not modified), shaped like it; torch's
    ``_zeropower_via_newtonschulz`` (see the module docstring for the CPU emulation of its bf16 GEMMs)."""
    if update.dim() != 2:
        raise ValueError(f"muon: newton_schulz takes a 2-D matrix, got shape {tuple(update.shape)}")
    if steps >= 100:
        raise ValueError(f"muon: Newton-Schulz steps must be < 100, got {steps}")
    if len(coefficients) != 3:
        raise ValueError(f"muon: Newton-Schulz needs 3 coefficients, got {len(coefficients)}")
    a, b, c = coefficients
    emulate = update.device.type == "cpu" and upcasts(torch.bfloat16)
    x = update.to(torch.bfloat16, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = _mm(x, x.T, emulate)
        gram_update = _addmm(gram, gram, gram, beta=b, alpha=c, emulate=emulate)
        x = _addmm(x, gram_update, x, beta=a, alpha=1.0, emulate=emulate)
    return x.T if tall else x


def adjusted_lr(lr: float, shape: Sequence[int], adjust: str) -> float:
    """torch's ``_adjust_lr`` for a matrix of ``shape`` (A, B): "original" (Keller Jordan) lr*sqrt(max(1, A/B));
    "match_rms_adamw" (Moonshot) lr*0.2*sqrt(max(A, B)), which makes the update's RMS AdamW's (~0.2)."""
    A, B = shape[:2]
    if adjust == "original":
        return lr * math.sqrt(max(1, A / B))
    if adjust == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(A, B)))
    raise ValueError(f"muon: adjust must be one of {ADJUST}, got {adjust!r}")


@torch.no_grad()
def muon_apply(param: torch.Tensor, ortho: torch.Tensor, lr: float, weight_decay: float, adjust: str,
               shape: Sequence[int]) -> None:
    """Decoupled weight decay, then ``param -= adjusted_lr * ortho``. ``param`` and ``ortho`` may be matching
    tensor-parallel pieces: ``shape`` is the WHOLE matrix's 2-D shape, which sets the learning rate."""
    if ortho.shape != param.shape:
        raise ValueError(f"muon: ortho shape {tuple(ortho.shape)} != param shape {tuple(param.shape)}")
    param.mul_(1 - lr * weight_decay)
    param.add_(ortho, alpha=-adjusted_lr(lr, shape, adjust))


@torch.no_grad()
def muon_step(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, lr: float, weight_decay: float,
              momentum: float = 0.95, nesterov: bool = True, coefficients: Sequence[float] = COEFFICIENTS,
              steps: int = STEPS, eps: float = EPS, adjust: str = "match_rms_adamw") -> None:
    """One Muon update of the whole 2-D ``param`` in place (``buf``, its momentum buffer, too): torch.optim.Muon's
    single-tensor step. Note the default ``adjust``: torch's Muon defaults to "original"."""
    if param.dim() != 2 or grad.shape != param.shape or buf.shape != param.shape:
        raise ValueError(f"muon: param, grad and buf must be one 2-D shape, got {tuple(param.shape)}, "
                         f"{tuple(grad.shape)}, {tuple(buf.shape)}")
    update = momentum_update(grad, buf, momentum, nesterov)
    ortho = newton_schulz(update, coefficients, steps, eps)
    muon_apply(param, ortho, lr, weight_decay, adjust, tuple(param.shape))
