"""The data-parallel strategy under ``precision=fp8`` (FP8-LM §2.1-2.3), ZeRO stages 0-3.

The engine talks to it through the same calls as ``parallel/zero/sharded.py``
(zero_grad, before_last_backward, finish_grads, clip, step, checkpoints); it
reuses that module's gather-before-use / release-after hooks and differs in what
each unit keeps (a unit's state: ``zero_unit.py``; the weights' refresh, gathers
and stage 0's casts from the masters: ``zero_weights.py``; checkpoints:
``zero_checkpoint.py``):

  model state (persistent)               stage 0        stages 1-2         stage 3
  master weights  FP16 + scale (or FP32)  whole unit     owned tensors      owned tensors
  Adam m          E4M3 + scale            whole unit     owned tensors      owned tensors
  Adam v          FP16 + scale            whole unit     owned tensors      owned tensors
  gradients       FP8 + scale             whole unit     owned tensors      owned tensors
  weights         -                       E4M3, whole    E4M3, owned (+ hpZ secondary)

"Owned" is ZeRO's ``whole_tensor`` partition (``parallel/zero/partition.py``):
every tensor lives whole on one DP rank, so each keeps its per-tensor scales
(they cannot be split), and the scales travel with their tensors: an FP8 weight
gather moves each rank's E4M3 shard with its fp32 scales appended, as one uint8
payload. Stage 1 keeps gradient shards like stage 2: the FP8 reduction produces
them anyway. One rank: stage 0 keeps 2 + 1 + 1 + 2 = 6 bytes a parameter.

The compute weights (bf16, or fp16 with fp16 GEMMs: what autograd, the norms and
16-bit GEMMs see) are *working* buffers for every stage: materialised before a
module runs and released after, from the master (stage 0), from the persistent
E4M3 copy (stages 1-2), or by the FP8 all-gather (stage 3, within the hpZ group
when its secondary is valid). The FP8 linears cast them to E4M3 with their own
scales (``fp8/linear.py``); with 16-bit GEMMs (``fp8.gemm``) they enter the GEMMs
as they are.

A step: backward accumulates each parameter's gradient into its unit's working
buffer (the compute dtype's 16 bits, or fp32: ``fp8.grad_accumulation``); on the
last micro-batch, once the unit is complete, the sequence-parallel norm pieces are
summed over TP, every tensor is cast to FP8 as g' = mu * g with its own scale, and
``fp8/grad_comm.py`` reduces it (shared min scale, FP8 bytes moved, fp32 sum,
result scale N * s'_g); stage 0 all-gathers the reduced FP8 shards. ``clip`` takes
the norm of the reduced gradients, removes mu with the loss scale, and updates mu
from the world's overflow count. ``step`` runs the FP8 AdamW (``fp8/adam.py``) on
each owned tensor, then refreshes the E4M3 weights.

Checkpoints hold fp32 values under the same global names as every other
precision (``model.*``, ``optim.*.exp_avg(_sq)``); all optimizer scales are
powers of two derived from the values, so dequantize -> save -> load ->
requantize gives back the very same bits (bitwise resume).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from config import Config, compute_precision, grad_accumulation_precision
from fp8 import adam
from fp8.device import triton_has_e4m3
from fp8.format import FORMATS, dequantize, quantize
from fp8.grad_comm import (AutoScale, _all_reduce_fp8, _key, _reduce_scatter_fp8, _segments, cast_gradients,
                           reduce_one_rank)
from fp8.scaling import Fp8States, fp8_only_weights
from fp8.zero_checkpoint import Fp8Checkpointing
from fp8.zero_unit import (MASTER_DTYPES, Fp8Unit, OwnerBalance, _compiled_without_grad, cast_unit_from_masters,
                           materialize_packed, packed_updates, unit_square_sum, unit_update)
from fp8.zero_weights import Fp8Weights
from model.compile import enabled as compile_enabled
from parallel import comm
from parallel.mesh import Mesh
from parallel.optim_rules import COMPUTE_DTYPES, grad_factor, unscaled_norm
from parallel.zero.sharded import Working, ZeroDataParallel


class Fp8DataParallel(Fp8Weights, Fp8Checkpointing, ZeroDataParallel):
    def __init__(self, cfg: Config, mesh: Mesh, chunks: Sequence[nn.Module], names: Dict[nn.Parameter, str]):
        f, z = cfg.fp8, cfg.zero
        assert not (cfg.model.tie_embeddings and mesh.layout.pp > 1), "refused by validate_config"
        self.cfg, self.mesh, self.stage = cfg, mesh, z.stage
        self.compute_dtype = COMPUTE_DTYPES[compute_precision(cfg)]
        self.grad_fmt = FORMATS[f.gradient_format]
        self.working = Working()
        self.qwz = self.qgz = None
        self.weight_delta = False  # (qWD needs qwZ, which FP8-LM replaces)
        self.hpz = mesh.hpz_group(z.hpz_size) if z.hpz_size > 1 else None
        self.sampling = False
        self.autoscale = AutoScale(f.mu_initial, f.mu_overflow_threshold, f.mu_growth_interval)
        self.mu_record: Dict[str, float] = {}
        self._cast_mu = self.autoscale.mu
        self._overflow = torch.zeros(2, dtype=torch.float64, device=mesh.device)  # overflowing, counted elements
        master_dtype = MASTER_DTYPES[f.master_dtype]
        owners: Dict[int, OwnerBalance] = {}  # per group size: DP's, and the expert units' (dp / ep ranks)
        self.packed = packed_updates(mesh.device)
        # train.compile: a unit's whole-unit operations (gradient cast, dequantizations, the AdamW update) compiled,
        # each into a few fused kernels (one graph per kind of unit: embedding, block, final norm)
        # (eager below compute capability 8.9: Triton has no E4M3 type there, fp8/device.py)
        compiled = compile_enabled(cfg, mesh.device) and self.packed and triton_has_e4m3(mesh.device)
        jit = _compiled_without_grad if compiled else (lambda fn: fn)
        self._cast, self._reduce_one = jit(cast_gradients), jit(reduce_one_rank)
        self._unit_update, self._square_sum, self._materialize_packed = (jit(unit_update), jit(unit_square_sum),
                                                                          jit(materialize_packed))
        # packed: the step's scalars as fp32 device tensors, filled once a step (unit_update)
        self._factor_t = torch.ones((), dtype=torch.float32, device=mesh.device)
        self._scalars = torch.zeros(3, dtype=torch.float32, device=mesh.device)
        acc_dtype = COMPUTE_DTYPES[grad_accumulation_precision(cfg)]
        # stage 0: the weights only FP8 GEMMs read keep no 16-bit working copy; their layers' E4M3 operands are cast
        # from the masters (_weight_source)
        sourced = fp8_only_weights(chunks) if self.stage == 0 else {}
        # (eager: ScaleState.cast of the value; compiled with the bf16 rounding kept, or the bytes would differ)
        self._cast_unit = _compiled_without_grad(cast_unit_from_masters, exact_casts=True) if compiled else None
        self._build_units(chunks, lambda spec: Fp8Unit(spec, owners, names, mesh, self.stage, master_dtype,
                                                       self.working, z.hpz_size, self.packed, acc_dtype,
                                                       self.compute_dtype, [p for p in spec.params if p in sourced]))
        # each unit's one-piece sourced layers (their copies made together: make_weight_copies), then the others
        self._copy_others: List[Fp8States] = []
        by_unit: Dict[int, List[Tuple[Fp8States, int]]] = {}
        for module in {id(m): m for m, _ in sourced.values()}.values():
            pieces = [self._where[p] for p in module.fp8_weight_params()]
            module.fp8_states.weight_source = self._weight_source(module.fp8_states, pieces)
            if len(pieces) == 1:
                by_unit.setdefault(id(pieces[0][0]), []).append((module.fp8_states, pieces[0][1]))
            else:
                self._copy_others.append(module.fp8_states)
        self._copy_groups: List[Tuple[Fp8Unit, List[Tuple[Fp8States, int]]]] = [
            (u, sorted(by_unit[id(u)], key=lambda e: e[1])) for u in self.units if id(u) in by_unit]
        self._factor = 1.0
        self.optimizer_steps = 0
        self._staging: Optional[List[Dict[str, torch.Tensor]]] = None
        self._refresh_weights()
        self._register_gather_hooks(chunks)

    # -- gradients ----------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for u in self.units:
            u.arrived, u.reduced = 0, False
        self._syncing = [False] * len(self.chunk_units)

    def _on_grad(self, p: nn.Parameter) -> None:
        unit, i = self._where[p]
        unit.grad_view(i).add_(p.grad)
        p.grad = None
        unit.arrived += 1
        if unit.arrived < len(unit.params):
            return
        unit.arrived = 0
        self._release(unit)
        if self._syncing[self._chunk_of[id(unit)]]:
            self._reduce(unit)

    @torch.no_grad()
    def _reduce(self, unit: Fp8Unit) -> None:
        """Cast the unit's accumulated gradients to FP8 (g' = mu g) and reduce them over DP (FP8-LM §2.1); routed
        experts split over EP over their expert-data-parallel group (``unit.group``), still as a mean over the whole
        DP group: each EP rank's expert gradients hold the contributions of its EP group's tokens, so their sum over
        the group is divided by the DP size, not the group's (the result's scale ``N s'_g`` times dp / N)."""
        unit.reduced = True
        self._cast_mu = self.autoscale.mu
        if unit.grad_acc is None:  # no gradient reached this unit: zeros, reduced like any other
            unit.grad_view(0)
        self.working.sub(unit.grad_acc.numel() * unit.grad_acc.element_size())
        acc = unit.grad_acc  # (16-bit sums are read as fp32 by the cast)
        if unit.sp and self.mesh.tp.size > 1:  # each TP rank normalised only its sequence slice: sum over TP
            acc = acc.float()  # (in fp32: a copy of 16-bit sums)
            pieces = [acc[unit.compact[i][0]:unit.compact[i][1]] for i in unit.sp]
            flat = torch.cat(pieces)
            comm.all_reduce(flat, self.mesh.tp)
            torch._foreach_copy_(pieces, list(flat.split([t.numel() for t in pieces])))
        # every tensor cast with its own scale in a few whole-unit kernels (counts stay on the device: no syncs)
        q, scales, saturated = self._cast(acc, unit.packing()["compact"], self.autoscale.mu, self.grad_fmt,
                                          self.cfg.fp8.margin, self.cfg.fp8.power_of_two_scales)
        back_to_back = list(unit.compact) == list(unit.bounds)  # stage 0's flat layout: tensors from 0 on
        if back_to_back and unit.layout.padded_size == unit.numel:
            data = q  # (no padding: one DP rank) the cast is the layout
        else:
            data = torch.zeros(unit.layout.padded_size, dtype=self.grad_fmt, device=acc.device)
            spans = [((0, unit.numel), (0, unit.numel))] if back_to_back else zip(unit.compact, unit.bounds)
            for (a, b), (lo, hi) in spans:
                data[lo:hi] = q[a:b]
        unit.grad_acc = None
        unit.grad_views = None
        del acc
        group = unit.group
        if self.stage == 0 and group.size == 1:  # one rank: no exchange, the same bits (grad_comm.reduce_one_rank)
            segments, _, position = _segments(_key(unit.bounds), 0, data.numel(), data.device)
            out, result_scale, overflow = self._reduce_one(data, scales, segments, position)
            numel = sum(b - a for a, b in unit.bounds)
            unit.grad8.copy_(out.view(torch.uint8)[:unit.extent])
        elif self.stage == 0:  # every rank keeps the whole reduced gradient (flat layout: bounds == where)
            out, result_scale, overflow, numel = _all_reduce_fp8(data, scales, unit.bounds, group)
            unit.grad8.copy_(out.view(torch.uint8)[:unit.extent])
        else:  # this rank keeps its owned tensors' sums, cast back to FP8 (data in the scale N s'_g convention)
            res = _reduce_scatter_fp8(data, scales, unit.bounds, group)
            base = unit.rank * unit.S
            for i in unit.owned:
                a, b = unit.where[i]
                lo, hi = unit.bounds[i]
                unit.grad8[a:b] = quantize(res.sum[lo - base:hi - base], 1.0, self.grad_fmt).view(torch.uint8)
            result_scale, overflow, numel = res.result_scale, res.overflow, res.numel
        if group.size != self.mesh.dp.size:  # an expert unit: the mean over DP (exact: scales times a whole number)
            result_scale = result_scale * (self.mesh.dp.size // group.size)
        unit.grad_scale.copy_(result_scale)
        self._overflow[0] += overflow + saturated
        self._overflow[1] += numel

    def finish_grads(self) -> None:
        for u in self.units:
            if not u.reduced:  # a unit that got no gradient hook on the last backward
                self._reduce(u)

    @staticmethod
    def _owned_scales(u: Fp8Unit, scales: torch.Tensor) -> torch.Tensor:
        """The owned tensors' entries of a unit's [T] scales: the tensor itself where the rank owns them all, in
        order (stage 0; updated in place then), else a copy."""
        pk = u.packing()
        return scales if pk["all_owned"] else scales[pk["index"]]

    def _grad(self, u: Fp8Unit, i: int) -> torch.Tensor:
        """The DP mean of mu * g for owned tensor i, fp32."""
        a, b = u.where[i]
        return dequantize(u.grad8[a:b].view(self.grad_fmt), u.grad_scale[i])

    # -- optimizer --------------------------------------------------------------------------------
    def norm_terms(self) -> torch.Tensor:
        """This rank's addends to the step's world sum (float64, ``Engine.train_step``): the squared norm of the
        reduced gradients it owns (stage 0: on the first rank of each unit's group only, every rank of the group
        holding every gradient), then the overflow counts (overflowing or saturated elements, elements counted)
        since the last step."""
        sq = torch.zeros(1, dtype=torch.float32, device=self.mesh.device)
        for u in self.units:  # packed: the per-tensor sums of squares of a whole unit at once
            if self.stage == 0 and u.group.rank != 0:
                continue
            if not u.packed:
                for i in u.owned:
                    if u.in_norm[i]:
                        sq += self._grad(u, i).square().sum()
            elif u.owned:
                pk = u.packing()
                sq += self._square_sum(u.grad8[:u.extent].view(self.grad_fmt), self._owned_scales(u, u.grad_scale),
                                       pk["owned"], pk["in_norm"])
        terms = torch.cat([sq.double(), self._overflow])
        self._overflow.zero_()
        return terms

    def clip(self, loss_scale: float, max_norm: float, terms: torch.Tensor) -> Tuple[float, bool]:
        """Global norm of the reduced gradients, given ``norm_terms`` summed over the world; then mu follows the
        overflow count.

        The reduced gradients hold ``mu * S * g`` (S the fp16 loss scale, 1 in bf16): the backward's 16-bit
        gradients carry S, the FP8 cast multiplies them by mu. Both leave together, in the factor the FP8 AdamW
        multiplies the dequantized gradient by (``1 / (mu S)``, times the clipping factor of the norm so unscaled).
        A non-finite norm skips the step. Under fp16 compute (``fp8.gemm=fp16``) that is the fp16 backward's
        overflow, which the loss scaler answers (the engine halves S): mu did not cause it (``mu * g`` is cast
        saturating and the FP8 sums are finite), so mu and its clean-step count hold. In bf16 a non-finite
        gradient counts as a full overflow and halves mu, as before. A finite step's saturated elements move mu
        (halved above ``fp8.mu_overflow_threshold``) and the step is taken: saturation clips, it does not skip."""
        sq, overflowing, counted = terms.tolist()
        mu = self.autoscale.mu
        norm = unscaled_norm(sq, loss_scale * mu)
        finite = math.isfinite(norm)
        if finite or self.compute_dtype != torch.float16:
            overflow = overflowing if finite else counted
            self.autoscale.update(int(overflow), max(int(counted), 1))
        self.mu_record = {"mu": mu, "overflow_fraction": self.autoscale.last_fraction,
                          "mu_changes": self.autoscale.changes}
        if not finite:
            return norm, False
        self._factor = grad_factor(norm, loss_scale * mu, max_norm)
        return norm, True

    @torch.no_grad()
    def step(self, lr: float) -> None:
        t = self.cfg.train
        self.optimizer_steps += 1
        if self.packed:  # the step's scalars, formed once in float64 (as the per-tensor update does), kept in fp32
            step_size, bc2_sqrt = adam.bias_corrections(self.optimizer_steps, lr, t.beta1, t.beta2)
            for i, x in enumerate((step_size, bc2_sqrt, 1.0 - lr * t.weight_decay)):
                self._scalars[i].fill_(x)  # fills, not a host-to-device copy (which may wait for the device)
            self._factor_t.fill_(self._factor)
        for u in self.units:  # packed: every owned tensor of a unit in one update (fp8/adam.adamw_update_segments)
            if not u.packed:
                for i in u.owned:
                    a, b = u.where[i]
                    adam.adamw_update(u.master[a:b], u.master_scale[i], u.m[a:b], u.m_scale[i], u.v[a:b],
                                      u.v_scale[i], self._grad(u, i) * self._factor, step=self.optimizer_steps,
                                      lr=lr, beta1=t.beta1, beta2=t.beta2, eps=t.eps,
                                      weight_decay=t.weight_decay if u.decay[i] else 0.0)
                continue
            if not u.owned:
                continue
            pk = u.packing()
            scales = [self._owned_scales(u, x) for x in (u.master_scale, u.m_scale, u.v_scale)]
            self._unit_update(u.grad8[:u.extent].view(self.grad_fmt), self._owned_scales(u, u.grad_scale),
                              self._factor_t, u.master, scales[0], u.m, scales[1], u.v, scales[2], pk["owned"],
                              pk["decay"], self._scalars, beta1=t.beta1, beta2=t.beta2, eps=t.eps)
            if not pk["all_owned"]:  # updated copies of the owned entries: back into the unit's scales
                for dst, src in zip((u.master_scale, u.m_scale, u.v_scale), scales):
                    dst.index_copy_(0, pk["index"], src)
        self._refresh_weights()

    # -- observability ----------------------------------------------------------------------------
    def quant_error(self) -> Dict[str, Optional[float]]:
        return {"weights": None, "gradients": None}

    def fp8_record(self) -> Dict[str, float]:
        """mu, the overflow fraction that decided its next value, and how often it changed (FP8-LM §2.1)."""
        return dict(self.mu_record)

    def unsharded_grads(self) -> Dict[str, torch.Tensor]:
        """Every parameter's reduced gradient (DP mean, mu removed), gathered over each unit's group (DP, or an
        expert unit's expert-data-parallel group): a collective, for tests."""
        out = {}
        mu = self._cast_mu  # the mu this step's gradients were cast with (clip may have moved it since)
        for u in self.units:
            full = torch.zeros(u.numel, dtype=torch.float32, device=u.master.device)
            for i in u.owned:
                a, b = u.compact[i]
                full[a:b] = self._grad(u, i) / mu
            if self.stage > 0:
                comm.all_reduce(full, u.group)
            for name, p, (a, b) in zip(u.names, u.params, u.compact):
                out[name] = full[a:b].view(p.shape)
        return out

    # -- accounting ---------------------------------------------------------------------------------
    def memory(self) -> Dict[str, int]:
        """Bytes this rank holds now, by component (scales included)."""
        def nbytes(*ts: Optional[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        params = sum(nbytes(u.master, u.master_scale) for u in self.units)
        weights = sum(nbytes(u.w8, u.w8_scale, u.secondary, u.secondary_scale) for u in self.units)
        grads = sum(nbytes(u.grad8, u.grad_scale) for u in self.units)
        optim = sum(nbytes(u.m, u.m_scale, u.v, u.v_scale) for u in self.units)
        # "parameters" is the master copy: with gradients and optimizer, FP8-LM's 6 bytes a parameter;
        # "fp8_weights" the E4M3 compute copy kept between steps (stages 1-3; none at stage 0)
        return {"parameters": params, "gradients": grads, "optimizer": optim, "fp8_weights": weights,
                "working_peak": self.working.peak}
