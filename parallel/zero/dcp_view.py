"""ZeRO shards as global tensors for torch.distributed.checkpoint, with no gather.

A flat shard holds arbitrary element ranges of row-major tensors, which no
DTensor placement describes. ``range_to_boxes`` cuts such a range into the few
boxes (hyper-rectangles) it is made of: a partial row, whole rows, a partial
row, recursively per dimension. ``ChunkedTensor`` presents a rank's boxes of one
global tensor through DCP's checkpointable protocol (the hooks DTensor itself
implements), so the files hold each tensor under its global name and shape:
any (stage, dp, tp, pp, partition) layout loads what any other saved, and DCP
reshards by box overlap. Boxes of TP-replicated tensors are identical on every
TP rank; DCP keeps one of each.
"""
from __future__ import annotations

import math
from typing import Any, List, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = Tuple[Tuple[int, ...], Tuple[int, ...], int, int]  # offsets, sizes, flat start, flat end


def range_to_boxes(shape: Sequence[int], start: int, end: int) -> List[Box]:
    """Boxes covering the flat element range [start, end) of a row-major tensor of ``shape``."""
    shape = tuple(shape)
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,), start, end)]
    inner = math.prod(shape[1:])
    first, last = start // inner, end // inner  # rows holding start and end
    if end <= (first + 1) * inner:  # inside one row
        return [((first,) + o, (1,) + s, first * inner + a, first * inner + b)
                for o, s, a, b in range_to_boxes(shape[1:], start - first * inner, end - first * inner)]
    boxes: List[Box] = []
    if start % inner:  # partial first row
        boxes += range_to_boxes(shape, start, (first + 1) * inner)
        first += 1
    if last > first:  # whole rows
        boxes.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + shape[1:], first * inner, last * inner))
    if end % inner:  # partial last row
        boxes += range_to_boxes(shape, last * inner, end)
    return boxes


class ChunkedTensor(torch.Tensor):
    """A global tensor of which this rank holds some boxes (views into its shards); a checkpoint view only."""

    _boxes: List[Tuple[torch.Size, torch.Tensor]]

    @staticmethod
    def __new__(cls, global_shape: Sequence[int], boxes: List[Tuple[Sequence[int], torch.Tensor]],
                dtype: torch.dtype, device: torch.device):
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(global_shape), dtype=dtype, device=device)
        r._boxes = [(torch.Size(off), t) for off, t in boxes]
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"ChunkedTensor only serves checkpointing; {func} is not supported")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ChunkedTensor(shape={tuple(self.shape)}, boxes={[(tuple(o), tuple(t.shape)) for o, t in self._boxes]})"

    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.shape),
                                                      properties=props, size=self.shape))
                for off, t in self._boxes]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=t.shape) for off, t in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self._boxes) and self._boxes[index.index][0] == index.offset:
            return self._boxes[index.index][1]
        for off, t in self._boxes:
            if off == index.offset:
                return t
        raise ValueError(f"{index.fqn}: this rank holds no box at offset {tuple(index.offset)}")


def shard_view(global_shape: Sequence[int], local_shape: Sequence[int], local_offset: Sequence[int],
               pieces: List[Tuple[int, int, torch.Tensor]], shard: torch.Tensor) -> ChunkedTensor:
    """The global tensor of which this rank holds ``pieces``: (start, end) flat ranges of its local (TP) tensor,
    each with the slice of ``shard`` holding those elements; ``local_offset`` places the local tensor globally."""
    boxes = []
    for start, end, data in pieces:
        for off, sizes, a, b in range_to_boxes(local_shape, start, end):
            glob = tuple(o + lo for o, lo in zip(off, local_offset))
            boxes.append((glob, data[a - start:b - start].view(sizes)))
    return ChunkedTensor(global_shape, boxes, shard.dtype, shard.device)
