"""Optimizer, learning-rate schedule, dynamic loss scaling and global-norm clipping."""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from parallel import comm
from parallel.comm import Group
from training.config import LossScaleConfig, TrainConfig


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


class LRSchedule:
    """Linear warm-up to the peak, cosine decay to ``min_lr_ratio`` x peak, then flat."""

    def __init__(self, t: TrainConfig):
        self.peak, self.floor = t.lr, t.lr * t.min_lr_ratio
        self.warmup = t.warmup_steps
        self.decay_end = t.decay_steps if t.decay_steps is not None else t.max_steps

    def __call__(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        if step >= self.decay_end:
            return self.floor
        progress = (step - self.warmup) / max(self.decay_end - self.warmup, 1)
        return self.floor + 0.5 * (self.peak - self.floor) * (1.0 + math.cos(math.pi * progress))

    def state_dict(self) -> Dict[str, float]:
        return {"peak": self.peak, "floor": self.floor, "warmup": self.warmup, "decay_end": self.decay_end}


class LossScaler:
    """Dynamic loss scaling for fp16: halve and skip on inf/nan, double after a clean window.

    For fp32 / bf16 the scale stays 1; a non-finite gradient still skips the step.
    """

    def __init__(self, cfg: LossScaleConfig, enabled: bool):
        self.enabled = enabled
        self.scale = cfg.initial if enabled else 1.0
        self.growth_interval, self.min_scale = cfg.growth_interval, cfg.min_scale
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            if self.scale <= self.min_scale:
                raise FloatingPointError(f"fp16 gradients overflow even at the minimum loss scale "
                                         f"loss_scale.min_scale={self.min_scale:g} (lower it, or use bf16)")
            self.scale = max(self.scale / 2, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= 2
            self.clean_steps = 0

    def state_dict(self) -> Dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


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


def unscale_and_clip(params: List[nn.Parameter], buffers: List[torch.Tensor], mp: Group, tp_rank: int,
                     loss_scale: float, max_norm: float) -> Tuple[float, bool]:
    """Global gradient norm over the model-parallel group, then one in-place pass that unscales and clips.

    Returns (norm of the unscaled gradients, finite). Non-finite gradients are left untouched.
    """
    owned = [p.grad for p in params if owns_gradient(p, tp_rank)]
    local = torch.nn.utils.get_total_norm(owned, 2.0) if owned else torch.zeros((), device=buffers[0].device)
    sq = (local.float() ** 2).reshape(1)
    comm.all_reduce(sq, mp)
    norm = sq.sqrt().item() / loss_scale
    if not math.isfinite(norm):
        return norm, False
    factor = grad_factor(norm, loss_scale, max_norm)
    if factor != 1.0:
        for buf in buffers:
            buf.mul_(factor)
    return norm, True
