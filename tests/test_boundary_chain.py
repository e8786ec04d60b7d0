"""The step boundary's chain (``parallel/volume.boundary_chain_bytes``; ``scripts/bench_cluster.py`` prints the
floor it sets): the bytes that must cross nodes between the end of the first block's backward and the start of
its next forward. References: the chain from the modules' parameter counts and the padding / quantization rules
(not from the ZeRO units' code), and the whole step's cross-node bytes from a real 2 x 2 run's ledger."""
import math

import pytest

from parallel.layout import make_layout
from parallel.volume import boundary_chain_bytes
from parallel.zero.zeropp import QgzPlan, Quant
from tests.dist_harness import run_world
from tests.parallel_utils import tiny_config, train_worker

NODES = ["parallel.ranks_per_node=2"]
ZERO3 = NODES + ["zero.stage=3"]
ZEROPP = ZERO3 + ["zero.quantized_weights=true", "zero.hpz_size=2", "zero.quantized_gradients=true"]
ALIGN = 128  # parallel/zero/partition.py: every shard rounded up to this many elements


def first_two_modules(cfg):
    """Parameter counts of the embedding and the first block, from the model itself."""
    from model.gpt import GPTChunk, chunk_layers
    from model.layers import TPContext
    from parallel.comm import Group, Ledger

    ctx = TPContext(Group("tp", None, [0], 0, "intra", Ledger()), False, rng=None)
    (_, layers), = chunk_layers(cfg.model, 1, 1, 0)
    chunk = GPTChunk(cfg.model, ctx, layers, first=True, last=True)
    first_block = next(iter(chunk.layers.values()))
    return [sum(p.numel() for p in chunk.embedding.parameters()), sum(p.numel() for p in first_block.parameters())]


def shard(numel: int, n: int) -> int:
    """Elements of each of n shards: numel / n rounded up, then up to a multiple of ALIGN."""
    return math.ceil(math.ceil(numel / n) / ALIGN) * ALIGN


def test_plain_zero3_chain_is_one_reduce_and_one_gather_of_the_first_two_modules():
    cfg = tiny_config(*ZERO3)
    layout = make_layout(cfg, 4, 2)
    n, e = 4, 4  # fp32 parameters and reduces; the DP group spans both nodes
    expected = sum((n - 1) * shard(k, n) * (e + e) for k in first_two_modules(cfg))
    got = boundary_chain_bytes(cfg, layout, 0)
    assert got["chain"] == expected
    assert 0 < got["chain"] < got["step"]


def test_zeropp_chain_counts_only_the_hops_that_cross_nodes():
    cfg = tiny_config(*ZEROPP)
    layout = make_layout(cfg, 4, 2)
    n, x, y = 4, 2, 2
    q4 = Quant(4, 128)
    expected = 0.0
    for numel in first_two_modules(cfg):
        s = shard(numel, n)
        expected += (y - 1) * (s + 4 * math.ceil(s / 128))  # qwZ's first hop: the int8 shard and its fp32 scales
        if n * s >= cfg.zero.qgz_min_numel:  # qgZ's inter-node all-to-all (the intra-node hop stays in the node)
            expected += QgzPlan(n * s, x, y, q4, cfg.zero.qgz_stages).bytes_per_rank()[1]
        else:
            expected += (n - 1) * s * 4
    got = boundary_chain_bytes(cfg, layout, 0, early=True)
    assert got["chain"] == pytest.approx(expected)
    assert 0 < got["chain"] < got["step"]


@pytest.mark.parametrize("overrides", [ZERO3, ZEROPP], ids=["zero3", "zeropp"])
def test_step_bytes_are_the_ledgers_cross_node_bytes(overrides):
    out = run_world(train_worker, 4, overrides, 2)
    cfg = tiny_config(*overrides)
    layout = make_layout(cfg, 4, 2)
    for rank, result in enumerate(out):
        expected = boundary_chain_bytes(cfg, layout, rank, early=result["early"])["step"]
        assert result["comm"]["by_link"]["inter"] == pytest.approx(expected, abs=16), rank


def test_refuses_what_it_does_not_model():
    for overrides, world, rpn in ((NODES + ["zero.stage=2"], 4, 2),
                                  (["zero.stage=3", "parallel.pp=2"], 2, 2)):
        cfg = tiny_config(*overrides)
        with pytest.raises(ValueError, match="ZeRO-3 on one pipeline stage"):
            boundary_chain_bytes(cfg, make_layout(cfg, world, rpn), 0)
