"""Context parallelism's CUDA kernels (``parallel/context.py`` ``_Kernels``: the memory-efficient SDPA kernel and
its backward, with the log-sum-exp padding it needs), in one process: every CP rank's share of the all-gather form
computed here over the whole sequence (``_prefix_pairs``: the chunks before each local query chunk, then the chunk
itself, causal), merged by log-sum-exp, against float64 causal attention's output and gradients on the CPU. The
multi-rank exchanges are covered on CPU with gloo (tests/test_context_attention.py); these kernels run only on CUDA.
"""
from __future__ import annotations

import pytest
import torch

from parallel.context import _attend, _attend_backward, _Kernels, _prefix_pairs, _query_rows, _start, local_chunks
from parallel.layout import cp_chunks


def shares(q, k, v, dout, cp: int):
    """Each CP rank's output rows and q/k/v gradients (k/v over the whole sequence, summed over ranks), in global
    order, from the kernels under test."""
    s = q.shape[2]
    c = s // (2 * cp)
    out = torch.empty_like(q, dtype=torch.float32)
    dq = torch.empty_like(q, dtype=torch.float32)
    dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
    for rank in range(cp):
        kern = _Kernels(q, k, None)
        ql, dl = (local_chunks(t, cp, rank, dim=2) for t in (q, dout))
        o, lse = _start(kern, ql)
        kv = kern.expand(torch.stack([k, v]))
        pairs = _prefix_pairs(cp_chunks(cp, rank), c)
        _attend(kern, ql.to(kern.work), kv[0], kv[1], pairs, o, lse)
        g = torch.zeros(ql.shape, dtype=kern.acc, device=q.device)
        _attend_backward(kern, _query_rows(kern, dl, ql, o.to(q.dtype), lse), kv[0], kv[1], pairs, g, dkv)
        for i, chunk in enumerate(cp_chunks(cp, rank)):
            out[:, :, chunk * c:(chunk + 1) * c] = o[:, :, i * c:(i + 1) * c]
            dq[:, :, chunk * c:(chunk + 1) * c] = g[:, :, i * c:(i + 1) * c]
    return out, dq, dkv[0], dkv[1]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cuda_pair_kernels_merge_to_full_causal_attention(cuda, kv_heads):
    torch.manual_seed(0)
    b, heads, s, d, cp = 2, 4, 120, 64, 4  # chunks of 15 rows: the efficient kernel's lse padding is exercised
    q = torch.randn(b, heads, s, d, device=cuda, dtype=torch.bfloat16)
    k, v = (torch.randn(b, kv_heads, s, d, device=cuda, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    out, dq, dk, dv = shares(q, k, v, dout, cp)

    ref = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    full = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=kv_heads != heads)
    full.backward(dout.double().cpu())
    for name, got, want in (("out", out, full), ("dq", dq, ref[0].grad), ("dk", dk, ref[1].grad),
                            ("dv", dv, ref[2].grad)):
        err = (got.double().cpu() - want).abs().max() / want.abs().max()
        assert err < 2e-2, f"{name}: {err:.2e} relative to its max"  # bf16 operands, fp32 accumulation
