"""Time the ZeRO++ quantization kernels on CPU: the plain-torch references (``kernels/quant.py``)
against the fast CPU path (``kernels/quant_cpu.py``), at the sizes one qgZ/qwZ step uses with
4 gloo ranks. Prints a markdown table (median of ``--repeats`` timed calls after a warm-up).

    python scripts/bench_quant.py [--threads 1] [--repeats 20]

The references' times depend on the allocator: their large temporaries cost page faults on every
call when freed memory goes back to the OS (e.g. ``MALLOC_MMAP_THRESHOLD_=131072``), and far less
once the heap keeps it (the default after a few calls): compare runs under the same setting.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import quant, quant_cpu  # noqa: E402


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cases() -> List[Tuple[str, str, Callable]]:
    """(function, size, call(module)) at the sizes of the brief: 200k / 800k elements."""
    g = torch.Generator().manual_seed(0)
    x200 = torch.randn(200_000, generator=g).to(torch.bfloat16)
    x800 = torch.randn(800_000, generator=g).to(torch.bfloat16)
    p8, s8 = quant.quantize_blockwise(x800, 8, 128)
    copies4 = [quant.quantize_blockwise(torch.randn(200_000, generator=g), 4, 128) for _ in range(2)]
    p4 = torch.stack([c[0] for c in copies4])
    s4 = torch.stack([c[1] for c in copies4])
    return [
        ("quantize_blockwise int8", "200k bf16, block 128",
         lambda m: m.quantize_blockwise(x200, 8, 128)),
        ("dequantize_blockwise int8", "800k -> bf16, block 128",
         lambda m: m.dequantize_blockwise(p8, s8, 8, 128, 800_000, torch.bfloat16)),
        ("reorder_and_quantize int4", "800k bf16, x=2 y=2, block 128, stages 2",
         lambda m: m.reorder_and_quantize(x800, 2, 2, 4, 128, 2)),
        ("dequant_sum_requant int4", "2 copies x 200k, block 128",
         lambda m: m.dequant_sum_requant(p4, s4, 4, 128, 200_000, 4)),
        ("dequant_sum int4", "2 copies x 200k, block 128",
         lambda m: m.dequant_sum(p4, s4, 4, 128, 200_000)),
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per cell (median reported)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of {args.repeats}\n")
    print("| function | size | reference ms | fast ms | speed-up |")
    print("|---|---|---:|---:|---:|")
    for name, size, call in cases():
        ref = median_ms(lambda: call(quant), args.repeats)
        fast = median_ms(lambda: call(quant_cpu), args.repeats)
        print(f"| {name} | {size} | {ref:.3f} | {fast:.3f} | {ref / fast:.1f}x |")


if __name__ == "__main__":
    main()
