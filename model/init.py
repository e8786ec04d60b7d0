"""Initialisation as a pure function of (seed, parameter name, global shape).

Each parameter draws its *global* tensor from its own generator, seeded by the
seed and its global name, then keeps this rank's TP slice. So a pipeline stage,
a TP shard or a single process all hold exactly the values of the single-process
model, whatever the layout, and no rank depends on the order in which others
built their layers. (Cost: a TP rank draws whole matrices and slices them, a
one-off at start-up.) Output projections of residual branches use the scaled
std set by their layer (Megatron's init).
"""
from __future__ import annotations

import torch
from torch import nn

from parallel.random import derive_seed


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, tp_rank: int, tp_size: int, ep_rank: int = 0) -> None:
    """Every parameter of ``module`` as the single-process model's, sliced to this rank's TP piece and, for routed
    experts split over expert parallelism (``ParamSpec.ep_size``), its EP rank's experts."""
    for name, p in module.named_parameters():
        spec = p.spec
        if spec.init == "ones":
            full = torch.ones(spec.global_shape)
        elif spec.init == "zeros":
            full = torch.zeros(spec.global_shape)
        else:
            g = torch.Generator().manual_seed(derive_seed(seed, "init", spec.shared_with or name))
            full = torch.empty(spec.global_shape).normal_(0.0, spec.std, generator=g)
        if spec.tp_dim is not None:  # this rank's piece (several TP ranks may hold the same one)
            full = full.chunk(spec.tp_pieces(tp_size), dim=spec.tp_dim)[spec.tp_piece(tp_rank)]
        if spec.expert:
            full = full.chunk(spec.ep_size, dim=0)[ep_rank]
        p.copy_(full)
