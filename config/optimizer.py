"""The optimizer settings beside AdamW's (``train.optimizer`` and its sections) and their checks.

``train.optimizer`` picks the update rule; AdamW's own settings (``train.beta1``, ``beta2``, ``eps``,
``weight_decay``) stay where they were, and the other rules read theirs from ``train.<name>``. The learning-rate
schedule, the weight-decay exemptions (norms and biases), the gradient clip and loss scaling are the shared rules
of every optimizer (``parallel/optim_rules.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

OPTIMIZERS = ("adamw", "adafactor", "adamw8bit", "muon")
"""``train.optimizer``'s values; adamw is the default."""

MUON_ADJUST_LR = ("match_rms_adamw", "original")
MAX_NS_STEPS = 99  # torch.optim.Muon refuses 100 or more
MAX_QUANT_STATE_BLOCK = 1 << 20


@dataclass
class AdafactorConfig:
    """torch.optim.Adafactor's arithmetic: factored second moments for matrices, a plain one for vectors; the step
    size is min(relative step, 1/sqrt(step)) times the parameter's RMS (at least eps2). The relative step is
    train.adafactor.lr under train.lr's schedule (warm-up, cosine: lr x schedule / train.lr)."""
    lr: Optional[float] = None
    """Adafactor's peak relative step (torch.optim.Adafactor's lr, a fraction of each parameter's RMS); null =
    auto: train.lr / model.init_std (0.002 / 0.02 = 0.1 at the defaults), so that a weight of the initial RMS moves
    by AdamW's step at the start. A number: torch's arithmetic with it (torch's own default is 1e-2, made for weights
    of RMS ~1, a tenth of AdamW's step here)."""
    weight_decay: Optional[float] = None
    """Decoupled weight decay (torch's: the parameter times 1 - lr x weight_decay a step, lr the relative step; none
    on norms and biases); null = auto: train.weight_decay x train.lr / Adafactor's lr (given or auto), so lr x decay
    a step is AdamW's (a decay of 0.002 at the defaults). A number: used as given."""
    beta2_decay: float = -0.8
    """The second moment's decay: 1 - beta2 at step t is t ** beta2_decay (negative)."""
    eps1: Optional[float] = None
    """Floor of the second-moment estimate (squared before use); null = the machine epsilon of fp32."""
    eps2: float = 1e-3
    """Floor of the parameter's RMS in the relative step size."""
    clip_threshold: float = 1.0
    """Update clipping: an update whose RMS exceeds this is scaled down to it (torch's ``d``)."""


@dataclass
class Adamw8bitConfig:
    """8-bit AdamW (Dettmers et al.): both moments kept as 8-bit codes of a dynamic map with one fp32 scale (the
    absmax) per block; betas, eps and weight decay are AdamW's (train.beta1, ...)."""
    block_size: int = 256
    """Elements per quantization block (each a tensor's or tensor-parallel piece's consecutive elements; blocks
    never straddle two tensors or two ranks' pieces)."""


@dataclass
class MuonConfig:
    """torch.optim.Muon for the 2-D weight matrices of the transformer blocks (Newton-Schulz orthogonalised
    momentum); AdamW (train.beta1, ...) for the embedding, the output head, norms and biases."""
    momentum: float = 0.95
    """Momentum of the matrices' update."""
    nesterov: bool = True
    """Nesterov momentum."""
    ns_steps: int = 5
    """Newton-Schulz iterations (torch's coefficients 3.4445, -4.7750, 2.0315)."""
    eps: float = 1e-7
    """Floor of the Frobenius norm the momentum is divided by before the iterations."""
    adjust_lr: str = "match_rms_adamw"
    """match_rms_adamw (Moonshot's: lr x 0.2 sqrt(max(rows, cols)), so the update's RMS matches AdamW's and
    train.lr and train.weight_decay carry over from AdamW) | original (Keller Jordan's: lr x sqrt(max(1,
    rows/cols)), needs a Muon-sized learning rate, ~0.02)."""


def adafactor_settings(cfg) -> Tuple[float, float]:
    """(peak relative step, weight decay) that Adafactor runs with: ``train.adafactor.lr`` and ``weight_decay``,
    or for null what they derive from (``AdafactorConfig``). From the config alone, so every rank of every layout,
    and a resume of the same config, has the same numbers."""
    t, a = cfg.train, cfg.train.adafactor
    lr = a.lr if a.lr is not None else t.lr / cfg.model.init_std
    decay = a.weight_decay if a.weight_decay is not None else t.weight_decay * t.lr / lr
    return lr, decay


def adafactor_line(cfg) -> str:
    """The start-up line: what Adafactor's relative step and weight decay are, and why."""
    a = cfg.train.adafactor
    lr, decay = adafactor_settings(cfg)
    if a.lr is None:
        what = (f"train.adafactor.lr=auto: {lr:.4g} = train.lr {cfg.train.lr:g} / model.init_std "
                f"{cfg.model.init_std:g} (the weights' initial RMS: a step starts as AdamW's)")
    else:
        what = f"train.adafactor.lr={lr:g} (given)"
    if a.weight_decay is None:
        what += (f", weight_decay=auto: {decay:.4g} (lr x decay = train.lr x train.weight_decay, "
                 f"{cfg.train.lr * cfg.train.weight_decay:.4g} a step)")
    else:
        what += f", weight_decay={decay:g} (given)"
    return f"[train] adafactor: {what}; under train.lr's schedule"


def validate_optimizer(cfg, need: Callable[[bool, str], None]) -> None:
    """The optimizer's checks, one line each, reported with the rest of ``validate_config``."""
    t = cfg.train
    # the names (train.optimizer, train.muon.adjust_lr) are checked with every string setting (schema.CHOICES)
    a, q, m = t.adafactor, t.adamw8bit, t.muon
    need(a.lr is None or (math.isfinite(a.lr) and a.lr > 0),
         f"train.adafactor.lr={a.lr} must be a number > 0, or null (auto: train.lr / model.init_std)")
    need(a.weight_decay is None or (math.isfinite(a.weight_decay) and a.weight_decay >= 0),
         f"train.adafactor.weight_decay={a.weight_decay} must be a number >= 0, or null (auto: lr x decay = AdamW's)")
    init_std = cfg.model.init_std
    need(t.optimizer != "adafactor" or a.lr is not None or (math.isfinite(init_std) and init_std > 0),
         f"model.init_std={init_std} must be > 0 for train.adafactor.lr=null (auto: train.lr / model.init_std); "
         "or set train.adafactor.lr")
    need(math.isfinite(a.beta2_decay) and a.beta2_decay < 0,
         f"train.adafactor.beta2_decay={a.beta2_decay} must be a negative number (1 - beta2 = step ** beta2_decay)")
    need(a.eps1 is None or (math.isfinite(a.eps1) and a.eps1 > 0),
         f"train.adafactor.eps1={a.eps1} must be a positive number or null")
    need(math.isfinite(a.eps2) and a.eps2 >= 0, f"train.adafactor.eps2={a.eps2} must be a number >= 0")
    need(math.isfinite(a.clip_threshold) and a.clip_threshold > 0,
         f"train.adafactor.clip_threshold={a.clip_threshold} must be a number > 0")
    need(1 <= q.block_size <= MAX_QUANT_STATE_BLOCK,
         f"train.adamw8bit.block_size={q.block_size} must be in [1, {MAX_QUANT_STATE_BLOCK}] elements")
    need(math.isfinite(m.momentum) and 0 <= m.momentum < 1, f"train.muon.momentum={m.momentum} must be in [0, 1)")
    need(1 <= m.ns_steps <= MAX_NS_STEPS, f"train.muon.ns_steps={m.ns_steps} must be in [1, {MAX_NS_STEPS}]")
    need(math.isfinite(m.eps) and m.eps > 0, f"train.muon.eps={m.eps} must be a number > 0")
    for key in ("beta1", "beta2"):
        value = getattr(t, key)
        need(math.isfinite(value) and 0 <= value < 1, f"train.{key}={value} must be in [0, 1)")
    need(math.isfinite(t.eps) and t.eps > 0, f"train.eps={t.eps} must be a number > 0")
    need(math.isfinite(t.weight_decay) and t.weight_decay >= 0,
         f"train.weight_decay={t.weight_decay} must be a number >= 0")
    if t.optimizer == "adamw":
        return
    need(cfg.precision != "fp8", f"train.optimizer={t.optimizer} does not combine with precision=fp8: FP8-LM keeps "
         "its own FP8 AdamW (FP8 first moment, fp16 second moment); use train.optimizer=adamw with it")
    z = cfg.zero
    need(z.stage == 0 or z.partition == "whole_tensor",
         f"train.optimizer={t.optimizer} with zero.stage={z.stage} needs zero.partition=whole_tensor (each rank "
         "updates whole tensors it owns: " + ("Newton-Schulz and Adafactor's row and column statistics need whole "
                                               "matrices)" if t.optimizer != "adamw8bit" else
                                               "8-bit blocks never straddle two ranks' shards)"))
    early = z.early_step and z.stage == 3 and z.hpz_size > 1 and z.quantized_weights and not z.weight_delta
    need(not early, f"zero.early_step=true (on by default) steps AdamW early: with train.optimizer={t.optimizer} "
         "set zero.early_step=false")
