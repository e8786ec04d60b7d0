"""Memory per rank, estimated from the config alone: model states by ZeRO stage, and activations.

Model states follow ZeRO's accounting with this code's buffers (per unit of
``parallel/zero/units.py``, S its padded shard, N the DP size, e_c / e_r the
compute / reduce dtype bytes; Phi = the rank's parameters)::

  stage 0   parameters 4 Phi (fp32 master used under autocast), gradients 4 Phi, AdamW m and v 8 Phi  = 16 Phi
  stage 1   parameters N S e_c, gradients N S e_r, optimizer (4 + 4 + 4) S                 ~ 2 + 2 + 12/N
  stage 2   parameters N S e_c, gradients S e_r, optimizer 12 S                             ~ 2 + 14/N
  stage 3   parameters S e_c, gradients S e_r, optimizer 12 S, plus the gathered working set ~ 16/N + working

In fp32 the master copy is the parameter buffer itself, so the optimizer holds
8 S. The stage-3 working set is what is gathered at once: two adjacent units'
parameters (the current one and the prefetched one) plus two adjacent units'
full gradients (the one filling and the one being reduce-scattered); stage 2
holds two full unit gradients during backward, or every unit's while
gradients accumulate over several micro-batches.

Activations (seed 004 §memory, 16-bit): with a checkpoint every ``ci`` blocks,
the checkpoints take 2 * b * s * h * layers / ci bytes per micro-batch in flight
and recomputing one segment needs b * s * ci * (16 h + 2 heads s). Without
recomputation, Megatron's per-layer figure s b h (34 + 5 heads s / h) (divided
by t under SP, its TP form otherwise).
"""
from __future__ import annotations

from typing import Dict, List

from parallel.layout import Layout
from parallel.zero.partition import shard_layout
from parallel.zero.units import chunk_units, meta_chunks
from training.config import Config

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
COMPONENTS = ("parameters", "gradients", "optimizer", "working_peak")


def model_state_bytes(cfg: Config, layout: Layout, rank: int = 0) -> Dict[str, int]:
    """Estimated model-state bytes held by ``rank``, by component (see the module docstring)."""
    z = cfg.zero
    pp_rank = layout.coords(rank)[0]
    chunks = meta_chunks(cfg, layout, pp_rank)
    if z.stage == 0:
        phi = sum(p.numel() for c in chunks for p in c.parameters())
        return {"parameters": 4 * phi, "gradients": 4 * phi, "optimizer": 8 * phi, "working_peak": 0}
    e_c = BYTES[cfg.precision]
    e_r = e_c if z.reduce_dtype == "compute" else 4
    master = 0 if cfg.precision == "fp32" else 4
    n = layout.dp
    out = dict.fromkeys(COMPONENTS, 0)
    pairs_p: List[int] = [0]
    pairs_g: List[int] = [0]
    all_full_grads = 0
    for chunk in chunks:
        shards = [shard_layout([p.numel() for p in u.params], n, z.partition).shard_size
                  for u in chunk_units(chunk)[0]]
        for s in shards:
            out["parameters"] += (n * s if z.stage < 3 else s) * e_c
            out["gradients"] += (n * s if z.stage == 1 else s) * e_r
            out["optimizer"] += (master + 8) * s
            all_full_grads += n * s * e_r
        sizes = shards + [0] if len(shards) == 1 else shards
        pairs_p += [n * (a + b) * e_c for a, b in zip(sizes, sizes[1:])]
        pairs_g += [n * (a + b) * e_r for a, b in zip(sizes, sizes[1:])]
    if z.stage == 3:
        out["working_peak"] = max(pairs_p) + max(pairs_g)
    elif z.stage == 2:
        out["working_peak"] = all_full_grads if layout.num_microbatches > 1 else max(pairs_g)
    return out


def activation_bytes(cfg: Config, layout: Layout, rank: int = 0) -> Dict[str, int]:
    """Seed 004's activation estimate for this rank (16-bit activations, 1F1B in-flight micro-batches)."""
    m, b = cfg.model, cfg.train.micro_batch_size
    s, h, a, t = m.seq_len, m.d_model, m.n_heads, layout.tp
    pp_rank = layout.coords(rank)[0]
    layers = m.n_layers // layout.pp
    in_flight = min(layout.pp - pp_rank, layout.num_microbatches) if layout.pp > 1 else 1
    if m.activation_checkpointing == "full":
        ci = 1
        checkpoints = 2 * b * s * h * layers // ci // (t if layout.sequence_parallel else 1)
        working = b * s * ci * (16 * h + 2 * a * s) // t
        return {"checkpoints": checkpoints * in_flight, "recompute_working": working}
    if layout.sequence_parallel:
        per_layer = s * b * h * (34 + 5 * a * s / h) / t
    else:
        per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    return {"stored": int(per_layer * layers * in_flight), "recompute_working": 0}
