"""The trainer's side of the mixture-of-experts layers (``model/moe.py``): once per optimizer step.

Before the step's forwards, each MoE layer learns the factor its balancing losses' backward uses (the LM loss's:
loss scale / micro-batches). After the backwards, the layers' step sums (token-slots per expert, dropped slots,
auxiliary and z losses, forwards) and their expert-bias ranges travel in the engine's one all-reduce of the step's
scalars (float64: counts are exact to 2**53), as a vector with a fixed place for every MoE layer of the model, so
every rank learns every layer's global figures whichever pipeline stage holds it. Then the aux-loss-free bias of
each layer moves by the global load (``MoE.update_bias``: identical on every rank that holds the layer, so the
replicas never drift) and the step's metrics record is built.

Only ranks with TP rank 0 add the sums (TP ranks route the same tokens), except under sequence parallelism, where
each TP rank routes its own slice of the sequence and adds its own (the auxiliary and z losses are then the
slices' parts of the sequence's, ``model/moe.py Router``); only DP rank 0 of them adds the bias range (every DP
rank holds the same bias).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch
from torch import nn

from config import Config
from config.moe import is_moe_layer
from model.moe import MoE
from parallel.mesh import Mesh

_SUMS = ("dropped", "aux", "z", "forwards", "bias_min", "bias_max")
"""After a layer's ``num_experts`` loads, its other places in the vector."""


class MoeTracker:
    """The MoE layers of this rank's chunks, and their per-step bookkeeping (a no-op for a dense model)."""

    def __init__(self, cfg: Config, mesh: Mesh, chunks: Sequence[nn.Module]):
        moe = cfg.model.moe
        self.num_experts = moe.num_experts
        self.layer_ids: List[int] = [i for i in range(cfg.model.n_layers) if is_moe_layer(moe, i)]
        self.modules: Dict[int, MoE] = {}
        self.buffers: Dict[str, torch.Tensor] = {}
        for chunk in chunks:
            for name, module in chunk.named_modules():
                if isinstance(module, MoE):
                    self.modules[int(name.split(".")[1])] = module  # layers.<i>.mlp
                    self.buffers[f"{name}.router.expert_bias"] = module.router.expert_bias
        # under sequence parallelism each TP rank routes its own slice: all add their sums, one counts the forward
        self.adds_sums = mesh.tp_rank == 0 or mesh.sequence_parallel
        self.adds_forwards = mesh.tp_rank == 0
        self.adds_bias = mesh.tp_rank == 0 and mesh.dp_rank == 0
        self.device = mesh.device
        self.width = self.num_experts + len(_SUMS)

    def __bool__(self) -> bool:
        return bool(self.layer_ids)

    def set_scale(self, scale: float) -> None:
        """The factor of the balancing losses' backward this step (the LM loss's: loss scale / micro-batches)."""
        for m in self.modules.values():
            m.aux_scale.fill_(scale)

    def terms(self) -> torch.Tensor:
        """This rank's addend to the step's all-reduce: ``[layers x (E + 6)]`` float64 (empty for a dense model)."""
        out = torch.zeros(len(self.layer_ids), self.width, dtype=torch.float64, device=self.device)
        for row, layer in enumerate(self.layer_ids):
            m = self.modules.get(layer)
            if m is None:
                continue
            if self.adds_sums:
                out[row, :self.num_experts] = m.load.double()
                forwards = m.forwards.double() if self.adds_forwards else torch.zeros_like(m.aux_sum)
                out[row, self.num_experts:self.num_experts + 4] = torch.stack(
                    [m.dropped_slots.double(), m.aux_sum, m.z_sum, forwards])
            if self.adds_bias:
                bias = m.router.expert_bias.double()
                out[row, -2:] = torch.stack([bias.min(), bias.max()])
        return out.flatten()

    @torch.no_grad()
    def after_step(self, totals: torch.Tensor, taken: bool) -> Dict[str, Any]:
        """``totals``: the all-reduced ``terms``. Moves the held layers' expert biases by the global load when the
        step was taken (a skipped step changes nothing), resets the step's sums, and returns the metrics record:
        per layer the max / mean token-slots per expert, the dropped fraction of the slots, the mean auxiliary and
        z losses (unweighted) and the expert-bias range this step routed with."""
        rows = totals.view(len(self.layer_ids), self.width)
        for row, layer in enumerate(self.layer_ids):
            m = self.modules.get(layer)
            if m is None:
                continue
            if taken:
                m.update_bias(rows[row, :self.num_experts])
            else:
                m.reset_stats()
        record: Dict[str, Any] = {}
        for row, layer in enumerate(self.layer_ids):
            load = rows[row, :self.num_experts]
            dropped, aux, z, forwards, bias_min, bias_max = rows[row, self.num_experts:].tolist()
            slots = load.sum().item()
            record[str(layer)] = {
                "load_max_over_mean": load.max().item() / load.mean().item() if slots else None,
                "dropped_frac": dropped / slots if slots else 0.0,
                "aux_loss": aux / forwards if forwards else None,
                "z_loss": z / forwards if forwards else None,
                "bias_min": bias_min, "bias_max": bias_max}
        loads = [r["load_max_over_mean"] for r in record.values() if r["load_max_over_mean"] is not None]
        return {"load_max_over_mean": max(loads) if loads else None,
                "dropped_frac": max(r["dropped_frac"] for r in record.values()), "layers": record}
