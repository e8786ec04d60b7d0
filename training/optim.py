"""The learning-rate schedule and dynamic loss scaling (the rules the strategies share for gradients and
AdamW live in ``parallel/optim_rules.py``)."""
from __future__ import annotations

import math
from typing import Dict

from config import LossScaleConfig, TrainConfig


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
        return {"scale": self.scale, "clean_steps": self.clean_steps, "enabled": self.enabled}

    def load_state_dict(self, state: Dict[str, float]) -> bool:
        """Restore a saved scaler of the same kind (both fp16's dynamic scaler, or both off) and return True. A
        scaler that was on where this one is off, or off where this one is on (a resume into or out of fp16
        compute), is not this precision's: this one stays as built (loss_scale.initial for fp16, else 1) and
        False is returned. ``enabled`` is in states saved since issue 53; for older ones the caller adds it."""
        if bool(state.get("enabled", self.enabled)) != self.enabled:
            return False
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
        return True
