"""Run a pipeline schedule: forwards, backwards and the p2p exchange between stages.

The loop in ``run`` is the whole algorithm: take the next action of this rank's
schedule (``parallel/schedule.py``), receive what it needs, compute, send what it
produces. Sends never block (``isend``); a receive is posted in the sender's
order (see ``link_orders``) and waited for only when the data is needed. Once a
sent activation has left, its storage is released (the tensor keeps its shape
and autograd node, which is all its backward needs), so a stage holds no more
than the schedule's in-flight micro-batches. With pp = 1 the same loop is plain
gradient accumulation.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from parallel import comm
from parallel.mesh import Mesh
from parallel.schedule import Action, Message, forward_schedule, link_orders, needs, sends, train_schedule

BatchFn = Callable[[int], Tuple[torch.Tensor, torch.Tensor]]


class PipelineRunner:
    def __init__(self, mesh: Mesh, chunks: Sequence[nn.Module], activation_shape: Tuple[int, ...],
                 documents: bool = False):
        """``activation_shape``: what flows between stages, ``[s (/tp under SP), micro_batch, d_model]``;
        ``documents``: the batches carry document ids third (data.document_mask), which every chunk's attention
        needs: each stage reads them with its micro-batch (the same samples; nothing travels between stages)."""
        self.mesh, self.chunks = mesh, list(chunks)
        self.pp, self.vp, self.rank = mesh.layout.pp, mesh.layout.virtual_stages, mesh.pp_rank
        self.activation_shape = activation_shape
        self.documents = documents
        self.max_in_flight = 0
        self.released_bytes = 0  # storage freed after sending (activations and input gradients)
        self._plans: Dict[Tuple[int, bool], tuple] = {}

    def _plan(self, num_mb: int, forward_only: bool):
        key = (num_mb, forward_only)
        if key not in self._plans:
            make = forward_schedule if forward_only else train_schedule
            schedules = [make(self.pp, self.vp, num_mb, r) for r in range(self.pp)]
            self._plans[key] = (schedules[self.rank], link_orders(schedules, self.pp, self.vp))
        return self._plans[key]

    def run(self, batch: BatchFn, num_mb: int, *, forward_only: bool = False, grad_scale: float = 1.0,
            compute: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
            dtype: torch.dtype = torch.float32,
            before_last_backward: Optional[Callable[[int], None]] = None) -> List[torch.Tensor]:
        """Run one schedule; returns the per-micro-batch losses on the last stage (empty elsewhere).

        ``grad_scale`` multiplies each micro-batch loss before backward (loss scale / micro-batches);
        ``compute`` is the autocast context of the forward; ``before_last_backward(chunk)`` is called
        before a chunk's last backward (so data parallelism can start reducing its gradients).
        """
        actions, orders = self._plan(num_mb, forward_only)
        last_backward = {a.chunk: i for i, a in enumerate(actions) if a.kind == "B"}
        st = _StepState(orders, self.rank)
        in_flight = 0
        grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
        with grad_mode:
            for i, action in enumerate(actions):
                st.release_sent()
                if action.kind == "F":
                    self._forward(action, st, batch, compute, dtype, forward_only)
                    if not forward_only:  # forward-only runs keep no activations
                        in_flight += 1
                        self.max_in_flight = max(self.max_in_flight, in_flight)
                else:
                    if before_last_backward is not None and last_backward[action.chunk] == i:
                        before_last_backward(action.chunk)
                    self._backward(action, st, grad_scale, dtype)
                    in_flight -= 1
        st.finish_sends()
        self.released_bytes += st.released_bytes
        return st.losses

    # -- one forward / one backward -----------------------------------------------------------
    def _forward(self, a: Action, st: "_StepState", batch: BatchFn, compute, dtype, forward_only: bool) -> None:
        chunk = self.chunks[a.chunk]
        tokens, labels, *docs = batch(a.mb) if chunk.first or chunk.last or self.documents else (None, None)
        if chunk.first:
            x = tokens
        else:
            x = self._receive(a, st, dtype)
            if not forward_only:
                x.requires_grad_()
        with compute():
            out = chunk(x, labels if chunk.last else None, *docs)
        if chunk.last:
            st.losses.append(out.detach())
        for dst, msg in sends(a, self.pp, self.vp, self.rank):
            st.send(out.detach(), dst, msg, self.mesh)
        if not forward_only:
            st.saved[(a.chunk, a.mb)] = (x, out)

    def _backward(self, a: Action, st: "_StepState", grad_scale: float, dtype) -> None:
        x, out = st.saved.pop((a.chunk, a.mb))
        if self.chunks[a.chunk].last:
            (out * grad_scale).backward()
        else:
            grad = self._receive(a, st, dtype)
            torch.autograd.backward(out, grad)
        for dst, msg in sends(a, self.pp, self.vp, self.rank):
            st.send(x.grad, dst, msg, self.mesh)

    def _receive(self, a: Action, st: "_StepState", dtype) -> torch.Tensor:
        [(src, msg)] = needs(a, self.pp, self.vp, self.rank)
        return st.receive(src, msg, self.mesh, self.activation_shape, dtype)


class _StepState:
    """Per-step bookkeeping: ordered receives, pending sends, saved activations, losses."""

    def __init__(self, orders: Dict[Tuple[int, int], List[Message]], rank: int):
        self.rank = rank
        self.incoming = {src: msgs for (src, dst), msgs in orders.items() if dst == rank}
        # a message's tag is its position on its link, the same number at both ends
        self.tags = {dst: {m: i for i, m in enumerate(msgs)} for (src, dst), msgs in orders.items() if src == rank}
        self.posted: Dict[Message, Tuple[object, torch.Tensor]] = {}
        self.next_post = {src: 0 for src in self.incoming}
        self.pending: List[Tuple[object, torch.Tensor]] = []
        self.saved: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        self.losses: List[torch.Tensor] = []
        self.released_bytes = 0

    def send(self, t: torch.Tensor, dst: int, msg: Message, mesh: Mesh) -> None:
        """Non-blocking send; ``t`` shares storage with the stage output (or input grad) it came from."""
        tag = self.tags[dst][msg]
        self.pending.append((comm.isend(t.contiguous(), dst, mesh.pp, tag=tag), t))

    def receive(self, src: int, msg: Message, mesh: Mesh, shape, dtype) -> torch.Tensor:
        order = self.incoming[src]
        while msg not in self.posted:  # post receives in the sender's order, up to the one needed
            ahead = order[self.next_post[src]]
            buf = torch.empty(shape, dtype=dtype, device=mesh.device)
            self.posted[ahead] = (comm.irecv(buf, src, mesh.pp, tag=self.next_post[src]), buf)
            self.next_post[src] += 1
        work, buf = self.posted.pop(msg)
        work.wait()
        return buf

    def release_sent(self) -> None:
        """Free the storage of activations whose send has completed (their autograd node stays)."""
        still = []
        for work, t in self.pending:
            if work.is_completed():
                self._release(t)
            else:
                still.append((work, t))
        self.pending = still

    def finish_sends(self) -> None:
        for work, t in self.pending:
            work.wait()
            self._release(t)
        self.pending = []

    def _release(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        self.released_bytes += storage.nbytes()
        storage.resize_(0)
