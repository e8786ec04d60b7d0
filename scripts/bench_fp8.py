"""FP8-LM against bf16 on one GPU, and both against their peers: tokens/s, TFLOP/s and MFU of the real trainer.

    python scripts/bench_fp8.py                                   # gpt_350m and gpt_1.3b, bf16 and fp8, + peers
    python scripts/bench_fp8.py --presets gpt_350m --steps 40 --micro-batch 2
    python scripts/bench_fp8.py --recompute off selective full    # each row with each recompute setting
    python scripts/bench_fp8.py --no-peers train.compile=false    # the trainer alone, eager
    python scripts/bench_fp8.py --json bench_fp8.json             # also the rows as JSON: plan.py --calibrate

Each row runs ``train.py --config configs/<preset>.yaml precision=... model.activation_checkpointing=...``
on one device (the preset's model and optimiser, the bundled sample corpus, ``--accum`` micro-batches of
``--micro-batch`` sequences a step) and reads the trainer's own metrics records after ``--warmup`` steps: tokens/s,
model TFLOP/s per device (6N + attention FLOPs a token, ``model/flops.py``) and MFU. MFU is printed
against the bf16 dense peak for both precisions
(comparable: how much of the machine the same model uses), and the trainer's own figure for fp8 is against
the FP8 dense peak. Needs a CUDA device with FP8 (compute capability >= 8.9) for the fp8 rows; on other
devices they fail with the trainer's error, which the table shows.

Peers (``--peers``, the default): for each preset, the same model shape as a plain PyTorch script
(``scripts/plain_gpt.py``: fp32 weights, bf16 autocast, fused AdamW) compiled per transformer block, and the same
with torchao's float8 training (tensorwise; ``requirements-gpu.txt``), in the same invocation, same micro-batch,
accumulation and steps. Two ratio columns: against this trainer's bf16 row of the same preset and recompute
setting, and against the compiled plain bf16 row. A peer that cannot run (torchao missing) shows its error.

``--json FILE`` also writes the device, the settings and every row (``source: "scripts/bench_fp8.py"``): the file
``scripts/plan.py --calibrate`` reads to fit the planner's GEMM rates to this trainer's measured steps
(training/plan/measured.py).
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
BF16_PEAK = {"H100": 989.0, "H200": 989.0, "H100 PCIe": 756.0}


SAMPLE = ["data.paths=[" + str(ROOT / "data" / "sample" / "sample_text_document") + "]",
          "data.tokenizer=" + str(ROOT / "data" / "sample" / "tokenizer.model")]


def precision_overrides(spec: str) -> list:
    """``bf16`` -> precision=bf16; ``fp8:fp16`` -> precision=fp8 fp8.gemm=fp16 (FP8-LM with a V100's GEMMs)."""
    precision, _, gemm = spec.partition(":")
    return [f"precision={precision}"] + ([f"fp8.gemm={gemm}"] if gemm else [])


def run(preset: str, precision: str, recompute: str, args, out: Path) -> dict:
    run_dir = out / f"{Path(preset).stem}-{precision.replace(':', '-gemm-')}-{recompute}"
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", args.preset_files[preset],
           *precision_overrides(precision), f"model.activation_checkpointing='{recompute}'", *SAMPLE,
           f"train.max_steps={args.steps}", f"train.micro_batch_size={args.micro_batch}",
           f"train.global_batch_size={args.micro_batch * args.accum}", "logging.interval=2",
           "train.eval_interval=0", "checkpoint.interval=0", "checkpoint.save_at_exit=false",
           "logging.wandb.mode=disabled", f"logging.run_dir={run_dir}", *args.overrides]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        lines = (p.stderr or p.stdout).strip().splitlines()
        error = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else f"rc {p.returncode}")
        return {"error": error[:200]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "tokens_per_s" in r and r["step"] > args.warmup]
    if not timed:
        return {"error": "no timed records after the warm-up"}
    best = max(timed, key=lambda r: r["tokens_per_s"])
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed), "best": best["tokens_per_s"],
            "tflops": sum(r["tflops_per_device"] for r in timed) / len(timed), "mfu": timed[-1].get("mfu"),
            "peak_mem_gib": max(r.get("peak_mem_bytes") or 0 for r in timed) / 2**30,
            "loss": timed[-1]["loss"]}


def peer(preset: str, args, compiled: bool, float8: bool) -> dict:
    """One run of scripts/plain_gpt.py (its JSON line), or {"error": ...}."""
    cmd = [sys.executable, str(ROOT / "scripts" / "plain_gpt.py"), "--preset", args.preset_files[preset],
           "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch), "--accum", str(args.accum)]
    cmd += ["--compile"] * compiled + ["--float8"] * float8
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        err = (p.stderr or p.stdout).strip().splitlines()
        return {"error": next((ln for ln in reversed(err) if "Error" in ln), err[-1] if err else f"rc {p.returncode}")[:200]}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["gpt_350m", "gpt_1.3b"])
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp8"],
                    help="rows: a precision, or fp8:<gemm> for precision=fp8 with fp8.gemm=<gemm> (fp8:bf16 and "
                         "fp8:fp16 time the A100 and V100 paths on a Hopper GPU)")
    ap.add_argument("--recompute", nargs="+", default=["selective"], choices=["off", "selective", "full"],
                    help="model.activation_checkpointing settings (a row each)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                    help="plain PyTorch rows (compiled bf16, + torchao float8) per preset")
    ap.add_argument("--json", help="also write the device, the settings and the rows as JSON here (the file "
                                   "scripts/plan.py --calibrate reads)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every trainer run")
    args = ap.parse_args(argv)
    # bad input before the first row (each takes minutes): one line, exit code 2 (scripts/_cli.py)
    from _cli import InputError, at_least, load_config as checked_config, output_file, preset as preset_file

    if args.json:
        output_file(args.json, "--json")

    args.preset_files = {name: preset_file(name, "--presets") for name in args.presets}
    for option in ("steps", "micro_batch", "accum"):
        at_least(getattr(args, option), 1, "--" + option.replace("_", "-"))
    at_least(args.warmup, 0, "--warmup")
    if args.steps <= args.warmup:
        raise InputError(f"--steps {args.steps} leaves no timed step after --warmup {args.warmup}")
    for name in args.presets:  # the overrides apply to every trainer row: known keys, right types
        checked_config(args.preset_files[name], args.overrides, "--presets")
    from config import CHOICES

    for spec in args.precisions:
        precision, colon, gemm = spec.partition(":")
        if precision not in CHOICES["precision"] or colon and (precision != "fp8" or gemm not in CHOICES["fp8.gemm"]):
            raise InputError(f"--precisions {spec}: expected one of {list(CHOICES['precision'])} or fp8:<gemm> with "
                             f"<gemm> one of {list(CHOICES['fp8.gemm'])}")
    try:
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - only for the table's header
        name = "unknown"
    peak = next((v for k, v in sorted(BF16_PEAK.items(), key=lambda kv: -len(kv[0])) if k in name), None)
    try:
        import torch

        versions = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    except Exception:  # noqa: BLE001
        versions = "torch unknown"
    print(f"device: {name}; {versions}; {args.steps} steps ({args.warmup} warm-up), micro-batch {args.micro_batch} "
          f"x {args.accum}; overrides: {' '.join(args.overrides) or 'none'}\n")
    print("| preset | recompute | run | tokens/s | TFLOP/s | MFU (bf16 peak) | MFU (trainer) | peak mem GiB | loss "
          "| vs our bf16 | vs plain compiled bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    sys.path.insert(0, str(ROOT))
    from config import load_config
    from model.flops import flops_per_token

    rows = []

    def row(preset, recompute, label, r, ours_bf16, plain, precision=None) -> None:
        rows.append({"preset": preset, "config": os.path.relpath(args.preset_files[preset], ROOT),
                     "recompute": recompute, "run": label, "precision": precision, **r})
        if "error" in r:
            print(f"| {preset} | {recompute} | {label} | failed: {r['error']} ||||||||", flush=True)
            return
        tflops = r.get("tflops") or r["tokens_per_s"] * fpt / 1e12
        mfu16 = f"{100 * tflops / peak:.1f}%" if peak else "n/a"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        ratio = lambda base: f"{r['tokens_per_s'] / base:.2f}x" if base else "n/a"  # noqa: E731
        print(f"| {preset} | {recompute} | {label} | {r['tokens_per_s']:,.0f} | {tflops:.1f} | {mfu16} | {mfu} | "
              f"{r['peak_mem_gib']:.1f} | {r['loss']:.3f} | {ratio(ours_bf16)} | {ratio(plain)} |", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            fpt = flops_per_token(load_config(args.preset_files[preset], []).model)
            plain, peers = None, []
            if args.peers:  # run first: their compiled bf16 is the second ratio's base for every row
                for label, compiled, float8 in (("plain PyTorch, compiled bf16", True, False),
                                                ("plain PyTorch + torchao float8, compiled", True, True)):
                    r = peer(preset, args, compiled, float8)
                    peers.append((label, r))
                    if not float8 and "error" not in r:
                        plain = r["tokens_per_s"]
            ours_bf16 = None
            for recompute in args.recompute:
                base = None
                for precision in args.precisions:
                    r = run(preset, precision, recompute, args, Path(tmp))
                    if precision == "bf16" and "error" not in r:
                        base = r["tokens_per_s"]
                        if recompute == "off" or ours_bf16 is None:
                            ours_bf16 = base
                    row(preset, recompute, f"this trainer, {precision}", r, base, plain, precision)
            for label, r in peers:
                row(preset, "off", label, r, ours_bf16, plain)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "source": "scripts/bench_fp8.py", "device": name, "versions": versions, "steps": args.steps,
            "warmup": args.warmup, "micro_batch": args.micro_batch, "accum": args.accum,
            "overrides": args.overrides, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    from _cli import run as run_cli  # scripts/ is sys.path[0] when a script runs

    sys.exit(run_cli(main))
