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

The update itself is ``adamw8bit_update``: its per-step scalars (``keep = 1 - lr*wd``, ``step_size = lr / (1 -
beta1**step)``, ``bc2_sqrt = sqrt(1 - beta2**step)``) come in as one fp32 device tensor of 3, formed once a step on
the host in float64 (``step_scalars``, as Python computes them) and rounded once to fp32: the pattern of FP8-LM's
AdamW (``fp8/adam.py`` ``adamw_update_segments``). Eagerly on CPU it gives the bits of the step with Python-float
scalars (tested against a copy of it): the fp32 values are those the kernels round the floats to, ``p * 1`` is exact
for exempt tensors, ``p - (m * s) / denom`` is CPU ``addcdiv``'s order, and ``v`` takes ``addcmul_(g * (1-beta2),
g)``: CPU ``addcmul`` computes ``v + (value * g) * g`` (measured: the last multiply-add fused), the same with the
product ``value * g`` made first (dynamo rewrites an ``addcmul_`` with a ``value`` into fma(g * g, value, v): other
bits).

Under ``train.compile`` (``optimizers/tensor_rules.py``) the function is compiled whole (``fullgraph``, static
shapes: one graph a tensor shape): dequantize, update and re-quantize in one graph, the step count and the learning
rate tensor values, not graph constants, so nothing recompiles from step to step. Measured (torch 2.13, 2-core EPYC
shared with other work): with ``aot_eager`` (the traced graph on torch's kernels) bit for bit with eager, one frame
a shape over 7 steps, ~3 s to trace a shape (tested); with inductor on CPU 39-48 s for each shape's first call
(C++ build), no recompilation over 6 steps, 0.12-0.14 s a step against eager's 0.42-0.68 s on a 256 x 1024 tensor,
and ~1 ulp from eager (its kernels contract multiply-adds): 1-ulp block scales in 7-23% of the blocks, parameters
within 2.4e-7 (absolute, values ~1), a code now and then. The CUDA (Triton) path is untimed: no GPU was at hand.
(An earlier try compiled ``adamw8bit_step`` with its Python-float scalars: 77 s for the first call with inductor on
CPU and a recompilation for every new ``step``.)
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


def moment_maps(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(first moment's signed map, second moment's unsigned map) on ``device`` (quant8's cached maps)."""
    return map_on(True, device), map_on(False, device)


def _store(state: Dict[str, torch.Tensor], exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, block: int,
           maps: Tuple[torch.Tensor, torch.Tensor]) -> None:
    for k, x, code_map in (("exp_avg", exp_avg, maps[0]), ("exp_avg_sq", exp_avg_sq, maps[1])):
        codes, scales = quantize(x, code_map, block)
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
    dev = state["exp_avg_codes"].device
    _store(state, exp_avg.to(dev), exp_avg_sq.to(dev), block, moment_maps(dev))


def step_scalars(step: int, lr: float, beta1: float, beta2: float, weight_decay: float) -> Tuple[float, float, float]:
    """``(keep, step_size, bc2_sqrt)`` of update ``step`` (>= 1), in float64 as Python computes them: ``1 - lr*wd``,
    ``lr / (1 - beta1**step)``, ``sqrt(1 - beta2**step)`` (``weight_decay`` 0 for exempt tensors: keep is 1)."""
    if step < 1:
        raise ValueError(f"adamw8bit: step counts from 1, got {step}")
    return 1.0 - lr * weight_decay, lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step)


def fill_step_scalars(out: torch.Tensor, step: int, lr: float, beta1: float, beta2: float,
                      weight_decay: float) -> torch.Tensor:
    """``step_scalars`` written into the fp32 [3] device tensor ``out`` (fills: no host-to-device copy)."""
    for i, x in enumerate(step_scalars(step, lr, beta1, beta2, weight_decay)):
        out[i].fill_(x)
    return out


@torch.no_grad()
def adamw8bit_update(param: torch.Tensor, grad: torch.Tensor, state: Dict[str, torch.Tensor], scalars: torch.Tensor,
                     maps: Tuple[torch.Tensor, torch.Tensor], beta1: float, beta2: float, eps: float,
                     block: int) -> None:
    """One AdamW update of fp32 ``param`` in place with 8-bit moments ``state`` (updated in place): dequantize, update,
    re-quantize. ``grad`` fp32, already unscaled and clipped; ``scalars`` fp32 [3] on the device, ``step_scalars``
    (its values are not constants of a compiled graph); ``maps``: ``moment_maps(param.device)``.

    Traceable whole by dynamo (``fullgraph=True``): the checks below read shapes and dtypes only, the ragged last
    block's padding and the ``bucketize`` of quant8 are graph operations; ``beta1``, ``beta2``, ``eps`` and
    ``block`` are constants of a run."""
    if grad.shape != param.shape:
        raise ValueError(f"adamw8bit: grad shape {tuple(grad.shape)} != param shape {tuple(param.shape)}")
    if scalars.shape != (3,) or scalars.dtype != torch.float32:
        raise ValueError(f"adamw8bit: scalars must be float32 of shape (3,), got {tuple(scalars.shape)} "
                         f"{scalars.dtype}")
    _check_state(state, param.shape, block)
    exp_avg = dequantize(state["exp_avg_codes"], state["exp_avg_scales"], maps[0], block)
    exp_avg_sq = dequantize(state["exp_avg_sq_codes"], state["exp_avg_sq_scales"], maps[1], block)
    param.mul_(scalars[0])  # exact for keep = 1
    exp_avg.lerp_(grad, 1.0 - beta1)
    # addcmul without ``value``: CPU addcmul is fma(value * g, g, v), so is this; dynamo rewrites an addcmul_ with a
    # ``value`` into fma(g * g, value, v), other bits (torch._dynamo.variables.tensor ``method_addcmul_``)
    exp_avg_sq.mul_(beta2).addcmul_(grad * (1.0 - beta2), grad)
    denom = (exp_avg_sq.sqrt() / scalars[2]).add_(eps)
    param.sub_(exp_avg * scalars[1] / denom)  # addcdiv's order on CPU: (value * m) / denom
    _store(state, exp_avg, exp_avg_sq, block, maps)


@torch.no_grad()
def adamw8bit_step(param: torch.Tensor, grad: torch.Tensor, state: Dict[str, torch.Tensor], step: int, lr: float,
                   beta1: float, beta2: float, eps: float, weight_decay: float, block: int) -> None:
    """One AdamW update of fp32 ``param`` in place with 8-bit moments ``state`` (updated in place); ``grad`` fp32,
    already unscaled and clipped; ``step`` >= 1 counts this update. ``adamw8bit_update`` with this call's scalars."""
    scalars = torch.tensor(step_scalars(step, lr, beta1, beta2, weight_decay), dtype=torch.float32,
                           device=param.device)
    adamw8bit_update(param, grad, state, scalars, moment_maps(param.device), beta1, beta2, eps, block)
