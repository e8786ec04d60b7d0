"""Tests for parallel/tensor_parallel.py, parallel/cross_entropy.py and model/init.py.

Every parallel layer is checked against a single-device ``torch.nn.functional`` computation on the full
weights, which the test builds itself and shards by hand the way the layers' docstrings describe:

* ColumnParallelLinear: weight ``(out, in)`` split on dim 0; fused: ``(fused, out, in)`` split on dim 1;
* RowParallelLinear: weight ``(out, in)`` split on dim 1, bias replicated;
* VocabParallelEmbedding: rows split;
* sequence parallelism: activations ``[s, b, h]``, a rank holds rows ``rank*s/tp .. (rank+1)*s/tp`` of dim 0.

Layers run in float64 (the reference too), so the comparisons are tight.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F

from tests.dist_harness import run_world

S, B, IN, OUT, V, H = 8, 3, 12, 8, 16, 6  # s and every split dim divisible by 4


def _rand(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _tp_group(rank: int, size: int, pg=None):
    from parallel.comm import Group, Ledger

    return Group(name="tp", pg=pg, ranks=list(range(size)), rank=rank, link="intra", ledger=Ledger())


def _sl(n: int, rank: int, size: int) -> slice:
    k = n // size
    return slice(rank * k, (rank + 1) * k)


# ---- workers (module level for the forkserver) ---------------------------------------------------------

def _column_checks(group, sp: bool, fused: int, out: Dict[str, tuple]) -> None:
    from parallel.tensor_parallel import ColumnParallelLinear

    r, g = group.rank, group.size
    lead = (fused,) if fused > 1 else ()
    W, b = _rand(1, *lead, OUT, IN), _rand(2, *lead, OUT)
    x, R = _rand(3, S, B, IN), _rand(4, S, B, fused * OUT)
    # reference on full weights
    Wr, br, xr = (t.clone().requires_grad_() for t in (W, b, x))
    y = F.linear(xr, Wr.reshape(-1, IN), br.reshape(-1))
    (y * R).sum().backward()
    # parallel layer with hand-made shards
    cols = _sl(OUT, r, g)
    layer = ColumnParallelLinear(IN, OUT, group, sequence_parallel=sp, bias=True, fused=fused).double()
    with torch.no_grad():
        layer.weight.copy_(W[..., cols, :])
        layer.bias.copy_(b[..., cols])
    seq = _sl(S, r, g) if sp else slice(None)
    xin = x[seq].clone().requires_grad_()
    yl = layer(xin)
    Rl = R.view(S, B, fused, OUT)[..., cols].reshape(S, B, -1)
    (yl * Rl).sum().backward()
    tag = f"column(fused={fused},sp={sp})"
    out[f"{tag}/out"] = (yl.detach(), y.detach().view(S, B, fused, OUT)[..., cols].reshape(S, B, -1))
    out[f"{tag}/dx"] = (xin.grad, xr.grad[seq])
    out[f"{tag}/dW"] = (layer.weight.grad, Wr.grad[..., cols, :])
    out[f"{tag}/db"] = (layer.bias.grad, br.grad[..., cols])


def _row_checks(group, sp: bool, out: Dict[str, tuple], partial: Dict[str, tuple]) -> None:
    from parallel.tensor_parallel import RowParallelLinear

    r, g = group.rank, group.size
    W, b = _rand(11, OUT, IN), _rand(12, OUT)
    x, R = _rand(13, S, B, IN), _rand(14, S, B, OUT)
    Wr, br, xr = (t.clone().requires_grad_() for t in (W, b, x))
    y = F.linear(xr, Wr, br)
    (y * R).sum().backward()
    feats = _sl(IN, r, g)
    layer = RowParallelLinear(IN, OUT, group, sequence_parallel=sp, bias=True).double()
    with torch.no_grad():
        layer.weight.copy_(W[:, feats])
        layer.bias.copy_(b)
    xin = x[..., feats].clone().requires_grad_()
    yl = layer(xin)
    seq = _sl(S, r, g) if sp else slice(None)
    (yl * R[seq]).sum().backward()
    tag = f"row(sp={sp})"
    out[f"{tag}/out"] = (yl.detach(), y.detach()[seq])
    out[f"{tag}/dx"] = (xin.grad, xr.grad[..., feats])
    out[f"{tag}/dW"] = (layer.weight.grad, Wr.grad[:, feats])
    if sp:  # each rank saw only its sequence slice: the bias gradient is partial, summed over TP
        partial[f"{tag}/db"] = (layer.bias.grad.clone(), br.grad)
    else:
        out[f"{tag}/db"] = (layer.bias.grad, br.grad)


def _embedding_checks(group, sp: bool, out: Dict[str, tuple]) -> None:
    from parallel.tensor_parallel import VocabParallelEmbedding

    r, g = group.rank, group.size
    W = _rand(21, V, H)
    ids = (torch.arange(B * S) * 7 + 3).remainder(V).view(B, S)  # every vocabulary shard is hit
    assert set(ids.flatten().tolist()) == set(range(V))
    R = _rand(22, S, B, H)
    Wr = W.clone().requires_grad_()
    y = F.embedding(ids.t(), Wr)
    (y * R).sum().backward()
    rows = _sl(V, r, g)
    layer = VocabParallelEmbedding(V, H, group, sequence_parallel=sp).double()
    with torch.no_grad():
        layer.weight.copy_(W[rows])
    yl = layer(ids)
    seq = _sl(S, r, g) if sp else slice(None)
    (yl * R[seq]).sum().backward()
    tag = f"embedding(sp={sp})"
    out[f"{tag}/out"] = (yl.detach(), y.detach()[seq])
    out[f"{tag}/dW"] = (layer.weight.grad, Wr.grad[rows])


def _cross_entropy_checks(group, out: Dict[str, tuple], loose: Dict[str, tuple]) -> None:
    from parallel.cross_entropy import vocab_parallel_cross_entropy

    r, g = group.rank, group.size
    cols = _sl(V, r, g)
    cases = {
        "spread": (_rand(31, S, B, V) * 3, (torch.arange(S * B) * 5 + 1).remainder(V).view(S, B)),
        "one_shard": (_rand(32, S, B, V), torch.full((S, B), V - 1)),
        "large": (_rand(33, S, B, V) * 40 + 1000.0, (torch.arange(S * B) * 3).remainder(V).view(S, B)),
    }
    for name, (logits, target) in cases.items():
        logits = logits.float().double()  # the loss is computed in fp32: compare on fp32-representable logits
        w = _rand(34, S, B)
        ref_in = logits.clone().requires_grad_()
        ref = F.cross_entropy(ref_in.view(-1, V), target.reshape(-1), reduction="none").view(S, B)
        (ref * w).sum().backward()
        local = logits[..., cols].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, group)
        (loss * w).sum().backward()
        out[f"ce[{name}]/loss"] = (loss.detach().double(), ref.detach())
        out[f"ce[{name}]/grad"] = (local.grad, ref_in.grad[..., cols])
    # bf16 logits: compared with the float64 loss of the same (bf16-rounded) values, and loosely with the
    # float64 loss of the unrounded logits
    logits, target = _rand(35, S, B, V) * 2, (torch.arange(S * B) * 11 + 2).remainder(V).view(S, B)
    lb = logits.to(torch.bfloat16)
    ref_in = lb.double().requires_grad_()
    ref = F.cross_entropy(ref_in.view(-1, V), target.reshape(-1), reduction="none").view(S, B)
    ref.sum().backward()
    local = lb[..., cols].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group)
    loss.sum().backward()
    assert local.grad.dtype == torch.bfloat16
    loose["ce[bf16]/loss"] = (loss.detach().double(), ref.detach(), 1e-4)
    loose["ce[bf16]/grad"] = (local.grad.double(), ref_in.grad[..., cols], 4e-3)
    exact = F.cross_entropy(logits.view(-1, V), target.reshape(-1), reduction="none").view(S, B)
    loose["ce[bf16]/loss_vs_unrounded"] = (loss.detach().double(), exact, 5e-2)


def layers_worker() -> dict:
    import torch.distributed as dist

    group = _tp_group(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
    out: Dict[str, tuple] = {}
    partial: Dict[str, tuple] = {}
    loose: Dict[str, tuple] = {}
    for sp in (False, True):
        for fused in (1, 2, 3):
            _column_checks(group, sp, fused, out)
        _row_checks(group, sp, out, partial)
        _embedding_checks(group, sp, out)
    _cross_entropy_checks(group, out, loose)
    return {"out": out, "partial": partial, "loose": loose, "ledger": dict(group.ledger.bytes)}


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def layer_world(request):
    return request.param, run_world(layers_worker, request.param, timeout=120)


def _check(actual, expected, rtol=1e-10, atol=1e-10, name=""):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _results(layer_world, prefix: str):
    tp, ranks = layer_world
    found = 0
    for rank, res in enumerate(ranks):
        for name, (actual, expected) in res["out"].items():
            if name.startswith(prefix):
                found += 1
                yield f"tp{tp} rank{rank} {name}", actual, expected
    assert found > 0


@pytest.mark.parametrize("prefix", ["column(fused=1,sp=False)", "column(fused=1,sp=True)",
                                    "column(fused=2,sp=False)", "column(fused=2,sp=True)", "column(fused=3,sp=False)",
                                    "column(fused=3,sp=True)", "row(sp=False)", "row(sp=True)",
                                    "embedding(sp=False)", "embedding(sp=True)"])
def test_parallel_layers_match_full_weight_reference(layer_world, prefix: str) -> None:
    for name, actual, expected in _results(layer_world, prefix):
        _check(actual, expected, name=name)


def test_sequence_parallel_row_bias_grad_sums_to_the_reference(layer_world) -> None:
    tp, ranks = layer_world
    partials = [res["partial"]["row(sp=True)/db"] for res in ranks]
    total = sum(p for p, _ in partials)
    _check(total, partials[0][1], name="row bias")
    # and it really is partial on each rank (a rank alone does not hold the full gradient)
    assert not torch.allclose(partials[0][0], partials[0][1])


def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(layer_world) -> None:
    for name, actual, expected in _results(layer_world, "ce["):
        _check(actual, expected, rtol=2e-5, atol=2e-6, name=name)


def test_vocab_parallel_cross_entropy_bf16_stays_close(layer_world) -> None:
    tp, ranks = layer_world
    for rank, res in enumerate(ranks):
        for name, (actual, expected, atol) in res["loose"].items():
            _check(actual, expected, rtol=0, atol=atol, name=f"tp{tp} rank{rank} {name}")


def test_sequence_parallel_traffic_is_counted_on_the_tp_group(layer_world) -> None:
    tp, ranks = layer_world
    for res in ranks:
        kinds = {k for (k, link, name) in res["ledger"]}
        assert {("all_reduce"), ("all_gather"), ("reduce_scatter")} <= kinds
        assert all(link == "intra" and name == "tp" for (_, link, name) in res["ledger"])


# ---- initialisation ------------------------------------------------------------------------------------

def _model_cfg(*overrides: str):
    from config import load_config

    base = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=8", "model.vocab_size=64",
            "model.ffn_hidden=64"]
    return load_config(None, base + list(overrides)).model


def _split_dim(name: str, swiglu: bool) -> Optional[int]:
    """Which dim of a parameter's global tensor TP splits, from the layer docstrings (independent of ParamSpec)."""
    if name == "embedding.weight" or name == "head.weight":
        return 0
    if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
        return 1  # (3, d, d) / (3, d)
    if name.endswith("mlp.up.weight") or name.endswith("mlp.up.bias"):
        return 1 if swiglu else 0  # (2, ffn, d) or (ffn, d)
    if name.endswith("proj.weight") or name.endswith("down.weight"):
        return 1
    return None  # norms and row-parallel biases are replicated


def _partial_under_sp(name: str) -> bool:
    return "norm" in name or name.endswith("proj.bias") or name.endswith("down.bias")


def _chunk(mcfg, rank: int, size: int, sp: bool, seed: int = 1234, pg=None):
    from model.gpt import GPTChunk
    from model.init import init_parameters
    from model.layers import TPContext
    from parallel.random import RNGTracker

    group = _tp_group(rank, size, pg)
    ctx = TPContext(group, sp and size > 1, RNGTracker(torch.device("cpu"), seed, 0, 0, rank))
    chunk = GPTChunk(mcfg, ctx, range(mcfg.n_layers), first=True, last=True)
    init_parameters(chunk, seed, rank, size)
    return chunk


VARIANTS = {
    "swiglu": [],
    "gelu_bias_tied": ["model.activation=gelu", "model.norm=layernorm", "model.bias=true",
                       "model.tie_embeddings=true"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_init_tp2_shards_are_slices_of_the_tp1_model(variant: str) -> None:
    mcfg = _model_cfg(*VARIANTS[variant])
    swiglu = mcfg.activation == "swiglu"
    with torch.random.fork_rng():
        full = dict(_chunk(mcfg, 0, 1, False).named_parameters())
        shards = [dict(_chunk(mcfg, r, 2, False).named_parameters()) for r in range(2)]
    d, f = mcfg.d_model, mcfg.ffn_size
    # global shapes, by hand
    shapes = {"embedding.weight": (64, d), "layers.0.attn.qkv.weight": (3, d, d), "layers.0.attn.proj.weight": (d, d),
              "layers.0.mlp.up.weight": (2, f, d) if swiglu else (f, d), "layers.0.mlp.down.weight": (d, f),
              "layers.0.attn_norm.weight": (d,), "final_norm.weight": (d,)}
    for name, shape in shapes.items():
        assert tuple(full[name].shape) == shape, name
    assert ("head.weight" in full) == (not mcfg.tie_embeddings)
    assert set(shards[0]) == set(full) == set(shards[1])
    for name, p in full.items():
        dim = _split_dim(name, swiglu)
        for r in range(2):
            want = p if dim is None else p.chunk(2, dim=dim)[r]
            assert torch.equal(shards[r][name], want), (name, r)
    # the init follows the documented distributions
    std = mcfg.init_std
    assert abs(full["embedding.weight"].std().item() - std) < 0.1 * std
    assert abs(full["layers.0.attn.qkv.weight"].std().item() - std) < 0.1 * std
    scaled = std / (2 * mcfg.n_layers) ** 0.5
    assert abs(full["layers.1.attn.proj.weight"].std().item() - scaled) < 0.15 * scaled
    assert abs(full["layers.0.mlp.down.weight"].std().item() - scaled) < 0.15 * scaled
    assert torch.equal(full["final_norm.weight"], torch.ones(d))
    if mcfg.bias:
        assert torch.equal(full["layers.0.attn.qkv.bias"], torch.zeros(3, d))
        assert torch.equal(full["layers.0.attn_norm.bias"], torch.zeros(d))
    # parameters are drawn independently (per name), and the seed matters
    assert not torch.equal(full["layers.0.attn.qkv.weight"], full["layers.1.attn.qkv.weight"])
    with torch.random.fork_rng():
        other = dict(_chunk(mcfg, 0, 1, False, seed=99).named_parameters())
    assert not torch.equal(other["embedding.weight"], full["embedding.weight"])


def test_init_does_not_depend_on_the_global_rng() -> None:
    mcfg = _model_cfg()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        a = dict(_chunk(mcfg, 1, 2, True).named_parameters())
        torch.manual_seed(12345)
        torch.rand(1000)
        b = dict(_chunk(mcfg, 1, 2, True).named_parameters())
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ---- a whole GPT chunk at tp=2 / tp=4 against tp=1 ---------------------------------------------------------

def _tokens():
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(0, 64, (2, 9), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _loss_and_grads(chunk) -> tuple:
    tokens, labels = _tokens()
    loss = chunk(tokens, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in chunk.named_parameters()}


def gpt_worker(runs: List[tuple]) -> dict:
    import torch.distributed as dist

    out = {}
    for variant, sp in runs:
        mcfg = _model_cfg(*VARIANTS[variant])
        chunk = _chunk(mcfg, dist.get_rank(), dist.get_world_size(), sp, pg=dist.group.WORLD)
        out[(variant, sp)] = _loss_and_grads(chunk)
    return out


def _compare_with_tp1(results: List[dict], runs: List[tuple]) -> None:
    tp = len(results)
    for variant, sp in runs:
        mcfg = _model_cfg(*VARIANTS[variant])
        with torch.random.fork_rng():
            ref_loss, ref_grads = _loss_and_grads(_chunk(mcfg, 0, 1, False))
        swiglu = mcfg.activation == "swiglu"
        for rank, res in enumerate(results):
            loss, _ = res[(variant, sp)]
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for name, ref in ref_grads.items():
            dim = _split_dim(name, swiglu)
            per_rank = [res[(variant, sp)][1][name] for res in results]
            if dim is not None:
                got = torch.cat(per_rank, dim=dim)
            elif sp and _partial_under_sp(name):
                got = sum(per_rank)
            else:
                for g in per_rank[1:]:
                    torch.testing.assert_close(g, per_rank[0], rtol=1e-5, atol=1e-7)
                got = per_rank[0]
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-6,
                                       msg=lambda m: f"tp{tp} {variant} sp={sp} {name}: {m}")


GPT_RUNS = [("swiglu", False), ("swiglu", True), ("gelu_bias_tied", False), ("gelu_bias_tied", True)]


def test_gpt_chunk_tp2_matches_tp1() -> None:
    _compare_with_tp1(run_world(gpt_worker, 2, GPT_RUNS, timeout=120), GPT_RUNS)


def test_gpt_chunk_tp4_sequence_parallel_matches_tp1() -> None:
    runs = [("gelu_bias_tied", True)]
    _compare_with_tp1(run_world(gpt_worker, 4, runs, timeout=120), runs)
