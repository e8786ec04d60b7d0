"""Context parallelism's all-to-all form (``parallel.cp_comm=a2a``, DeepSpeed-Ulysses): heads scattered, the whole
sequence gathered.

Each CP rank holds two chunks of every sequence (parallel/context.py's layout: chunks r and 2·cp-1-r) for all of
this TP rank's heads. One all-to-all turns that into the whole sequence, in global order, for heads / cp of them;
attention then runs as without CP (causal SDPA over the whole sequence, parallel/cpu_gemm.py's ``attention``);
one all-to-all after turns the output back into this rank's two chunks of every head. The backward runs the same
two all-to-alls in reverse (the gradients travel the way the activations came).

**Heads.** Rank j gets query heads [j·H/cp, (j+1)·H/cp) (config/context.py refuses H not divisible by cp). Its KV
heads are the ones those query heads use (query head i uses KV head i // (H / KV), as SDPA's ``enable_gqa``): with
KV divisible by cp each rank gets KV / cp of them, disjoint; with fewer KV heads than that (KV < cp, or KV not a
multiple of cp), each rank gets the KV heads its own query heads need, so a KV head is **replicated** on every rank
whose query heads share it, and its gradient is the sum of those ranks' shares (the backward sends each share home
and adds them).

**Bytes** each rank sends (the ledger's all_to_all; n = b·2C·d elements of one head's local tokens, e the bytes of
an element of the input dtype; kv_j = the KV heads rank j gets, ``kv_heads_of``; the piece a rank keeps is not
sent): forward (cp-1)·(H/cp) heads of q, sum over j != r of 2·kv_j heads of k and v, and (cp-1)·(H/cp) heads of
the output; backward the same pieces' gradients the other way: (cp-1)·(H/cp) of the output's, (cp-1)·(H/cp) of
dq and 2·(cp-1)·kv_r of dk, dv (``a2a_bytes``; parallel/volume.py counts them).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from parallel import comm
from parallel.comm import Group
from parallel.cpu_gemm import attention as cpu_attention


def kv_heads_of(rank: int, cp: int, heads: int, kv_heads: int) -> Tuple[int, int]:
    """(first, count) of the KV heads rank ``rank``'s query heads [rank·H/cp, (rank+1)·H/cp) use."""
    per, group = heads // cp, heads // kv_heads
    first = rank * per // group
    last = ((rank + 1) * per - 1) // group
    return first, last - first + 1


def a2a_bytes(n: int, e: int, cp: int, rank: int, heads: int, kv_heads: int) -> Tuple[int, int, int]:
    """(forward's q, k, v exchange, forward's output exchange, backward) bytes rank ``rank`` sends in one attention
    call (module docstring's formula). Selective recomputation repeats only the first: the output's exchange
    saves nothing for the backward, so torch's non-reentrant checkpoint stops its recompute before it."""
    per = heads // cp
    kv = [kv_heads_of(j, cp, heads, kv_heads)[1] for j in range(cp)]
    inputs = (cp - 1) * per + 2 * (sum(kv) - kv[rank])
    output = (cp - 1) * per
    backward = 2 * (cp - 1) * per + 2 * (cp - 1) * kv[rank]
    return inputs * n * e, output * n * e, backward * n * e


class _Exchange(torch.autograd.Function):
    """All-to-all of per-destination slices: to member j goes ``x.narrow(dim, starts[j], lengths[j])``; from member
    i comes a tensor shaped like the slice this rank would send itself along ``dim`` but ``in_lengths[i]`` long
    along ``recv_dim``. The slices this rank sends may overlap (replicated KV heads): the backward adds every
    destination's gradient into its slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int, starts: List[int], lengths: List[int],
                recv_dim: int, in_lengths: List[int]) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.starts, ctx.lengths = group, dim, starts, lengths
        ctx.recv_dim, ctx.in_lengths, ctx.shape = recv_dim, in_lengths, x.shape
        return _send(x, group, dim, starts, lengths, recv_dim, in_lengths)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, dim = ctx.group, ctx.dim
        # the gradient of what member i sent this rank goes back to member i; what comes back from member j is
        # the gradient of the slice sent to j
        offsets = [sum(ctx.in_lengths[:i]) for i in range(group.size)]
        back = _send(grad, group, ctx.recv_dim, offsets, ctx.in_lengths, dim, ctx.lengths)
        out = grad.new_zeros(ctx.shape)
        pos = 0
        for j in range(group.size):
            out.narrow(dim, ctx.starts[j], ctx.lengths[j]).add_(back.narrow(dim, pos, ctx.lengths[j]))
            pos += ctx.lengths[j]
        return out, None, None, None, None, None, None


def _send(x: torch.Tensor, group: Group, dim: int, starts: List[int], lengths: List[int], recv_dim: int,
          in_lengths: List[int]) -> torch.Tensor:
    """The all-to-all of ``_Exchange.forward`` (also its backward's): the received pieces concatenated along
    ``recv_dim`` in member order."""
    pieces = [x.narrow(dim, s, n).movedim(recv_dim, 0).contiguous() for s, n in zip(starts, lengths)]
    rest = pieces[0].shape[1:]
    if any(p.shape[1:] != rest for p in pieces):
        raise ValueError("ulysses: every destination's slice must have the same shape but along the received dim")
    inp = torch.cat([p.reshape(-1) for p in pieces])
    row = rest.numel()
    out = x.new_empty(sum(in_lengths) * row)
    comm.all_to_all_v(out, inp, [n * row for n in in_lengths], [p.numel() for p in pieces], group)
    return out.view(sum(in_lengths), *rest).movedim(0, recv_dim)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, chunk_ids: List[List[int]],
                      scale: Optional[float] = None, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention over the whole sequence for this rank's two chunks, by all-to-all (module docstring).

    ``q`` ``[b, H, 2C, d]``, ``k`` and ``v`` ``[b, KV, 2C, d]`` (H a multiple of KV and of the group's size);
    ``chunk_ids[r]``: the global chunk indices rank r holds, in its local order. ``mask``: a boolean ``[b, 1, S, S]``
    over the whole sequence in global order (True: may attend; a document mask, model/doc_mask.py) in place of the
    causal one. Returns ``[b, H, 2C, d]``."""
    cp, r = group.size, group.rank
    heads, length = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    if heads % cp or heads % kv_heads or k.shape != v.shape:
        raise ValueError(f"ulysses attention needs heads ({heads}) divisible by cp ({cp}) and by kv_heads "
                         f"({kv_heads}), and k, v of one shape")
    per = heads // cp
    kv = [kv_heads_of(j, cp, heads, kv_heads) for j in range(cp)]
    everyone = [length] * cp
    qs = _Exchange.apply(q, group, 1, [j * per for j in range(cp)], [per] * cp, 2, everyone)
    ks = _Exchange.apply(k, group, 1, [s for s, _ in kv], [n for _, n in kv], 2, everyone)
    vs = _Exchange.apply(v, group, 1, [s for s, _ in kv], [n for _, n in kv], 2, everyone)
    # [b, heads', cp·2C, d] in member order: member i's chunks chunk_ids[i] -> the sequence's global order
    c = length // 2
    order = [0] * (2 * cp)
    for i, ids in enumerate(chunk_ids):
        for a, g in enumerate(ids):
            order[g] = 2 * i + a
    index = torch.cat([torch.arange(p * c, (p + 1) * c) for p in order]).to(q.device)
    qs, ks, vs = (t.index_select(2, index) for t in (qs, ks, vs))
    first, local = kv[r]
    group_size = heads // kv_heads
    owner = [(r * per + i) // group_size - first for i in range(per)]
    masking = {"is_causal": True} if mask is None else {"attn_mask": mask}
    if per % local == 0 and owner == [i // (per // local) for i in range(per)]:  # SDPA's own GQA mapping
        o = cpu_attention(qs, ks, vs, scale=scale, enable_gqa=per != local, **masking)
    else:  # this rank's query heads straddle KV heads unevenly: one KV head per query head, by index
        pick = torch.tensor(owner, device=q.device)
        o = cpu_attention(qs, ks.index_select(1, pick), vs.index_select(1, pick), scale=scale, **masking)
    # back to member order, then each member's two chunks of this rank's heads go home
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    o = o.index_select(2, inverse)
    return _Exchange.apply(o, group, 2, [j * length for j in range(cp)], everyone, 1, [per] * cp)
