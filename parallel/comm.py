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

A failed or timed-out operation raises :class:`CommError` (a RuntimeError) naming the
operation, the group and, where it can be known, the rank that did not arrive: the peer
of a p2p transfer; for a collective that timed out, the members that did not report
reaching the same collective (each member counts its collectives per group and, on a
timeout, checks in with the launcher's key-value store for ``ABSENT_GRACE_S`` seconds).
A member whose connection was closed by a peer is treated the same way: gloo closes a
rank's connections when *it* times out, so the members that entered the collective a
little later see "connection closed" before their own timeout, and still learn who was absent.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from parallel import hang
from parallel.launch import LaunchError

_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)}
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class Ledger:
    """Bytes sent by this rank, keyed by (kind, link, group name)."""

    bytes: Dict[Tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    _held: Optional[List[Tuple[Tuple[str, str, str], int]]] = field(default=None, repr=False)

    def record(self, kind: str, group: "Group", nbytes: float) -> None:
        entry = ((kind, group.link, group.name), int(round(nbytes)))
        if self._held is not None:
            self._held.append(entry)
        else:
            self.bytes[entry[0]] += entry[1]

    @contextlib.contextmanager
    def deferred(self) -> Iterator[List[Tuple[Tuple[str, str, str], int]]]:
        """Collectives launched inside are counted not now but when ``replay`` is given the list this yields:
        a gather launched ahead of the step that uses it (ZeRO-3's optimizer step starts the next forward's
        first gathers) is counted in that step, so a step's record stays the bytes that step needs."""
        if self._held is not None:
            raise RuntimeError("Ledger.deferred does not nest")
        self._held = held = []
        try:
            yield held
        finally:
            self._held = None

    def replay(self, held: List[Tuple[Tuple[str, str, str], int]]) -> None:
        for key, n in held:
            self.bytes[key] += n

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
    collectives: int = field(default=0, repr=False, compare=False)
    """Collectives issued on this group so far (the same count on every member): names a stuck one."""
    reverse: Optional[dist.ProcessGroup] = field(default=None, repr=False, compare=False)
    """A twin process group over the same members (gloo, groups that cross nodes; ``Mesh``): with it,
    ``all_gather`` and ``all_to_all`` run as pairwise transfers, each pair's lower member sending to the higher
    over ``pg`` and the higher to the lower over ``reverse``, so each TCP connection carries one direction (gloo
    runs the two directions of one connection one after the other at times: a two-member exchange over a shaped
    link was measured at 48-65% of its rate, each direction on a connection of its own at ~95%). ``reduce_scatter``
    then sends each member its slice directly (gloo's own put a 2-node x 2 reduce-scatter at 70% of the link)."""
    pairwise_gather: bool = field(default=False, repr=False, compare=False)
    """With ``reverse``: ``all_gather`` and ``all_to_all`` run pairwise too (groups of one member per node, where a
    direct exchange crosses no more than gloo's ring; over a group with several members per node the ring's
    gather crosses less and stays)."""

    @property
    def size(self) -> int:
        return len(self.ranks)


ABSENT_GRACE_S = 10.0
"""After a collective times out, how long a member waits for the others to report reaching it."""


class CommError(RuntimeError):
    """A collective or p2p transfer failed or timed out; the message names the operation, group and culprit.
    ``absent``: the members found not to have reached it (None: not known)."""

    def __init__(self, message: str, absent: Optional[List[int]] = None):
        super().__init__(message)
        self.absent = absent


def _reason(e: BaseException) -> str:
    """The backend's message without gloo's ``[source.cc:NN]`` prefix, on one line."""
    text = " ".join(str(e).split())
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text) or e.__class__.__name__


_STALLED = re.compile(r"timed out|timeout|connection (closed|reset) by peer", re.IGNORECASE)
"""Failures that mean a member of a collective is missing: this rank's timeout, or a peer that timed out first
(gloo: "connection closed by peer", or "Application timeout caused pair closure" when the pair is shared with
another group's collective that timed out)."""


def _absent(group: Group, seq: int) -> Optional[List[int]]:
    """Members that did not report reaching collective ``seq`` of ``group`` (via the store), or None if unknown."""
    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = f"comm_timeout/{group.name}/{'-'.join(map(str, group.ranks))}/{seq}/"
        me = group.ranks[group.rank]
        store.set(prefix + str(me), "1")
        others = [r for r in group.ranks if r != me]
        deadline = time.monotonic() + ABSENT_GRACE_S
        while True:
            missing = [r for r in others if not store.check([prefix + str(r)])]
            if not missing or time.monotonic() > deadline or hang.hurry():
                return missing
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store may be gone with a dead rank: then it is just not known
        return None


def _error(kind: str, group: Group, e: BaseException, seq: Optional[int], peer: Optional[int]) -> CommError:
    reason = _reason(e)
    what = f"{kind} on group {group.name} (ranks {group.ranks})"
    absent = None
    if peer is not None:
        who = f"; peer rank {group.ranks[peer]}"
    elif seq is not None and _STALLED.search(reason):
        hang.alarm(f"{what}, collective #{seq} of the group, on rank {group.ranks[group.rank]}: {reason}")
        absent = _absent(group, seq)
        who = (f"; rank(s) {absent} did not arrive (collective #{seq} of this group)" if absent
               else f"; every member reached it (collective #{seq})" if absent == [] else "")
    else:
        who = ""
    return CommError(f"{what} failed on rank {group.ranks[group.rank]}: {reason}{who}", absent)


class _Trace:
    """``GPT_COMM_TRACE=DIR``: every call through this door and every wait on its handles, with their times, is
    appended to ``DIR/rank<R>.jsonl`` (what a step waits for, and when; ``scripts/comm_trace.py`` sums it).
    Marks (``mark``) name the phases of a step around them; the events are written at each mark."""

    def __init__(self, directory: Optional[str]):
        self.directory, self.events = directory, []

    def add(self, *event) -> None:
        self.events.append(event)

    def flush(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
            f.writelines(json.dumps(e) + "\n" for e in self.events)
        self.events = []


_trace = _Trace(os.environ.get("GPT_COMM_TRACE"))
_waited = [0.0]


def waited_s() -> float:
    """Seconds the main thread has spent blocked in this door so far (synchronous calls, waits on its handles,
    ``trace_wait``). A step's time less what this grew by during it is the rank's own work
    (training/straggler.py). On CUDA, NCCL calls return before the transfer ends: the device-side wait is not seen
    here."""
    return _waited[0]


def _count_wait(t0: float) -> None:
    if threading.current_thread() is threading.main_thread():
        _waited[0] += time.perf_counter() - t0


def check_trace() -> None:
    """With ``GPT_COMM_TRACE`` set: its directory can take this rank's trace (made if missing). Called at start-up
    (training/trainer.py), so that a regular file or an unwritable place there is one LaunchError naming it
    before anything is trained, not a traceback from the first step's mark."""
    directory = _trace.directory
    if not directory:
        return
    path = os.path.join(directory, f"rank{os.environ.get('RANK', '0')}.jsonl")
    try:
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise LaunchError(f"GPT_COMM_TRACE={directory} is a file, not a directory for the communication "
                              "trace")
        os.makedirs(directory, exist_ok=True)
        if os.path.lexists(path):
            with open(path, "a"):  # appended to by flush(); opening it changes nothing
                pass
        else:
            with tempfile.TemporaryFile(dir=directory):  # can a file be made there (leaving none behind)?
                pass
    except OSError as e:
        where = os.fsdecode(e.filename) if e.filename is not None else directory
        raise LaunchError(f"GPT_COMM_TRACE={directory} cannot take the communication trace: {where}: "
                          f"{e.strerror or e}") from None


def mark(label: str) -> None:
    """A phase boundary in the trace (nothing without ``GPT_COMM_TRACE``)."""
    if _trace.directory:
        _trace.add("mark", label, time.perf_counter())
        _trace.flush()


def trace_wait(what: str, group: Group, t0: float) -> None:
    """A wait of this thread since ``t0`` for something other than a handle of this door, into the trace."""
    _count_wait(t0)
    if _trace.directory:
        _trace.add("wait", what, group.name, None, t0, time.perf_counter(),
                   threading.current_thread() is threading.main_thread())


def _guarded(kind: str, group: Group, call: Callable[[], Any], collective: bool = True, peer: Optional[int] = None):
    """Run one backend call; turn its failure into a CommError (async handles are wrapped likewise)."""
    seq = None
    if collective:
        seq = group.collectives
        group.collectives += 1
    t0 = time.perf_counter()
    try:
        work = call()
    except RuntimeError as e:  # DistBackendError, gloo/NCCL errors are RuntimeErrors
        raise _error(kind, group, e, seq, peer) from e
    _count_wait(t0)
    if _trace.directory:
        _trace.add("call", kind, group.name, seq, t0, time.perf_counter(), work is not None)
    return _Work(work, kind, group, seq, peer) if work is not None else None


class _Work:
    """An async handle whose wait() reports a failure as CommError."""

    def __init__(self, work, kind: str, group: Group, seq: Optional[int], peer: Optional[int]):
        self.work, self.kind, self.group, self.seq, self.peer = work, kind, group, seq, peer

    def wait(self, timeout=None) -> bool:
        t0 = time.perf_counter()
        try:
            done = self.work.wait() if timeout is None else self.work.wait(timeout)
        except RuntimeError as e:
            raise _error(self.kind, self.group, e, self.seq, self.peer) from e
        _count_wait(t0)
        if _trace.directory:
            _trace.add("wait", self.kind, self.group.name, self.seq, t0, time.perf_counter(),
                       threading.current_thread() is threading.main_thread())
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def __getattr__(self, name: str):
        return getattr(self.work, name)


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
    return _handle(_guarded("all_reduce", group,
                            lambda: dist.all_reduce(t, op=_OPS[op], group=group.pg, async_op=async_op)), async_op)


def count_all_gather(inp: torch.Tensor, group: Group) -> None:
    """Count an all-gather of ``inp`` now, in this thread's ledger state (``Ledger.deferred``), that another
    thread launches later with ``counted=False`` (ZeRO++'s two-hop gathers, ``zeropp.HopRunner``): a step's
    record must not depend on when a background thread got to run."""
    if group.size > 1:
        group.ledger.record("all_gather", group, (group.size - 1) * _nbytes(inp))


class _Pairwise:
    """The transfers of one exchange over a group with a ``reverse`` twin (``_exchange``), waited for together;
    ``then`` runs once they have all arrived (a reduce-scatter's sum)."""

    def __init__(self, works: List[Any], then: Optional[Callable[[], None]] = None):
        self.works, self.then = works, then

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _exchange(sends: List[torch.Tensor], recvs: List[torch.Tensor], group: Group, async_op: bool,
              then: Optional[Callable[[], None]] = None):
    """Member j receives ``sends[j]`` into its ``recvs[me]``: one irecv and one isend per peer, lower -> higher
    members over ``group.pg``, higher -> lower over ``group.reverse`` (own slot copied); ``then`` after."""
    me = group.rank
    recvs[me].copy_(sends[me])
    works = [dist.irecv(_wire(recvs[j]), group=group.pg if j < me else group.reverse, group_src=j)
             for j in range(group.size) if j != me]
    works += [dist.isend(_wire(sends[j]), group=group.pg if me < j else group.reverse, group_dst=j)
              for j in range(group.size) if j != me]
    work = _Pairwise(works, then)
    if not async_op:
        work.wait()
    return work if async_op else None


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False, counted: bool = True):
    """Concatenate every member's ``inp`` along dim 0 into ``out`` (size g * inp.shape[0]). ``counted=False``:
    the caller counted it already (``count_all_gather``)."""
    if group.size == 1:
        out.copy_(inp)
        return _Done() if async_op else None
    if counted:
        count_all_gather(inp, group)
    if group.reverse is not None and group.pairwise_gather:
        return _handle(_guarded("all_gather", group, lambda: _exchange(
            [inp] * group.size, list(out.chunk(group.size)), group, async_op)), async_op)
    return _handle(_guarded("all_gather", group, lambda: dist.all_gather_single(
        _wire(out), _wire(inp), group=group.pg, async_op=async_op)), async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False):
    """Sum ``inp`` over members and keep this rank's 1/g slice of dim 0 in ``out``."""
    if group.size == 1:
        out.copy_(inp)
        return _Done() if async_op else None
    group.ledger.record("reduce_scatter", group, (group.size - 1) / group.size * _nbytes(inp))
    if group.reverse is not None:  # each member's slice sent to it directly, summed in member order in fp32
        pieces = [torch.empty_like(out) for _ in range(group.size)]

        def total() -> None:
            acc = pieces[0].float()
            for p in pieces[1:]:
                acc += p.float()
            out.copy_(acc)

        return _handle(_guarded("reduce_scatter", group, lambda: _exchange(
            list(inp.chunk(group.size)), pieces, group, async_op, then=total)), async_op)
    return _handle(_guarded("reduce_scatter", group, lambda: dist.reduce_scatter_single(
        out, inp, group=group.pg, async_op=async_op)), async_op)


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False):
    """Slice i of ``inp`` (dim 0, equal slices) goes to member i; slice j of ``out`` comes from member j."""
    if group.size == 1:
        out.copy_(inp)
        return _Done() if async_op else None
    group.ledger.record("all_to_all", group, (group.size - 1) / group.size * _nbytes(inp))
    if group.reverse is not None and group.pairwise_gather:
        return _handle(_guarded("all_to_all", group, lambda: _exchange(
            list(inp.chunk(group.size)), list(out.chunk(group.size)), group, async_op)), async_op)
    return _handle(_guarded("all_to_all", group, lambda: dist.all_to_all_single(
        _wire(out), _wire(inp), group=group.pg, async_op=async_op)), async_op)


def all_to_all_v(out: torch.Tensor, inp: torch.Tensor, out_splits: List[int], in_splits: List[int], group: Group,
                 async_op: bool = False):
    """Uneven all-to-all along dim 0: the next ``in_splits[i]`` rows of ``inp`` go to member i, and ``out``
    receives ``out_splits[j]`` rows from member j, in member order (expert parallelism's token dispatch). The
    ledger counts the rows that leave this rank."""
    if group.size == 1:
        out.copy_(inp)
        return _Done() if async_op else None
    row = _nbytes(inp) // max(inp.shape[0], 1)
    group.ledger.record("all_to_all", group, (sum(in_splits) - in_splits[group.rank]) * row)
    if group.reverse is not None and group.pairwise_gather:
        return _handle(_guarded("all_to_all", group, lambda: _exchange(
            list(inp.split(in_splits)), list(out.split(out_splits)), group, async_op)), async_op)
    return _handle(_guarded("all_to_all", group, lambda: dist.all_to_all_single(
        _wire(out), _wire(inp), out_splits, in_splits, group=group.pg, async_op=async_op)), async_op)


def broadcast(t: torch.Tensor, src: int, group: Group) -> None:
    """In-place broadcast from group rank ``src``."""
    if group.size == 1:
        return
    if group.rank == src:
        group.ledger.record("broadcast", group, _nbytes(t))
    _guarded("broadcast", group, lambda: dist.broadcast(_wire(t), group=group.pg, group_src=src))


def isend(t: torch.Tensor, dst: int, group: Group, tag: int = 0):
    """Non-blocking send to group rank ``dst``; returns a handle with wait()/is_completed()."""
    group.ledger.record("p2p", group, _nbytes(t))
    return _guarded("p2p send", group, lambda: dist.isend(_wire(t), group=group.pg, group_dst=dst, tag=tag),
                    collective=False, peer=dst)


def irecv(t: torch.Tensor, src: int, group: Group, tag: int = 0):
    """Non-blocking receive from group rank ``src`` into ``t``."""
    return _guarded("p2p recv", group, lambda: dist.irecv(_wire(t), group=group.pg, group_src=src, tag=tag),
                    collective=False, peer=src)


def broadcast_object(obj: Any, src: int, group: Group) -> Any:
    """Broadcast a picklable object (control plane: not counted in the ledger)."""
    if group.size == 1:
        return obj
    box = [obj]
    _guarded("broadcast_object", group, lambda: dist.broadcast_object_list(box, group=group.pg, group_src=src))
    return box[0]


def all_gather_object(obj: Any, group: Group) -> List[Any]:
    """Gather a picklable object from every member (control plane: not counted)."""
    if group.size == 1:
        return [obj]
    out: List[Any] = [None] * group.size
    _guarded("all_gather_object", group, lambda: dist.all_gather_object(out, obj, group=group.pg))
    return out


def barrier(group: Group) -> None:
    if group.size > 1:
        _guarded("barrier", group, lambda: dist.barrier(group=group.pg))
