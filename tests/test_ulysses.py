"""parallel/ulysses.py, context parallelism's all-to-all form, against float64 full causal attention.

The reference is tests/test_context_attention.py's: every rank builds the same seeded full-length q, k, v and
upstream gradient, runs float64 causal SDPA over the whole sequence (``enable_gqa``) with autograd and takes the
output and gradients at its own two chunks. Cases cover KV heads split over the ranks, replicated on several
(KV < cp) and straddled unevenly (a rank's query heads using two KV heads of different sharing). The ledger's
all_to_all bytes equal the formula of the module docstring, counted here by hand per head.
"""
from __future__ import annotations

import pytest
import torch

from parallel.comm import Group, Ledger
from parallel.context import local_chunks
from parallel.layout import cp_chunks
from parallel.ulysses import kv_heads_of, ulysses_attention
from tests.dist_harness import run_world
from tests.test_context_attention import B, D, TOLERANCE, _full, _reference

CASES = {  # cp: [(heads, kv_heads, dtype)]
    2: [(4, 4, torch.float64), (4, 1, torch.float64), (12, 3, torch.float64), (4, 2, torch.bfloat16)],
    4: [(4, 4, torch.float64), (8, 2, torch.float64), (4, 1, torch.float64), (8, 8, torch.float32)],
}
SEQ = 24


def _worker():
    import torch.distributed as dist

    size, rank = dist.get_world_size(), dist.get_rank()
    group = Group("cp", dist.group.WORLD, list(range(size)), rank, "intra", Ledger())
    out = {}
    for heads, kv_heads, dtype in CASES[size]:
        q, k, v, dout = _full(SEQ, heads, kv_heads, seed=heads + kv_heads)
        mine = [local_chunks(t, size, rank, dim=2).to(dtype).requires_grad_() for t in (q, k, v)]
        group.ledger.reset()
        o = ulysses_attention(*mine, group, [list(cp_chunks(size, r)) for r in range(size)])
        forward = group.ledger.bytes.get(("all_to_all", "intra", "cp"), 0)
        group.ledger.reset()
        o.backward(local_chunks(dout, size, rank, dim=2).to(dtype))
        backward = group.ledger.bytes.get(("all_to_all", "intra", "cp"), 0)
        out[heads, kv_heads, dtype] = {"got": [o.detach()] + [t.grad for t in mine], "forward": forward,
                                       "backward": backward,
                                       "want": _reference(q, k, v, dout, dtype, size, rank)}
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_all_to_all_attention_equals_full_attention(cp):
    results = run_world(_worker, cp)
    for rank, result in enumerate(results):
        for (heads, kv_heads, dtype), r in result.items():
            for name, got, want in zip(("out", "dq", "dk", "dv"), r["got"], r["want"]):
                assert got.dtype == dtype and got.shape == want.shape, (name, got.shape, want.shape)
                assert torch.isfinite(got).all()
                err = (got.double() - want).abs().max().item()
                bar = TOLERANCE[dtype] * (1 if dtype == torch.float64 else want.abs().max().item())
                assert err <= bar, (rank, heads, kv_heads, dtype, name, err)
            # bytes, per head of this rank's 2C tokens: q out and the output back, the KV heads each other rank
            # needs; the backward returns what came in
            n = B * (SEQ // cp) * D * torch.finfo(dtype).bits // 8
            per = heads // cp
            need = [sum(1 for kv in range(kv_heads) if any((j * per + i) // (heads // kv_heads) == kv
                                                          for i in range(per))) for j in range(cp)]
            assert need == [kv_heads_of(j, cp, heads, kv_heads)[1] for j in range(cp)]
            assert r["forward"] == n * (2 * (cp - 1) * per + 2 * (sum(need) - need[rank]))
            assert r["backward"] == n * (2 * (cp - 1) * per + 2 * (cp - 1) * need[rank])


def _masked_worker():
    """tests/test_document_mask.py's batches and float64 reference, through the a2a form with the whole
    sequence's document mask (model/doc_mask.py: DocumentMask under a2a carries the dense mask)."""
    import torch.distributed as dist

    from data.gpt_dataset import document_ids
    from model.doc_mask import DocumentMask
    from parallel.context import ContextParallel, context_attention
    from tests.test_document_mask import EOD, _full as _masked_full, _reference as _masked_reference
    from tests.test_document_mask import _reference_mask, _tokens

    size, rank = dist.get_world_size(), dist.get_rank()
    group = Group("cp", dist.group.WORLD, list(range(size)), rank, "intra", Ledger())
    cp = ContextParallel(group, "a2a")
    out = {}
    for batch, heads, kv_heads, dtype in (("designed", 4, 2, torch.float64), ("random", 4, 1, torch.float64),
                                          ("designed", 4, 4, torch.bfloat16)):
        tokens = _tokens(batch)
        q, k, v, dout = _masked_full(heads, kv_heads)
        want = [local_chunks(t, size, rank, dim=2)
                for t in _masked_reference(q, k, v, dout, _reference_mask(tokens), dtype)]
        mask = DocumentMask.build(document_ids(tokens, EOD), cp)
        assert mask.ring is None and mask.dense is not None
        mine = [local_chunks(t, size, rank, dim=2).to(dtype).requires_grad_() for t in (q, k, v)]
        o = context_attention(*mine, cp, mask=mask.dense)
        o.backward(local_chunks(dout, size, rank, dim=2).to(dtype))
        out[batch, heads, kv_heads, dtype] = {"got": [o.detach()] + [t.grad for t in mine], "want": want}
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_document_masked_all_to_all_attention_equals_float64_reference(cp):
    from tests.test_document_mask import _check

    for rank, result in enumerate(run_world(_masked_worker, cp)):
        for (batch, heads, kv_heads, dtype), r in result.items():
            _check(r["got"], r["want"], dtype, f"a2a cp={cp} rank {rank} {batch} heads={heads} kv={kv_heads} {dtype}")
