"""Does FP8-LM track 16-bit training? Train the same job in both and print the validation losses side by side.

    python scripts/convergence_fp8.py                          # 300 steps, both layouts, FP8 GEMMs, seeds 1 2 3
    python scripts/convergence_fp8.py --steps 100 --layouts single --seeds 1
    python scripts/convergence_fp8.py --steps 200 --layouts single --gemm bf16 fp16

Every row is the real trainer (``train.py``; ``torchrun --nproc-per-node 4`` for the parallel layout) on
the bundled sample corpus, the same data and batch, in two layouts:

  single   one process, ZeRO stage 0
  tp2dp2   parallel.tp=2 with sequence parallelism, DP 2 with ZeRO-1 (FP8 all-gathers of SP activations,
           FP8 gradient reduce-scatter over whole tensors, FP8 AdamW on each rank's tensors)

``--gemm``: the GEMM paths of precision=fp8 to run (``fp8.gemm``), each against the 16-bit precision it computes
in: fp8 GEMMs and bf16 GEMMs (an A100's path) against precision=bf16, fp16 GEMMs (a V100's path, under the loss
scaler) against precision=fp16. ``--seeds``: train.seed of each repetition (default 1 2 3; one seed can move a gap
by ~1%: a claim is judged over several); every run and its reference are trained once per seed.

Printed, a line per run and seed: final training loss (the last step's, and the mean of the last 10% of steps),
final validation loss, its difference to the reference of the same layout and seed (the *gap*), mu at the end and
how often it changed. Then per layout and GEMM path: each seed's gap, their mean, min..max and sample standard
deviation. The bar: the mean gap of the final validation loss within 2% (exit code 1 if a mean is not; the line
says how many single seeds held it too). A script, not a test: it takes minutes a run.
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
LAYOUTS = {
    "single": (1, []),
    "tp2dp2": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "zero.stage=1"]),
}


def train_overrides(extra: list, args, run_dir: Path) -> list:
    return [f"train.max_steps={args.steps}", f"train.eval_interval={args.steps}", "logging.interval=1",
            "train.micro_batch_size=8", "train.global_batch_size=16", "checkpoint.interval=0",
            "checkpoint.save_at_exit=false", "logging.wandb.mode=disabled", f"logging.run_dir={run_dir}",
            *extra, *args.overrides]


REFERENCE = {"fp8": "bf16", "bf16": "bf16", "fp16": "fp16"}
"""The precision each fp8.gemm path is compared with: the one it computes in outside the FP8 parts."""


def runs_of(args) -> list:
    """(name, overrides) of every run a layout and seed needs: the references, then one fp8 run per GEMM path."""
    refs = sorted({REFERENCE[g] for g in args.gemm})
    return ([(ref, [f"precision={ref}"]) for ref in refs]
            + [(f"fp8-{g}", ["precision=fp8", f"fp8.gemm={g}"]) for g in args.gemm])


def check_input(args) -> None:
    """Bad options, overrides and data before the first run (each takes minutes): one line, exit code 2."""
    from config import validate_config
    from parallel.layout import make_layout

    _cli.at_least(args.steps, 1, "--steps")
    _seeds.check(args.seeds, args.overrides)
    if args.out:
        _cli.output_dir(args.out, "--out")
    for layout in args.layouts:
        nproc, extra = LAYOUTS[layout]
        for _, over in runs_of(args):
            for seed in args.seeds:
                cfg = _cli.load_config(None, train_overrides(extra + over + [f"train.seed={seed}"], args, Path("run")))
                validate_config(cfg)
            make_layout(cfg, nproc, nproc)
    _cli.check_run_data(cfg)  # the data and tokenizer the overrides name (the same for every run)


def run(name: str, nproc: int, extra: list, args, out_dir: Path) -> dict:
    run_dir = out_dir / name
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                if nproc > 1 else [sys.executable])
    cmd = [*launcher, str(ROOT / "train.py"), *train_overrides(extra, args, run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    _cli.run_trainer(cmd, name, ROOT, env)
    records = _cli.metrics_records(run_dir)
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
    ap.add_argument("--gemm", nargs="+", default=["fp8"], choices=list(REFERENCE),
                    help="fp8.gemm paths to run (default: fp8)")
    _seeds.add_argument(ap)
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args(argv)
    check_input(args)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.out or tmp).absolute()  # train.py runs in ROOT: no relative run dirs
        for layout in args.layouts:
            nproc, extra = LAYOUTS[layout]
            for seed in args.seeds:
                for what, over in runs_of(args):
                    name = f"{layout}-{what}-seed{seed}"
                    results[name] = run(name, nproc, extra + over + [f"train.seed={seed}"], args, out_dir)
                    print(f"[convergence] {name}: {results[name]}", file=sys.stderr, flush=True)
    print(f"\n{args.steps} steps on the bundled corpus (tiny model, batch 16 x 128 tokens), "
          f"seeds {' '.join(map(str, args.seeds))}\n")
    print("| layout | run | seed | final train loss | mean of last 10% | final val loss | val vs reference "
          "| mu (changes) | s/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    gaps = {}
    for layout in args.layouts:
        for what, _ in runs_of(args):
            for seed in args.seeds:
                r = results[f"{layout}-{what}-seed{seed}"]
                fp8 = what.startswith("fp8-")
                ref = results[f"{layout}-{REFERENCE[what[4:]] if fp8 else what}-seed{seed}"]
                rel = (r["val"] - ref["val"]) / ref["val"]
                if fp8:
                    gaps.setdefault((layout, what), []).append(rel)
                mu = f"{r['mu']:g} ({r['mu_changes']})" if r["mu"] is not None else "-"
                label = f"fp8, fp8.gemm={what[4:]} (vs {REFERENCE[what[4:]]})" if fp8 else what
                print(f"| {layout} | {label} | {seed} | {r['final']:.4f} | {r['tail']:.4f} | {r['val']:.4f} | "
                      f"{100 * rel:+.2f}% | {mu} | {r['step_s']:.2f} |")
    print()
    worst = max((abs(sum(g) / len(g)) for g in gaps.values()), default=0.0)
    for (layout, what), g in gaps.items():
        print(f"{layout} fp8.gemm={what[4:]} vs {REFERENCE[what[4:]]}: final validation loss {_seeds.describe(g)}; "
              f"{_seeds.within(g, 0.02)}")
    print(f"\nlargest |mean gap| of the final validation loss: {100 * worst:.2f}% (bar: 2%)")
    return 0 if worst <= 0.02 else 1


if __name__ == "__main__":
    sys.exit(_cli.run(main))
