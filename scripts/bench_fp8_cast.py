"""Time the FP8 backward operand casts on a GPU: the cast-and-transpose kernels (``kernels/fp8_transpose.py``,
``fp8.cast_transpose=true``) against the same operations as torch ops compiled by inductor (what the compiled
FP8 linear runs by default), at gpt_1.3b's backward operand shapes.

    python scripts/bench_fp8_cast.py            # needs CUDA; prints a markdown table

Each row: a [tokens, features] bf16 operand cast to FP8 with a scale into both layouts (``q`` and ``qT``), and
the transpose of an FP8 matrix; median of CUDA-event timings after a warm-up, and the bandwidth (bytes read +
written per second) beside the device's copy bandwidth (``bench_quant.copy_bandwidth_gbs``): a memory-bound
kernel is as good as it gets near that figure. In the trainer the inductor form also fuses the operand's
producer (the GELU backward, say), which this isolated comparison leaves out: the step's own figure is
``gpu_check.sh`` step 4b.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._cli import InputError, at_least  # noqa: E402
from scripts.bench_quant import copy_bandwidth_gbs, cuda_ms  # noqa: E402

SHAPES = [(8192, 8192, "fc2 dy / fc1 out (4 x 2048 tokens, ffn 8192)"), (8192, 6144, "qkv dy"),
          (8192, 2048, "proj / fc2 dy"), (2048, 8192, "fc1 input, transposed")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    at_least(args.repeats, 1, "--repeats")
    if not torch.cuda.is_available():
        raise InputError("this benchmark times CUDA kernels: no CUDA device here")
    from kernels.fp8_transpose import cast_transpose, reference_cast_transpose, reference_transpose, transpose

    inductor_cast = torch.compile(reference_cast_transpose)
    inductor_transpose = torch.compile(reference_transpose)
    copy_gbs = copy_bandwidth_gbs(args.repeats)
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; copy bandwidth {copy_gbs:,.0f} GB/s "
          f"(2 GiB copy, read + written)\n")
    print("| operation | shape | what | inductor us | kernel us | kernel GB/s | kernel / copy bandwidth | speed-up |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    scale = torch.tensor(0.75, device="cuda")
    for m, n, what in SHAPES:
        x = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        a = cuda_ms(lambda: inductor_cast(x, scale, "e5m2"), args.repeats) * 1e3
        b = cuda_ms(lambda: cast_transpose(x, scale, "e5m2"), args.repeats) * 1e3
        moved = m * n * (2 + 1 + 1)
        print(f"| cast + transpose (bf16 -> e5m2, both layouts) | {m} x {n} | {what} | {a:,.1f} | {b:,.1f} | "
              f"{moved / b / 1e3:,.0f} | {moved / b / 1e3 / copy_gbs:.2f} | {a / b:.2f}x |")
        q = cast_transpose(x, scale, "e4m3")[0]
        a = cuda_ms(lambda: inductor_transpose(q), args.repeats) * 1e3
        b = cuda_ms(lambda: transpose(q), args.repeats) * 1e3
        moved = m * n * 2
        print(f"| transpose (e4m3) | {m} x {n} | {what} | {a:,.1f} | {b:,.1f} | {moved / b / 1e3:,.0f} | "
              f"{moved / b / 1e3 / copy_gbs:.2f} | {a / b:.2f}x |")
    return 0


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
