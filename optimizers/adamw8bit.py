"""8-bit AdamW for one tensor: both moments kept as blockwise 8-bit codes (``optimizers/quant8.py``), the
arithmetic in fp32.

State of one tensor (bytes an element): ``exp_avg_codes`` uint8 [1] with ``exp_avg_scales`` fp32 [4 a block],
``exp_avg_sq_codes`` uint8 [1] with ``exp_avg_sq_scales`` fp32 [4 a block]: 2 + 8/256 = 2.03 bytes an element
at block 256, against AdamW's 8. The first moment uses the signed dynamic map, the second the unsigned one
(bitsandbytes' and torchao's choice: v >= 0, so the unsigned map spends all 256 codes on one sign).

One update (``adamw8bit_step``), as torchao's and bitsandbytes' 8-bit Adam:
  1. dequantize m and v to fp32;
  2. torch.optim.AdamW's single-tensor arithmetic, operation for operation the one of ``parallel/zero/adamw.py``:
     decoupled decay ``p *= 1 - lr*wd`` first, ``m.lerp_(g, 1-beta1)``, ``v = v*beta2 + (1-beta2)*g*g``, bias
     corrections, ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``. The step uses the fp32 m and v just computed;
     the 8-bit copies only carry them to the next step;
  3. re-quantize both with fresh block scales.
Blocks are consecutive elements of the tensor handed in: a tensor-parallel piece makes its own blocks.

Checkpoints hold the moments as fp32 (``dequantized_moments``) and ``load_moments`` re-quantizes them; that round
trip is exact (quant8's docstring), so a resume continues bit for bit. A NaN or inf gradient is not hidden: it
reaches the moments and the whole block of each moment reads NaN from then on (quant8's rule).

Not compiled: ``torch.compile`` of ``adamw8bit_step`` (torch 2.13, CPU, 2 cores) took 77 s for its first call,
recompiled for each new ``step`` (8 s) and did not reproduce the eager bits; the eager step is a handful of
elementwise passes and one ``bucketize`` a moment.
"""
from __future__ import annotations

import math
from typing import Dict, Sequence, Tuple

import torch

from optimizers.quant8 import dequantize, map_on, num_blocks, quantize

STATE_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")


def adamw8bit_state(shape: Sequence[int], device: torch.device, block: int = 256) -> Dict[str, torch.Tensor]:
    """Zero moments for a tensor of ``shape``: each moment's zero code (quant8 of zeros) and scales 0."""
    zeros = torch.zeros(tuple(shape), dtype=torch.float32, device=device)
    m_codes, m_scales = quantize(zeros, map_on(True, zeros.device), block)
    v_codes, v_scales = quantize(zeros, map_on(False, zeros.device), block)
    return {"exp_avg_codes": m_codes, "exp_avg_scales": m_scales,
            "exp_avg_sq_codes": v_codes, "exp_avg_sq_scales": v_scales}


def _check_state(state: Dict[str, torch.Tensor], shape: Sequence[int], block: int) -> None:
    shape = tuple(shape)
    nb = num_blocks(math.prod(shape), block)
    for k in ("exp_avg", "exp_avg_sq"):
        codes, scales = state[k + "_codes"], state[k + "_scales"]
        if tuple(codes.shape) != shape or codes.dtype != torch.uint8:
            raise ValueError(f"adamw8bit: {k}_codes must be uint8 of shape {shape}, got "
                             f"{tuple(codes.shape)} {codes.dtype}")
        if tuple(scales.shape) != (nb,) or scales.dtype != torch.float32:
            raise ValueError(f"adamw8bit: {k}_scales must be float32 of shape ({nb},) (blocks of {block}), got "
                             f"{tuple(scales.shape)} {scales.dtype}")


@torch.no_grad()
def dequantized_moments(state: Dict[str, torch.Tensor], shape: Sequence[int],
                        block: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq) as fresh fp32 tensors of ``shape`` (what a checkpoint holds)."""
    _check_state(state, shape, block)
    dev = state["exp_avg_codes"].device
    m = dequantize(state["exp_avg_codes"], state["exp_avg_scales"], map_on(True, dev), block)
    v = dequantize(state["exp_avg_sq_codes"], state["exp_avg_sq_scales"], map_on(False, dev), block)
    return m, v


def _store(state: Dict[str, torch.Tensor], exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, block: int) -> None:
    dev = state["exp_avg_codes"].device
    for k, x, signed in (("exp_avg", exp_avg, True), ("exp_avg_sq", exp_avg_sq, False)):
        codes, scales = quantize(x, map_on(signed, dev), block)
        state[k + "_codes"].copy_(codes)
        state[k + "_scales"].copy_(scales)


@torch.no_grad()
def load_moments(state: Dict[str, torch.Tensor], exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 block: int) -> None:
    """Re-quantize fp32 moments (from a checkpoint) into ``state`` in place; exact for what
    ``dequantized_moments`` returned. A negative second moment cannot come from AdamW: ValueError."""
    shape = tuple(state["exp_avg_codes"].shape)
    _check_state(state, shape, block)
    for name, x in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if tuple(x.shape) != shape or x.dtype != torch.float32:
            raise ValueError(f"adamw8bit: {name} must be float32 of shape {shape}, got {tuple(x.shape)} {x.dtype}")
    if bool((exp_avg_sq < 0).any()):
        raise ValueError(f"adamw8bit: exp_avg_sq has negative values (min {exp_avg_sq.min().item():g}); "
                         "a second moment is >= 0")
    _store(state, exp_avg.to(state["exp_avg_codes"].device), exp_avg_sq.to(state["exp_avg_codes"].device), block)


@torch.no_grad()
def adamw8bit_step(param: torch.Tensor, grad: torch.Tensor, state: Dict[str, torch.Tensor], step: int, lr: float,
                   beta1: float, beta2: float, eps: float, weight_decay: float, block: int) -> None:
    """One AdamW update of fp32 ``param`` in place with 8-bit moments ``state`` (updated in place); ``grad`` fp32,
    already unscaled and clipped; ``step`` >= 1 counts this update."""
    if grad.shape != param.shape:
        raise ValueError(f"adamw8bit: grad shape {tuple(grad.shape)} != param shape {tuple(param.shape)}")
    exp_avg, exp_avg_sq = dequantized_moments(state, param.shape, block)
    if weight_decay:
        param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    step_size = lr / (1.0 - beta1 ** step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2 ** step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    _store(state, exp_avg, exp_avg_sq, block)
