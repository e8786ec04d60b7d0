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

The concepts beside the step live in mixins of ``ZeroDataParallel``: stage 3's gathers (``gathers.py``,
``Stage3Gathers``), the early step (``early_step.py``, ``EarlyStep``), checkpoints, load and memory accounting
(``sharded_state.py``, ``ZeroState``). The buffers above are ``buffers.py``'s ``Unit`` (re-exported here, with
``Working``).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from config import Config
from model.gpt import EMBEDDING
from parallel import comm
from parallel.mesh import Mesh
from parallel.optim_rules import COMPUTE_DTYPES, grad_factor, unscaled_norm, weight_decay_exempt
from optimizers.tensor_rules import Entry, TensorRules
from parallel.zero.adamw import adamw_step
from parallel.zero.buffers import Unit, Working
from parallel.zero.early_step import EarlyStep, early_step_applies
from parallel.zero.gathers import Stage3Gathers
from parallel.zero.sharded_state import ZeroState
from parallel.zero.units import ModuleUse, UnitSpec, chunk_units
from parallel.zero.zeropp import ComparedReduce, GatherRoute, QgzReduce, Quant, QuantizedGather


class ZeroDataParallel(Stage3Gathers, EarlyStep, ZeroState):
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
                        tied, z.hpz_size, self._quantized_step_gather(), z.weight_delta,
                        adam=cfg.train.optimizer == "adamw")

        self._build_units(chunks, make_unit)
        if cfg.train.optimizer != "adamw":
            for u in self.units:
                self._tensor_rules(u)
        self._factor = 1.0
        self.optimizer_steps = 0
        if self.stage == 3:
            self._register_gather_hooks(chunks)

    def _tensor_rules(self, u: Unit) -> None:
        """``train.optimizer`` other than AdamW (``optimizers/tensor_rules.py``): the whole tensors of this rank's
        shard (``zero.partition=whole_tensor``, checked by the config), each a view of the fp32 master. The TP ranks
        of one DP rank own the same tensors (their pieces have the same sizes), so the TP collectives of a rule
        that needs whole matrices run in the same order on each."""
        entries = []
        for i, a, b, at in u.layout.owned(u.group.rank):
            p = u.params[i]
            if (a, b) != (0, p.numel()):
                raise RuntimeError(f"{u.names[i]}: train.optimizer={self.cfg.train.optimizer} needs whole tensors "
                                   f"in a shard (zero.partition=whole_tensor)")
            u.rule_at.append((i, at))
            entries.append(Entry(u.names[i], u.master[at:b - a + at].view(p.shape), p.spec,
                                 not weight_decay_exempt(u.names[i], p)))
        u.rules = TensorRules(self.cfg, self.mesh, entries)

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
            buf.div_(self.mesh.dp.size)  # the DP mean (an expert unit's group is a part of DP)
            work = comm.reduce_scatter(out, buf, unit.group, async_op=True)
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
            if u.rules is not None:  # another train.optimizer: the whole tensors this rank owns
                u.rules.step([grad[at:at + e.param.numel()].view(e.param.shape)
                              for (_, at), e in zip(u.rule_at, u.rules.entries)], lr, self.optimizer_steps)
            else:
                adamw_step(u.master, grad, u.exp_avg, u.exp_avg_sq, u.decay, self.optimizer_steps, lr, t.beta1,
                           t.beta2, t.eps, t.weight_decay)
            if self._quantized_step_gather():  # the shard is what the gather delivers
                gathers.append(self._step_gather(u))
                continue
            if u.shard is not u.master:
                u.shard.copy_(u.master)
            if self.stage < 3:  # everyone's updated shard -> everyone's full parameters
                comm.all_gather(u.full, u.shard.clone(), u.group)
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

    def _quantized_step_gather(self) -> bool:
        """Stages 1-2 with qwZ: the post-step all-gather of the updated parameters is quantized."""
        return self.stage < 3 and self.qwz is not None and self.mesh.dp.size > 1

    def _step_gather(self, u: Unit) -> QuantizedGather:
        """Launch a stage-1/2 unit's quantized post-step gather: of its master shard, or (qWD) of the difference
        between it and this rank's piece of the weights every rank holds (``full``), which the gather adds to."""
        values = u.master - u.shard.float() if self.weight_delta else u.master
        return QuantizedGather(u.full, values, self.mesh.dp, self.qwz, self.gather_route, add=self.weight_delta)

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
