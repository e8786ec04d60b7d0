"""Does ZeRO++ converge like ZeRO-3? Train the same job under each and print the losses side by side.

    python scripts/convergence_zeropp.py                     # 300 steps, bf16, 4 ranks as 2 nodes x 2
    python scripts/convergence_zeropp.py --steps 100 --rows zero3 zeropp

Every row is the real trainer (``train.py`` under ``torchrun --nproc-per-node 4``) on the bundled
sample corpus with ``parallel.ranks_per_node=2`` (two simulated nodes, so qgZ's intra- and
inter-node hops and hpZ's node-local group are real), the same seed, data order and batch:

  zero3    zero.stage=3
  qwz      + int8 quantized weight all-gather
  hpz      + secondary shards over the 2 ranks of a node
  qgz      + int4 hierarchical gradient reduce
  zeropp   all three

Printed: final training loss (the last step's, and the mean of the last 10% of steps, less noisy),
final validation loss, and each one's difference to ZeRO-3. The issue's bar: ZeRO++'s final
validation loss within 1% of ZeRO-3's. A script, not a test: it takes minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = {
    "zero3": [],
    "qwz": ["zero.quantized_weights=true"],
    "hpz": ["zero.hpz_size=2"],
    "qgz": ["zero.quantized_gradients=true"],
    "zeropp": ["zero.quantized_weights=true", "zero.hpz_size=2", "zero.quantized_gradients=true"],
}


def run(name: str, extra: list, args, out_dir: Path) -> dict:
    run_dir = out_dir / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "train.py"), "precision=bf16", "zero.stage=3", "parallel.ranks_per_node=2",
           f"train.max_steps={args.steps}", f"train.eval_interval={args.steps}", "logging.interval=1",
           "train.micro_batch_size=4", "train.global_batch_size=16", "checkpoint.interval=0",
           "checkpoint.save_at_exit=false", "logging.wandb.mode=disabled", f"logging.run_dir={run_dir}",
           *extra, *args.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{name} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    tail = losses[-max(1, len(losses) // 10):]
    return {"final": losses[-1], "tail": sum(tail) / len(tail),
            "val": [r["val_loss"] for r in records if "val_loss" in r][-1],
            "step_s": sum(r["step_time_s"] for r in records if "step_time_s" in r) / len(losses)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every row")
    args = ap.parse_args(argv)
    rows = ["zero3"] + [r for r in args.rows if r != "zero3"]
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.out or tmp)
        results = {}
        for name in rows:
            results[name] = run(name, ROWS[name], args, out_dir)
            print(f"[convergence] {name}: {results[name]}", file=sys.stderr, flush=True)
    ref = results["zero3"]
    print(f"\n{args.steps} steps, bf16, 4 ranks as 2 nodes x 2, bundled corpus\n")
    print("| run | final train loss | mean of last 10% | final val loss | val vs ZeRO-3 | s/step |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        rel = (r["val"] - ref["val"]) / ref["val"]
        print(f"| {name} | {r['final']:.4f} | {r['tail']:.4f} | {r['val']:.4f} | {100 * rel:+.2f}% | "
              f"{r['step_s']:.2f} |")
    if "zeropp" in results:
        rel = abs(results["zeropp"]["val"] - ref["val"]) / ref["val"]
        print(f"\nZeRO++ final validation loss within 1% of ZeRO-3's: {'yes' if rel <= 0.01 else 'NO'} "
              f"({100 * rel:.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
