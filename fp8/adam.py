"""The FP8-LM AdamW (SPEC §4, "FP8 optimizer (§2.2)"): narrow optimizer state, fp32 arithmetic.

State of one tensor (bytes a parameter in brackets):

  master  FP16 with a per-tensor scale [2]  (or FP32 without a scale [4], ``master_dtype="fp32"``)
  m       E4M3 with a per-tensor scale [1]  first moment
  v       FP16 with a per-tensor scale [2]  second moment (FP8 here diverges, per the paper)

plus the gradient, which the caller keeps in FP8 [1]: 6 bytes a parameter instead of 16.
Every scale follows ``fp8/format.py``'s convention ``q = cast(x * s)``, ``x ≈ q / s`` and is a
0-dim fp32 tensor (it may be a view into a vector of scales: it is only ever written in place).

One update (``adamw_update``), for one whole tensor:
  1. dequantize master, m and v to fp32;
  2. the AdamW step in fp32, operation for operation the one of ``parallel/zero/adamw.py``
     (torch.optim.AdamW's single-tensor form: decoupled decay ``p *= 1 - lr*wd`` first, then
     m, v, bias corrections, ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``); the step uses
     the fp32 m and v just computed, the narrow copies only carry them to the next step;
  3. requantize all three with fresh scales from their new amax (current scaling).

Scale rules (why):
  * master and v, FP16: ``s = 2**floor(log2(65504 / amax))`` (power of two, no margin).
    A power-of-two scale makes ``q / s`` and ``x * s`` exact, so an element the step did not
    change re-rounds to itself, whether or not the scale moved with the amax: no drift from
    requantizing every step. The scale is computed from the very values it casts, so nothing
    can overflow and a margin would only cost a binade at the small end (FP16 precision is
    relative, a scale shifts range, not resolution). Amax lands in (32752, 65504].
  * m, E4M3: a power of two as well, ``s = 2**floor(log2(448 / amax))`` (amax lands in (224, 448]).
    E4M3 precision is relative too, so this costs at most one binade of range at the bottom, and it
    makes ``q / s`` exact: the fp32 values a checkpoint holds requantize to the very same bits
    (``set_moments``), which is what makes an FP8 resume bitwise (``fp8/zero.py``).
  * amax 0 (a zero tensor), inf or NaN: the previous scale is kept (``format.scale_from_amax``);
    zeros quantize to zeros, ``sqrt(0) + eps > 0`` so a zero m/v never makes a NaN. A NaN in the
    gradient is not hidden: it reaches the state, and the caller (loss scaler) must skip such
    steps.

Known limit of the formats (not fixed here): an element of v more than ~2**39 below the
tensor's amax flushes to 0 in FP16 and its step becomes ``m / eps``; E4M3 m flushes first in
the usual case (its range is 2**17.8 against sqrt(v)'s 2**19.5), so this needs a near-zero m
amax relative to sqrt(v).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Optional, Tuple, Union

import torch

from fp8.format import E4M3, amax, dequantize, quantize, scale_from_amax
from fp8.segments import Segments

MASTER_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
M_DTYPE = E4M3
V_DTYPE = torch.float16
STATE_KEYS = ("master", "master_scale", "m", "m_scale", "v", "v_scale")


def _scale(x: torch.Tensor, dtype: torch.dtype, previous: Optional[torch.Tensor]) -> torch.Tensor:
    """The scale rule above: a power of two below ``max(dtype) / amax`` (master, m, v alike)."""
    return scale_from_amax(amax(x), dtype, margin=0, power_of_two=True, previous=previous)


def _requantize(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Write fp32 ``x`` into ``q`` (its dtype) and ``scale`` in place with a fresh scale."""
    s = _scale(x, q.dtype, previous=scale)
    q.copy_(quantize(x, s, q.dtype))
    scale.copy_(s)


def _check(master: torch.Tensor, master_scale: Optional[torch.Tensor], m: torch.Tensor, m_scale: torch.Tensor,
           v: torch.Tensor, v_scale: torch.Tensor, grad: torch.Tensor) -> None:
    if master.dtype not in MASTER_DTYPES.values():
        raise TypeError(f"fp8 adam: master must be float16 (scaled) or float32, got {master.dtype}")
    if master.dtype == torch.float16 and master_scale is None:
        raise ValueError("fp8 adam: an FP16 master needs its master_scale")
    if m.dtype != M_DTYPE or v.dtype != V_DTYPE:
        raise TypeError(f"fp8 adam: m must be {M_DTYPE} and v {V_DTYPE}, got {m.dtype} and {v.dtype}")
    for name, s in (("master_scale", master_scale), ("m_scale", m_scale), ("v_scale", v_scale)):
        if s is not None and (s.dim() != 0 or s.dtype != torch.float32):
            raise ValueError(f"fp8 adam: {name} must be a 0-dim float32 tensor, got {tuple(s.shape)} {s.dtype}")
    if not (master.shape == m.shape == v.shape == grad.shape):
        raise ValueError(f"fp8 adam: shapes differ: master {tuple(master.shape)}, m {tuple(m.shape)}, "
                         f"v {tuple(v.shape)}, grad {tuple(grad.shape)}")
    if grad.dtype != torch.float32:
        raise TypeError(f"fp8 adam: grad must be float32 (unscaled and clipped by the caller), got {grad.dtype}")


def bias_corrections(step: int, lr: Union[float, torch.Tensor], beta1: float,
                     beta2: float) -> Tuple[Union[float, torch.Tensor], float]:
    """``(step_size, sqrt(bc2))`` of step ``step``: ``lr / (1 - beta1**step)`` and ``sqrt(1 - beta2**step)``, in
    float64 as parallel/zero/adamw.py computes them (a 0-dim tensor step size for a tensor ``lr``)."""
    return lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step)


def _moments_and_step(p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                      step_size: Union[float, torch.Tensor], bc2_sqrt: Union[float, torch.Tensor], beta1: float,
                      beta2: float, eps: float) -> None:
    """AdamW after the decay, in fp32 and in place: m, v, bias corrections and the parameter step, operation for
    operation parallel/zero/adamw.py's (shared by the per-tensor and the packed update).

    ``step_size`` and ``bc2_sqrt`` (``bias_corrections``): Python floats, or 0-dim device tensors holding them
    (the compiled packed update, ``fp8/zero.py`` under ``train.compile``, where a Python float that changes every
    step would be a constant of the graph). With a tensor step size the parameter step is ``p - (m * step_size) /
    denom``, addcdiv's order on CPU (addcdiv takes no tensor factor): the same bits there, which the packed update
    run eagerly relies on to match the per-tensor one (tested); fp32 tensors hold the values an fp32 kernel rounds
    the floats to."""
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    if isinstance(step_size, torch.Tensor):
        p.sub_(exp_avg * step_size.float() / denom)
    else:
        p.addcdiv_(exp_avg, denom, value=-step_size)


@torch.no_grad()
def adamw_update(master: torch.Tensor, master_scale: Optional[torch.Tensor], m: torch.Tensor,
                 m_scale: torch.Tensor, v: torch.Tensor, v_scale: torch.Tensor, grad: torch.Tensor, *,
                 step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step of one whole tensor, every argument updated in place; ``step`` >= 1.

    ``master`` is FP16 with ``master_scale`` or FP32 (``master_scale`` ignored, may be None);
    ``m`` E4M3, ``v`` FP16, scales 0-dim fp32; ``grad`` fp32, already unscaled and clipped.
    ``weight_decay`` applies to the whole tensor (pass 0 for exempt tensors)."""
    _check(master, master_scale, m, m_scale, v, v_scale, grad)
    if step < 1:
        raise ValueError(f"fp8 adam: step counts from 1, got {step}")
    fp32_master = master.dtype == torch.float32
    # 1. dequantize (an fp32 master is stepped in place, exactly as parallel/zero/adamw.py does)
    p = master if fp32_master else dequantize(master, master_scale)
    exp_avg = dequantize(m, m_scale)
    exp_avg_sq = dequantize(v, v_scale)
    # 2. the step in fp32: parallel/zero/adamw.py's operations in its order
    if weight_decay:
        p.mul_(1.0 - lr * weight_decay)
    _moments_and_step(p, exp_avg, exp_avg_sq, grad, *bias_corrections(step, lr, beta1, beta2), beta1, beta2, eps)
    # 3. requantize with fresh scales
    if not fp32_master:
        _requantize(p, master, master_scale)
    _requantize(exp_avg, m, m_scale)
    _requantize(exp_avg_sq, v, v_scale)


def _requantize_packed(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, segments: Segments) -> None:
    """``_requantize`` of T tensors stored back to back: fresh per-tensor scales from per-tensor amaxes."""
    s = scale_from_amax(segments.max(x.abs()), q.dtype, margin=0, power_of_two=True, previous=scales)
    q.copy_(quantize(x, segments.spread(s), q.dtype))
    scales.copy_(s)


@torch.no_grad()
def adamw_update_packed(master: torch.Tensor, master_scales: Optional[torch.Tensor], m: torch.Tensor,
                        m_scales: torch.Tensor, v: torch.Tensor, v_scales: torch.Tensor, grad: torch.Tensor,
                        segments: Segments, weight_decays: torch.Tensor, *, step: int, lr: Union[float, torch.Tensor],
                        beta1: float, beta2: float, eps: float) -> None:
    """``adamw_update`` of T whole tensors stored back to back in flat buffers, in a fixed number of kernels
    whatever T is (the per-tensor loop launches some 40 small kernels a tensor, which is what an FP8 step
    spends its GPU time on).

    ``segments``: the T tensors' lengths (``fp8/segments.py``; no gaps); scales: fp32 [T], updated in place; ``weight_decays``:
    float64 [T] (the decoupled factor ``1 - lr * wd`` is formed in float64, as Python does for the per-tensor
    call, and rounded once to fp32; exempt tensors have 0 and are multiplied by exactly 1). Every element
    goes through the per-tensor function's operations with its tensor's scalars, so the results are those of
    ``adamw_update`` tensor by tensor (tested bit for bit)."""
    if step < 1:
        raise ValueError(f"fp8 adam: step counts from 1, got {step}")
    step_size, bc2_sqrt = bias_corrections(step, lr, beta1, beta2)
    adamw_update_segments(master, master_scales, m, m_scales, v, v_scales, grad, segments,
                          (1.0 - lr * weight_decays).to(torch.float32), step_size=step_size, bc2_sqrt=bc2_sqrt,
                          beta1=beta1, beta2=beta2, eps=eps)


@torch.no_grad()
def adamw_update_segments(master: torch.Tensor, master_scales: Optional[torch.Tensor], m: torch.Tensor,
                          m_scales: torch.Tensor, v: torch.Tensor, v_scales: torch.Tensor, grad: torch.Tensor,
                          segments: Segments, keep: torch.Tensor, *, step_size: Union[float, torch.Tensor],
                          bc2_sqrt: Union[float, torch.Tensor], beta1: float, beta2: float, eps: float) -> None:
    """``adamw_update_packed`` with the step's scalars made by the caller: ``keep`` fp32 [T], each tensor's
    decoupled decay factor ``1 - lr * wd``; ``step_size``, ``bc2_sqrt``: ``bias_corrections`` (floats, or 0-dim
    fp32 device tensors).

    Why the split: compiled, every scalar computed inside the update is recomputed per element by the fused
    kernel (inductor inlines 0-dim producers into their consumers). From the step number and a learning rate
    that was two float64 ``pow``, a float64 ``sqrt`` and float64 divisions an element, which made the AdamW kernel
    of a 50M-element unit compute-bound (read in the generated code: ``libdevice.pow(0.95, ks0)`` per element).
    The caller (``fp8/zero.py``) forms them once a step on the host, in float64 as Python does, and passes them
    as fp32 device scalars: the same values, so the same bits."""
    n = master.numel()
    if not (m.numel() == v.numel() == grad.numel() == n == segments.numel):
        raise ValueError(f"fp8 adam: packed buffers differ in length: master {n}, m {m.numel()}, v {v.numel()}, "
                         f"grad {grad.numel()}, segments {segments.numel}")
    if master.dtype not in MASTER_DTYPES.values() or m.dtype != M_DTYPE or v.dtype != V_DTYPE:
        raise TypeError(f"fp8 adam: master, m, v must be float16/float32, {M_DTYPE}, {V_DTYPE}; got {master.dtype}, "
                        f"{m.dtype}, {v.dtype}")
    if grad.dtype != torch.float32 or keep.dtype != torch.float32:
        raise TypeError(f"fp8 adam: grad and keep must be float32, got {grad.dtype} and {keep.dtype}")
    fp32_master = master.dtype == torch.float32
    p = master if fp32_master else dequantize(master, segments.spread(master_scales))
    exp_avg = dequantize(m, segments.spread(m_scales))
    exp_avg_sq = dequantize(v, segments.spread(v_scales))
    p.mul_(segments.spread(keep))
    _moments_and_step(p, exp_avg, exp_avg_sq, grad, step_size, bc2_sqrt, beta1, beta2, eps)
    if not fp32_master:
        _requantize_packed(p, master, master_scales, segments)
    _requantize_packed(exp_avg, m, m_scales, segments)
    _requantize_packed(exp_avg_sq, v, v_scales, segments)


@torch.no_grad()
def init_state(values: torch.Tensor, master_dtype: str = "fp16") -> Dict[str, Optional[torch.Tensor]]:
    """Fresh state for a tensor with initial weights ``values``: master (scaled FP16, or an fp32
    copy with ``master_scale`` None), m and v zero with scale 1. Keys: ``STATE_KEYS``."""
    if master_dtype not in MASTER_DTYPES:
        raise ValueError(f"fp8 adam: master_dtype must be one of {sorted(MASTER_DTYPES)}, got {master_dtype!r}")
    x = values.detach().float()

    def one() -> torch.Tensor:
        return torch.ones((), dtype=torch.float32, device=x.device)

    if master_dtype == "fp32":
        master, master_scale = x.clone(), None
    else:
        master, master_scale = torch.empty_like(x, dtype=torch.float16), one()
        _requantize(x, master, master_scale)
    return {"master": master, "master_scale": master_scale,
            "m": torch.zeros_like(x, dtype=M_DTYPE), "m_scale": one(),
            "v": torch.zeros_like(x, dtype=V_DTYPE), "v_scale": one()}


@torch.no_grad()
def set_master(master: torch.Tensor, master_scale: Optional[torch.Tensor], values: torch.Tensor) -> None:
    """Store fp32 ``values`` as the master in place (FP16 with a fresh scale, or a plain FP32 copy)."""
    if master.dtype == torch.float32:
        master.copy_(values)
    else:
        _requantize(values.float(), master, master_scale)


@torch.no_grad()
def set_moments(m: torch.Tensor, m_scale: torch.Tensor, v: torch.Tensor, v_scale: torch.Tensor,
                m_values: torch.Tensor, v_values: torch.Tensor) -> None:
    """Store fp32 first and second moments in place with fresh scales (the optimizer's own rule, so values
    that came out of this state give back the same bits)."""
    _requantize(m_values.float(), m, m_scale)
    _requantize(v_values.float(), v, v_scale)


def master_value(master: torch.Tensor, master_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """The master weights in fp32 (a copy for an FP16 master, ``master`` itself for an FP32 one)."""
    if master.dtype == torch.float32:
        return master
    return dequantize(master, master_scale)


def state_nbytes(state: Dict[str, Any]) -> int:
    """Bytes held by one tensor's optimizer state (data and scales; the step count not counted)."""
    return sum(t.numel() * t.element_size() for k, t in state.items() if k in STATE_KEYS and t is not None)


class Fp8AdamW(torch.optim.Optimizer):
    """AdamW over ordinary parameters with FP8-LM's state (``adamw_update`` on each tensor).

    Groups take ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``master_dtype`` ("fp16" or
    "fp32"). State is created at a parameter's first step from its values; after every step
    the parameter is overwritten with the master's value in the parameter's own dtype.
    ``state_dict()`` is a snapshot (cloned tensors, native dtypes, per-parameter step count and
    every scale); ``load_state_dict`` restores it bitwise."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, master_dtype: str = "fp16"):
        if not lr >= 0.0:
            raise ValueError(f"Fp8AdamW: lr must be >= 0, got {lr}")
        if not eps > 0.0:
            raise ValueError(f"Fp8AdamW: eps must be > 0 (a zero m/v would give 0/0), got {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Fp8AdamW: betas must lie in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Fp8AdamW: weight_decay must be >= 0, got {weight_decay}")
        if master_dtype not in MASTER_DTYPES:
            raise ValueError(f"Fp8AdamW: master_dtype must be one of {sorted(MASTER_DTYPES)}, got {master_dtype!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, master_dtype=master_dtype)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Fp8AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state.update(init_state(p, group["master_dtype"]))
                    state["step"] = 0
                state["step"] += 1
                adamw_update(state["master"], state["master_scale"], state["m"], state["m_scale"], state["v"],
                             state["v_scale"], p.grad.float(), step=state["step"], lr=group["lr"], beta1=beta1,
                             beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
                p.copy_(master_value(state["master"], state["master_scale"]))
        return loss

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd["state"] = {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in s.items()}
                       for k, s in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a ``state_dict()`` bitwise; dtypes and shapes are checked, never cast.

        (torch's own loader would cast every state tensor to the parameter's dtype.)"""
        saved = state_dict["state"]
        super().load_state_dict({**state_dict, "state": {}})
        params = [p for g in self.param_groups for p in g["params"]]
        groups = {id(p): g for g in self.param_groups for p in g["params"]}
        for k, s in saved.items():
            if not 0 <= k < len(params):
                raise ValueError(f"Fp8AdamW.load_state_dict: state for parameter {k}, but there are {len(params)}")
            p = params[k]
            missing = {"step", *STATE_KEYS} - set(s)
            if missing:
                raise ValueError(f"Fp8AdamW.load_state_dict: parameter {k} lacks {sorted(missing)}")
            master_dtype = MASTER_DTYPES[groups[id(p)]["master_dtype"]]
            want = {"master": master_dtype, "m": M_DTYPE, "v": V_DTYPE}
            for name, dtype in want.items():
                t = s[name]
                if t.dtype != dtype or t.shape != p.shape:
                    raise ValueError(f"Fp8AdamW.load_state_dict: parameter {k} {name} is {t.dtype} "
                                     f"{tuple(t.shape)}, expected {dtype} {tuple(p.shape)}")
            scales = ("m_scale", "v_scale") + (("master_scale",) if master_dtype == torch.float16 else ())
            for name in scales:
                t = s[name]
                if not (torch.is_tensor(t) and t.dim() == 0 and t.dtype == torch.float32):
                    raise ValueError(f"Fp8AdamW.load_state_dict: parameter {k} {name} must be a 0-dim float32 "
                                     f"tensor, got {t!r}")
            self.state[p] = {n: (t.to(p.device, copy=True) if torch.is_tensor(t) else t) for n, t in s.items()}
