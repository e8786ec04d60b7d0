"""Expert parallelism's token exchange (``parallel.ep``): dispatch token-slots to the EP ranks that hold their
experts, run the local experts, bring the outputs back.

An EP group is ep consecutive data-parallel ranks (``Layout.ep_ranks``); rank r of it holds the routed experts
``[r E/ep, (r+1) E/ep)`` of every MoE layer. Each rank routes its own tokens (its micro-batch, as at ep = 1), so
routing, capacity drops and the balancing losses are exactly the one-process ones; only the expert FFNs move:

1. the slots, already sorted by global expert (``model/moe.py Experts``), are cut by owner; the per-expert counts
   go around first (one equal-split all-to-all of ``E`` integers), so each rank knows what it will receive;
2. an uneven all-to-all sends each owner its rows; they arrive grouped by source rank, then by local expert, and
   are regrouped by local expert (source order kept within an expert) for the grouped GEMM;
3. the outputs are put back in arrival order and return by the reverse all-to-all, to be weighted and summed at
   their tokens' rank.

Both all-to-alls go through the comm door (``comm.all_to_all_v``: the ledger counts the rows that leave, a dead or
stalled peer ends the job like every other collective) and are differentiable: the backward of a dispatch is the
reverse all-to-all of the gradients, with the split sizes swapped. They run eagerly (``torch.compiler.disable``:
a compiled block splits into the regions around them).
"""
from __future__ import annotations

from typing import Callable, List

import torch

from parallel import comm
from parallel.comm import Group


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group: Group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        comm.all_to_all_v(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        comm.all_to_all_v(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None


def _regroup(received: torch.Tensor) -> torch.Tensor:
    """For rows that arrived as blocks (source j, local expert e) in j-major order, with ``received [ep, E_local]``
    rows each: the index of each row in e-major order (local expert, then source)."""
    lengths = received.flatten()
    starts = torch.cumsum(lengths, 0) - lengths  # where each (j, e) block begins in arrival order
    lengths_e, starts_e = lengths.view_as(received).t().flatten(), starts.view_as(received).t().flatten()
    total = int(lengths.sum())
    begin = torch.repeat_interleave(torch.cumsum(lengths_e, 0) - lengths_e, lengths_e, output_size=total)
    return torch.repeat_interleave(starts_e, lengths_e, output_size=total) + (
        torch.arange(total, device=received.device) - begin)


@torch.compiler.disable
def run_experts(xs: torch.Tensor, counts: torch.Tensor, group: Group,
                ffn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``xs [N, d]``: this rank's token-slots sorted by global expert, ``counts [E]`` rows each. ``ffn(rows,
    local_counts)`` runs this rank's ``E / ep`` experts on rows sorted by local expert. Returns the FFN outputs of
    ``xs``'s rows, in ``xs``'s order."""
    ep = group.size
    local = counts.numel() // ep
    sent = counts.view(ep, local)  # [owner, its local expert]
    received = torch.empty_like(sent)  # [source, my local expert]
    comm.all_to_all(received, sent.contiguous(), group)
    in_splits, out_splits = sent.sum(1).tolist(), received.sum(1).tolist()
    rows = _AllToAllV.apply(xs, out_splits, in_splits, group)
    order = _regroup(received)
    out = ffn(rows[order], received.sum(0))
    back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return _AllToAllV.apply(out[back], in_splits, out_splits, group)
