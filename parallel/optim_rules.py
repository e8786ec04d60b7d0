"""Gradient and optimizer rules every data-parallel strategy shares (stage 0, ZeRO 1-3, FP8-LM).

The compute dtype of each precision, which parameters get weight decay, the AdamW every strategy
builds or mirrors, which rank counts a parameter in the global gradient norm, and the one
unscale-and-clip factor. They sit here, beside the parallel primitives, so that ``parallel/zero/``
and ``fp8/zero.py`` need nothing from ``training/``.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch
from torch import nn

from config import TrainConfig


COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
"""The dtype each ``precision`` computes in (fp8: the linear layers' GEMMs in FP8, everything else bf16)."""


def weight_decay_exempt(name: str, p: nn.Parameter) -> bool:
    """Norms (1-D) and biases (by name: fused biases are 2-D) get no weight decay."""
    return name.endswith("bias") or p.ndim < 2


def build_optimizer(named_params: Sequence[Tuple[str, nn.Parameter]], t: TrainConfig,
                    device: torch.device) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms and biases (``weight_decay_exempt``)."""
    exempt = [weight_decay_exempt(n, p) for n, p in named_params]
    decay = [p for (_, p), ex in zip(named_params, exempt) if not ex]
    no_decay = [p for (_, p), ex in zip(named_params, exempt) if ex]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                             fused=device.type == "cuda", foreach=None if device.type == "cuda" else True)


def owns_gradient(p: nn.Parameter, tp_rank: int) -> bool:
    """Count each global parameter once in the norm: TP-replicated ones (and pieces held by several TP ranks)
    on their first holder, tied copies never."""
    spec = p.spec
    if spec.shared_with is not None:
        return False
    return spec.owns_once(tp_rank)


def grad_factor(norm: float, loss_scale: float, max_norm: float) -> float:
    """What to multiply gradients by: unscale, and clip to ``max_norm`` (0 = off) given the unscaled norm."""
    factor = 1.0 / loss_scale
    if max_norm > 0 and norm > max_norm:
        factor *= max_norm / (norm + 1e-6)
    return factor


def local_grad_sq(params: List[nn.Parameter], tp_rank: int, device: torch.device) -> torch.Tensor:
    """Squared L2 norm of the gradients this rank owns (``owns_gradient``), fp32, shape (1,)."""
    owned = [p.grad for p in params if owns_gradient(p, tp_rank)]
    local = torch.nn.utils.get_total_norm(owned, 2.0) if owned else torch.zeros((), device=device)
    return (local.float() ** 2).reshape(1)


def unscaled_norm(sq: float, loss_scale: float) -> float:
    """The global gradient norm from the world's sum of squares of the scaled gradients (NaN or inf when a
    gradient is not finite)."""
    return math.sqrt(sq) / loss_scale if sq >= 0 else math.nan


def unscale_and_clip(buffers: List[torch.Tensor], sq: float, loss_scale: float, max_norm: float) -> Tuple[float, bool]:
    """Given the global squared norm of the scaled gradients, one in-place pass that unscales and clips.

    Returns (norm of the unscaled gradients, finite). Non-finite gradients are left untouched.
    """
    norm = unscaled_norm(sq, loss_scale)
    if not math.isfinite(norm):
        return norm, False
    factor = grad_factor(norm, loss_scale, max_norm)
    if factor != 1.0:
        for buf in buffers:
            buf.mul_(factor)
    return norm, True
