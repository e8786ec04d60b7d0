"""Document masks (model/doc_mask.py, parallel/context_mask.py): attention against a float64 reference.

Reference: every rank builds the same seeded full-length q, k, v, upstream gradient and tokens, finds the documents
with a Python loop over the tokens (an EOD ends its document), writes the boolean mask q_doc == k_doc and k <= q
element by element, and runs float64 SDPA with that mask under autograd; it takes the output and the gradients at
its own chunks. None of the code under test builds it. Tolerances as tests/test_context_attention.py's: 1e-10
absolute for float64, 2e-2 relative for bf16.

Boundaries: a designed batch (one-token documents, a document over three CP chunks, a chunk that is all one
document's middle, a query chunk that sees nothing of the first key chunk in any row: a skipped pair, and rows that
see nothing of a pair in another row: a masked pair's empty rows) and a seeded random batch. Also checked: which
pairs run (exactly those with a visible entry in some row), the bytes sent (the dense formulas: skipping changes
no transfer), no NaN or inf anywhere, the reset positions, and that masking off is the causal path bit for bit.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F

from data.gpt_dataset import document_ids
from model.doc_mask import DocumentMask, dense_mask, document_positions
from parallel.comm import Group, Ledger
from parallel.context import ContextParallel, context_attention, local_chunks
from parallel.context_mask import ContextMask
from parallel.layout import cp_chunks
from tests.dist_harness import run_world

EOD = 2  # the bundled sentencepiece tokenizer's (data/sample/tokenizer.model)
SEQ, D = 48, 8  # cp 4: chunks of 6 tokens
DESIGNED = [  # EOD positions per row
    [3, 4, 5, 20, 40],  # docs [0..3] [4] [5] [6..20]: over chunks 1-3, chunk 2 (12..17) all its middle; [21..40]
    [10, 30, 31, 47],  # [0..10] [11..30] [31] [32..47]; no row's chunk 7 (42..47) sees chunk 0
]
CASES = [  # (batch, form, heads, kv_heads, dtype)
    ("designed", "p2p", 4, 2, torch.float64), ("designed", "all_gather", 4, 2, torch.float64),
    ("random", "p2p", 4, 4, torch.float64), ("random", "all_gather", 4, 1, torch.float64),
    ("designed", "p2p", 4, 4, torch.bfloat16), ("random", "all_gather", 4, 2, torch.bfloat16),
]
TOLERANCE = {torch.float64: 1e-10, torch.bfloat16: 2e-2}


def _tokens(batch: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, 100, (2, SEQ), generator=g)
    if batch == "designed":
        for row, eods in enumerate(DESIGNED):
            tokens[row, eods] = EOD
    else:
        tokens[torch.rand(2, SEQ, generator=g) < 0.12] = EOD
    return tokens


def _reference_mask(tokens: torch.Tensor) -> torch.Tensor:
    """[b, 1, S, S] bool from a loop over the tokens (independent of document_ids / dense_mask)."""
    rows = []
    for row in tokens.tolist():
        doc, d = [], 0
        for t in row:
            doc.append(d)
            d += t == EOD
        rows.append([[doc[q] == doc[k] and k <= q for k in range(len(row))] for q in range(len(row))])
    return torch.tensor(rows)[:, None]


def _full(heads: int, kv_heads: int, seed: int = 0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, heads, SEQ, D), (2, kv_heads, SEQ, D), (2, kv_heads, SEQ, D), (2, heads, SEQ, D)]
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def _reference(q, k, v, dout, mask, dtype) -> List[torch.Tensor]:
    q, k, v = (t.to(dtype).double().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.backward(dout.to(dtype).double())
    return [out.detach(), q.grad, k.grad, v.grad]


def _check(got: List[torch.Tensor], want: List[torch.Tensor], dtype, case: str) -> None:
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype and g.shape == w.shape, f"{case} {name}: {g.dtype} {tuple(g.shape)}"
        assert torch.isfinite(g).all(), f"{case} {name}: not finite"
        err = (g.double() - w).abs().max().item()
        bound = TOLERANCE[dtype] * (1 if dtype == torch.float64 else w.abs().max().item())
        assert err <= bound, f"{case} {name}: max error {err:.3g} > {bound:.3g}"


def _worker() -> Dict[tuple, dict]:
    import torch.distributed as dist

    size, rank = dist.get_world_size(), dist.get_rank()
    group = Group("cp", dist.group.WORLD, list(range(size)), rank, "intra", Ledger())
    results = {}
    for batch, form, heads, kv_heads, dtype in CASES:
        tokens = _tokens(batch)
        ref_mask = _reference_mask(tokens)
        q, k, v, dout = _full(heads, kv_heads)
        want = [local_chunks(t, size, rank, dim=2) for t in _reference(q, k, v, dout, ref_mask, dtype)]
        mask = ContextMask(document_ids(tokens, EOD), size, rank)
        cp = ContextParallel(group, form)
        ql, kl, vl = (local_chunks(t, size, rank, dim=2).to(dtype).requires_grad_() for t in (q, k, v))
        group.ledger.reset()
        out = context_attention(ql, kl, vl, cp, mask=mask)
        out.backward(local_chunks(dout, size, rank, dim=2).to(dtype))
        results[batch, form, heads, kv_heads, dtype] = {
            "got": [out.detach(), ql.grad, kl.grad, vl.grad], "want": want, "bytes": dict(group.ledger.bytes),
            "pairs": _pairs_run(mask, form, size), "visible": _visible(ref_mask, size, rank)}
    return results


def _pairs_run(mask: ContextMask, form: str, cp: int) -> dict:
    """(query chunk, key chunk) -> whether a kernel runs on it (p2p), or each prefix pair's key range."""
    if form == "all_gather":
        return {("prefix", mask.q_ids[a], start, n) for a, start, n, _, _ in mask.prefix_pairs()}
    out = {}
    for src in range(cp):
        run = {(mask.q_ids[a], cp_chunks(cp, src)[start // mask.c]) for a, start, *_ in mask.block_pairs(src)}
        for kc in cp_chunks(cp, src):
            for qc in mask.q_ids:
                if kc <= qc:
                    out[qc, kc] = (qc, kc) in run
    return out


def _visible(ref_mask: torch.Tensor, cp: int, rank: int) -> dict:
    """(query chunk, key chunk) -> whether some row sees some key of it, from the reference mask."""
    c = SEQ // (2 * cp)
    return {(qc, kc): bool(ref_mask[..., qc * c:(qc + 1) * c, kc * c:(kc + 1) * c].any())
            for qc in cp_chunks(cp, rank) for kc in range(qc + 1)}


@pytest.mark.parametrize("cp", [2, 4])
def test_document_masked_context_attention_equals_float64_reference(cp):
    from tests.test_context_attention import B, D as D_DENSE, _expected_bytes

    assert (B, D_DENSE) == (2, D)  # its byte formulas are for the same shapes

    worlds = run_world(_worker, cp, timeout=120)
    skipped = 0
    for rank, results in enumerate(worlds):
        for (batch, form, heads, kv_heads, dtype), r in results.items():
            case = f"cp={cp} rank {rank} {batch} {form} heads={heads} kv_heads={kv_heads} {dtype}"
            _check(r["got"], r["want"], dtype, case)
            if form == "p2p":  # a kernel runs on a pair iff some row sees some key of it: no wasted GEMM
                assert r["pairs"] == r["visible"], case
                skipped += sum(not run for run in r["pairs"].values())
            else:  # the prefix starts at a key some row sees: every key before it is invisible to all rows
                c = SEQ // (2 * cp)
                for _, qc, start, n in (p for p in r["pairs"] if p[2] + p[3] == p[1] * c):  # not the diagonal's
                    rows = _reference_mask(_tokens(batch))[..., qc * c:(qc + 1) * c, :]
                    assert not rows[..., :start].any() and rows[..., start].any(), (case, start)
            forward, backward = _expected_bytes(form, cp, SEQ, kv_heads, dtype)  # the dense ring's: masks change
            assert r["bytes"] == {k: forward.get(k, 0) + backward.get(k, 0) for k in forward | backward}, case
    assert skipped > 0, "the designed batch has pairs no row sees: some must be skipped"


def test_cp_of_one_dense_mask_equals_float64_reference():
    """Without CP the attention layer calls SDPA with ``dense_mask``; every row sees at least itself."""
    for batch in ("designed", "random"):
        tokens = _tokens(batch)
        ref_mask = _reference_mask(tokens)
        mask = dense_mask(document_ids(tokens, EOD))
        assert torch.equal(mask, ref_mask), batch
        q, k, v, dout = _full(4, 2)
        want = _reference(q, k, v, dout, ref_mask, torch.float64)
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out.backward(dout)
        _check([out.detach(), q.grad, k.grad, v.grad], want, torch.float64, batch)


def test_document_ids_and_reset_positions():
    tokens = torch.tensor([[5, EOD, EOD, 7, 8, EOD, 9, 9]])
    assert document_ids(tokens, EOD).tolist() == [[0, 0, 1, 2, 2, 2, 3, 3]]
    assert document_positions(document_ids(tokens, EOD)).tolist() == [[0, 1, 0, 0, 1, 2, 0, 1]]
    docs = document_ids(_tokens("random"), EOD)
    pos = document_positions(docs)  # against a loop: the distance back to the previous EOD (or the start)
    for row, toks in zip(pos.tolist(), _tokens("random").tolist()):
        expect, p = [], 0
        for t in toks:
            expect.append(p)
            p = 0 if t == EOD else p + 1
        assert row == expect


def test_reset_positions_are_the_rotary_angles_at_document_positions():
    """The rope of a reset batch equals Rotary's own table read at the document positions, and a batch of one
    document each is the table itself (the dense positions), bit for bit, also at a CP rank's chunks."""
    from config import load_config
    from model.layers import Rotary, rope_frequencies

    cfg = load_config(None, ["model.seq_len=48", "model.d_model=32", "model.n_heads=4"]).model
    table = Rotary(cfg)
    docs = document_ids(_tokens("designed"), EOD)
    cos, sin = DocumentMask.build(docs, None, rope_frequencies(cfg)).rope
    pos = document_positions(docs).t()
    assert torch.equal(cos, table.cos[:, 0, 0][pos][:, :, None])
    assert torch.equal(sin, table.sin[:, 0, 0][pos][:, :, None])
    one_doc = torch.zeros(2, 48, dtype=torch.int32)
    cp = ContextParallel(Group("cp", None, [0, 1], 1, "intra", Ledger()))
    cos, _ = DocumentMask.build(one_doc, cp, rope_frequencies(cfg)).rope
    assert torch.equal(cos, Rotary(cfg, cp.positions(48)).cos.expand(-1, 2, -1, -1))


def test_masking_off_is_the_causal_path_bit_for_bit():
    """A block given no document mask computes exactly what it computed before masks existed (is_causal SDPA),
    and one given the mask of a batch of single documents computes causal attention (the same values)."""
    from model.layers import Block
    from tests.parallel_utils import tiny_config
    from training.engine import TPContext
    from parallel.random import RNGTracker

    cfg = tiny_config().model
    group = Group("tp", None, [0], 0, "intra", Ledger())
    torch.manual_seed(0)
    block = Block(cfg, TPContext(group, False, RNGTracker(torch.device("cpu"), 0, 0, 0, 0)))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(cfg.seq_len, 2, cfg.d_model)
    attn = block.attn
    qkv = attn.qkv(block.attn_norm(x))
    q, k, v = qkv.view(cfg.seq_len, 2, 3, attn.heads, attn.head_dim).unbind(2)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (attn.rotary(q), attn.rotary(k), v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).flatten(2)
    today = x + attn.proj(o)
    today = today + block.mlp(block.mlp_norm(today))
    assert torch.equal(block(x), today)
    single = DocumentMask.build(torch.zeros(2, cfg.seq_len, dtype=torch.int32), None)
    torch.testing.assert_close(block(x, single), today, rtol=1e-6, atol=1e-6)


def test_batches_carry_the_whole_sequences_document_ids():
    """get_batch with the EOD id: the same tokens and labels as without (also as CP spans), and the document ids of
    the whole sequences, whatever the spans."""
    from data.gpt_dataset import get_batch

    class Data:
        def sample(self, index, lo=0, hi=None):
            return _tokens("random")[index % 2, :25].numpy()[lo:hi]  # 24 tokens + 1

    spans = [(0, 6), (18, 24)]
    for s in (None, spans):
        tokens, labels, docs = get_batch(Data(), [0, 1], s, EOD)
        want = get_batch(Data(), [0, 1], s)
        assert torch.equal(tokens, want[0]) and torch.equal(labels, want[1])
        full = get_batch(Data(), [0, 1])[0]
        assert docs.dtype == torch.int32 and torch.equal(docs, document_ids(full, EOD))
