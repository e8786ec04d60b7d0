"""Tests for parallel/context.py: context-parallel attention against full causal attention.

Reference: every rank builds the same seeded full-length q, k, v and upstream gradient, runs float64 causal SDPA
over the whole sequence (``enable_gqa`` for grouped-query cases) with autograd, and takes the output and the
q, k, v gradients at its own chunks (``local_chunks``). The CP rank gets only its chunks, rounded to the case's
dtype. Tolerances: 1e-10 absolute for float64 (a wrong merge, pair or gradient hop is off by ~1), 1e-5
relative for fp32, 2e-2 relative for bf16 (one rounding of the output and gradients; the reference then sees
the same bf16 inputs in float64).

The ledger check counts what each rank sent in one forward and backward against the formulas of
parallel/context.py's docstring, with n = b * kv_heads * 2C * d elements of K.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F

from parallel.comm import Group, Ledger
from parallel.context import ContextParallel, context_attention, local_chunks
from tests.dist_harness import run_world

B, D = 2, 8
CASES = [  # (form, heads, kv_heads, dtype)
    ("p2p", 4, 4, torch.float64), ("p2p", 4, 2, torch.float64), ("p2p", 4, 1, torch.float64),
    ("all_gather", 4, 4, torch.float64), ("all_gather", 4, 2, torch.float64),
    ("p2p", 4, 2, torch.float32), ("p2p", 4, 2, torch.bfloat16), ("all_gather", 4, 1, torch.bfloat16),
]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}
"""float64: absolute; the others: relative to the largest element of the reference."""


def _full(seq: int, heads: int, kv_heads: int, seed: int = 0) -> List[torch.Tensor]:
    """Seeded full-length q, k, v and upstream gradient, in float64."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, heads, seq, D), (B, kv_heads, seq, D), (B, kv_heads, seq, D), (B, heads, seq, D)]
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def _reference(q, k, v, dout, dtype, cp: int, rank: int) -> List[torch.Tensor]:
    """Output and q, k, v gradients of float64 full causal attention over the dtype-rounded inputs, at this rank's
    chunks."""
    q, k, v = (t.to(dtype).double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout.to(dtype).double())
    return [local_chunks(t, cp, rank, dim=2) for t in (out.detach(), q.grad, k.grad, v.grad)]


def _run(cp: ContextParallel, q, k, v, dout, dtype) -> Dict[str, object]:
    """CP attention on this rank's chunks; its output, gradients and the bytes sent in forward and in backward."""
    rank, size = cp.group.rank, cp.size
    q, k, v = (local_chunks(t, size, rank, dim=2).to(dtype).requires_grad_() for t in (q, k, v))
    cp.group.ledger.reset()
    out = context_attention(q, k, v, cp)
    forward = dict(cp.group.ledger.bytes)
    cp.group.ledger.reset()
    out.backward(local_chunks(dout, size, rank, dim=2).to(dtype))
    backward = dict(cp.group.ledger.bytes)
    return {"got": [out.detach(), q.grad, k.grad, v.grad], "forward": forward, "backward": backward}


def _worker(seq: int) -> Dict[tuple, Dict[str, object]]:
    import torch.distributed as dist

    size, rank = dist.get_world_size(), dist.get_rank()
    group = Group("cp", dist.group.WORLD, list(range(size)), rank, "intra", Ledger())
    results = {}
    for form, heads, kv_heads, dtype in CASES:
        full = _full(seq, heads, kv_heads)
        results[form, heads, kv_heads, dtype] = {
            **_run(ContextParallel(group, form), *full, dtype),
            "want": _reference(*full, dtype, size, rank)}
    return results


def _expected_bytes(form: str, cp: int, seq: int, kv_heads: int, dtype: torch.dtype) -> tuple:
    """The ledger's (forward, backward) entries of one rank, from the formulas of parallel/context.py."""
    n = B * kv_heads * (seq // cp) * D
    e = torch.empty((), dtype=dtype).element_size()
    a = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    key = lambda kind: (kind, "intra", "cp")  # noqa: E731
    if form == "p2p":
        return {key("p2p"): (cp - 1) * 2 * n * e}, {key("p2p"): (cp - 1) * 2 * n * (e + a)}
    return ({key("all_gather"): (cp - 1) * 2 * n * e},
            {key("all_gather"): (cp - 1) * 2 * n * e, key("reduce_scatter"): (cp - 1) * 2 * n * a})


@pytest.mark.parametrize("cp, seq", [(2, 40), (4, 120)])  # cp 4: chunks of 15 tokens
def test_context_attention_equals_full_causal_attention(cp, seq):
    worlds = run_world(_worker, cp, seq, timeout=120)
    for rank, results in enumerate(worlds):
        for (form, heads, kv_heads, dtype), r in results.items():
            case = f"cp={cp} rank {rank} {form} heads={heads} kv_heads={kv_heads} {dtype}"
            for name, got, want in zip(("out", "dq", "dk", "dv"), r["got"], r["want"]):
                assert got.dtype == dtype and got.shape == want.shape, f"{case} {name}: {got.dtype} {got.shape}"
                err = (got.double() - want).abs().max().item()
                bound = TOLERANCE[dtype] * (1 if dtype == torch.float64 else want.abs().max().item())
                assert err <= bound, f"{case} {name}: max error {err:.3g} > {bound:.3g}"
            assert (r["forward"], r["backward"]) == _expected_bytes(form, cp, seq, kv_heads, dtype), case


@pytest.mark.parametrize("form", ["p2p", "all_gather"])
def test_cp_of_one_is_causal_sdpa_and_sends_nothing(form):
    group = Group("cp", None, [0], 0, "intra", Ledger())
    q, k, v, _ = _full(12, 4, 2)
    got = context_attention(q, k, v, ContextParallel(group, form))
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert not group.ledger.bytes


def test_chunks_and_positions_are_megatron_load_balanced():
    x = torch.arange(8)
    ranks = [ContextParallel(Group("cp", None, [0, 1], r, "intra", Ledger())) for r in range(2)]
    assert [local_chunks(x, 2, r, dim=0).tolist() for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [cp.positions(8).tolist() for cp in ranks] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [cp.chunk_ids() for cp in ranks] == [(0, 3), (1, 2)]
    four = ContextParallel(Group("cp", None, [0, 1, 2, 3], 1, "intra", Ledger()))
    assert four.positions(24).tolist() == [3, 4, 5, 18, 19, 20]
    assert four.positions(24).dtype == torch.int64
    y = torch.arange(16).view(2, 8)
    assert local_chunks(y, 2, 1, dim=1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    with pytest.raises(ValueError, match="2 x cp = 4"):
        ranks[0].positions(10)
    with pytest.raises(ValueError, match="comm must be one of"):
        ContextParallel(ranks[0].group, "ulysses")
