"""Estimate per-rank memory of a config for ZeRO stages 0-3: model states by component, and activations.

    python scripts/estimate_memory.py --config configs/gpt_7b.yaml --world 32 [key=value ...]

The layout comes from the config (parallel.tp/pp/...) and ``--world``; the
figures are those of ``training/memory.py``, for the first rank of the first and
of the last pipeline stage. The trainer logs the measured figures at its first
step (``model_state_bytes`` in metrics.jsonl), to compare with. For a mixture of
experts, a rank holds num_experts / parallel.ep of each MoE layer's routed experts
(Phi counts those), sharded over the dp / ep ranks holding the same experts. With context parallelism
(parallel.cp) a rank's activations are those of its seq_len / cp tokens, and the attention keeps no s x s scores.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from config import validate_config  # noqa: E402
from scripts._cli import load_config  # noqa: E402
from parallel.layout import make_layout  # noqa: E402


def gib(n: float) -> str:
    return f"{n / 2**30:9.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config")
    ap.add_argument("--world", type=int, required=True, help="number of ranks (GPUs)")
    ap.add_argument("--ranks-per-node", type=int, default=None, help="default: parallel.ranks_per_node or 8")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.world < 1:
        ap.error(f"--world must be at least 1 (the number of ranks), got {args.world}")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        ap.error(f"--ranks-per-node must be at least 1, got {args.ranks_per_node}")
    cfg = load_config(args.config, args.overrides)  # --config as train.py reads it; ConfigError: one line, exit 2
    validate_config(cfg)
    layout = make_layout(cfg, args.world, args.ranks_per_node or cfg.parallel.ranks_per_node or 8)
    from model.flops import parameter_count  # torch and the model: after the input is checked
    from training.memory import (COMPONENTS, activation_bytes, checkpoint_staging_bytes, held_parameters,
                                 model_state_bytes)
    whole = cfg.train.optimizer != "adamw"  # its ZeRO stages need whole-tensor shards (config/optimizer.py)
    partition = "whole_tensor at stages 1-3" if whole else cfg.zero.partition
    print(f"{layout.describe()}\nprecision={cfg.precision}, train.optimizer={cfg.train.optimizer}, "
          f"zero.partition={partition}, zero.reduce_dtype={cfg.zero.reduce_dtype}; GiB per rank")
    moe = cfg.model.moe
    if moe.num_experts:
        counts = parameter_count(cfg.model)
        print(f"mixture of experts: {moe.num_experts} routed experts, top-{moe.top_k}, parallel.ep={layout.ep}; "
              f"{counts['total'] / 1e9:.2f}B parameters, {counts['active'] / 1e9:.2f}B active per token")
    last = layout.rank_of(layout.pp - 1, 0, 0)
    for rank in sorted({0, last}):
        pp_rank = layout.coords(rank)[0]
        phi = held_parameters(cfg, layout, rank)
        print(f"\nrank {rank} (pipeline stage {pp_rank}): {phi / 1e6:.1f}M parameters held (Phi)")
        print(f"{'':8} " + " ".join(f"{c:>12}" for c in COMPONENTS) + f" {'total':>10} {'bytes/Phi':>10}")
        for stage in range(4):
            kind = "whole_tensor" if whole and stage else cfg.zero.partition
            c = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, stage=stage, partition=kind))
            est = model_state_bytes(c, layout, rank)
            total = sum(est.values())
            print(f"stage {stage}  " + " ".join(f"{gib(est[k]):>12}" for k in COMPONENTS)
                  + f" {gib(total):>10} {total / phi:10.2f}")
        act = activation_bytes(cfg, layout, rank)
        cp = (f"; cp {layout.cp}: {cfg.model.seq_len // layout.cp} tokens of each sequence, no s x s scores"
              if layout.cp > 1 else "")
        print(f"activations (seed 004, per rank, micro-batches in flight{cp}): "
              + ", ".join(f"{k} {gib(v).strip()} GiB" for k, v in act.items()))
        if cfg.checkpoint.async_save:
            print(f"checkpoint.async_save staging copy (host memory, zero.stage={cfg.zero.stage}): "
                  f"{gib(checkpoint_staging_bytes(cfg, layout, rank)).strip()} GiB")
    return 0


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
