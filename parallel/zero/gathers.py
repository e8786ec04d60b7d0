"""Stage 3's gathers: a mixin of ``ZeroDataParallel`` (``sharded.py``), whose state it reads (units,
hpZ group, qwZ, working set, ledger); FP8-LM's stage 3 (``fp8/zero.py``) inherits it too.

A forward pre-hook gathers the units a module uses (waiting for
a prefetch if one is in flight) and prefetches the units of the next
``zero.prefetch_depth`` modules (the order is recorded during each chunk's first
forward); the forward hook releases them (storage resized to 0: the parameters
keep their shapes and autograd's saved references) and hooks the module output,
whose gradient's arrival gathers them again for backward (unless the module's
backward does not read them: an embedding lookup's) and prefetches the previous
modules'. qwZ's two-hop gathers (``zeropp.py``) have their hops launched by a
thread of their own, in the order they started. A unit is released
when its last gradient arrives. Activation recomputation runs inside backward,
where the forward hook does not release: the recompute's gather *is* the
backward gather (no extra traffic). Under pipelining every micro-batch gathers
in forward and again in backward, and reduce-scatters its gradients.
"""
from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from parallel import comm
from parallel.zero.buffers import Unit
from parallel.zero.units import ModuleUse
from parallel.zero.zeropp import DeltaGather, QuantizedGather, accumulate_error


class Stage3Gathers:
    """Gather a module's units before its forward (and backward), release them after; prefetch the next ones."""

    def _register_gather_hooks(self, chunks: Sequence[nn.Module]) -> None:
        """Gather a module's units before its forward (and backward), release them after (stage 3)."""
        self.depth = self.cfg.zero.prefetch_depth if self.cfg.zero.prefetch else 0
        self._order: List[Optional[List[ModuleUse]]] = [None] * len(chunks)
        self._recording: Dict[int, List[ModuleUse]] = {}
        for c, chunk in enumerate(chunks):
            chunk.register_forward_pre_hook(partial(self._chunk_begin, c))
            chunk.register_forward_hook(partial(self._chunk_end, c))
            for use in self.chunk_uses[c]:
                use.module.register_forward_pre_hook(partial(self._pre_forward, c, use))
                use.module.register_forward_hook(partial(self._post_forward, c, use))

    def _next_forward_units(self) -> List[Unit]:
        """Stage 3 with prefetch: the units of the first ``zero.prefetch_depth`` + 1 modules of the recorded
        forward of the first chunk, in that order (empty otherwise). ``step`` updates them first and starts
        their gathers at once, so the link carries the next forward's first weights while the other units'
        AdamW, the metrics and the stop check run; the forward's hooks then wait for them as for any prefetch
        (the same gathers of the same shards, so the same bits). At most what the forward's own prefetch
        would hold, so the working set's peak (and the memory estimate) is unchanged. The ledger counts these
        gathers when a forward uses them (``Ledger.deferred``): in the next training step, or in a validation
        pass that comes first (whose gathers the metrics never counted), so every step's record is the bytes
        that step needs, as without this (a run's last step starts gathers nothing uses: not counted)."""
        if self.stage != 3 or not self.depth or not self._order or self._order[0] is None:
            return []
        out: List[Unit] = []
        for use in self._order[0][:self.depth + 1]:
            out += [u for u in use.units if all(u is not o for o in out)]
        return out

    # -- stage 3: gather before use, release after --------------------------------------------------
    def _start_gather(self, unit: Unit) -> None:
        self._settle_early(unit)
        if unit.gathered or unit.gather_work is not None:
            return
        unit.full.untyped_storage().resize_(unit.full_bytes)
        self.working.add(unit.full_bytes)
        if unit.secondary_valid:  # hpZ: inside the node
            unit.gather_work = comm.all_gather(unit.full, unit.secondary, self.hpz, async_op=True)
        elif self.weight_delta and not unit.reference_valid:  # qWD's first gather: exact
            unit.gather_work = comm.all_gather(unit.full, unit.shard, self.mesh.dp, async_op=True)
        elif self.weight_delta:  # the secondary shards hold the previous weights, W~: gather W~ + differences
            delta = unit.master - unit.reference.float()
            unit.gather_work = DeltaGather(unit.full, unit.secondary, self.hpz, delta, self.mesh.dp, self.qwz,
                                           self.gather_route)
        elif self.qwz is not None and self.mesh.dp.size > 1:
            unit.gather_work = QuantizedGather(unit.full, unit.shard, self.mesh.dp, self.qwz, self.gather_route)
        else:
            unit.gather_work = comm.all_gather(unit.full, unit.shard, unit.group, async_op=True)

    def _gather(self, unit: Unit) -> None:
        if unit.ledger_held is not None:  # started by the optimizer step: counted now, by the step using it
            self.mesh.ledger.replay(unit.ledger_held)
            unit.ledger_held = None
        self._start_gather(unit)
        if unit.gather_work is not None:
            unit.gather_work.wait()
            if self.sampling and (isinstance(unit.gather_work, (QuantizedGather, DeltaGather))
                                  or self.qwz is not None and unit.secondary_unmeasured):
                accumulate_error(self._qerr[:2], unit.full[unit.own], unit.shard)  # own dequantized piece vs shard
                unit.secondary_unmeasured = False
            if self.weight_delta and not unit.secondary_valid:  # qWD: from the primary shards
                unit.reference.copy_(unit.full[unit.own])
                unit.reference_valid = True
            unit.gather_work = None
            unit.gathered = True

    def _release(self, unit: Unit) -> None:
        if unit.gather_work is not None:
            self._gather(unit)
        if unit.gathered:
            unit.full.untyped_storage().resize_(0)
            self.working.sub(unit.full_bytes)
            unit.gathered = False

    def _prefetch(self, chunk: int, use: ModuleUse, step: int) -> None:
        """Start gathering the ``depth`` modules after (step 1) or before (-1) ``use`` in the recorded order."""
        order = self._order[chunk]
        if order is None or not self.depth:
            return
        i = next((k for k, u in enumerate(order) if u is use), None)
        if i is None:
            return
        for d in range(1, self.depth + 1):
            if 0 <= i + d * step < len(order) and (step > 0 or order[i + d * step].backward_reads_weights):
                for unit in order[i + d * step].units:
                    self._start_gather(unit)
        self._poll()

    def _chunk_begin(self, chunk: int, module, args) -> None:
        if self._order[chunk] is None and torch.is_grad_enabled() and not _in_backward():
            self._recording[chunk] = []

    def _chunk_end(self, chunk: int, module, args, out) -> None:
        if chunk in self._recording:
            self._order[chunk] = self._recording.pop(chunk)

    def _pre_forward(self, chunk: int, use: ModuleUse, module, args) -> None:
        if chunk in self._recording and not _in_backward():
            self._recording[chunk].append(use)
        for unit in use.units:
            self._gather(unit)
        self._prefetch(chunk, use, -1 if _in_backward() else 1)

    def _post_forward(self, chunk: int, use: ModuleUse, module, args, out):
        if _in_backward():
            return None  # a recomputation: the backward that follows needs the weights
        for unit in use.units:
            if unit.secondary is not None and not unit.secondary_valid:
                # hpZ: the first forward since the optimizer step, training or validation, keeps this rank's
                # slice; every later gather until the next step (the rest of validation, the next training
                # step's forwards and backward) is inside the node
                self._keep_secondary(unit)
                unit.secondary_valid = True
                # qwZ's error is sampled on gathers from the primary shards; a secondary copy that a validation
                # pass built is measured on the next sampled step's first gather of the unit instead
                if self.qwz is not None:
                    unit.secondary_unmeasured = not torch.is_grad_enabled()
            self._release(unit)
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(partial(self._pre_backward, chunk, use))
        return None

    def _keep_secondary(self, unit: Unit) -> None:
        n = unit.secondary.numel()
        unit.secondary.copy_(unit.full[self.hpz.rank * n:(self.hpz.rank + 1) * n])

    def _pre_backward(self, chunk: int, use: ModuleUse, grad: torch.Tensor) -> None:
        if use.backward_reads_weights:
            for unit in use.units:
                self._gather(unit)
        self._prefetch(chunk, use, -1)


def _in_backward() -> bool:
    """True inside an autograd backward pass (e.g. during activation recomputation)."""
    return torch._C._current_graph_task_id() != -1
