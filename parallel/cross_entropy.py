"""Vocab-parallel cross entropy: the loss over a vocabulary split across the TP group.

No rank ever holds full-vocabulary logits. For logits z (this rank's vocabulary
slice) and target t (SPEC §2):

  1. m = max_v z_v                     local max, all-reduce MAX  (stability)
  2. z_t                               the target's logit where t is in this slice,
                                       else 0; all-reduce SUM
  3. S = sum_v exp(z_v - m)            local sum, all-reduce SUM
  4. loss = log S - (z_t - m)

Backward: d loss / d z_v = softmax_v - [v == t], computed from the exp saved in step 3.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel import comm
from parallel.comm import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
        z = logits.float()  # [N, V/tp]; a copy when logits are bf16/fp16, written in place below
        if z.data_ptr() == logits.data_ptr():
            z = z.clone()
        rows = z.shape[-1]
        start = group.rank * rows

        m = z.max(dim=-1).values
        comm.all_reduce(m, group, op="max")
        z.sub_(m.unsqueeze(-1))

        local_t = target - start
        outside = (local_t < 0) | (local_t >= rows)
        local_t = local_t.masked_fill(outside, 0)
        z_t = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(z_t, group)

        z.exp_()
        s = z.sum(dim=-1)
        comm.all_reduce(s, group)
        loss = torch.log(s) - z_t

        z.div_(s.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(z, local_t, outside)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if getattr(ctx, "consumed", False):
            raise RuntimeError("vocab-parallel cross entropy reuses its saved softmax in backward; "
                               "a second backward through it (retain_graph=True) is not supported")
        ctx.consumed = True
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax  # backward runs once: reuse the saved buffer instead of another logits-sized copy
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
    """Per-token loss for logits ``[..., V/tp]`` and targets ``[...]`` (global vocabulary ids)."""
    shape = target.shape
    logits2d, target1d = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if group.size == 1:
        loss = F.cross_entropy(logits2d.float(), target1d, reduction="none")
    else:
        loss = _VocabParallelCrossEntropy.apply(logits2d, target1d, group)
    return loss.view(shape)
