"""Framework overhead: the trainer's step time against a minimal plain-PyTorch loop.

    python scripts/bench_overhead.py [--precision fp32|bf16|fp16|fp8] [--steps 40] [--rounds 2] [--config FILE]

Both train the same model (same init), on the same samples of the same corpus, at
the same precision and global batch (gradient accumulation over the same
micro-batches). The trainer is the real one (``training.trainer.run``: engine,
pipeline loop, DP buckets, clipping, loss scaling, metrics every 10 steps, signal
checks), timed from its own metrics records between step 10 and the last step;
the plain loop is forward / backward / AdamW.step, timed over the same steps.
Rounds alternate to spread machine noise; the best round of each is reported.
On a GPU it also prints tokens/s and MFU (e.g. --config configs/gpt_350m.yaml
--precision bf16).

``--precision fp8``: plain PyTorch has no FP8-LM, so the plain loop runs bf16 autocast and the trainer runs
twice, in bf16 and in fp8 (FP8 GEMMs, FP8 gradients and FP8 AdamW), and the fp8/bf16 step ratio is printed:
what switching a run to ``precision=fp8`` costs or gains on this device (on CPU the FP8 GEMMs are fp32 GEMMs
of the widened FP8 operands, see fp8/linear.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from config import load_config, validate_config  # noqa: E402
from scripts._cli import InputError, at_least, load_config as checked_config  # noqa: E402
# torch, the model and the trainer are imported where they are used: a bad --config fails before them

SMALL = ["model.n_layers=4", "model.d_model=512", "model.n_heads=8", "model.seq_len=256",
         "train.micro_batch_size=4", "train.global_batch_size=8"]
WARMUP = 10


def trainer_step_time(args, overrides) -> dict:
    from training.trainer import run

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(args.config, overrides + [
            f"train.max_steps={args.steps}", "logging.interval=10", "train.eval_interval=0",
            "checkpoint.interval=0", "checkpoint.save_at_exit=false", "logging.wandb.mode=disabled",
            f"logging.run_dir={d}"])
        run(cfg)
        recs = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in recs if r["step"] == WARMUP)
    last = recs[-1]
    return {"step_s": (last["time"] - first["time"]) / (last["step"] - first["step"]),
            "tokens_per_s": last["tokens_per_s"], "mfu": last["mfu"]}


def plain_step_time(args, overrides) -> float:
    import torch

    from data.gpt_dataset import build_datasets, get_batch
    from model.gpt import build_chunks
    from model.layers import TPContext
    from parallel.comm import Group, Ledger
    from parallel.optim_rules import COMPUTE_DTYPES, build_optimizer
    from parallel.random import RNGTracker

    cfg = load_config(args.config, overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    solo = Group("tp", None, [0], 0, "intra", Ledger())
    [model] = build_chunks(cfg.model, TPContext(solo, False, RNGTracker(device, cfg.train.seed, 0, 0, 0)),
                           1, 1, 0, cfg.train.seed, device)
    opt = build_optimizer(list(model.named_parameters()), cfg.train, device)
    train_ds, _ = build_datasets(list(cfg.data.paths), None, list(cfg.data.split), cfg.model.seq_len,
                                 cfg.train.seed)
    dtype = COMPUTE_DTYPES[cfg.precision]
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype != torch.float32 else contextlib.nullcontext
    micro, g = cfg.train.micro_batch_size, cfg.train.global_batch_size
    n_mb = g // micro
    for step in range(args.steps):
        if step == WARMUP:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for mb in range(n_mb):
            start = step * g + mb * micro
            tokens, labels = get_batch(train_ds, range(start, start + micro))
            with autocast():
                loss = model(tokens.to(device), labels.to(device)) / n_mb
            loss.backward()
        opt.step()
    loss.item()
    return (time.perf_counter() - t0) / (args.steps - WARMUP)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="YAML config (default: a small 4-layer d=512 model)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16", "fp8"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.steps <= WARMUP:
        raise InputError(f"--steps must be more than the {WARMUP} warm-up steps, got {args.steps}")
    at_least(args.rounds, 1, "--rounds")
    base = ([] if args.config else SMALL) + ["parallel.ranks_per_node=1"]
    # bad input before the first round: --config as train.py reads it, then its data (one line, exit code 2)
    cfg = checked_config(args.config, base + [f"precision={'bf16' if args.precision == 'fp8' else args.precision}"])
    validate_config(cfg)
    import torch

    from model.flops import flops_per_token
    from training.metrics import peak_tflops
    from training.trainer import check_data

    check_data(cfg)
    fp8 = args.precision == "fp8"
    plain_precision = "bf16" if fp8 else args.precision
    overrides = base + [f"precision={plain_precision}"]
    if args.precision == "fp16":
        overrides.append("loss_scale.initial=1024")
    trainer, plain, trainer_fp8 = [], [], []
    for _ in range(args.rounds):
        trainer.append(trainer_step_time(args, overrides))
        plain.append(plain_step_time(args, overrides))
        if fp8:
            trainer_fp8.append(trainer_step_time(args, base + ["precision=fp8"]))
    best_t = min(r["step_s"] for r in trainer)
    best_p = min(plain)
    cfg = load_config(args.config, overrides)
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, precision {args.precision}, "
          f"{tokens} tokens/step, steps {WARMUP + 1}..{args.steps}, best of {args.rounds} rounds")
    print(f"{'loop':<14} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6}")
    rows = [(f"plain {plain_precision}", best_p, plain_precision),
            (f"trainer {plain_precision}", best_t, plain_precision)]
    best_fp8 = min((r["step_s"] for r in trainer_fp8), default=None)
    if fp8:
        rows.append(("trainer fp8", best_fp8, "fp8"))
    for name, step_s, precision in rows:
        peak = peak_tflops(device, precision)
        tflops = tokens / step_s * flops_per_token(cfg.model) / 1e12
        mfu = f"{100 * tflops / peak:5.1f}%" if peak else "  n/a"
        print(f"{name:<14} {1000 * step_s:9.1f} {tokens / step_s:10.0f} {tflops:8.3f} {mfu:>6}")
    print(f"framework overhead: {100 * (best_t / best_p - 1):+.1f}% "
          f"(rounds: trainer {[round(1000 * r['step_s'], 1) for r in trainer]} ms, "
          f"plain {[round(1000 * p, 1) for p in plain]} ms)")
    if fp8:
        print(f"fp8 / bf16 trainer step: {best_fp8 / best_t:.2f}x "
              f"(fp8 rounds {[round(1000 * r['step_s'], 1) for r in trainer_fp8]} ms)")


if __name__ == "__main__":
    from _cli import run as run_cli  # scripts/ is sys.path[0] when a script runs

    sys.exit(run_cli(main))
