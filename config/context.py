"""Context parallelism's config checks (parallel.cp, parallel.cp_comm): what a config alone can refuse.

The checks that need the launch (cp dividing the world, the sequence-parallel split of each rank's chunks) are in
``parallel/layout.py make_layout``.
"""
from __future__ import annotations

from typing import Callable

from config.schema import Config


def validate_context(cfg: Config, need: Callable[[bool, str], None]) -> None:
    cp, m = cfg.parallel.cp, cfg.model
    need(cp >= 1, f"parallel.cp={cp} must be >= 1")
    if cp <= 1:
        return
    need(m.seq_len % (2 * cp) == 0,
         f"model.seq_len={m.seq_len} is not divisible by 2 x parallel.cp = {2 * cp} (context parallelism cuts each "
         f"sequence into 2 x cp chunks, two per rank)")
    need(m.attention_dropout == 0.0,
         f"model.attention_dropout={m.attention_dropout} with parallel.cp={cp} is not built (ring attention has no "
         "dropout): set model.attention_dropout=0")
    if cfg.parallel.cp_comm == "a2a":
        tp = max(cfg.parallel.tp, 1)
        heads = m.n_heads // tp if m.n_heads % tp == 0 else None  # (n_heads vs tp: refused by its own check)
        need(heads is None or heads % cp == 0,
             f"parallel.cp_comm=a2a with parallel.cp={cp}: model.n_heads={m.n_heads} / parallel.tp={tp} = {heads} "
             f"heads per TP rank do not divide into {cp} CP ranks (the all-to-all gives each CP rank heads / cp of "
             "them); use parallel.cp_comm=p2p or all_gather, or a cp that divides the heads")
    need(m.moe.num_experts == 0 or m.moe.capacity_factor is None,
         f"model.moe.capacity_factor={m.moe.capacity_factor} with parallel.cp={cp} is not built (a capacity keeps each "
         "expert's first token-slots in the sequence's order, which context parallelism splits between ranks in "
         "zigzag chunks): use a dropless MoE (model.moe.capacity_factor=null) or parallel.cp=1")
