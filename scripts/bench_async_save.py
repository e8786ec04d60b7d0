"""Synchronous vs asynchronous checkpoints (checkpoint.async_save): the training loop's stall per save, and the step
time while a write is in flight against the normal one.

    python scripts/bench_async_save.py [--world 2] [--saves 3] [key=value ...]

Each rank (local gloo processes) builds the engine of a GPT of 162M parameters (12 layers, d_model 768,
vocabulary 32000 untied, AdamW state: 1.95 GB of checkpoint), takes two warm-up steps, then per mode saves ``--saves``
times through ``training/async_checkpoint.py``'s Saver, the trainer's own: a normal step, the save (its stall: the
time ``Saver.save`` holds the loop: the whole write when synchronous; the CPU copy when asynchronous), then steps
until the write is published (each such step is a step with a write in flight); before each save, 2 steps with no
write in flight. Times are rank 0's medians; both modes run in the same processes, one after the other, and the
normal step of the last line is the median of both modes' steps with no write in flight. Checkpoints go to a temporary directory
(``--dir`` to choose one: the disk matters).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._cli import at_least, load_config, output_dir  # noqa: E402

MODEL = ["model.n_layers=12", "model.d_model=768", "model.n_heads=12", "model.seq_len=128",
         "model.vocab_size=32000", "model.ffn_hidden=3072", "train.micro_batch_size=1", "precision=fp32",
         "logging.wandb.mode=disabled"]
NORMAL_STEPS = 2
"""Steps with no write in flight before each save."""
MAX_IN_FLIGHT_STEPS = 50
"""A write still in flight after this many steps is waited for (and its steps still counted as in flight)."""


def worker(overrides, saves: int, directory: str):
    import torch
    import torch.distributed as dist

    from config import load_config as load
    from model.flops import parameter_count
    from parallel.layout import make_layout
    from parallel.mesh import Mesh
    from training.async_checkpoint import Saver
    from training.checkpoint import Checkpointer
    from training.engine import Engine

    world = dist.get_world_size()
    cfg = load(None, overrides + [f"train.global_batch_size={world}"])
    engine = Engine(cfg, Mesh(make_layout(cfg, world, world), torch.device("cpu")))
    gen = torch.Generator().manual_seed(dist.get_rank())

    def batch(_mb):
        tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_len + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        t0 = time.perf_counter()
        engine.train_step(batch)
        return time.perf_counter() - t0

    for _ in range(2):
        step()
    out = {"params": parameter_count(cfg.model)["total"]}
    for mode in ("sync", "async"):
        run_cfg = load(None, overrides + [f"train.global_batch_size={world}", f"checkpoint.async_save={mode == 'async'}",
                                          "checkpoint.keep_last=1"])
        saver = Saver(run_cfg, Checkpointer(run_cfg, str(Path(directory) / mode), engine), engine.mesh)
        normal, in_flight, stalls, write_steps = [], [], [], []
        for _ in range(saves):
            normal += [step() for _ in range(NORMAL_STEPS)]
            t0 = time.perf_counter()
            saver.save(engine.step, 0)
            stalls.append(time.perf_counter() - t0)
            n = 0
            while saver.poll() is False:  # (None: synchronous, nothing in flight)
                in_flight.append(step())
                n += 1
                if n >= MAX_IN_FLIGHT_STEPS:
                    saver.wait()
            write_steps.append(n)
        saver.finish()
        out[mode] = {"stall": statistics.median(stalls), "normal": statistics.median(normal), "normals": normal,
                     "in_flight": statistics.median(in_flight) if in_flight else None,
                     "write_steps": write_steps, "staged": saver.staging.nbytes() if saver.staging else 0}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="extra config overrides, e.g. zero.stage=1")
    args = ap.parse_args()
    at_least(args.world, 1, "--world")
    at_least(args.saves, 1, "--saves")
    overrides = MODEL + args.overrides
    load_config(None, overrides)  # bad overrides: one line, exit 2, before torch starts ranks
    if args.dir is not None:
        output_dir(args.dir, "--dir").mkdir(parents=True, exist_ok=True)
    from tests.dist_harness import run_world

    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        r = run_world(worker, args.world, overrides, args.saves, directory, timeout=3600,
                      env={"OMP_NUM_THREADS": str(max(1, 2 // args.world))})[0]
    sync, asy = r["sync"], r["async"]
    print(f"model: {r['params'] / 1e6:.1f}M parameters, {args.world} gloo rank(s), {' '.join(args.overrides)}; "
          f"rank 0's medians over {args.saves} saves; staging copy {asy['staged'] / 2**30:.2f} GiB a rank")
    head = f"{'mode':<6} {'stall/save s':>12} {'step s':>8} {'step, write in flight s':>24} {'steps a write took':>19}"
    print(head)
    print("-" * len(head))
    for mode, m in (("sync", sync), ("async", asy)):
        flight = f"{m['in_flight']:.3f}" if m["in_flight"] is not None else "-"
        print(f"{mode:<6} {m['stall']:12.3f} {m['normal']:8.3f} {flight:>24} {str(m['write_steps']):>19}")
    normal = statistics.median(sync["normals"] + asy["normals"])
    print(f"async stall / sync stall: {asy['stall'] / sync['stall']:.3f} (goal <= 0.25); step with a write in flight "
          f"/ normal step ({normal:.3f} s): {asy['in_flight'] / normal:.3f} (goal <= 1.3)" if asy["in_flight"] else
          f"async stall / sync stall: {asy['stall'] / sync['stall']:.3f} (goal <= 0.25); every write ended within "
          "its save")


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
