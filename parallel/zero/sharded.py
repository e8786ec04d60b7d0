"""ZeRO stages 1, 2 and 3 over the data-parallel group of each (pp, tp) coordinate.

Every unit (``units.py``: embedding, each block, final norm, head) keeps its
parameters as views of one flat buffer laid out by ``partition.py``; rank r of
the N DP ranks owns shard r of it. What each stage keeps between steps:

  stage   parameters (compute dtype)   gradients (reduce dtype)       optimizer (fp32)
  1       full                         full                           master, m, v shards
  2       full                         shard                          master, m, v shards
  3       shard (+ gathered working)   shard                          master, m, v shards

(in fp32 the master shard *is* the parameter shard, no copy.) A step:

1. Backward. A hook on each parameter adds its gradient into the unit's flat
   gradient buffer (in the reduce dtype, so bf16 parameters can accumulate in
   fp32) and frees ``p.grad``. Once all of a unit's parameters have reported:
   stages 1-2, on the last backward of the step, divide by N and launch the
   unit's reduce-scatter asynchronously (overlapping the rest of backward);
   stage 3 does that after every micro-batch's backward, accumulating the
   reduced shard. Stages 2-3 keep up to ``zero.reduce_in_flight`` reduce-scatters
   in flight (launching one waits for the oldest beyond that) and free a unit's
   full gradient buffer when its shard arrives (with gradient accumulation,
   stage 2 holds full gradients until the last backward, as stage 1 does). Every
   gradient hook also moves the reduces in flight on (``_poll``): a qgZ reduce
   whose intra-node hop has arrived is summed and its inter-node hop launched
   then, not when its result is needed, so that hop crosses the slow link while
   backward goes on.
2. ``finish_grads``: wait; sum the pieces of sequence-parallel norm/bias gradients
   over TP; sum the tied embedding's shard over first + last stage.
3. ``norm_terms`` / ``clip``: the global norm from shard pieces, each global
   parameter once (TP-replicated pieces on TP rank 0 only, tied copies never),
   summed over the whole world (= DP shards x TP x PP) in the engine's one
   all-reduce of the step's scalars.
4. ``step``: AdamW on the fp32 master shard, then stages 1-2 all-gather the
   updated parameters (compute dtype; with qwZ quantized, with qWD the quantized
   differences to the parameters every rank holds, ``zeropp.py``); stage 3
   refreshes its parameter shard.

Stage 3 gathers: a forward pre-hook gathers the units a module uses (waiting for
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

import math
from dataclasses import replace
from functools import partial
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from config import Config
from model.gpt import EMBEDDING
from parallel import comm
from parallel.mesh import Mesh
from parallel.optim_rules import (COMPUTE_DTYPES, grad_factor, owns_gradient, unscaled_norm,
                                   weight_decay_exempt)
from parallel.zero.adamw import adamw_step
from parallel.zero.dcp_view import shard_view
from parallel.zero.partition import ShardLayout, shard_layout
from parallel.zero.units import ModuleUse, UnitSpec, chunk_units
from parallel.zero.zeropp import (ComparedReduce, DeltaGather, GatherRoute, QgzReduce, Quant, QuantizedGather,
                                  accumulate_error)

Ranges = List[Tuple[int, int]]


def _merge(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class Working:
    """Bytes of transient buffers alive now (gathered parameters, full gradients) and their peak."""

    def __init__(self):
        self.now = self.peak = 0

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def sub(self, n: int) -> None:
        self.now -= n


class Unit:
    """One unit's buffers on this rank; see the module docstring for what each stage keeps."""

    def __init__(self, spec: UnitSpec, names: Dict[nn.Parameter, str], mesh: Mesh, stage: int, kind: str,
                 compute: torch.dtype, reduce: torch.dtype, working: Working, tied: bool, hpz: int = 1,
                 quantized_gather: bool = False, weight_delta: bool = False):
        self.name, self.params, self.stage, self.working, self.tied = spec.name, spec.params, stage, working, tied
        self.names = [names[p] for p in self.params]
        dp = mesh.dp
        self.layout: ShardLayout = shard_layout([p.numel() for p in self.params], dp.size, kind)
        n, s, r = dp.size, self.layout.shard_size, dp.rank
        self.own = slice(r * s, (r + 1) * s)
        self.reduce_dtype = reduce
        with torch.no_grad():
            values = torch.zeros(n * s, dtype=torch.float32, device=mesh.device)
            for p, off in zip(self.params, self.layout.offsets):
                values[off:off + p.numel()] = p.detach().flatten().float()
            self.full = values.to(compute)
            for p, off in zip(self.params, self.layout.offsets):
                p.data = self.full[off:off + p.numel()].view(p.shape)
            if stage == 3:
                self.shard = self.full[self.own].clone()
                self.master = self.shard if compute == torch.float32 else values[self.own].clone()
                self.full.untyped_storage().resize_(0)  # gathered on demand
            else:
                self.shard = self.full[self.own]
                # a quantized post-step gather overwrites the shard with what every rank dequantized: the master
                # is a copy of its own, in fp32 too
                separate = compute != torch.float32 or quantized_gather
                self.master = values[self.own].clone() if separate else self.shard
        del values
        self.exp_avg = torch.zeros(s, dtype=torch.float32, device=mesh.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.grad_full: Optional[torch.Tensor] = None
        if stage == 1:
            self.grad_full = torch.zeros(n * s, dtype=reduce, device=mesh.device)
            self.grad_shard = self.grad_full[self.own]
        else:
            self.grad_shard = torch.zeros(s, dtype=reduce, device=mesh.device)
        # per-piece roles of this rank's shard
        decay, norm, sp = [], [], []
        for i, a, b, at in self.layout.owned(r):
            p, piece = self.params[i], (at, at + b - a)
            if not weight_decay_exempt(self.names[i], p):
                decay.append(piece)
            if owns_gradient(p, mesh.tp_rank):
                norm.append(piece)
            if p.spec.sequence_parallel:
                sp.append(piece)
        self.decay, self.norm_ranges, self.sp_ranges = _merge(decay), _merge(norm), _merge(sp)
        self.arrived = 0
        self.reduced = False  # this step's reduce-scatter launched
        self.gathered = stage < 3
        self.gather_work = None
        self.ledger_held = None  # the ledger records of a gather the optimizer step started (see step)
        # hpZ: this rank's slice of the gathered buffer, valid from the first forward after an optimizer step
        # (training or validation) until the next one
        self.secondary = torch.zeros(n * s // hpz, dtype=compute, device=mesh.device) if hpz > 1 else None
        self.secondary_valid = False
        self.secondary_unmeasured = False  # built by a validation pass from qwZ-gathered weights (quant_error)
        # stage-3 qWD: this rank's piece of the weights every rank reconstructed at the last gather from the
        # primary shards (the secondary shards hold the rest); valid once such a gather happened (or was loaded)
        # (a checkpoint saved before that holds the exact weights: what the first gather will deliver)
        self.reference = self.shard.clone() if stage == 3 and weight_delta else None
        self.reference_valid = False

    @property
    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def grad_view(self, i: int) -> torch.Tensor:
        if self.grad_full is None:
            self.grad_full = torch.zeros(self.layout.padded_size, dtype=self.reduce_dtype, device=self.shard.device)
            self.working.add(self.grad_full.numel() * self.grad_full.element_size())
        off, p = self.layout.offsets[i], self.params[i]
        return self.grad_full[off:off + p.numel()].view(p.shape)


def early_step_applies(z) -> bool:
    """``zero.early_step`` takes effect (``ZeroDataParallel._early_step``; ``parallel/volume.py`` counts its bytes):
    stage 3 with hpZ secondary shards to gather into and qwZ (whose gather dequantizes just the node's slice), not
    qWD (whose differences are taken against the secondary copies an early gather overwrites)."""
    return z.early_step and z.stage == 3 and z.hpz_size > 1 and z.quantized_weights and not z.weight_delta


class ZeroDataParallel:
    # the early step's state read by methods FP8-LM's stage 3 (``fp8/zero.py``) inherits without this __init__
    early, _plan = False, None

    def __init__(self, cfg: Config, mesh: Mesh, chunks: Sequence[nn.Module], names: Dict[nn.Parameter, str]):
        z = cfg.zero
        self.cfg, self.mesh, self.stage = cfg, mesh, z.stage
        self.compute_dtype = COMPUTE_DTYPES[cfg.precision]
        reduce = self.compute_dtype if z.reduce_dtype == "compute" else torch.float32
        self.overlap = cfg.parallel.overlap_grad_reduce
        self.working = Working()
        # ZeRO++ (stage 3 only; config validation refuses them below)
        self.qwz = Quant(z.weight_bits, z.quant_block) if z.quantized_weights else None
        self.qgz = Quant(z.gradient_bits, z.quant_block) if z.quantized_gradients else None
        self.hpz = mesh.hpz_group(z.hpz_size) if z.hpz_size > 1 else None
        self.gather_route: Optional[GatherRoute] = None  # qwZ's two hops where DP spans nodes of several ranks
        if self.qwz is not None and mesh.dp_intra.size > 1 and mesh.dp_inter.size > 1:
            inter, intra = mesh.gather_groups()
            self.gather_route = GatherRoute.of(mesh.dp, inter, intra, mesh.layout.dp_inter_ranks)
        self.weight_delta = z.weight_delta
        self.qgz_intra = Quant(z.gradient_bits_intra, z.quant_block) if z.gradient_bits_intra else None
        self.in_flight = z.reduce_in_flight
        self.early = early_step_applies(z)  # zero.early_step: see _early_step
        self._plan: Optional[Tuple[float, float]] = None  # this step's (lr, gradient factor) if it steps early
        self._early_units: set = set()  # ids of the units that step early this step (_early_candidates)
        self._bites = False  # the last step's clip (or an overflow) bit: the next one does not step early
        self._early: Dict[int, list] = {}  # id(unit) -> [unit, gather in flight or None, its ledger records]
        self._landing: Dict[int, Tuple[Unit, object]] = {}  # kept early gathers still in flight after the step
        self.early_kept = self.early_discarded = 0  # steps whose early work was kept / thrown away
        self.last_early = False  # the last optimizer step kept its early gathers (the next forward uses them)
        self.sampling = False  # this step measures the quantization error (``quant_error``)
        self._qerr = torch.zeros(4, dtype=torch.float64, device=mesh.device)  # weights err, ref; gradients err, ref
        tie = cfg.model.tie_embeddings and mesh.layout.pp > 1

        def make_unit(spec: UnitSpec) -> Unit:
            tied = tie and any(names[p] == EMBEDDING or p.spec.shared_with == EMBEDDING for p in spec.params)
            return Unit(spec, names, mesh, self.stage, z.partition, self.compute_dtype, reduce, self.working,
                        tied, z.hpz_size, self._quantized_step_gather(), z.weight_delta)

        self._build_units(chunks, make_unit)
        self._factor = 1.0
        self.optimizer_steps = 0
        if self.stage == 3:
            self._register_gather_hooks(chunks)

    def _build_units(self, chunks: Sequence[nn.Module], make_unit) -> None:
        """Every chunk's units (``make_unit(spec)``), their module uses, and a gradient hook on each parameter."""
        self.chunk_units, self.chunk_uses, self._where = [], [], {}
        for chunk in chunks:
            specs, uses = chunk_units(chunk)
            units = []
            for spec in specs:
                unit = make_unit(spec)
                for i, p in enumerate(unit.params):
                    self._where[p] = (unit, i)
                    p.register_post_accumulate_grad_hook(self._on_grad)
                units.append(unit)
            self.chunk_units.append(units)
            # the same module uses, holding this strategy's Unit objects instead of indices
            self.chunk_uses.append([ModuleUse(u.module, [units[i] for i in u.units], u.backward_reads_weights)
                                    for u in uses])
        self.units = [u for units in self.chunk_units for u in units]
        self._syncing = [False] * len(self.chunk_units)
        self._launched: List[tuple] = []  # (unit, work, out, full buffer) of reduce-scatters in flight, oldest first
        self._chunk_of = {id(u): c for c, units in enumerate(self.chunk_units) for u in units}

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

    # -- gradients ----------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        if self._early:  # a step whose early work was never decided (no clip call): thrown away
            self._discard_early()
        for u in self.units:
            u.arrived, u.reduced = 0, False
            if self.stage == 1:
                u.grad_full.zero_()
            elif self.stage == 3:
                u.grad_shard.zero_()
        self._syncing = [False] * len(self.chunk_units)

    def before_last_backward(self, chunk: int) -> None:
        self._syncing[chunk] = True

    def _on_grad(self, p: nn.Parameter) -> None:
        unit, i = self._where[p]
        unit.grad_view(i).add_(p.grad)
        p.grad = None
        unit.arrived += 1
        self._poll()
        if unit.arrived < len(unit.params):
            return
        unit.arrived = 0
        chunk = self._chunk_of[id(unit)]
        if self.stage == 3:
            self._release(unit)
            self._reduce(unit)
        elif self._syncing[chunk] and self.overlap:
            self._reduce(unit)
        if self.stage >= 2 and unit is self.chunk_units[chunk][0]:
            self._drain()  # the chunk's backward is over: nothing stays in flight across pipeline actions

    def _reduce(self, unit: Unit) -> None:
        """Launch the unit's gradient reduce-scatter (mean over DP)."""
        unit.reduced = True
        if self.stage >= 2:  # zero.reduce_in_flight bounds the full-gradient buffers alive at once
            self._drain(keep=self.in_flight - 1)
        buf = unit.grad_full
        if self.stage >= 2:
            unit.grad_full = None  # the buffer travels with its reduce-scatter and is freed on arrival
        out = unit.grad_shard if self.stage == 2 else torch.empty_like(unit.grad_shard)
        if self._quantized_reduce(buf):
            work = QgzReduce(out, buf, self.mesh.dp_intra, self.mesh.dp_inter, self.qgz, self.cfg.zero.qgz_stages,
                             self.qgz_intra, self.cfg.zero.gradient_hadamard)
            if self.sampling:  # the unquantized mean, by an extra (counted) reduce-scatter, to compare on arrival
                exact = torch.empty_like(out)
                comm.reduce_scatter(exact, buf / self.mesh.dp.size, replace(self.mesh.dp, name="quant_error"))
                work = ComparedReduce(work, out, exact, self._qerr[2:])
        else:
            buf.div_(self.mesh.dp.size)
            work = comm.reduce_scatter(out, buf, self.mesh.dp, async_op=True)
        self._launched.append((unit, work, out, buf))

    def _quantized_reduce(self, buf: torch.Tensor) -> bool:
        """qgZ for this buffer? (on, more than one DP rank, and not below the size threshold)"""
        return self.qgz is not None and self.mesh.dp.size > 1 and buf.numel() >= self.cfg.zero.qgz_min_numel

    def _drain(self, keep: int = 0) -> None:
        """Wait for the reduces in flight, oldest first, until ``keep`` are left."""
        while len(self._launched) > keep:
            unit, work, out, buf = self._launched.pop(0)
            work.wait()
            if self.stage == 3:
                unit.grad_shard.add_(out)
                if (self._plan is not None and id(unit) in self._early_units
                        and self._syncing[self._chunk_of[id(unit)]]):
                    self._early_step(unit)  # the last backward's reduce: the shard is final
            elif self.stage == 1:
                unit.grad_shard.copy_(out)
            if self.stage >= 2:
                self.working.sub(buf.numel() * buf.element_size())

    def _poll(self) -> None:
        """Move communication on without waiting: launch the inter-node hop of qgZ reduces whose first hop has
        arrived, oldest first (the order every rank launches them in)."""
        for _, work, _, _ in self._launched:
            if hasattr(work, "advance") and not work.advance(block=False):
                break

    def finish_grads(self) -> None:
        if self.stage < 3:
            for u in self.units:
                if not u.reduced:  # overlap off, or a unit that got no gradient hook
                    self._reduce(u)
        self._drain()
        tp = self.mesh.tp
        pieces = [u.grad_shard[a:b] for u in self.units for a, b in u.sp_ranges]
        if pieces and tp.size > 1:  # each TP rank normalised only its sequence slice
            flat = torch.cat(pieces)
            comm.all_reduce(flat, tp)
            torch._foreach_copy_(pieces, list(flat.split([p.numel() for p in pieces])))
        for u in self.units:
            if u.tied:  # the embedding (first stage) and its copy (last stage): same layout, sum the shards
                comm.all_reduce(u.grad_shard, self.mesh.embedding)

    # -- optimizer --------------------------------------------------------------------------------
    def norm_terms(self) -> torch.Tensor:
        """This rank's addends to the step's world sum (float64, ``Engine.train_step``): the squared norm of its
        shard pieces, each global parameter once (TP-replicated pieces on TP rank 0 only, tied copies never)."""
        sq = torch.zeros(1, dtype=torch.float32, device=self.mesh.device)
        for u in self.units:
            for a, b in u.norm_ranges:
                sq += u.grad_shard[a:b].float().square().sum()
        return sq.double()

    def clip(self, loss_scale: float, max_norm: float, terms: torch.Tensor) -> Tuple[float, bool]:
        """The clip factor ``step`` applies, given ``norm_terms`` summed over the world."""
        norm = unscaled_norm(terms[0].item(), loss_scale)
        planned, self._plan = self._plan, None
        finite = math.isfinite(norm)
        if finite:
            self._factor = grad_factor(norm, loss_scale, max_norm)
        self._bites = not finite or self._factor != grad_factor(0.0, loss_scale, 0.0)
        if self._early and (not finite or planned is None or self._factor != planned[1]):
            self._discard_early()  # the step's factor is not the one the early step assumed
        return norm, finite

    @torch.no_grad()
    def step(self, lr: float) -> None:
        t = self.cfg.train
        self.optimizer_steps += 1
        gathers = []
        ahead = self._next_forward_units()
        for u in ahead + [u for u in self.units if all(u is not a for a in ahead)]:
            grad = u.grad_shard.float() * self._factor
            adamw_step(u.master, grad, u.exp_avg, u.exp_avg_sq, u.decay, self.optimizer_steps, lr, t.beta1,
                       t.beta2, t.eps, t.weight_decay)
            if self._quantized_step_gather():  # the shard is what the gather delivers
                gathers.append(self._step_gather(u))
                continue
            if u.shard is not u.master:
                u.shard.copy_(u.master)
            if self.stage < 3:  # everyone's updated shard -> everyone's full parameters
                comm.all_gather(u.full, u.shard.clone(), self.mesh.dp)
            early = self._early.get(id(u))
            if early is not None:  # the secondary shards hold (or are receiving) these weights already
                u.secondary_valid, u.secondary_unmeasured = True, self.qwz is not None
                u.ledger_held = early[2]  # counted when a forward uses them, as below
            else:
                u.secondary_valid = u.secondary_unmeasured = False  # hpZ: the next forward gathers the primary shards
            if any(u is a for a in ahead):  # stage 3: the next forward's first gathers leave now
                with self.mesh.ledger.deferred() as held:  # counted in the step that uses them
                    self._start_gather(u)
                u.ledger_held = (u.ledger_held or []) + held
        for work in gathers:  # all launched (two-hop ones by their thread, in this order); waited for in this order
            work.wait()
        self.last_early = bool(self._early)
        self.early_kept += self.last_early
        # kept early gathers still in flight: waited for by their unit's next gather (_start_gather)
        self._landing.update({k: (e[0], e[1]) for k, e in self._early.items() if e[1] is not None})
        self._early.clear()

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

    # -- early step (zero.early_step) ------------------------------------------------------------------
    def plan_step(self, lr: float, loss_scale: float) -> None:
        """The engine, before a training step's forward and backward: the learning rate its optimizer step will
        use and the loss scale. With ``zero.early_step`` where it applies, and unless the last step's clip (or an
        overflow) bit or this step samples the quantization error, this step's units step early."""
        ok = self.early and not self._bites and not self.sampling and self.mesh.dp.size > 1
        self._early_units = self._early_candidates() if ok else set()
        self._plan = (lr, grad_factor(0.0, loss_scale, 0.0)) if self._early_units else None

    def _early_candidates(self) -> set:
        """Ids of the units that step early: every unit of each chunk's recorded forward but those of its first
        module (the embedding, on the first stage). That module's gradient is final last and the forward needs it
        first: an early gather of it would arrive no sooner than the one the optimizer step starts, and the step
        would wait for it."""
        firsts = {id(u) for order in self._order if order for u in order[0].units}
        return {id(u) for order in self._order for use in order or [] for u in use.units} - firsts

    @torch.no_grad()
    def _early_step(self, unit: Unit) -> None:
        """Step the unit's optimizer shard now, on copies, assuming the step's gradient factor is the unscale alone
        (no clip), and gather the updated weights across nodes into the hpZ secondary shards while backward goes
        on: the gather the next forward's first use would make from the primary shards, the same bits (``step``
        then computes the same AdamW on the same inputs in place). ``clip`` decides: the factor it finds is the
        assumed one (the clip did not bite, nothing overflowed), and ``step`` keeps the secondary copies
        (counted when a forward uses them, as the gathers the step starts); else ``_discard_early``. The unit's
        backward is over (its gradient shard is final), so nothing of this step reads its secondary shard again.
        Holds no gathered buffer: qwZ's quantized pieces of the node's slice are dequantized straight into the
        secondary shard (the quantized send and receive buffers, uncounted as every qwZ gather's)."""
        lr, factor = self._plan
        t = self.cfg.train
        master, m, v = unit.master.clone(), unit.exp_avg.clone(), unit.exp_avg_sq.clone()
        adamw_step(master, unit.grad_shard.float() * factor, m, v, unit.decay, self.optimizer_steps + 1, lr,
                   t.beta1, t.beta2, t.eps, t.weight_decay)
        del m, v
        shard = master if self.compute_dtype == torch.float32 else master.to(self.compute_dtype)
        per = self.mesh.dp.size // self.hpz.size  # this rank's hpZ slice: the whole pieces of ``per`` DP ranks
        rows = (self.hpz.rank * per, (self.hpz.rank + 1) * per)
        with self.mesh.ledger.deferred() as held:
            work = QuantizedGather(unit.secondary, shard, self.mesh.dp, self.qwz, self.gather_route, rows=rows)
        self._early[id(unit)] = [unit, work, held]
        self._poll()

    def _settle_early(self, unit: Unit) -> None:
        """Wait for the unit's early gather, if it is still in flight (its secondary shard is then whole)."""
        if not self.early:
            return
        landing = self._landing.pop(id(unit), None)
        if landing is not None:
            landing[1].wait()
        early = self._early.get(id(unit))  # (the optimizer step keeps it and starts the unit's gather)
        if early is not None and early[1] is not None:
            early[1].wait()
            early[1] = None

    def _discard_early(self) -> None:
        """The step's factor is not the assumed one: the early gathers (waited for: every rank is in them) never
        happened as far as the model is concerned; their secondary shards hold weights no step made, so the next
        forward gathers from the primary shards as after any step; their bytes are not counted (none used)."""
        self.early_discarded += bool(self._early)
        for unit, work, _ in self._early.values():
            if work is not None:
                work.wait()
            unit.secondary_valid = unit.secondary_unmeasured = False
        self._early.clear()

    def _quantized_step_gather(self) -> bool:
        """Stages 1-2 with qwZ: the post-step all-gather of the updated parameters is quantized."""
        return self.stage < 3 and self.qwz is not None and self.mesh.dp.size > 1

    def _step_gather(self, u: Unit) -> QuantizedGather:
        """Launch a stage-1/2 unit's quantized post-step gather: of its master shard, or (qWD) of the difference
        between it and this rank's piece of the weights every rank holds (``full``), which the gather adds to."""
        values = u.master - u.shard.float() if self.weight_delta else u.master
        return QuantizedGather(u.full, values, self.mesh.dp, self.qwz, self.gather_route, add=self.weight_delta)

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
            unit.gather_work = comm.all_gather(unit.full, unit.shard, self.mesh.dp, async_op=True)

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

    # -- observability ----------------------------------------------------------------------------
    def quant_error(self) -> Dict[str, Optional[float]]:
        """Relative L2 error qwZ / qgZ introduced over the steps sampled since the last call (None where the
        feature is off or nothing was sampled): gathered weights vs the shards they came from, reduced
        gradients vs an unquantized reduce-scatter. A collective over the world; ends the sampling."""
        comm.all_reduce(self._qerr, self.mesh.world)
        e = self._qerr.tolist()
        self._qerr.zero_()
        self.sampling = False
        return {"weights": math.sqrt(e[0] / e[1]) if e[1] > 0 else None,
                "gradients": math.sqrt(e[2] / e[3]) if e[3] > 0 else None}

    # -- checkpoints ------------------------------------------------------------------------------
    def checkpoint_state(self, with_optimizer: bool) -> Dict[str, Dict[str, torch.Tensor]]:
        """Per parameter name: its master weights (and AdamW moments) as global tensors of which this rank
        holds its shard's pieces (views: loading writes straight into the shards). With qWD and the optimizer,
        also ``weight_reference``: the weights every rank reconstructed (compute dtype), what the next
        differences are taken against, so a resume continues bit for bit (``after_load``)."""
        out: Dict[str, Dict[str, torch.Tensor]] = {}
        buffers = ("model", "exp_avg", "exp_avg_sq") if with_optimizer else ("model",)
        if with_optimizer and self.weight_delta:
            buffers += ("weight_reference",)
        for u in self.units:
            pieces: Dict[int, list] = {i: [] for i in range(len(u.params))}
            for i, a, b, at in u.layout.owned(self.mesh.dp.rank):
                pieces[i].append((a, b, at))
            for i, (name, p) in enumerate(zip(u.names, u.params)):
                spec, local = p.spec, tuple(p.shape)
                offset = spec.tp_offset(local, self.mesh.tp_rank)
                sources = {"model": u.master, "exp_avg": u.exp_avg, "exp_avg_sq": u.exp_avg_sq,
                           "weight_reference": u.reference if self.stage == 3 else u.shard}
                out[name] = {key: shard_view(spec.global_shape, local, offset,
                                             [(a, b, sources[key][at:at + b - a]) for a, b, at in pieces[i]],
                                             sources[key])
                             for key in buffers}
        return out

    def set_optimizer_steps(self, steps: int) -> None:
        self.optimizer_steps = steps

    def reference_kind(self) -> Optional[str]:
        """qWD: what this rank's ``weight_reference`` (``checkpoint_state``) holds now, recorded in a checkpoint's
        meta.json so that any stage resumes it: ``"applied"``, the weights the next forward runs on (stages 1-2:
        the post-step gather added the step's differences; stage 3 once a forward since the step, a validation
        pass for one, gathered them and kept the secondary shards), or ``"pending"`` (stage 3 right after a step:
        the weights the last forward ran on, the step's differences not yet sent). None without qWD."""
        if not self.weight_delta:
            return None
        if self.stage < 3:
            return "applied"
        kept = {u.secondary_valid for u in self.units}
        if len(kept) > 1:  # a forward is all or none of a rank's units between two steps
            raise RuntimeError("qWD: some units were gathered since the optimizer step and others not")
        return "applied" if kept == {True} else "pending"

    @torch.no_grad()
    def after_load(self, reference_loaded: bool = False, reference_kind: str = "applied") -> None:
        """Master shards were loaded: refresh the compute-dtype parameters from them.

        qWD: with the reconstructed weights loaded too (``reference_loaded``: a checkpoint of a qWD run, of any stage),
        every rank's copy of them is rebuilt exactly, so the run continues as if never stopped; without them the next
        gather is exact, as at the start. ``reference_kind`` (``reference_kind`` of the saving run): ``"applied"``,
        they are the weights the next forward runs on (stages 1-2: the full parameters; stage 3: the secondary
        shards, marked valid so that forward gathers them inside the node and sends no differences); ``"pending"``,
        the step's differences are still to be added (stage 3: the next forward's gather adds them, as after any
        step; stages 1-2: the post-step gather of the differences runs now). Stages 1-2 with qwZ (no qWD): the
        parameters are the quantized gather of the master, as after every step."""
        if reference_kind not in ("applied", "pending"):
            raise ValueError(f"qWD reference kind must be applied or pending, got {reference_kind!r}")
        self._discard_early()
        for _, work in self._landing.values():
            work.wait()
        self._landing.clear()
        quantized = self._quantized_step_gather()
        for u in self.units:  # (stages 1-2 qWD with the reference loaded: the shard holds that reference)
            if u.shard is not u.master and not (quantized and self.weight_delta and reference_loaded):
                u.shard.copy_(u.master)
        if quantized and not self.weight_delta:
            for work in [self._step_gather(u) for u in self.units]:
                work.wait()
            return
        for u in self.units:
            if self.stage < 3:
                comm.all_gather(u.full, u.shard.clone(), self.mesh.dp)
            u.secondary_valid = u.secondary_unmeasured = False
            if u.reference is not None:
                u.reference_valid = reference_loaded
                if not reference_loaded:
                    u.reference.copy_(u.shard)
                else:  # the secondary shards: this rank's hpZ slice of everyone's references
                    full = torch.empty_like(u.full)
                    comm.all_gather(full, u.reference.clone(), self.mesh.dp)
                    n = u.secondary.numel()
                    u.secondary.copy_(full[self.hpz.rank * n:(self.hpz.rank + 1) * n])
                    u.secondary_valid = reference_kind == "applied"
        if quantized and self.weight_delta and reference_loaded and reference_kind == "pending":
            for work in [self._step_gather(u) for u in self.units]:  # a stage-3 checkpoint: its step's differences
                work.wait()

    def unsharded_grads(self) -> Dict[str, torch.Tensor]:
        """Every parameter's (DP-mean) gradient, gathered from the shards: a collective over DP, for tests."""
        out = {}
        for u in self.units:
            full = torch.empty(u.layout.padded_size, dtype=u.grad_shard.dtype, device=u.grad_shard.device)
            comm.all_gather(full, u.grad_shard.clone(), self.mesh.dp)
            for name, p, off in zip(u.names, u.params, u.layout.offsets):
                out[name] = full[off:off + p.numel()].view(p.shape).float()
        return out

    # -- accounting ---------------------------------------------------------------------------------
    def memory(self) -> Dict[str, int]:
        """Bytes this rank holds now, by component (views of one storage counted once)."""
        seen = set()

        def size(*tensors: Optional[torch.Tensor]) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                st = t.untyped_storage()
                if st.data_ptr() in seen or st.nbytes() == 0:
                    continue
                seen.add(st.data_ptr())
                total += st.nbytes()
            return total

        params = sum(size(u.full if self.stage < 3 else u.shard, u.secondary, u.reference) for u in self.units)
        grads = sum(size(u.grad_full if self.stage == 1 else u.grad_shard) for u in self.units)
        optim = sum(size(u.master, u.exp_avg, u.exp_avg_sq) for u in self.units)
        return {"parameters": params, "gradients": grads, "optimizer": optim, "working_peak": self.working.peak}


def _in_backward() -> bool:
    """True inside an autograd backward pass (e.g. during activation recomputation)."""
    return torch._C._current_graph_task_id() != -1
