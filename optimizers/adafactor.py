"""Adafactor for one tensor: torch.optim.Adafactor's single-tensor arithmetic, operation for operation.

Adafactor (Shazeer & Stern, 1804.04235, in torch's form) keeps no first moment and, for a tensor of two or more
dimensions, a factored second moment: a row statistic (shape[:-1] + (1,)) and a column statistic
(shape[:-2] + (1, shape[-1])), each an EMA of the gradient's squared row / column means, whose outer product over
the row statistic's mean estimates the whole second moment. A vector (or scalar) keeps the whole second moment.
State: (rows + cols) fp32 a matrix instead of AdamW's 2 x rows x cols.

Step ``t`` (1-based, counting this update), as ``torch.optim._adafactor._single_tensor_adafactor``:
  beta2_t = t ** beta2_decay            the EMA weight of the new statistic (1 at t = 1)
  rho_t   = min(lr, 1 / sqrt(t))        relative step size
  alpha   = max(eps2, RMS(param)) * rho_t   (RMS before this step's decay)
  param  *= 1 - lr * weight_decay       decoupled weight decay
  row_var.lerp_(mean_cols(g*g), beta2_t); col_var.lerp_(mean_rows(g*g), beta2_t)
  var     = row_var @ col_var / max(mean(row_var), eps1)   (matrices; vectors: variance.lerp_(g*g, beta2_t))
  update  = g / sqrt(max(var, eps1**2))
  param  -= alpha / max(1, RMS(update) / d) * update        update clipping at threshold d
Same ops in the same order as torch's, so the result is torch's bit for bit (the tests check it). The two
``.item()`` reads (RMS of param and of update) are torch's too: Adafactor's step sizes are host floats.

The caller hands the WHOLE tensor: the row and column statistics and both RMS values are those of the whole
matrix (a tensor-parallel caller gathers the pieces first, ``optimizers/tensor_rules.py``).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch


def adafactor_state(shape: Sequence[int], device: torch.device) -> Dict[str, torch.Tensor]:
    """fp32 zeros: ``row_var`` and ``col_var`` for ndim >= 2 (torch's shapes), else ``variance``."""
    shape = tuple(shape)
    if len(shape) >= 2:
        row = shape[:-1] + (1,)
        col = shape[:-2] + (1, shape[-1])
        return {"row_var": torch.zeros(row, dtype=torch.float32, device=device),
                "col_var": torch.zeros(col, dtype=torch.float32, device=device)}
    return {"variance": torch.zeros(shape, dtype=torch.float32, device=device)}


@torch.no_grad()
def adafactor_step(param: torch.Tensor, grad: torch.Tensor, state: Dict[str, torch.Tensor], step: int, lr: float,
                   weight_decay: float, beta2_decay: float = -0.8, eps1: Optional[float] = None,
                   eps2: float = 1e-3, d: float = 1.0) -> None:
    """One Adafactor update of ``param`` in place (``state`` too); ``grad`` fp32 (unscaled, clipped); ``step``
    >= 1 counts this update; ``eps1`` None: the machine epsilon of ``param``'s dtype (torch's default)."""
    if grad.shape != param.shape:
        raise ValueError(f"adafactor: grad shape {tuple(grad.shape)} != param shape {tuple(param.shape)}")
    if step < 1:
        raise ValueError(f"adafactor: step counts this update and must be >= 1, got {step}")
    if eps1 is None:
        eps1 = torch.finfo(param.dtype).eps
    step_float = float(step)
    one_minus_beta2_t = step_float ** beta2_decay
    rho_t = min(lr, 1 / (step_float ** 0.5))
    alpha = max(eps2, param.norm(2).item() / (param.numel() ** 0.5)) * rho_t

    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)

    if grad.dim() > 1:
        row_var, col_var = state["row_var"], state["col_var"]
        # (g * g).mean(dim=-1) without materializing g * g, as torch
        row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
        row_var.lerp_(row_mean, one_minus_beta2_t)
        col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
        col_var.lerp_(col_mean, one_minus_beta2_t)
        var_estimate = row_var @ col_var
        var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    else:
        variance = state["variance"]
        grad_squared = grad * grad
        variance.lerp_(grad_squared, one_minus_beta2_t)
        var_estimate = variance.clone()

    # eps1 squared: the square root comes after
    update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
    update.mul_(grad)
    denom = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * d))
    param.add_(update, alpha=-alpha / denom)
