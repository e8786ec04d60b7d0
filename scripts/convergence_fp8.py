"""Does FP8-LM track bf16? Train the same job in both precisions and print the losses side by side.

    python scripts/convergence_fp8.py                          # 300 steps, both layouts
    python scripts/convergence_fp8.py --steps 100 --layouts single

Every row is the real trainer (``train.py``; ``torchrun --nproc-per-node 4`` for the parallel layout) on
the bundled sample corpus, same seed, data order and batch, in two layouts:

  single   one process, ZeRO stage 0
  tp2dp2   parallel.tp=2 with sequence parallelism, DP 2 with ZeRO-1 (FP8 all-gathers of SP activations,
           FP8 gradient reduce-scatter over whole tensors, FP8 AdamW on each rank's tensors)

Printed: final training loss (last step, and the mean of the last 10% of steps), final validation loss,
fp8's difference to bf16 in the same layout, mu at the end and how often it changed. The issue's bar:
the final validation loss within 2% of bf16's. A script, not a test: it takes minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _cli

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "single": (1, []),
    "tp2dp2": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "zero.stage=1"]),
}


def train_overrides(extra: list, args, run_dir: Path) -> list:
    return [f"train.max_steps={args.steps}", f"train.eval_interval={args.steps}", "logging.interval=1",
            "train.micro_batch_size=8", "train.global_batch_size=16", "checkpoint.interval=0",
            "checkpoint.save_at_exit=false", "logging.wandb.mode=disabled", f"logging.run_dir={run_dir}",
            *extra, *args.overrides]


def check_input(args) -> None:
    """Bad options, overrides and data before the first run (each takes minutes): one line, exit code 2."""
    from config import validate_config
    from parallel.layout import make_layout

    _cli.at_least(args.steps, 1, "--steps")
    if args.out:
        _cli.output_dir(args.out, "--out")
    for layout in args.layouts:
        nproc, extra = LAYOUTS[layout]
        for precision in ("bf16", "fp8"):
            cfg = _cli.load_config(None, train_overrides(extra + [f"precision={precision}"], args, Path("run")))
            validate_config(cfg)
            make_layout(cfg, nproc, nproc)
    _cli.check_run_data(cfg)  # the data and tokenizer the overrides name (the same for every run)


def run(name: str, nproc: int, extra: list, args, out_dir: Path) -> dict:
    run_dir = out_dir / name
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                if nproc > 1 else [sys.executable])
    cmd = [*launcher, str(ROOT / "train.py"), *train_overrides(extra, args, run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode == 2:  # train.py's bad input (e.g. a data path in the overrides): its one line
        errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
        raise _cli.InputError(f"{name}: {errors[-1] if errors else p.stderr.strip()[-300:]}")
    if p.returncode != 0:
        raise SystemExit(f"{name} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    losses = [r["loss"] for r in steps]
    tail = losses[-max(1, len(losses) // 10):]
    fp8 = steps[-1].get("fp8") or {}
    return {"final": losses[-1], "tail": sum(tail) / len(tail),
            "val": [r["val_loss"] for r in records if "val_loss" in r][-1],
            "step_s": sum(r["step_time_s"] for r in steps) / len(steps),
            "mu": fp8.get("mu"), "mu_changes": fp8.get("mu_changes")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args(argv)
    check_input(args)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.out or tmp).absolute()  # train.py runs in ROOT: no relative run dirs
        for layout in args.layouts:
            nproc, extra = LAYOUTS[layout]
            for precision in ("bf16", "fp8"):
                name = f"{layout}-{precision}"
                results[name] = run(name, nproc, extra + [f"precision={precision}"], args, out_dir)
                print(f"[convergence] {name}: {results[name]}", file=sys.stderr, flush=True)
    print(f"\n{args.steps} steps on the bundled corpus (tiny model, batch 16 x 128 tokens)\n")
    print("| layout | precision | final train loss | mean of last 10% | final val loss | val vs bf16 | mu (changes) "
          "| s/step |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for layout in args.layouts:
        ref = results[f"{layout}-bf16"]
        for precision in ("bf16", "fp8"):
            r = results[f"{layout}-{precision}"]
            rel = (r["val"] - ref["val"]) / ref["val"]
            if precision == "fp8":
                worst = max(worst, abs(rel))
            mu = f"{r['mu']:g} ({r['mu_changes']})" if r["mu"] is not None else "-"
            print(f"| {layout} | {precision} | {r['final']:.4f} | {r['tail']:.4f} | {r['val']:.4f} | "
                  f"{100 * rel:+.2f}% | {mu} | {r['step_s']:.2f} |")
    print(f"\nlargest |fp8 - bf16| / bf16 final validation loss: {100 * worst:.2f}% (bar: 2%)")
    return 0 if worst <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(_cli.run(main))
