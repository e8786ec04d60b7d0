"""Tests for parallel/layout.py: rank coordinates, group membership, node topology, and every impossible layout."""

from __future__ import annotations

import itertools

import pytest

from config import ConfigError, load_config
from parallel.layout import make_layout

BASE = ["model.n_layers=8", "model.n_heads=8", "model.d_model=128", "model.vocab_size=4096",
        "model.ffn_hidden=512", "model.seq_len=64", "train.micro_batch_size=1", "train.global_batch_size=32"]


def cfg(*overrides: str):
    return load_config(None, BASE + list(overrides))


def layout(world: int, *overrides: str, launcher_rpn: int | None = None):
    return make_layout(cfg(*overrides), world, launcher_rpn if launcher_rpn is not None else world)


# ---- coordinates and groups -------------------------------------------------------------------------

# world 16 = pp 2 x dp 2 x tp 4, written out by hand: TP innermost, PP outermost
COORDS_16 = [
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 1, 3),
    (1, 0, 0), (1, 0, 1), (1, 0, 2), (1, 0, 3), (1, 1, 0), (1, 1, 1), (1, 1, 2), (1, 1, 3),
]


def test_coordinates_world16_pp2_dp2_tp4() -> None:
    lay = layout(16, "parallel.tp=4", "parallel.pp=2")
    assert (lay.world_size, lay.pp, lay.dp, lay.tp) == (16, 2, 2, 4)
    for rank, coords in enumerate(COORDS_16):
        assert lay.coords(rank) == coords, rank
        assert lay.rank_of(*coords) == rank
    assert lay.num_microbatches == 32 // (1 * 2)


def test_group_membership_world16() -> None:
    lay = layout(16, "parallel.tp=4", "parallel.pp=2")
    assert lay.tp_ranks(5) == [4, 5, 6, 7]
    assert lay.dp_ranks(5) == [1, 5]
    assert lay.pp_ranks(5) == [5, 13]
    assert lay.embedding_ranks(5) == [5, 13]
    assert lay.model_parallel_ranks(5) == [4, 5, 6, 7, 12, 13, 14, 15]
    assert lay.tp_ranks(10) == [8, 9, 10, 11]
    assert lay.dp_ranks(10) == [10, 14]
    assert lay.pp_ranks(10) == [2, 10]
    assert lay.embedding_ranks(10) == [2, 10]
    assert lay.model_parallel_ranks(10) == [0, 1, 2, 3, 8, 9, 10, 11]
    # every family partitions the world, and membership is symmetric
    for fam in (lay.tp_ranks, lay.dp_ranks, lay.pp_ranks, lay.model_parallel_ranks):
        groups = {tuple(fam(r)) for r in range(16)}
        assert sorted(r for g in groups for r in g) == list(range(16))
        for r in range(16):
            assert r in fam(r)
            assert all(fam(q) == fam(r) for q in fam(r))


def test_embedding_group_with_middle_stages() -> None:
    lay = layout(8, "parallel.tp=2", "parallel.pp=4")
    assert lay.pp_ranks(1) == [1, 3, 5, 7]
    assert lay.embedding_ranks(0) == [0, 6]
    assert lay.embedding_ranks(6) == [0, 6]
    assert lay.embedding_ranks(7) == [1, 7]
    assert lay.embedding_ranks(2) == [2]  # a middle stage holds no embedding
    assert lay.embedding_ranks(5) == [5]
    single = layout(2, "parallel.tp=2")
    assert single.embedding_ranks(1) == [1]


def test_dp_intra_inter_world8_rpn4_tp2() -> None:
    lay = layout(8, "parallel.tp=2", "parallel.ranks_per_node=4")
    assert (lay.dp, lay.ranks_per_node, lay.dp_intra_size, lay.dp_inter_size) == (4, 4, 2, 2)
    expected = {  # rank: (dp, dp_intra, dp_inter); nodes are {0..3} and {4..7}
        0: ([0, 2, 4, 6], [0, 2], [0, 4]), 2: ([0, 2, 4, 6], [0, 2], [2, 6]),
        4: ([0, 2, 4, 6], [4, 6], [0, 4]), 6: ([0, 2, 4, 6], [4, 6], [2, 6]),
        1: ([1, 3, 5, 7], [1, 3], [1, 5]), 3: ([1, 3, 5, 7], [1, 3], [3, 7]),
        5: ([1, 3, 5, 7], [5, 7], [1, 5]), 7: ([1, 3, 5, 7], [5, 7], [3, 7]),
    }
    for r, (dp, intra, inter) in expected.items():
        assert lay.dp_ranks(r) == dp
        assert lay.dp_intra_ranks(r) == intra, r
        assert lay.dp_inter_ranks(r) == inter, r
        assert lay.node_of(r) == r // 4


def test_ranks_per_node_from_launcher_and_override() -> None:
    lay = layout(8, "parallel.tp=2", launcher_rpn=4)
    assert lay.ranks_per_node == 4 and lay.dp_intra_ranks(0) == [0, 2]
    over = layout(8, "parallel.tp=2", "parallel.ranks_per_node=2", launcher_rpn=8)
    assert over.ranks_per_node == 2
    assert over.dp_intra_ranks(0) == [0] and over.dp_inter_ranks(0) == [0, 2, 4, 6]
    assert (over.dp_intra_size, over.dp_inter_size) == (1, 4)
    one_node = layout(8, "parallel.tp=2")
    assert (one_node.dp_intra_size, one_node.dp_inter_size) == (4, 1)
    assert one_node.dp_inter_ranks(3) == [3]


@pytest.mark.parametrize("world, tp, pp, rpn", [
    (8, 1, 1, 2), (8, 2, 1, 2), (8, 2, 1, 4), (8, 1, 2, 2), (16, 2, 2, 4), (16, 4, 1, 8), (16, 1, 2, 4),
    (16, 2, 2, 8), (16, 1, 1, 4), (12, 1, 1, 4), (12, 2, 1, 6), (8, 1, 4, 2),
])
def test_dp_subgroups_follow_spec_definitions(world: int, tp: int, pp: int, rpn: int) -> None:
    """SPEC §1: dp_intra = DP peers on this node (X); dp_inter = DP peers with the same intra index, one per
    node (Y); DP = X*Y."""
    gbs = 4 * world
    lay = make_layout(cfg(f"parallel.tp={tp}", f"parallel.pp={pp}", f"train.global_batch_size={gbs}",
                          f"parallel.ranks_per_node={rpn}"), world, world)
    dp = world // (tp * pp)
    assert lay.dp == dp
    X, Y = lay.dp_intra_size, lay.dp_inter_size
    assert X * Y == dp
    for r in range(world):
        peers = lay.dp_ranks(r)
        node = r // rpn
        intra = [q for q in peers if q // rpn == node]
        assert lay.dp_intra_ranks(r) == intra and len(intra) == X
        idx = intra.index(r)
        nodes = sorted({q // rpn for q in peers})
        inter = [[q for q in peers if q // rpn == n][idx] for n in nodes]
        assert lay.dp_inter_ranks(r) == inter and len(inter) == Y
        assert len({q // rpn for q in inter}) == Y  # one per node
        # the TP group never crosses a node
        assert len({q // rpn for q in lay.tp_ranks(r)}) == 1


def test_sequence_parallel_flag_is_dropped_without_tp() -> None:
    assert layout(4, "parallel.sequence_parallel=true").sequence_parallel is False
    assert layout(4, "parallel.tp=2", "parallel.sequence_parallel=true").sequence_parallel is True


def test_num_microbatches() -> None:
    lay = layout(8, "parallel.tp=2", "train.micro_batch_size=2", "train.global_batch_size=48")
    assert lay.dp == 4 and lay.num_microbatches == 48 // (2 * 4)


def test_describe_names_the_sizes() -> None:
    text = layout(16, "parallel.tp=4", "parallel.pp=2", "parallel.ranks_per_node=8").describe()
    assert "pp 2" in text and "dp 2" in text and "tp 4" in text and "world=16" in text


# ---- impossible layouts ---------------------------------------------------------------------------

def _impossible(world: int, *overrides: str, launcher_rpn: int | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        layout(world, *overrides, launcher_rpn=launcher_rpn)
    return str(e.value)


def test_world_not_divisible_by_tp_times_pp() -> None:
    msg = _impossible(6, "parallel.tp=2", "parallel.pp=2")
    assert "6" in msg and "parallel.tp=2" in msg and "parallel.pp=2" in msg and "4" in msg


def test_heads_vocab_ffn_not_divisible_by_tp() -> None:
    msg = _impossible(4, "parallel.tp=4", "model.n_heads=6", "model.d_model=96")
    assert "model.n_heads=6" in msg and "parallel.tp=4" in msg
    msg = _impossible(4, "parallel.tp=4", "model.vocab_size=4098")
    assert "model.vocab_size=4098" in msg and "parallel.tp=4" in msg
    msg = _impossible(4, "parallel.tp=4", "model.ffn_hidden=510")
    assert "510" in msg and "ffn_hidden" in msg and "parallel.tp=4" in msg


def test_layers_not_divisible_by_pp_times_virtual_stages() -> None:
    msg = _impossible(3, "parallel.pp=3", "train.global_batch_size=33")
    assert "model.n_layers=8" in msg and "parallel.pp=3" in msg
    msg = _impossible(2, "parallel.pp=2", "parallel.virtual_stages=3", "model.n_layers=8",
                      "train.global_batch_size=4")
    assert "model.n_layers=8" in msg and "parallel.virtual_stages=3" in msg and "6" in msg


def test_virtual_stages_need_pipeline() -> None:
    msg = _impossible(2, "parallel.virtual_stages=2")
    assert "parallel.virtual_stages=2" in msg and "pp" in msg


def test_fewer_microbatches_than_stages() -> None:
    msg = _impossible(4, "parallel.pp=4", "train.global_batch_size=6", "train.micro_batch_size=2")
    assert "3 micro-batches" in msg and "parallel.pp=4" in msg


def test_interleaved_needs_microbatches_divisible_by_pp() -> None:
    msg = _impossible(2, "parallel.pp=2", "parallel.virtual_stages=2", "train.global_batch_size=5")
    assert "(5)" in msg and "parallel.pp=2" in msg
    # the same numbers without interleaving are fine
    assert layout(2, "parallel.pp=2", "train.global_batch_size=5").num_microbatches == 5


def test_global_batch_not_divisible_by_micro_batch_times_dp() -> None:
    msg = _impossible(4, "train.global_batch_size=6", "train.micro_batch_size=1")
    assert "train.global_batch_size=6" in msg and "4" in msg


def test_seq_len_not_divisible_by_tp_under_sequence_parallelism() -> None:
    msg = _impossible(4, "parallel.tp=4", "parallel.sequence_parallel=true", "model.seq_len=66")
    assert "model.seq_len=66" in msg and "parallel.tp=4" in msg
    assert layout(4, "parallel.tp=4", "model.seq_len=66").tp == 4  # fine without SP


def test_tp_spanning_nodes() -> None:
    msg = _impossible(8, "parallel.tp=4", "parallel.ranks_per_node=2")
    assert "parallel.tp=4" in msg and "ranks_per_node=2" in msg
    msg = _impossible(12, "parallel.tp=4", "parallel.ranks_per_node=6", "train.global_batch_size=30")
    assert "parallel.tp=4" in msg and "ranks_per_node=6" in msg
    msg = _impossible(8, "parallel.tp=4", launcher_rpn=2)  # from the launcher as well
    assert "parallel.tp=4" in msg and "2" in msg


def test_ranks_per_node_not_dividing_world() -> None:
    msg = _impossible(8, "parallel.ranks_per_node=3")
    assert "ranks_per_node=3" in msg and "8" in msg
    msg = _impossible(8, "parallel.ranks_per_node=0")
    assert "ranks_per_node=0" in msg


def test_dp_peers_spread_unevenly_over_nodes() -> None:
    # world 12, pp 2 -> dp 6; stage 0 = ranks 0..5 = 4 on node 0 and 2 on node 1
    msg = _impossible(12, "parallel.pp=2", "parallel.ranks_per_node=4", "train.global_batch_size=12")
    assert "ranks_per_node=4" in msg


def test_all_problems_reported_together() -> None:
    msg = _impossible(6, "parallel.tp=4", "model.n_heads=6", "model.d_model=96", "parallel.ranks_per_node=4")
    assert "world size 6" in msg and "model.n_heads=6" in msg and "ranks_per_node=4" in msg


def test_many_valid_layouts_are_consistent() -> None:
    for tp, pp, world in itertools.product((1, 2, 4), (1, 2, 4), (4, 8, 16)):
        if world % (tp * pp):
            continue
        lay = layout(world, f"parallel.tp={tp}", f"parallel.pp={pp}")
        assert lay.dp == world // (tp * pp)
        seen = sorted(lay.rank_of(*lay.coords(r)) for r in range(world))
        assert seen == list(range(world))
        for r in range(world):
            p, d, t = lay.coords(r)
            assert r == p * lay.dp * tp + d * tp + t
