"""Does ZeRO++ (and 4-bit communication) converge like plain ZeRO? Train the same job under each and print the
losses side by side.

    python scripts/convergence_zeropp.py                     # 300 steps, bf16, 4 ranks as 2 nodes x 2, seeds 1 2 3
    python scripts/convergence_zeropp.py --steps 150 --rows zero3 zeropp_4bit zeropp_4bit_direct
    python scripts/convergence_zeropp.py --steps 150 --rows zeropp_4bit --seeds 98 99 100

Every row is the real trainer (``train.py`` under ``torchrun --nproc-per-node 4``) on the bundled
sample corpus with ``parallel.ranks_per_node=2`` (two simulated nodes, so qgZ's intra- and
inter-node hops and hpZ's node-local group are real), the same data and batch. Every row runs once
per seed (``--seeds``, train.seed; default 1 2 3) and each run is compared with the plain run of its
ZeRO stage with the same seed (its *baseline*):

  zero3               zero.stage=3
  qwz / hpz / qgz     + int8 quantized weight all-gather / secondary shards over a node / int4 gradient reduce
  zeropp              all three (ZeRO++)
  zeropp_4bit         4-bit weight differences (qWD) + hpZ + Hadamard-smoothed 4-bit gradients (SDP4Bit-style)
  zeropp_4bit_noh     the same without the Hadamard transform
  zeropp_4bit_direct  direct 4-bit weights (no differences) + hpZ + Hadamard 4-bit gradients: the contrast
  zero1, zero2        zero.stage=1 / 2
  zero1_4bit, zero2_4bit  4-bit weight differences in the post-step gather, two-level gradients (8 bits
                      inside the node, 4 across, Hadamard) in the reduce-scatter

Printed, a line per row and seed: final training loss (the last step's, and the mean of the last 10% of
steps, less noisy), final validation loss and its difference to the same seed's baseline (the *gap*),
and the counted inter-node bytes of a step (rank 0's ``comm.by_link.inter`` x 4 ranks) against the
baseline's. Then per row: each seed's gap, their mean, min..max and sample standard deviation. The
issues' bar: the mean gap of the final validation loss within 1% (one seed can move a gap by more than
a point: the row says how many single seeds held it too). A script, not a test: it takes minutes a run.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import _cli
import _seeds

ROOT = Path(__file__).resolve().parents[1]
QWD4 = ["zero.quantized_weights=true", "zero.weight_bits=4", "zero.weight_delta=true"]
HQGZ4 = ["zero.quantized_gradients=true", "zero.gradient_bits=4", "zero.gradient_hadamard=true"]
TWO_LEVEL = HQGZ4 + ["zero.gradient_bits_intra=8"]
ROWS = {  # name: (baseline row, overrides)
    "zero3": ("zero3", ["zero.stage=3"]),
    "qwz": ("zero3", ["zero.stage=3", "zero.quantized_weights=true"]),
    "hpz": ("zero3", ["zero.stage=3", "zero.hpz_size=2"]),
    "qgz": ("zero3", ["zero.stage=3", "zero.quantized_gradients=true"]),
    "zeropp": ("zero3", ["zero.stage=3", "zero.quantized_weights=true", "zero.hpz_size=2",
                         "zero.quantized_gradients=true"]),
    "zeropp_4bit": ("zero3", ["zero.stage=3", "zero.hpz_size=2"] + QWD4 + HQGZ4),
    "zeropp_4bit_noh": ("zero3", ["zero.stage=3", "zero.hpz_size=2"] + QWD4 + HQGZ4[:2]),
    "zeropp_4bit_direct": ("zero3", ["zero.stage=3", "zero.hpz_size=2"] + QWD4[:2] + HQGZ4),
    "zero1": ("zero1", ["zero.stage=1"]),
    "zero1_4bit": ("zero1", ["zero.stage=1"] + QWD4 + TWO_LEVEL),
    "zero2": ("zero2", ["zero.stage=2"]),
    "zero2_4bit": ("zero2", ["zero.stage=2"] + QWD4 + TWO_LEVEL),
}
DEFAULT_ROWS = ["zero3", "zeropp", "zeropp_4bit", "zeropp_4bit_direct", "zero1", "zero1_4bit", "zero2",
                "zero2_4bit"]


def train_overrides(extra: list, args, run_dir: Path) -> list:
    return ["precision=bf16", "parallel.ranks_per_node=2", f"train.max_steps={args.steps}",
            f"train.eval_interval={args.steps}", "logging.interval=1", "train.micro_batch_size=4",
            "train.global_batch_size=16", "checkpoint.interval=0", "checkpoint.save_at_exit=false",
            "logging.wandb.mode=disabled", f"logging.run_dir={run_dir}", *extra, *args.overrides]


def check_input(args, rows: list) -> None:
    """Bad options, overrides and data before the first run (each takes minutes): one line, exit code 2."""
    from config import validate_config
    from parallel.layout import make_layout

    _cli.at_least(args.steps, 1, "--steps")
    _seeds.check(args.seeds, args.overrides)
    if args.out:
        _cli.output_dir(args.out, "--out")
    for name in rows:
        for seed in args.seeds:
            cfg = _cli.load_config(None, train_overrides(ROWS[name][1] + [f"train.seed={seed}"], args, Path("run")))
            validate_config(cfg)
        make_layout(cfg, 4, 2)
    _cli.check_run_data(cfg)  # the data and tokenizer the overrides name (the same for every row)


def run(name: str, extra: list, args, out_dir: Path) -> dict:
    run_dir = out_dir / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "train.py"), *train_overrides(extra, args, run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    _cli.run_trainer(cmd, name, ROOT, env)
    records = _cli.metrics_records(run_dir)
    losses = [r["loss"] for r in records if "loss" in r]
    tail = losses[-max(1, len(losses) // 10):]
    inter = [r["comm"]["by_link"].get("inter", 0) for r in records if "comm" in r]
    return {"final": losses[-1], "tail": sum(tail) / len(tail),
            "val": [r["val_loss"] for r in records if "val_loss" in r][-1],
            "inter_mib": 4 * inter[-1] / 2**20 if inter else 0.0,  # the last step's, all 4 ranks
            "step_s": sum(r["step_time_s"] for r in records if "step_time_s" in r) / len(losses)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, choices=list(ROWS))
    _seeds.add_argument(ap)
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every row")
    args = ap.parse_args(argv)
    rows = []
    for name in args.rows:  # every row's baseline runs first
        for r in (ROWS[name][0], name):
            if r not in rows:
                rows.append(r)
    check_input(args, rows)
    results = {}  # (row, seed): the run's figures
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.out or tmp).absolute()  # train.py runs in ROOT: no relative run dirs
        for seed in args.seeds:  # seed by seed: an interrupted sweep has whole seeds in its log
            for name in rows:
                r = results[name, seed] = run(f"{name}-seed{seed}", ROWS[name][1] + [f"train.seed={seed}"], args,
                                              out_dir)
                print(f"[convergence] {name} seed {seed}: {r}", file=sys.stderr, flush=True)
    print(f"\n{args.steps} steps, bf16, 4 ranks as 2 nodes x 2, bundled corpus, seeds {' '.join(map(str, args.seeds))}"
          "\n")
    print("| run | baseline | seed | final train loss | mean of last 10% | final val loss | val vs baseline | "
          "inter-node MiB/step | vs baseline | s/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for name in rows:
        base_name = ROWS[name][0]
        gaps, ratios = [], []
        for seed in args.seeds:
            r, ref = results[name, seed], results[base_name, seed]
            rel = (r["val"] - ref["val"]) / ref["val"]
            ratio = r["inter_mib"] / ref["inter_mib"] if ref["inter_mib"] else float("nan")
            gaps.append(rel)
            ratios.append(ratio)
            print(f"| {name} | {base_name} | {seed} | {r['final']:.4f} | {r['tail']:.4f} | {r['val']:.4f} | "
                  f"{100 * rel:+.2f}% | {r['inter_mib']:.3f} | {ratio:.3f} | {r['step_s']:.2f} |")
        if name != base_name:
            verdicts.append(f"{name} vs {base_name}: final validation loss {_seeds.describe(gaps)}; "
                            f"{_seeds.within(gaps, 0.01)}; inter-node bytes "
                            + "..".join(sorted({f"{x:.3f}x" for x in ratios})))
    print("\n" + "\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(_cli.run(main))
