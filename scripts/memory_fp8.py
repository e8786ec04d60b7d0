"""Measured model-state bytes a parameter, FP8-LM against bf16 AdamW (FP8-LM §2.2).

    python scripts/memory_fp8.py [--world 4] [--steps 2] [key=value ...]

Each row builds the real engine on local gloo processes, trains ``--steps`` steps
of the tiny default model (d_model 128, 4 layers: 1.9M parameters) on synthetic
data, and reads what the DP strategy holds (``memory()``: the buffers themselves,
scales and padding included) on every rank. Printed per row: bytes per rank per
parameter *of the model* (Phi, all ranks' parameters counted once), by
component, for one rank and for ``--world`` DP ranks with ZeRO-1, and the sum
over the DP ranks (what the job holds per parameter).

  bf16   zero.stage=0: fp32 parameters (autocast), fp32 gradients, AdamW m, v fp32 = 16
         zero.stage=1: bf16 parameters and gradients whole, fp32 master, m, v sharded
  fp8    master FP16 + scale, FP8 gradients, E4M3 m, FP16 v (6 a parameter on one rank);
         ZeRO-1 shards those by whole tensors and keeps an E4M3 copy of the weights for the next
         forward (1 a parameter on every rank; its own column, as bf16 ZeRO-1's bf16 weights are
         its "parameters")
  fp8 with bf16 / fp16 GEMMs (fp8.gemm: an A100's and a V100's path) hold the same model state: only the
         GEMMs' operands differ (the 16-bit working weights instead of their E4M3 casts)
The transient working buffers (bf16 weights materialised per module, gradient accumulation) are
reported separately as the peak, not in the model state.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from config import validate_config  # noqa: E402
from parallel.layout import make_layout  # noqa: E402
from scripts._cli import at_least, load_config  # noqa: E402

MODEL = ["model.d_model=128", "model.n_heads=4", "model.ffn_hidden=384", "model.vocab_size=4096",
         "model.seq_len=64", "train.micro_batch_size=2"]
STATE = ("parameters", "gradients", "optimizer")


def worker(overrides, steps):
    from tests.parallel_utils import batch_fn, build_engine, tiny_config
    from training.memory import model_state_bytes

    cfg = tiny_config(*MODEL, *overrides)
    engine = build_engine(cfg)
    for step in range(steps):
        engine.train_step(batch_fn(engine, step))
    phi = sum(p.numel() for p in engine.params.values())  # this rank's share of the model (TP/PP split)
    estimated = model_state_bytes(engine.cfg, engine.mesh.layout, engine.mesh.rank)
    return {"memory": engine.dp.memory(), "phi": phi, "estimated": estimated}


PRECISIONS = {  # row label: its overrides
    "bf16": ["precision=bf16"],
    "fp8": ["precision=fp8", "fp8.gemm=fp8"],
    "fp8, bf16 GEMMs (A100)": ["precision=fp8", "fp8.gemm=bf16"],
    "fp8, fp16 GEMMs (V100)": ["precision=fp8", "fp8.gemm=fp16"],
}


def row_overrides(precision: str, world: int, stage: int, extra: list) -> list:
    return [*PRECISIONS[precision], f"zero.stage={stage}", f"train.global_batch_size={2 * world}", *extra]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    at_least(args.world, 1, "--world")
    at_least(args.steps, 1, "--steps")
    rows = [(p, world, stage) for world, stage in ((1, 0), (args.world, 1)) for p in PRECISIONS]
    load_config(None, [*MODEL, *args.overrides])  # bad overrides (syntax, keys, types) before torch: one line
    from tests.dist_harness import run_world
    from tests.parallel_utils import BASE

    for precision, world, stage in rows:  # and their combinations, before any rank starts
        cfg = load_config(None, [*BASE, *MODEL, *row_overrides(precision, world, stage, args.overrides)])
        validate_config(cfg)
        make_layout(cfg, world, world)
    print(f"tiny model, measured after {args.steps} steps; bytes per parameter of the model (Phi)\n")
    print("| precision | DP ranks | ZeRO | parameters (master) | gradients | optimizer | model state / rank (max) "
          "| estimated (training/memory.py) | sum over ranks | E4M3 weight copy / rank | working peak / rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for precision, world, stage in rows:
        over = row_overrides(precision, world, stage, args.overrides)
        out = run_world(worker, world, over, args.steps, timeout=600)
        phi = out[0]["phi"]  # pure DP: every rank's model is the whole model
        per = [{k: r["memory"][k] / phi for k in r["memory"]} for r in out]
        worst_rank = max(range(len(per)), key=lambda r: sum(per[r][k] for k in STATE))
        worst = per[worst_rank]
        estimated = sum(out[worst_rank]["estimated"][k] for k in STATE) / phi
        total = sum(sum(m[k] for k in STATE) for m in per)
        print(f"| {precision} | {world} | {stage} | " + " | ".join(f"{worst[k]:.2f}" for k in STATE)
              + f" | {sum(worst[k] for k in STATE):.2f} | {estimated:.2f} | {total:.2f} | "
                f"{worst.get('fp8_weights', 0):.2f} "
                f"| {worst['working_peak']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
