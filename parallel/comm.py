"""The one door for communication: every collective and p2p transfer of the trainer.

Each call records, in the ledger of the group it runs on, how many bytes this rank
puts on the wire, by kind (all_reduce, all_gather, ...), by link (``intra`` when
the whole group sits on one node, ``inter`` when it spans nodes, as the ZeRO++
paper accounts a collective that crosses nodes) and by group name (tp, pp, dp,
embedding, ...). The trainer resets the ledger at the start of a step and logs it.

Byte convention, per rank, for a group of g ranks and a tensor of n bytes
(the volume of the bandwidth-optimal ring / direct algorithm):

  all_reduce      2 (g-1)/g n      (reduce-scatter + all-gather)
  all_gather      (g-1) n_in       (= (g-1)/g of the gathered output)
  reduce_scatter  (g-1)/g n_in
  all_to_all      (g-1)/g n_in
  broadcast       n on the source, 0 elsewhere
  p2p (send)      n (receives are counted by their sender)

Collectives over a group of one rank are skipped and cost nothing. FP8 tensors
travel as uint8 views (gloo and NCCL have no float8 type).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)}
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class Ledger:
    """Bytes sent by this rank, keyed by (kind, link, group name)."""

    bytes: Dict[Tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))

    def record(self, kind: str, group: "Group", nbytes: float) -> None:
        self.bytes[(kind, group.link, group.name)] += int(round(nbytes))

    def reset(self) -> None:
        self.bytes.clear()

    def snapshot(self) -> Dict[str, Any]:
        """The per-step ``comm`` record: totals by kind, by link, by group, and by kind/link."""
        out: Dict[str, Any] = {"by_kind": defaultdict(int), "by_link": {"intra": 0, "inter": 0},
                               "by_group": defaultdict(int), "by_kind_link": defaultdict(int)}
        for (kind, link, name), n in self.bytes.items():
            out["by_kind"][kind] += n
            out["by_link"][link] += n
            out["by_group"][name] += n
            out["by_kind_link"][f"{kind}/{link}"] += n
        out["total"] = sum(self.bytes.values())
        return {k: dict(v) if isinstance(v, defaultdict) else v for k, v in out.items()}


@dataclass
class Group:
    """A process group with what the ledger needs: a name, its members and whether it crosses nodes."""

    name: str
    pg: Optional[dist.ProcessGroup]
    ranks: List[int]
    """Global ranks of the members, in group-rank order."""
    rank: int
    """This rank's index in the group."""
    link: str
    """'intra' if all members share a node, else 'inter'."""
    ledger: Ledger

    @property
    def size(self) -> int:
        return len(self.ranks)


class _Done:
    """Handle of an operation that finished synchronously (or was skipped)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _handle(work, async_op: bool):
    if async_op:
        return work if work is not None else _Done()
    return None


def all_reduce(t: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False):
    """In-place all-reduce (sum | max | min)."""
    if group.size == 1:
        return _Done() if async_op else None
    group.ledger.record("all_reduce", group, 2 * (group.size - 1) / group.size * _nbytes(t))
    return _handle(dist.all_reduce(t, op=_OPS[op], group=group.pg, async_op=async_op), async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False):
    """Concatenate every member's ``inp`` along dim 0 into ``out`` (size g * inp.shape[0])."""
    if group.size == 1:
        out.copy_(inp)
        return _Done() if async_op else None
    group.ledger.record("all_gather", group, (group.size - 1) * _nbytes(inp))
    return _handle(dist.all_gather_single(_wire(out), _wire(inp), group=group.pg, async_op=async_op), async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False):
    """Sum ``inp`` over members and keep this rank's 1/g slice of dim 0 in ``out``."""
    if group.size == 1:
        out.copy_(inp)
        return _Done() if async_op else None
    group.ledger.record("reduce_scatter", group, (group.size - 1) / group.size * _nbytes(inp))
    return _handle(dist.reduce_scatter_single(out, inp, group=group.pg, async_op=async_op), async_op)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False):
    """Slice i of ``inp`` (dim 0, equal slices) goes to member i; slice j of ``out`` comes from member j."""
    if group.size == 1:
        out.copy_(inp)
        return _Done() if async_op else None
    group.ledger.record("all_to_all", group, (group.size - 1) / group.size * _nbytes(inp))
    return _handle(dist.all_to_all_single(_wire(out), _wire(inp), group=group.pg, async_op=async_op), async_op)


def broadcast(t: torch.Tensor, src: int, group: Group) -> None:
    """In-place broadcast from group rank ``src``."""
    if group.size == 1:
        return
    if group.rank == src:
        group.ledger.record("broadcast", group, _nbytes(t))
    dist.broadcast(_wire(t), group=group.pg, group_src=src)


def isend(t: torch.Tensor, dst: int, group: Group, tag: int = 0):
    """Non-blocking send to group rank ``dst``; returns a handle with wait()/is_completed()."""
    group.ledger.record("p2p", group, _nbytes(t))
    return dist.isend(_wire(t), group=group.pg, group_dst=dst, tag=tag)


def irecv(t: torch.Tensor, src: int, group: Group, tag: int = 0):
    """Non-blocking receive from group rank ``src`` into ``t``."""
    return dist.irecv(_wire(t), group=group.pg, group_src=src, tag=tag)


def broadcast_object(obj: Any, src: int, group: Group) -> Any:
    """Broadcast a picklable object (control plane: not counted in the ledger)."""
    if group.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=group.pg, group_src=src)
    return box[0]


def all_gather_object(obj: Any, group: Group) -> List[Any]:
    """Gather a picklable object from every member (control plane: not counted)."""
    if group.size == 1:
        return [obj]
    out: List[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=group.pg)
    return out


def barrier(group: Group) -> None:
    if group.size > 1:
        dist.barrier(group=group.pg)
