"""Context parallelism's attention: causal attention over a sequence split between the ranks of a CP group.

**Layout.** Each sequence of S tokens is cut into 2·cp chunks of C = S / (2·cp) tokens; CP rank r holds chunks r and
2·cp-1-r, in that order (Megatron-Core's causal load balancing: under the causal mask every rank then does the same
attention work). Its q, k and v are ``[b, heads, 2C, d]``; ``local_chunks`` cuts a full-length tensor that way and
``ContextParallel.positions`` gives the global positions of the local tokens (for RoPE).

**Pairs.** Attention of a query chunk over a key chunk, by their global chunk indices: skipped when the key chunk
comes later, full (no mask) when earlier, causal when it is the same chunk. Each pair runs one SDPA kernel that
also returns the log-sum-exp of its rows; the partial outputs of a query chunk are merged by their log-sum-exp,
in fp32 (fp64 for fp64 inputs), from a start of (0, -inf)::

    lse = logaddexp(lse, lse_p);    out = out·exp(lse_old - lse) + out_p·exp(lse_p - lse)

Every query row sees at least its own token, so the final lse is finite and nothing is NaN. The backward of a pair
is the kernel's own backward given the *merged* out and lse of the query rows instead of the pair's: with
P = exp(S - lse) and D = rowsum(dO·O) it computes dS = P·(dP - D), which with the global lse and O is exactly
the pair's share of the full attention's gradient (how torch's experimental context_parallel and Transformer
Engine do it; tests/test_context_attention.py checks it against float64 full attention).

**Two forms** (``ContextParallel.comm``):

- ``p2p``, ring attention: the K/V block (both local chunks, KV heads only, in the input dtype) travels round the
  ring, rank r sending to r+1 and receiving from r-1, cp-1 hops; the next block's transfer is posted before the
  attention on the block in hand, so the two overlap. The backward sends K/V round again and, one step behind,
  each block's dK/dV accumulator (fp32), which every rank adds its share to before passing it on: the accumulator
  of rank r's block starts at r+1 and reaches r after the last step; dQ stays local. Only local tensors (q, k, v,
  out, lse) are saved for the backward.
- ``all_gather`` (Llama 3's form): K/V all-gathered over the group, put in global order, and each local query
  chunk j attends to the chunks before it (one full call) and to itself (one causal call); the backward gathers
  K/V again (nothing but local tensors saved here either) and reduce-scatters dK/dV, in fp32.

Bytes each rank sends (parallel/comm.py's ledger; n = b·kv_heads·2C·d elements of K, e and a the bytes of an
element of the input and of the fp32 (fp64 for fp64 inputs) accumulators):

    p2p         forward  p2p (cp-1)·2n·e              backward  p2p (cp-1)·2n·(e + a)
    all_gather  forward  all_gather (cp-1)·2n·e       backward  all_gather (cp-1)·2n·e, reduce_scatter (cp-1)·2n·a

**Kernels.** CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward; 16-bit inputs are computed on
their fp32 upcasts, as parallel/cpu_gemm.py computes the project's 16-bit CPU GEMMs (a 16-bit kernel would also
round every partial output before the merge), and the output is rounded to the input dtype once. CUDA: the
memory-efficient kernel ``_scaled_dot_product_efficient_attention`` and its backward in the input dtype; **that
branch has not run on a GPU yet**. Grouped-query attention: K/V heads are expanded per block on arrival (query
head i uses KV head i // (heads / kv_heads), as SDPA's ``enable_gqa``) and their gradients summed back over each
group.

**Document masks** (``mask``, ``parallel/context_mask.py``): the same pairs, each with its slice of the micro-batch's
mask; a pair no row sees anything of is skipped (its block still travels: every rank posts the same transfers, so
the bytes above hold), one inside a single document keeps the dense kernel, and the rest run the kernel with an
additive mask, their empty rows set to (0, -inf) before the merge, whose weights are then 0 rather than NaN.

No dropout (config/context.py refuses attention_dropout > 0 with cp > 1). Under ``torch.compile`` the entry point
runs eagerly between compiled regions (``torch.compiler.disable``), as every collective of the project does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch

from parallel import comm
from parallel.comm import Group
from parallel.context_mask import ContextMask, Pair, PairMask
from parallel.cpu_gemm import attention as cpu_attention
from parallel.layout import cp_chunks, cp_spans

aten = torch.ops.aten

FORMS = ("p2p", "all_gather", "a2a")


@dataclass(frozen=True)
class ContextParallel:
    """The CP group of this rank and how its attention communicates."""

    group: Group
    """The CP ring: ``group.rank`` is this rank's CP rank."""
    comm: str = "p2p"
    """``p2p`` (ring attention), ``all_gather`` or ``a2a`` (all-to-all: ``parallel/ulysses.py``)."""

    def __post_init__(self):
        if self.comm not in FORMS:
            raise ValueError(f"context parallelism's comm must be one of {FORMS}, got {self.comm!r}")

    @property
    def size(self) -> int:
        return self.group.size

    def chunk_ids(self) -> Tuple[int, int]:
        """The global indices of this rank's two chunks, in local order."""
        return cp_chunks(self.size, self.group.rank)

    def positions(self, seq_len: int) -> torch.Tensor:
        """Global positions (int64 ``[seq_len // cp]``) of this rank's tokens, in local order."""
        _chunk_len(seq_len, self.size)  # a length not cut into 2 x cp equal chunks is refused
        return torch.cat([torch.arange(lo, hi) for lo, hi in cp_spans(seq_len, self.size, self.group.rank)])


def _chunk_len(seq_len: int, cp: int) -> int:
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens cannot be cut into 2 x cp = {2 * cp} equal chunks")
    return seq_len // (2 * cp)


def local_chunks(x: torch.Tensor, cp: int, rank: int, dim: int) -> torch.Tensor:
    """This rank's two chunks of a full-length tensor along ``dim``: chunks rank and 2·cp-1-rank, concatenated."""
    c = _chunk_len(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, i * c, c) for i in cp_chunks(cp, rank)], dim)


def _global_order(per_rank: List[torch.Tensor], dim: int) -> torch.Tensor:
    """The full-length tensor from every rank's two chunks along ``dim`` (the inverse of ``local_chunks``)."""
    cp, c = len(per_rank), per_rank[0].shape[dim] // 2
    return torch.cat([per_rank[min(g, 2 * cp - 1 - g)].narrow(dim, 0 if g < cp else c, c) for g in range(2 * cp)],
                     dim)


@torch.compiler.disable
def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
                      scale: Optional[float] = None, mask=None) -> torch.Tensor:
    """Causal attention over global positions of this rank's two chunks (module docstring); with ``mask``, a
    micro-batch's document mask: for p2p and all_gather a ``ContextMask`` (``parallel/context_mask.py``: its pairs
    instead, the empty ones skipped), for a2a the whole sequence's boolean mask ``[b, 1, S, S]``.

    ``q`` ``[b, heads, 2C, d]``, ``k`` and ``v`` ``[b, kv_heads, 2C, d]`` with heads a multiple of kv_heads (any
    strides). Returns ``[b, heads, 2C, d]`` in q's dtype: the full causal SDPA over the whole sequence (every
    rank's chunks in global order) at this rank's rows. With cp = 1 it is causal SDPA (parallel/cpu_gemm.py's
    ``attention``). Under autocast the operands are cast to its dtype first, as SDPA's are."""
    gqa = q.shape[1] != k.shape[1]
    if cp.size == 1 and mask is None:
        return cpu_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if q.shape[1] % k.shape[1] or k.shape != v.shape or q.shape[2] % 2:
        raise ValueError(f"context attention needs q [b, heads, 2C, d] and k, v [b, kv_heads, 2C, d] with heads a "
                         f"multiple of kv_heads; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    device = q.device.type
    if torch.is_autocast_enabled(device):
        q, k, v = (t.to(torch.get_autocast_dtype(device)) for t in (q, k, v))
    with torch.autocast(device, enabled=False):
        if cp.comm == "a2a":
            if mask is not None and not isinstance(mask, torch.Tensor):
                raise TypeError("the a2a form takes the whole sequence's document mask (model/doc_mask.py dense)")
            return _ulysses(q, k, v, cp, scale, mask)
        form = _Ring if cp.comm == "p2p" else _AllGather
        return form.apply(q, k, v, cp, scale, mask)


def _ulysses(q, k, v, cp: ContextParallel, scale, mask: Optional[torch.Tensor]):
    from parallel.ulysses import ulysses_attention

    return ulysses_attention(q, k, v, cp.group, [list(cp_chunks(cp.size, r)) for r in range(cp.size)], scale, mask)


class _Kernels:
    """The pair kernels of one call, with its dtypes: ``work`` (what the kernel computes in) and ``acc`` (merged
    outputs, log-sum-exps, gradient accumulators)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, scale: Optional[float]):
        cpu16 = q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
        self.work = torch.float32 if cpu16 else q.dtype
        self.acc = torch.promote_types(self.work, torch.float32)
        self.groups = q.shape[1] // k.shape[1]
        self.scale = scale

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """A K/V block ``[..., kv_heads, L, d]`` in the work dtype with a head per query head."""
        kv = kv.to(self.work)
        return kv.repeat_interleave(self.groups, dim=-3) if self.groups > 1 else kv

    def fold(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of an expanded block ``[b, heads, L, d]`` summed over each group: ``[b, kv_heads, L, d]``."""
        b, h, n, d = grad.shape
        return grad.to(self.acc).view(b, h // self.groups, self.groups, n, d).sum(2)

    def _bias(self, q: torch.Tensor, mask: Optional[PairMask]) -> Optional[torch.Tensor]:
        """The pair's additive mask (0 / -inf) ``[b, 1 or heads, Lq, Lk]`` as the kernel takes it, or None."""
        if mask is None:
            return None
        if q.is_cuda:  # the memory-efficient kernel: rows aligned to 16 elements, a head dimension (expanded)
            return mask.bias(self.work, align=16).expand(-1, q.shape[1], -1, -1)
        return mask.bias(self.work)

    def forward(self, q, k, v, causal: bool, mask: Optional[PairMask] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The pair's output and log-sum-exp ``[b, heads, Lq]``, in the accumulator dtype; the rows that see no key
        of a masked pair get output 0 and lse -inf (the CPU kernel returns lse 0 for them)."""
        bias = self._bias(q, mask)
        if q.is_cuda:
            out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal,
                                                                          scale=self.scale)
            lse = lse[..., :q.shape[2]]  # the kernel pads its rows to a multiple of 32
        else:
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                        scale=self.scale)
        out, lse = out.to(self.acc), lse.to(self.acc)
        if mask is not None and mask.rows is not None:
            lse = lse.masked_fill(~mask.rows, float("-inf"))
            out = out.masked_fill(~mask.rows[..., None], 0.0)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal: bool,
                 mask: Optional[PairMask] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pair's dq, dk, dv (dk, dv over expanded heads) given the merged ``out`` and ``lse`` of its rows
        (finite: every row sees its own token somewhere, so a masked key's P = exp(-inf - lse) is 0)."""
        bias = self._bias(q, mask)
        if q.is_cuda:
            padded = torch.nn.functional.pad(lse.float(), (0, -lse.shape[-1] % 32))
            no_rng = torch.zeros((), dtype=torch.int64)  # the dropout generator's state: unused without dropout
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                dout, q, k, v, bias, out, padded, no_rng, no_rng, 0.0, [True, True, True, False], causal,
                scale=self.scale)
        else:
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=bias, scale=self.scale)
        return dq, dk, dv


def _block_pairs(q_ids: Tuple[int, int], k_ids: Tuple[int, int], c: int) -> List[Pair]:
    """The pairs of this rank's query chunks with a K/V block holding chunks ``k_ids`` (C = c tokens each)."""
    return [(a, j * c, c, kc == qc, None) for a, qc in enumerate(q_ids) for j, kc in enumerate(k_ids) if kc <= qc]


def _rows(t: torch.Tensor, a: int, c: int) -> torch.Tensor:
    """Local query chunk ``a`` of a ``[b, heads, 2C, ...]`` tensor (a view)."""
    return t.narrow(2, a * c, c)


def _attend(kern: _Kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pairs: List[Pair],
            out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge the pairs' attention into the running ``out`` and ``lse`` (in place)."""
    c = q.shape[2] // 2
    for a, start, n, causal, mask in pairs:
        o, m = kern.forward(_rows(q, a, c), k.narrow(2, start, n), v.narrow(2, start, n), causal, mask)
        o_run, m_run = _rows(out, a, c), _rows(lse, a, c)
        merged = torch.logaddexp(m_run, m)
        # a row that has seen nothing yet (masked pairs only) stays at (0, -inf): its weights are 0, not NaN
        ref = merged.masked_fill(merged == float("-inf"), 0.0) if mask is not None else merged
        o_run.mul_(torch.exp(m_run - ref).unsqueeze(-1)).add_(o * torch.exp(m - ref).unsqueeze(-1))
        m_run.copy_(merged)


def _attend_backward(kern: _Kernels, rows: Tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor,
                     pairs: List[Pair], dq: torch.Tensor, dkv: torch.Tensor) -> None:
    """Add the pairs' gradients to ``dq`` and to ``dkv`` (``[2, b, kv_heads, L, d]``, for the keys in hand)."""
    dout, q, out, lse = rows
    c = q.shape[2] // 2
    for a, start, n, causal, mask in pairs:
        g = kern.backward(*(_rows(t, a, c) for t in (dout, q)), k.narrow(2, start, n), v.narrow(2, start, n),
                          *(_rows(t, a, c) for t in (out, lse)), causal, mask)
        _rows(dq, a, c).add_(g[0])
        dkv[0].narrow(2, start, n).add_(kern.fold(g[1]))
        dkv[1].narrow(2, start, n).add_(kern.fold(g[2]))


def _start(kern: _Kernels, q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The running (out, lse) before any pair: 0 and -inf."""
    return (torch.zeros(q.shape, dtype=kern.acc, device=q.device),
            torch.full(q.shape[:3], float("-inf"), dtype=kern.acc, device=q.device))


def _query_rows(kern: _Kernels, dout, q, out, lse) -> Tuple[torch.Tensor, ...]:
    """What the backward of every pair reads of the query rows: dout, q and out in the work dtype, the merged lse."""
    return dout.to(kern.work), q.to(kern.work), out.to(kern.work), lse


class _Shift:
    """One step of the ring: ``send`` on its way to the next rank while the previous rank's arrives (``arrived``).

    Every rank posts its transfers in the same sequence, so backends that match them in order (NCCL) pair them
    right; even ranks post the send first and odd ones the receive, since with two ranks both directions share one
    NCCL communicator, whose operations run in the order posted."""

    def __init__(self, send: torch.Tensor, group: Group):
        self.send, self.recv = send, torch.empty_like(send)  # both held until the transfers are done
        nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
        posts = [lambda: comm.isend(self.send, nxt, group), lambda: comm.irecv(self.recv, prev, group)]
        self.handles = [post() for post in (posts if group.rank % 2 == 0 else posts[::-1])]

    def arrived(self) -> torch.Tensor:
        for h in self.handles:
            h.wait()
        return self.recv


def _rotate(block: torch.Tensor, group: Group) -> Iterator[Tuple[int, torch.Tensor]]:
    """(source rank, block) for each step of the ring: this rank's block, then the one of rank-1, rank-2, ...; each
    next block's transfer is posted before the one in hand is yielded, so it overlaps the caller's work on it."""
    for step in range(group.size):
        shift = _Shift(block, group) if step < group.size - 1 else None
        yield (group.rank - step) % group.size, block
        if shift is not None:
            block = shift.arrived()


class _Ring(torch.autograd.Function):
    """Ring attention (``p2p``)."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, scale, mask: Optional[ContextMask]):
        kern, group = _Kernels(q, k, scale), cp.group
        out, lse = _start(kern, q)
        qw = q.to(kern.work)
        for src, block in _rotate(torch.stack([k, v]), group):
            pairs = _ring_pairs(cp, src, q.shape[2] // 2, mask)
            if pairs:  # a block none of whose pairs is visible is passed on without being expanded
                kv = kern.expand(block)
                _attend(kern, qw, kv[0], kv[1], pairs, out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.kern, ctx.mask = cp, kern, mask
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, kern, c, group = ctx.cp, ctx.kern, q.shape[2] // 2, ctx.cp.group
        rows = _query_rows(kern, dout, q, out, lse)
        dq = torch.zeros(q.shape, dtype=kern.acc, device=q.device)
        own = passing = None  # this rank's share of its own block's dK/dV; the accumulator in flight
        for step, (src, block) in enumerate(_rotate(torch.stack([k, v]), group)):
            dkv = torch.zeros(block.shape, dtype=kern.acc, device=q.device)
            pairs = _ring_pairs(cp, src, c, ctx.mask)
            if pairs:
                kv = kern.expand(block)
                _attend_backward(kern, rows, kv[0], kv[1], pairs, dq, dkv)
            if step == 0:
                own = dkv
                continue
            if passing is not None:  # this block's accumulator, from rank-1, which had the block a step earlier
                dkv += passing.arrived()
            passing = _Shift(dkv, group)
        if passing is not None:  # the last hop brings this rank's own block's accumulator home (none at cp 1)
            own += passing.arrived()
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None


def _ring_pairs(cp: ContextParallel, src: int, c: int, mask: Optional[ContextMask]) -> List[Pair]:
    """This rank's pairs with CP rank ``src``'s K/V block: the dense ones, or the document mask's."""
    if mask is not None:
        return mask.block_pairs(src)
    return _block_pairs(cp.chunk_ids(), cp_chunks(cp.size, src), c)


def _gather(kv: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's K/V block ``[2, b, kv_heads, 2C, d]`` all-gathered, in global order: ``[2, b, kv_heads, S, d]``."""
    gathered = kv.new_empty((group.size * kv.shape[0], *kv.shape[1:]))
    comm.all_gather(gathered, kv, group)
    return _global_order(list(gathered.view(group.size, *kv.shape)), dim=3)


def _prefix_pairs(q_ids: Tuple[int, int], c: int) -> List[Pair]:
    """Each local query chunk over the full-length keys: the chunks before it (no mask), then itself (causal)."""
    return [(a, 0, qc * c, False, None) for a, qc in enumerate(q_ids) if qc > 0] + \
        [(a, qc * c, c, True, None) for a, qc in enumerate(q_ids)]


class _AllGather(torch.autograd.Function):
    """All-gathered K/V (``all_gather``)."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, scale, mask: Optional[ContextMask]):
        kern, c = _Kernels(q, k, scale), q.shape[2] // 2
        out, lse = _start(kern, q)
        kv = kern.expand(_gather(torch.stack([k, v]), cp.group))
        pairs = mask.prefix_pairs() if mask is not None else _prefix_pairs(cp.chunk_ids(), c)
        _attend(kern, q.to(kern.work), kv[0], kv[1], pairs, out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.kern, ctx.mask = cp, kern, mask
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, kern, c = ctx.cp, ctx.kern, q.shape[2] // 2
        full = _gather(torch.stack([k, v]), cp.group)
        kv = kern.expand(full)
        dq = torch.zeros(q.shape, dtype=kern.acc, device=q.device)
        dkv = torch.zeros(full.shape, dtype=kern.acc, device=q.device)
        pairs = ctx.mask.prefix_pairs() if ctx.mask is not None else _prefix_pairs(cp.chunk_ids(), c)
        _attend_backward(kern, _query_rows(kern, dout, q, out, lse), kv[0], kv[1], pairs, dq, dkv)
        per_rank = torch.cat([local_chunks(dkv, cp.size, r, dim=3) for r in range(cp.size)])
        mine = torch.empty((2, *k.shape), dtype=kern.acc, device=q.device)
        comm.reduce_scatter(mine, per_rank, cp.group)
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None
