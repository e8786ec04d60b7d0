"""Shard layouts (flat, whole_tensor) and the box decomposition used to checkpoint shards."""
import itertools

import pytest
import torch

from parallel.zero.dcp_view import range_to_boxes
from parallel.zero.partition import ALIGN, shard_layout


def coverage(layout):
    """For every tensor element, the ranks whose shard holds it."""
    owners = [[[] for _ in range(n)] for n in layout.numels]
    for r in range(layout.world):
        for i, a, b, at in layout.owned(r):
            assert 0 <= at and at + (b - a) <= layout.shard_size
            for e in range(a, b):
                owners[i][e].append(r)
    return owners


@pytest.mark.parametrize("kind", ["flat", "whole_tensor"])
@pytest.mark.parametrize("numels,world", [([10, 3, 700, 1], 4), ([32], 8), ([5000, 5000, 128], 3), ([1], 1),
                                          ([300, 300, 300, 300, 7], 2)])
def test_every_element_has_exactly_one_owner_and_shards_are_aligned(kind, numels, world):
    layout = shard_layout(numels, world, kind)
    assert layout.shard_size % ALIGN == 0 and layout.shard_size > 0
    assert all(len(o) == 1 for t in coverage(layout) for o in t)
    ends = sorted((off, off + n) for off, n in zip(layout.offsets, numels))
    assert all(b <= a2 for (_, b), (a2, _) in zip(ends, ends[1:])), "tensors overlap in the gathered buffer"
    assert ends[-1][1] <= layout.padded_size


def test_flat_is_contiguous_in_order_with_equal_padded_shards():
    layout = shard_layout([100, 200, 50], 4, "flat")
    assert layout.offsets == (0, 100, 300)
    assert layout.shard_size == 128  # ceil(350 / 4) = 88 -> 128
    assert layout.owned(0) == [(0, 0, 100, 0), (1, 0, 28, 100)]
    assert layout.owned(3) == []  # all padding


def test_whole_tensor_greedy_largest_first_to_least_loaded_lowest_rank_on_ties():
    # sizes 7, 5, 4, 4, 3, 1 over 3 ranks (by hand): 7->r0, 5->r1, 4->r2, 4->r2 (loads 7,5,4: r2), 3->r1 (7,5,8),
    # 1->r0 (7,8,8)
    layout = shard_layout([4, 7, 1, 5, 3, 4], 3, "whole_tensor")
    owner = [layout.owner(i) for i in range(6)]
    assert owner == [2, 0, 0, 1, 1, 2]
    for i, n in enumerate(layout.numels):  # whole: the tensor lies inside its owner's shard
        r = owner[i]
        assert r * layout.shard_size <= layout.offsets[i] and layout.offsets[i] + n <= (r + 1) * layout.shard_size


def test_tiny_tensors_with_a_large_group_leave_empty_shards_that_still_work():
    layout = shard_layout([32], 16, "whole_tensor")
    assert [len(layout.owned(r)) for r in range(16)] == [1] + [0] * 15
    flat = shard_layout([32], 16, "flat")
    assert sum(len(flat.owned(r)) for r in range(16)) == 1


def test_bad_requests_fail_loudly():
    with pytest.raises(ValueError, match="striped"):
        shard_layout([1], 2, "striped")
    with pytest.raises(ValueError):
        shard_layout([1], 0)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 6), (1, 1, 1), (3, 2, 2, 2)])
def test_any_flat_range_is_the_union_of_its_boxes(shape):
    n = int(torch.tensor(shape).prod())
    t = torch.arange(n).view(shape)
    for a, b in itertools.combinations_with_replacement(range(n + 1), 2):
        got = []
        for off, sizes, fa, fb in range_to_boxes(shape, a, b):
            values = t[tuple(slice(o, o + s) for o, s in zip(off, sizes))].flatten().tolist()
            assert values == list(range(fa, fb)), (shape, a, b, off, sizes)
            got += values
        assert got == list(range(a, b))
