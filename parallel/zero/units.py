"""ZeRO units: the groups of parameters that are gathered, reduced and stepped together.

One unit per module that runs as a whole: the token embedding, each transformer
block, the final norm and the output projection, in forward order. Every
parameter belongs to exactly one unit (nothing stays replicated by a size rule);
a parameter used by two modules (the output projection tied to the embedding on
one stage) belongs to the first, and the second module *uses* that unit too. Under
expert parallelism an MoE block's routed experts are a second unit of the block
(``layers.<i>.experts``), sharded over the expert-data-parallel group.

The tied output weight on the last pipeline stage is a copy of the embedding: it
is a unit of its own, as the embedding is, so both have the same shard layout and
their gradient shards can be summed element-wise over the embedding group.

``meta_chunks`` builds a rank's chunks on the meta device (shapes only, no
memory, no initialisation) for the memory estimator and the analytic volume.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from config import Config, fp8_operands
from model.gpt import GPTChunk, chunk_layers
from model.layers import TPContext
from parallel.comm import Group, Ledger
from parallel.layout import Layout, kv_replicas


@dataclass
class UnitSpec:
    name: str
    params: List[nn.Parameter]


@dataclass
class ModuleUse:
    module: nn.Module
    units: List[int] = field(default_factory=list)
    """Indices (into the chunk's unit list) of the units this module's forward needs."""
    backward_reads_weights: bool = True
    """Whether the module's backward needs its weights (not an embedding lookup's: its ``backward_reads_weights``
    class attribute says so): stage 3 gathers them again for backward only where it does."""


def chunk_units(chunk: nn.Module) -> tuple:
    """(units in forward order, module uses) of one model chunk."""
    modules = []
    if getattr(chunk, "first", False):
        modules.append(("embedding", chunk.embedding))
    modules += [(f"layers.{i}", block) for i, block in chunk.layers.items()]
    if getattr(chunk, "last", False):
        modules += [("final_norm", chunk.final_norm), ("head", chunk.head)]
    units: List[UnitSpec] = []
    uses: List[ModuleUse] = []
    owner = {}
    for name, module in modules:
        use = ModuleUse(module, backward_reads_weights=getattr(module, "backward_reads_weights", True))
        fresh = [p for p in module.parameters() if p.requires_grad and p not in owner]
        # routed experts split over expert parallelism shard over their own group: a unit of their own
        split = [getattr(p, "spec", None) is not None and p.spec.expert for p in fresh]
        dense = [p for p, e in zip(fresh, split) if not e]
        experts = [p for p, e in zip(fresh, split) if e]
        for part, label in ((dense, name), (experts, f"{name}.experts")):
            if part:
                for p in part:
                    owner[p] = len(units)
                units.append(UnitSpec(label, part))
        for p in module.parameters():
            if p.requires_grad and owner[p] not in use.units:
                use.units.append(owner[p])
        uses.append(use)
    return units, uses


_MEMO: Optional[Dict[tuple, Sequence[GPTChunk]]] = None
"""meta_chunks' results while ``memoised_meta`` is entered (None: off); at most ``_MEMO_MAX`` kept."""
_MEMO_MAX = 64


@contextlib.contextmanager
def memoised_meta(memo: Optional[Dict[tuple, Sequence[GPTChunk]]] = None):
    """Within it, ``meta_chunks`` returns the same chunks for the same model, precision and split (the planner
    estimates thousands of layouts of one model: building the modules dominated its time), kept in ``memo``
    (one that outlives the ``with``: the caller's) or a fresh dict. The callers only read the chunks' shapes and
    parameter order; nested use without a memo of its own shares the outer one."""
    global _MEMO
    outer = _MEMO
    _MEMO = memo if memo is not None else {} if outer is None else outer
    try:
        yield
    finally:
        _MEMO = outer


def meta_chunks(cfg: Config, layout: Layout, pp_rank: int) -> Sequence[GPTChunk]:
    """A pipeline rank's chunks with meta tensors: the real modules' shapes and parameter order, no data."""
    if _MEMO is None:
        return _build_meta_chunks(cfg, layout, pp_rank)
    # recomputation changes no shape or parameter: one entry serves off, selective and full
    key = (repr(dataclasses.replace(cfg.model, activation_checkpointing="off")), cfg.precision, repr(cfg.fp8),
           layout.tp, layout.sequence_parallel, layout.ep, layout.pp, layout.virtual_stages, pp_rank)
    if key not in _MEMO:
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.clear()
        _MEMO[key] = _build_meta_chunks(cfg, layout, pp_rank)
    return _MEMO[key]


def _build_meta_chunks(cfg: Config, layout: Layout, pp_rank: int) -> Sequence[GPTChunk]:
    tp = Group("tp", None, list(range(layout.tp)), 0, "intra", Ledger())
    replicas = kv_replicas(cfg.model.kv_heads, layout.tp)
    kv_group = Group("tp_kv", None, list(range(replicas)), 0, "intra", Ledger()) if replicas > 1 else None
    # FP8 linears where the run casts operands to FP8 (an unresolved fp8.gemm=auto counts as FP8 GEMMs)
    fp8 = cfg.fp8 if cfg.precision == "fp8" and fp8_operands(cfg.fp8) else None
    ep = Group("ep", None, list(range(layout.ep)), 0, "intra", Ledger())  # expert parallelism: the experts' share
    ctx = TPContext(tp, layout.sequence_parallel, rng=None, fp8=fp8, kv_group=kv_group,  # type: ignore[arg-type]
                    ep=ep)
    last_v = layout.pp * layout.virtual_stages - 1
    with torch.device("meta"):
        return [GPTChunk(cfg.model, ctx, layers, first=v == 0, last=v == last_v,
                         tied_copy=cfg.model.tie_embeddings and last_v > 0)
                for v, layers in chunk_layers(cfg.model, layout.pp, layout.virtual_stages, pp_rank)]
