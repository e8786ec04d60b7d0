"""One unit's buffers on this rank (``Unit``) and the bytes of transient buffers alive (``Working``).

``sharded.py``'s module docstring says what each ZeRO stage keeps in them between steps; its ``ZeroDataParallel``
(and the mixins beside it) use them, and it re-exports both names. Apart from sharded.py so that the mixins
(``gathers.py``, ``early_step.py``) can name ``Unit`` without an import cycle.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from parallel.mesh import Mesh
from parallel.optim_rules import owns_gradient, weight_decay_exempt
from parallel.zero.partition import ShardLayout, shard_layout
from parallel.zero.units import UnitSpec

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
    """One unit's buffers on this rank; see ``sharded.py``'s module docstring for what each stage keeps."""

    def __init__(self, spec: UnitSpec, names: Dict[nn.Parameter, str], mesh: Mesh, stage: int, kind: str,
                 compute: torch.dtype, reduce: torch.dtype, working: Working, tied: bool, hpz: int = 1,
                 quantized_gather: bool = False, weight_delta: bool = False, adam: bool = True):
        self.name, self.params, self.stage, self.working, self.tied = spec.name, spec.params, stage, working, tied
        self.names = [names[p] for p in self.params]
        # the ranks this unit is sharded over: DP, or for routed experts split over EP their expert-data-parallel
        # group (the DP ranks holding the same experts); gradients are divided by the whole DP size either way
        self.expert = any(p.spec.expert for p in self.params)
        self.group = dp = mesh.edp if self.expert else mesh.dp
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
        # AdamW's moments; another train.optimizer keeps its states per owned tensor (``rules``, set by the strategy)
        self.exp_avg = torch.zeros(s if adam else 0, dtype=torch.float32, device=mesh.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.rules = None  # optimizers.tensor_rules.TensorRules of the tensors this rank owns (whole_tensor)
        self.rule_at: List[Tuple[int, int]] = []  # (tensor index, start in the shard) of each of its entries
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
