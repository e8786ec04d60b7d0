"""AdamW on flat fp32 shards: the optimizer step of a ZeRO rank.

The arithmetic is torch.optim.AdamW's (single-tensor form), applied to a shard
that mixes pieces of several parameters; weight decay is applied only to the
``decay`` ranges of the shard (norms and biases are exempt, as in
``training/optim.py``). Stage 0 steps with torch's own AdamW, so every ZeRO
equivalence test also checks this function against torch's.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch


@torch.no_grad()
def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               decay: List[Tuple[int, int]], step: int, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float) -> None:
    """One AdamW update of ``param`` in place; ``grad`` is fp32 and already unscaled/clipped; ``step`` >= 1."""
    if weight_decay:
        for a, b in decay:
            param[a:b].mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    step_size = lr / (1.0 - beta1 ** step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2 ** step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
