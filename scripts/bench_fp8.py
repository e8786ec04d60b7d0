"""FP8-LM against bf16 on one GPU: tokens/s, TFLOP/s and MFU of the real trainer for the model presets.

    python scripts/bench_fp8.py                                   # gpt_350m and gpt_1.3b, bf16 and fp8
    python scripts/bench_fp8.py --presets gpt_350m --steps 40 --micro-batch 2
    python scripts/bench_fp8.py --recompute off selective full    # each row with each recompute setting

Each row runs ``train.py --config configs/<preset>.yaml precision=... model.activation_checkpointing=...``
on one device (the preset's model and optimiser, the bundled sample corpus, ``--accum`` micro-batches of
``--micro-batch`` sequences a step) and reads the trainer's own metrics records after ``--warmup`` steps: tokens/s,
model TFLOP/s per device (6N + attention FLOPs a token, ``model/flops.py``) and MFU. MFU is printed
against the bf16 dense peak for both precisions
(comparable: how much of the machine the same model uses), and the trainer's own figure for fp8 is against
the FP8 dense peak. Needs a CUDA device with FP8 (compute capability >= 8.9) for the fp8 rows; on other
devices they fail with the trainer's error, which the table shows.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BF16_PEAK = {"H100": 989.0, "H200": 989.0, "H100 PCIe": 756.0}


SAMPLE = ["data.paths=[" + str(ROOT / "data" / "sample" / "sample_text_document") + "]",
          "data.tokenizer=" + str(ROOT / "data" / "sample" / "tokenizer.model")]


def run(preset: str, precision: str, recompute: str, args, out: Path) -> dict:
    run_dir = out / f"{preset}-{precision}-{recompute}"
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / f"{preset}.yaml"),
           f"precision={precision}", f"model.activation_checkpointing='{recompute}'", *SAMPLE,
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["gpt_350m", "gpt_1.3b"])
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--recompute", nargs="+", default=["selective"], choices=["off", "selective", "full"],
                    help="model.activation_checkpointing settings (a row each)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args(argv)
    try:
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - only for the table's header
        name = "unknown"
    peak = next((v for k, v in sorted(BF16_PEAK.items(), key=lambda kv: -len(kv[0])) if k in name), None)
    print(f"device: {name}; {args.steps} steps ({args.warmup} warm-up), micro-batch {args.micro_batch} x "
          f"{args.accum}\n")
    print("| preset | recompute | precision | tokens/s | TFLOP/s | MFU (bf16 peak) | MFU (trainer) | peak mem GiB "
          "| loss | vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            for recompute in args.recompute:
                base = None
                for precision in args.precisions:
                    r = run(preset, precision, recompute, args, Path(tmp))
                    if "error" in r:
                        print(f"| {preset} | {recompute} | {precision} | failed: {r['error']} |||||||", flush=True)
                        continue
                    base = base or r["tokens_per_s"]
                    mfu16 = f"{100 * r['tflops'] / peak:.1f}%" if peak else "n/a"
                    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
                    print(f"| {preset} | {recompute} | {precision} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | "
                          f"{mfu16} | {mfu} | {r['peak_mem_gib']:.1f} | {r['loss']:.3f} | "
                          f"{r['tokens_per_s'] / base:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
