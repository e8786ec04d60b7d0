"""ZeRO++ (SPEC §3, paper 003): the three changes to ZeRO-3's communication.

**qwZ** (``zero.quantized_weights``): the stage-3 all-gather of a unit's weights
sends each rank's shard blockwise-quantized (int8 by default, int4 optional;
``kernels/quant.py``) with its fp32 scales packed behind the payload in one uint8
buffer, so one all-gather carries both. Every rank dequantizes all pieces,
its own included, so all ranks compute with identical weights. The persistent
shard and the fp32 master weights are never quantized. Where the DP group spans
Y > 1 nodes of X > 1 ranks, the gather takes two hops (``GatherRoute``): an
all-gather over the Y peers of this rank's intra-node index (one per node), then
an all-gather of those Y pieces over the X ranks of the node. Every shard then
crosses into each other node once, (Y-1) shards a rank, where one all-gather over
all P ranks moves (P-1) a rank over groups that cross nodes (a ring enters and
leaves every node with all P-1 shards). The bytes are the same quantized bytes,
so the weights are bit for bit those of the one-hop gather. The hops run on
groups of their own (``Mesh.gather_groups``), launched by one thread per route
(``HopRunner``) in the order the gathers started: the first hops one at a time
(the slow link carries the gathers in the order they are needed), a second hop
as soon as its first has arrived.

**hpZ** (``zero.hpz_size`` = H > 1): after a unit's first forward since the last
optimizer step (a training forward, or a no_grad one: validation), before the
gathered weights are released, rank h of its hpZ group (H consecutive DP ranks of
one node) keeps slice h of the gathered buffer (``N*S/H`` elements, compute dtype)
as a *secondary* shard. Every later gather of the unit until the next optimizer
step (backward, recomputation, the other micro-batches' forwards, the rest of a
validation pass, the next training step after a validation pass) is an all-gather
of secondary shards inside the node: the weights cross nodes once per unit and
optimizer step. The secondary copy is the gathered forward weights as they were
used (with qwZ, the dequantized ones: forward and backward see the same weights,
and a copy validation built holds exactly what a training forward's qwZ gather
would have delivered; it is never re-quantized), and it is a slice of the unit's
flat buffer, never of one tensor, so a tiny tensor cannot leave a rank with an
empty piece. ``step`` and ``after_load`` invalidate it; the next forward gathers
from the primary shards again and rebuilds it. So a training step that follows a
validation pass gathers only inside the node (``parallel/volume.py``:
``step_bytes(..., secondary_valid=True)``; the validation pass's own gathers:
``validation_gather_bytes``), and qwZ's sampled error (``quant_error``) is then
measured on that step's first gather of each unit, from the copy validation built.
FP8-LM's stage 3 (``fp8/zero.py``) follows the same rule with E4M3 secondary bytes.

**qgZ** (``zero.quantized_gradients``): the gradient reduce-scatter of a unit over
the P = X*Y DP ranks (X per node, Y nodes; DP rank p = node*X + local) becomes

  1-2. ``reorder_and_quantize``: pad by rule, reorder the P partitions so local
       rank l's group [l, X+l, ..., (Y-1)X+l] is contiguous (per pipeline stage),
       quantize (int4 by default) and all-to-all over ``dp_intra``;
  3.   ``dequant_sum_requant`` of the X received copies (fp32 sum);
  4.   all-to-all over ``dp_inter`` (slot j goes to node j), ``dequant_sum``;
  5.   divide by P once: the mean over all DP ranks.

The buffer is cut into ``zero.qgz_stages`` = S stages (the generalized reordering,
paper Algorithm 2): all intra-node all-to-alls are launched at once; ``advance``
sums and re-quantizes each stage whose intra-node hop has arrived and launches its
inter-node all-to-all, so the caller can push the inter-node hop out as soon as
it can go (while backward continues) and wait for the result only when it needs
the memory back or the step needs the gradients. Stage s's inter-node hop is in
flight while stage s+1 is summed. The inter-node hops of all reduces in flight
are launched in the order the reduces were (``advance`` is called oldest first),
the same on every rank.
One node (Y = 1) is one intra-node all-to-all and a dequantize-sum; one rank per
node (X = 1) quantizes once and does only the inter-node hop. The groups are those
of this rank's (pp, tp) coordinate, so qgZ composes with TP and PP. Units whose
gradient buffer has fewer than ``zero.qgz_min_numel`` elements take the plain
reduce-scatter (latency of two hops beats the bytes saved); the rule is the same in
the analytic volume.

Error bound of qgZ (tested in tests/test_zeropp.py): with m = 2**(bits-1) at the bits of each
quantization, for an element x_r on DP rank r whose quantization block has absmax a_r, and the value
v_n it sums to in node n's dequantized sum, whose re-quantization block has absmax b_n,

    |result - mean| <= ( sum_r e(x_r, a_r) + sum_n e(v_n, b_n) ) / P   (+ fp32 rounding)
    e(x, a) = max(a / (2m), |x| - (m-1) a / m)  <=  a / m

(``kernels/quant.py``'s bound: a quantization errs by at most half a step, a/(2m), except a value on
the other side of zero from its block's extreme with magnitude above (1 - 2**-bits) a, which is
clipped to the top code and errs by at most one step, a/m; the second sum is absent with one node or
one rank per node). Inputs that int4 represents exactly, sums included, come back exactly (the fp32
mean, bit for bit): e.g. blocks k*w with w integers in [-8, 7] whose extreme is -8 (scale k, codes w).

**Beyond ZeRO++: 4-bit communication that converges** (SDP4Bit, SPEC §7), at ZeRO stages 1, 2 and 3:

* qgZ serves the stage-1/2 gradient reduce-scatter too (the same ``QgzReduce``, once per step).
* Two-level bits (``zero.gradient_bits_intra``): the intra-node hop quantizes at its own bits (SDP4Bit: 8),
  the node's sum is re-quantized for the inter-node hop at ``zero.gradient_bits`` (4). One rank a node
  quantizes once, at the inter-node bits; one node, at the intra-node bits.
* Hadamard smoothing (``zero.gradient_hadamard``, ``kernels/hadamard.py``): the padded buffer's blocks are
  rotated before the first quantization. The rotation is linear and blocks never straddle a slot, so the
  node sums and the re-quantization happen on rotated blocks, and the reduced shard is rotated back once,
  before the division by P. The error bound above then holds for the rotated values; rotating back preserves
  each block's L2 error.
* qWD (``zero.weight_delta``): a gather sends the quantized *difference* between the new master shard (fp32)
  and this rank's piece of the weights every rank reconstructed at the last gather, W~, and every rank adds
  the dequantized differences to its W~ (fp32 sum, one rounding to the compute dtype; its own piece too, so
  all ranks hold the same weights). The new W~ differs from the master by one step's quantization error of
  the difference, never the sum of all steps'. Stages 1-2: W~ is the full parameters every rank holds
  (``QuantizedGather(add=True)`` after the step). Stage 3 (``DeltaGather``, needs hpZ): the node's secondary
  shards hold W~, so an exact intra-node gather of them runs beside the cross-node gather of differences;
  each rank keeps its own piece of W~ (``Unit.reference``) to take the next difference against. A run's
  first gather, and the first after a resume from a checkpoint without W~, is the exact all-gather of
  compute-dtype shards.

Byte counts per rank (the ledger's convention, ``parallel/comm.py``), for a unit of
N*S elements: ``qwz_gather_bytes``, ``hpz_gather_bytes``, ``QgzPlan.bytes_per_rank``.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from kernels import hadamard as hadamard_blocks
from kernels.ops import quant_ops
from kernels.quant import n_blocks, payload_nbytes, qgz_padded_shards, qgz_slice_sizes
from parallel import comm


@dataclass(frozen=True)
class Quant:
    bits: int
    block: int

    def wire_nbytes(self, numel: int) -> int:
        """Bytes of ``numel`` values on the wire: payload plus one fp32 scale per block."""
        return payload_nbytes(numel, self.bits, self.block) + 4 * n_blocks(numel, self.block)


def _pack(payload: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.cat([payload, scales.view(torch.uint8)])


def _unpack(rows: torch.Tensor, payload_bytes: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """k packed rows -> (k x payload bytes, k x scales fp32), contiguous."""
    return rows[:, :payload_bytes].contiguous(), rows[:, payload_bytes:].contiguous().view(torch.float32)


# -- qwZ ------------------------------------------------------------------------------------------
class HopRunner:
    """The thread that launches the hops of a route's two-hop gathers, in the order the gathers started (the
    same on every rank, the only order the route's groups see): a gather's first (inter-node) hop once the
    previous gather's first hop has arrived, and its second hop the moment its own first hop has.

    One first hop at a time, because the slow link then carries the gathers one after the other in the order
    the forward needs them: gloo runs two collectives of a group at once, and two gathers sharing the link
    both arrive late, the one needed first included. And a second hop launched by this thread waits for
    nothing the main thread does (a poll between two modules' compute could be a layer's forward away).
    A failure (a CommError: a timeout, a dead peer) fails that gather and every later one."""

    def __init__(self):
        self._queue: "queue.SimpleQueue[QuantizedGather]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def submit(self, gather: "QuantizedGather") -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="zeropp-hops", daemon=True)
            self._thread.start()
        self._queue.put(gather)

    def _run(self) -> None:
        while True:
            g = self._queue.get()
            try:
                if self._error is not None:
                    raise self._error
                g.launch_hops()
            except BaseException as e:  # noqa: BLE001 - handed to the thread that waits for this gather
                self._error = self._error or e
                g.error = e
            finally:
                g.launched.set()


@dataclass(frozen=True)
class GatherRoute:
    """The two hops of a hierarchical all-gather over the DP group (see the module docstring).

    ``order[r]``: the row of the second hop's output that holds DP rank r's piece. ``runner``: the thread
    that launches the hops (``HopRunner``)."""

    inter: comm.Group
    intra: comm.Group
    order: Tuple[int, ...]
    runner: HopRunner = field(default_factory=HopRunner, compare=False, repr=False)

    @staticmethod
    def of(dp: comm.Group, inter: comm.Group, intra: comm.Group, inter_members) -> Optional["GatherRoute"]:
        """The route over ``inter`` then ``intra`` (None where one hop is the whole group: one node, or one rank
        a node). ``inter_members(global rank)``: that rank's inter-node peers, the order of its first hop."""
        if inter.size == 1 or intra.size == 1:
            return None
        rows = [g for a in intra.ranks for g in inter_members(a)]
        if sorted(rows) != sorted(dp.ranks):
            raise ValueError(f"gather route: intra {intra.ranks} x inter peers {rows} do not cover DP {dp.ranks}")
        return GatherRoute(inter, intra, tuple(rows.index(r) for r in dp.ranks))


class QuantizedGather:
    """All-gather of every rank's quantized shard into ``full`` (dequantized on ``wait``), in one hop over
    ``group`` or, with a ``route``, two, launched by the route's ``HopRunner`` (counted in the ledger here, when
    the gather starts).

    ``add``: the shards are differences (qWD), and ``wait`` adds them to what ``full`` holds (in fp32, one
    rounding to ``full``'s dtype) instead of overwriting it. ``rows`` = (a, b): ``full`` receives only the pieces
    of DP ranks a..b-1 (the rest are received but not dequantized; ZeRO-3's early step fills a secondary shard)."""

    def __init__(self, full: torch.Tensor, shard: torch.Tensor, group: comm.Group, q: Quant,
                 route: Optional[GatherRoute] = None, add: bool = False, rows: Optional[Tuple[int, int]] = None):
        self.full, self.q, self.n, self.g, self.route, self.add = full, q, shard.numel(), group.size, route, add
        self.rows = rows
        self.ops = quant_ops(shard.device)
        payload, scales = self.ops.quantize_blockwise(shard, q.bits, q.block)
        self.payload_bytes = payload.numel()
        self.send = _pack(payload, scales)
        self.recv = torch.empty(self.g * self.send.numel(), dtype=torch.uint8, device=shard.device)
        self.error: Optional[BaseException] = None
        self.launched = threading.Event()
        if route is None:
            self.work = comm.all_gather(self.recv, self.send, group, async_op=True)
            self.launched.set()
        else:
            self.mid = torch.empty(route.inter.size * self.send.numel(), dtype=torch.uint8, device=shard.device)
            comm.count_all_gather(self.send, route.inter)
            comm.count_all_gather(self.mid, route.intra)
            self.work = None
            route.runner.submit(self)

    def launch_hops(self) -> None:
        """(The route's thread) the first hop, waited for; then the second, left in flight."""
        first = comm.all_gather(self.mid, self.send, self.route.inter, async_op=True, counted=False)
        first.wait()
        self.work = comm.all_gather(self.recv, self.mid, self.route.intra, async_op=True, counted=False)
        self.mid = None

    def advance(self, block: bool = False) -> bool:
        """Whether both hops are launched (``block``: wait until they are)."""
        if block and not self.launched.is_set():
            t0 = time.perf_counter()
            while not self.launched.wait(1.0):
                pass
            comm.trace_wait("hops launched", self.route.inter, t0)
        if self.error is not None:
            raise self.error
        return self.launched.is_set()

    def wait(self) -> None:
        self.advance(block=True)
        self.work.wait()
        self.send = None
        rows = self.recv.view(self.g, -1)
        order = list(self.route.order) if self.route is not None else list(range(self.g))
        if self.rows is not None:
            order = order[self.rows[0]:self.rows[1]]
        if order != list(range(self.g)):  # row r <- DP rank r's piece (bytes: cheaper to move than the values)
            rows = rows[order]
        g = len(order)
        payloads, scales = _unpack(rows, self.payload_bytes)
        nb = scales.shape[1]
        dtype = torch.float32 if self.add else self.full.dtype
        values = self.ops.dequantize_blockwise(payloads.reshape(-1), scales.reshape(-1), self.q.bits, self.q.block,
                                               g * nb * self.q.block, dtype)
        values = values.view(g, nb * self.q.block)[:, :self.n]
        full = self.full.view(g, self.n)
        full.copy_(full.float() + values if self.add else values)
        self.recv = None


class DeltaGather:
    """Stage 3's qWD gather with hpZ (SDP4Bit): the node's secondary shards hold the weights every rank
    reconstructed at the last gather, W~; an all-gather of them inside the node (compute dtype, exact) rebuilds W~
    in ``full`` while the quantized differences ``delta`` (new master shard minus this rank's piece of W~) cross
    nodes; ``wait`` adds them: ``full`` = W~ + dequant(delta), identical on every rank. Both start at once."""

    def __init__(self, full: torch.Tensor, secondary: torch.Tensor, hpz: comm.Group, delta: torch.Tensor,
                 dp: comm.Group, q: Quant, route: Optional[GatherRoute] = None):
        self.base = comm.all_gather(full, secondary, hpz, async_op=True)
        self.deltas = QuantizedGather(full, delta, dp, q, route, add=True)

    def wait(self) -> None:
        self.base.wait()
        self.deltas.wait()


def qwz_gather_bytes(shard: int, world: int, q: Quant, x: int = 1, y: int = 1) -> Dict[str, int]:
    """Per-rank bytes of one quantized all-gather of ``shard``-element shards over ``world`` = x * y ranks, by
    group: one hop over ``dp``, or (x > 1 and y > 1) (y-1) pieces over ``qwz_inter`` and (x-1) y over
    ``qwz_intra``."""
    w = q.wire_nbytes(shard)
    if x > 1 and y > 1:
        return {"qwz_inter": (y - 1) * w, "qwz_intra": (x - 1) * y * w}
    return {"dp": (world - 1) * w} if world > 1 else {}


# -- hpZ ------------------------------------------------------------------------------------------
def hpz_gather_bytes(full_numel: int, hpz: int, element_size: int) -> int:
    """Per-rank bytes of one all-gather of secondary shards (``full_numel / hpz`` elements each)."""
    return (hpz - 1) * (full_numel // hpz) * element_size if hpz > 1 else 0


# -- qgZ ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QgzPlan:
    """Sizes of one qgZ reduce of ``numel`` elements over X x Y ranks in ``stages`` stages: ``q`` across nodes,
    ``q_intra`` (default ``q``) inside the node (the same block; only the bits differ)."""

    numel: int
    x: int
    y: int
    q: Quant
    stages: int
    q_intra: Optional[Quant] = None

    @property
    def first(self) -> Quant:
        """How a rank quantizes its buffer: for the intra-node hop, or (one rank a node) for the inter-node one."""
        return (self.q_intra or self.q) if self.x > 1 else self.q

    @property
    def shard(self) -> int:
        return qgz_slice_sizes(self.numel, self.x, self.y, self.q.block, self.stages)[0]

    @property
    def sub(self) -> int:
        """Elements of one partition's sub-slice per stage."""
        return qgz_slice_sizes(self.numel, self.x, self.y, self.q.block, self.stages)[1] // self.stages

    def slot_bytes(self, q: Optional[Quant] = None) -> Tuple[int, int]:
        """(payload bytes, scale bytes) of one slot (a partition's sub-slice of one stage) at ``q`` (default: the
        inter-node ``q``)."""
        q = q or self.q
        return payload_nbytes(self.sub, q.bits, q.block), 4 * n_blocks(self.sub, q.block)

    def bytes_per_rank(self) -> Tuple[float, float]:
        """(intra-node, inter-node) bytes this rank sends, ledger convention."""
        intra = (self.x - 1) / self.x * self.stages * self.x * self.y * sum(self.slot_bytes(self.first)) \
            if self.x > 1 else 0.0
        inter = (self.y - 1) / self.y * self.stages * self.y * sum(self.slot_bytes()) if self.y > 1 else 0.0
        return intra, inter


class QgzReduce:
    """qgZ steps 1-5 for one gradient buffer; ``wait`` leaves the DP mean of this rank's shard in ``out``.

    The intra-node all-to-alls start at construction (overlapping whatever the caller does next);
    ``wait`` runs steps 3-5, stage by stage, with stage s's inter-node hop in flight during stage s+1's
    sum and re-quantization.
    """

    def __init__(self, out: torch.Tensor, buf: torch.Tensor, intra: comm.Group, inter: comm.Group, q: Quant,
                 stages: int, q_intra: Optional[Quant] = None, hadamard: bool = False):
        self.out, self.intra, self.inter, self.q, self.hadamard = out, intra, inter, q, hadamard
        self.plan = QgzPlan(buf.numel(), intra.size, inter.size, q, stages, q_intra)
        if self.plan.shard != out.numel():
            raise ValueError(f"qgZ: a buffer of {buf.numel()} elements over {intra.size}x{inter.size} ranks "
                             f"has shards of {self.plan.shard}, not {out.numel()}")
        if q_intra is not None and q_intra.block != q.block:
            raise ValueError(f"qgZ: both hops quantize the same blocks ({q_intra.block} != {q.block})")
        self.ops = quant_ops(buf.device)
        x, y, s = intra.size, inter.size, stages
        first = self.plan.first
        pb, sb = self.plan.slot_bytes(first)
        if hadamard:  # rotate the blocks as they will be quantized: pad by reorder_and_quantize's rule first
            buf = hadamard_blocks.rotate(qgz_padded_shards(buf, x, y, q.block, s), q.block)
        payload, scales = self.ops.reorder_and_quantize(buf, x, y, first.bits, q.block, s)
        # per stage: X rows (one per local destination) of [Y slots' payload | Y slots' scales]
        self.send = torch.cat([payload.view(s, x, y * pb), scales.view(torch.uint8).view(s, x, y * sb)], dim=2)
        self.recv = torch.empty_like(self.send) if x > 1 else self.send
        self.intra_work = [comm.all_to_all(self.recv[k], self.send[k], intra, async_op=True) if x > 1 else None
                           for k in range(s)]
        self.pending: List[tuple] = []  # per stage sent across nodes: (work, receive buffer)

    def _group_of_stage(self, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Step 3 for stage k: the Y slots of this rank's group, summed over the node (payload, scales)."""
        x, y, first = self.plan.x, self.plan.y, self.plan.first
        pb, _ = self.plan.slot_bytes(first)
        if self.intra_work[k] is not None:
            self.intra_work[k].wait()
        rows = self.recv[k]  # x rows: the copy from each local peer (x = 1: our own data)
        payloads, scales = _unpack(rows, y * pb)
        if x == 1:
            return payloads[0], scales[0]
        return self.ops.dequant_sum_requant(payloads, scales, first.bits, self.q.block, y * self.plan.sub,
                                            self.q.bits)

    def advance(self, block: bool = False) -> bool:
        """Steps 3-4 for the next stages whose intra-node hop has arrived (``block``: all of them, waiting):
        sum, re-quantize and launch the inter-node all-to-all. True when every stage's is launched (one node:
        there is none). Reduces must be advanced in the order they were launched, on every rank."""
        y, s = self.plan.y, self.plan.stages
        if y == 1:
            return True
        pb, sb = self.plan.slot_bytes()
        while len(self.pending) < s:
            k = len(self.pending)
            if not block and self.intra_work[k] is not None and not self.intra_work[k].is_completed():
                return False
            payload, scales = self._group_of_stage(k)
            send = torch.cat([payload.view(y, pb), scales.view(torch.uint8).view(y, sb)], dim=1)
            recv = torch.empty_like(send)
            self.pending.append((comm.all_to_all(recv, send, self.inter, async_op=True), recv))
        return True

    def wait(self) -> None:
        x, y, s, sub = self.plan.x, self.plan.y, self.plan.stages, self.plan.sub
        if y == 1:  # one node: the intra-node all-to-all was the whole reduction
            arrived, q = list(zip(self.intra_work, self.recv)), self.plan.first
        else:
            self.advance(block=True)
            arrived, q = self.pending, self.q
        pb, _ = self.plan.slot_bytes(q)
        total = torch.empty(s * sub, dtype=torch.float32, device=self.out.device)
        for k, (work, recv) in enumerate(arrived):
            work.wait()
            payloads, scales = _unpack(recv, pb)
            total[k * sub:(k + 1) * sub] = self.ops.dequant_sum(payloads, scales, q.bits, q.block, sub)
        if self.hadamard:  # the sums are of rotated blocks (the rotation is linear): rotate the total back
            total = hadamard_blocks.unrotate(total, self.q.block)
        total = total[:self.plan.shard]
        total.div_(x * y)  # step 5: the mean over all P ranks, divided once
        self.out.copy_(total)
        self.send = self.recv = None
        self.pending = []


# -- observability (zero.quant_error_interval) ------------------------------------------------------
class ComparedReduce:
    """A qgZ reduce whose result is compared, on arrival, with the unquantized one."""

    def __init__(self, work: QgzReduce, out: torch.Tensor, exact: torch.Tensor, acc: torch.Tensor):
        self.work, self.out, self.exact, self.acc = work, out, exact, acc

    def advance(self, block: bool = False) -> bool:
        return self.work.advance(block)

    def wait(self) -> None:
        self.work.wait()
        accumulate_error(self.acc, self.out, self.exact)


def accumulate_error(acc: torch.Tensor, value: torch.Tensor, reference: torch.Tensor) -> None:
    """acc += (|value - reference|^2, |reference|^2)."""
    ref = reference.double()
    acc[0] += (value.double() - ref).square().sum()
    acc[1] += ref.square().sum()
