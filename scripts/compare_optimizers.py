"""AdamW, 8-bit AdamW, Adafactor and Muon on the bundled corpus: the default model trained with each optimizer at
its usual learning rate; final validation loss, optimizer state bytes per parameter and step time side by side.

    python scripts/compare_optimizers.py                        # 200 steps, the four default rows, seeds 1 2 3
    python scripts/compare_optimizers.py --steps 50 --rows adamw muon --seeds 1
    python scripts/compare_optimizers.py --out /tmp/opt_runs model.n_layers=2

Every run is the real trainer (``train.py``, one process, ZeRO stage 0, the default model, batch and precision) on
the bundled sample corpus, the same data and batches, once per seed (``--seeds``, train.seed; default 1 2 3). The
rows (``train.optimizer`` and what changes with it; everything else is the default config):

  adamw      train.lr 2e-3, weight decay 0.1, betas 0.9/0.95 (the defaults): the baseline
  adamw8bit  the same lr, betas and weight decay; both moments as 8-bit blockwise codes
             (train.adamw8bit.block_size 256, the default)
  adafactor  nothing else set: train.adafactor.lr and weight_decay auto. Adafactor's step is *relative*:
             rho_t = min(relative step, 1/sqrt(t)) times the parameter's RMS (at least eps2 = 1e-3); auto makes the
             relative step train.lr / model.init_std (0.1 at the defaults), so a weight of the initial RMS (0.02)
             moves by AdamW's 2e-3 at the start, and the weight decay train.weight_decay x train.lr / 0.1 = 2e-3,
             so lr x decay a step is AdamW's 2e-4. Under the shared schedule (warmup, cosine) and clip
  adafactor_torch  (not by default) train.adafactor.lr=1e-2, train.adafactor.weight_decay=0.1: torch's default
             relative step (the paper's cap, T5 / Hugging Face's relative_step), made for weights of RMS ~1: on
             this model a tenth of AdamW's step, with AdamW's decay coefficient (five times AdamW's decay a step)
  adafactor_old  (not by default) train.adafactor.lr=2e-3, train.adafactor.weight_decay=0.1: what
             train.optimizer=adafactor alone ran before the auto setting (train.lr as the relative step)
  muon       train.muon.adjust_lr=match_rms_adamw (Moonshot's: the matrices' lr is scaled by
             0.2 sqrt(max(rows, cols)) so the update's RMS matches AdamW's), hence AdamW's train.lr 2e-3 and
             weight decay 0.1 carry over unchanged; the embedding, head and norms step with AdamW itself

Extra ``key=value`` overrides go to every row after its own (``train.lr=...`` moves Adafactor's auto step too).

Printed, a line per row and seed: final validation loss (after the last step), its difference to the AdamW run of
the same seed (the *gap*), the optimizer state bytes per parameter and the mean step time. The state bytes are the
run's own measurement (``model_state_bytes.optimizer`` in metrics.jsonl: the trainer counts the optimizer's
tensors after the first step) divided by the model's parameter count (``model.flops.parameter_count``). The step
time is the mean ``step_time_s`` of the steps after the first 5 (start-up). Then per row: each seed's gap, their
mean, min..max and sample standard deviation, and the issues' bars: Muon's mean final validation loss <= AdamW's;
8-bit AdamW's mean gap at most +2%, Adafactor's at its defaults at most +3% (exit code 1 if a bar is missed; the
adafactor_torch and adafactor_old rows have none). A script, not a test: it takes minutes a run.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import _cli
import _seeds

ROOT = Path(__file__).resolve().parents[1]
ROWS = {  # name: (settings as printed, overrides after the default config)
    "adamw": ("lr 2e-3", ["train.optimizer=adamw"]),
    "adamw8bit": ("lr 2e-3, block 256", ["train.optimizer=adamw8bit"]),
    "adafactor": ("defaults: relative step auto 0.1, wd auto 2e-3", ["train.optimizer=adafactor"]),
    "adafactor_torch": ("relative step 1e-2, wd 0.1 (torch's lr)",
                        ["train.optimizer=adafactor", "train.adafactor.lr=1e-2", "train.adafactor.weight_decay=0.1"]),
    "adafactor_old": ("relative step 2e-3, wd 0.1 (before auto)",
                      ["train.optimizer=adafactor", "train.adafactor.lr=2e-3", "train.adafactor.weight_decay=0.1"]),
    "muon": ("lr 2e-3, match_rms_adamw", ["train.optimizer=muon", "train.muon.adjust_lr=match_rms_adamw"]),
}
DEFAULT_ROWS = ["adamw", "adamw8bit", "adafactor", "muon"]
BASELINE = "adamw"
WITHIN = {"adamw8bit": 0.02, "adafactor": 0.03}  # the bar: mean gap of the final validation loss at most this
SKIP_STEPS = 5  # start-up steps left out of the step time


def train_overrides(extra: list, args, run_dir: Path) -> list:
    return [f"train.max_steps={args.steps}", f"train.eval_interval={args.steps}", "logging.interval=1",
            "checkpoint.interval=0", "checkpoint.save_at_exit=false", "logging.wandb.mode=disabled",
            f"logging.run_dir={run_dir}", *extra, *args.overrides]


def check_input(args, rows: list) -> dict:
    """Bad options, overrides and data before the first run (each takes minutes): one line, exit code 2. Returns
    each row's parameter count."""
    from config import validate_config
    from model.flops import parameter_count
    from parallel.layout import make_layout

    _cli.at_least(args.steps, 1, "--steps")
    _seeds.check(args.seeds, args.overrides)
    if args.out:
        _cli.output_dir(args.out, "--out")
    params = {}
    for name in rows:
        for seed in args.seeds:
            cfg = _cli.load_config(None, train_overrides(ROWS[name][1] + [f"train.seed={seed}"], args, Path("run")))
            validate_config(cfg)
        make_layout(cfg, 1, 1)
        params[name] = parameter_count(cfg.model)["total"]
    _cli.check_run_data(cfg)  # the data and tokenizer the overrides name (the same for every row)
    return params


def run(name: str, extra: list, args, out_dir: Path, n_params: int) -> dict:
    run_dir = out_dir / name
    cmd = [sys.executable, str(ROOT / "train.py"), *train_overrides(extra, args, run_dir)]
    _cli.run_trainer(cmd, name, ROOT)
    records = _cli.metrics_records(run_dir)
    steps = [r for r in records if "loss" in r]
    timed = [r["step_time_s"] for r in steps if r["step"] > SKIP_STEPS] or [r["step_time_s"] for r in steps]
    state = steps[-1]["model_state_bytes"]
    return {"val": [r["val_loss"] for r in records if "val_loss" in r][-1], "final": steps[-1]["loss"],
            "optim_bytes": state["optimizer"], "optim_b_per_param": state["optimizer"] / n_params,
            "step_s": statistics.fmean(timed), "skipped": steps[-1].get("skipped_steps", 0)}


def fmt_spread(values: list, unit: str = "", digits: int = 4) -> str:
    s = _seeds.spread(values)
    sd = f", sd {s['sd']:.{digits}f}{unit}" if len(values) > 1 else ""
    return f"{s['mean']:.{digits}f}{unit} (min..max {s['min']:.{digits}f}..{s['max']:.{digits}f}{unit}{sd})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="training steps of every run (default: 200)")
    ap.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, choices=list(ROWS),
                    help=f"optimizers to run (default: {' '.join(DEFAULT_ROWS)}; adamw, the baseline, always runs)")
    _seeds.add_argument(ap)
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every row")
    args = ap.parse_args(argv)
    rows = [BASELINE] + [r for r in dict.fromkeys(args.rows) if r != BASELINE]
    n_params = check_input(args, rows)
    results = {}  # (row, seed): the run's figures
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.out or tmp).absolute()  # train.py runs in ROOT: no relative run dirs
        for seed in args.seeds:  # seed by seed: an interrupted sweep has whole seeds in its log
            for name in rows:
                r = results[name, seed] = run(f"{name}-seed{seed}", ROWS[name][1] + [f"train.seed={seed}"], args,
                                              out_dir, n_params[name])
                print(f"[compare] {name} seed {seed}: {r}", file=sys.stderr, flush=True)
    print(f"\n{args.steps} steps, default model ({n_params[BASELINE] / 1e6:.2f}M parameters), one process, bundled "
          f"corpus, seeds {' '.join(map(str, args.seeds))}; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs" + (f"; overrides {' '.join(args.overrides)}" if args.overrides else "") + "\n")
    timed = f"steps > {SKIP_STEPS}" if args.steps > SKIP_STEPS else "all steps"
    print("| optimizer | settings | seed | final train loss | final val loss | val vs adamw | optimizer state B/param "
          f"| s/step ({timed}) |")
    print("|---|---|---|---|---|---|---|---|")
    summary, failed = [], False
    for name in rows:
        settings = ROWS[name][0]
        gaps = []
        for seed in args.seeds:
            r, ref = results[name, seed], results[BASELINE, seed]
            gaps.append((r["val"] - ref["val"]) / ref["val"])
            print(f"| {name} | {settings} | {seed} | {r['final']:.4f} | {r['val']:.4f} | {100 * gaps[-1]:+.2f}% | "
                  f"{r['optim_b_per_param']:.3f} | {r['step_s']:.3f} |")
        vals = [results[name, s]["val"] for s in args.seeds]
        times = [results[name, s]["step_s"] for s in args.seeds]
        line = (f"{name}: final val loss {fmt_spread(vals)}; optimizer state "
                f"{results[name, args.seeds[0]]['optim_b_per_param']:.3f} B/param; s/step {fmt_spread(times, 's', 3)}")
        if name != BASELINE:
            mean = statistics.fmean(vals)
            base = statistics.fmean(results[BASELINE, s]["val"] for s in args.seeds)
            line += f"\n  vs adamw: {_seeds.describe(gaps)}"
            if name == "muon":
                ok = mean <= base
                held = sum(g <= 0 for g in gaps)
                line += (f"\n  bar (mean val loss <= adamw's, {mean:.4f} vs {base:.4f}): {'yes' if ok else 'NO'}, "
                         f"single seeds at or below adamw: {held} of {len(gaps)}")
            elif name in WITHIN:  # "within x% of AdamW's": at most x% worse (a lower loss is no miss)
                bar = WITHIN[name]
                ok = statistics.fmean(gaps) <= bar
                held = sum(g <= bar for g in gaps)
                line += (f"\n  bar (mean gap <= +{100 * bar:g}%): {'yes' if ok else 'NO'}, single seeds within it: "
                         f"{held} of {len(gaps)}")
            else:
                ok = True  # a reference row, no bar
            failed = failed or not ok
        summary.append(line)
    print("\noptimizer state bytes: measured by each run (metrics.jsonl model_state_bytes.optimizer, after step 1) / "
          "model.flops.parameter_count total\n")
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_cli.run(main))
