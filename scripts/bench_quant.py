"""Time the ZeRO++ quantization kernels on CPU: the plain-torch references (``kernels/quant.py``)
against the fast CPU path (``kernels/quant_cpu.py``), at the sizes one qgZ/qwZ step uses with
4 gloo ranks. Prints a markdown table (median of ``--repeats`` timed calls after a warm-up).

    python scripts/bench_quant.py [--threads 1] [--repeats 20]
    python scripts/bench_quant.py --device cuda        # the Triton kernels on a GPU: GB/s against a copy

On CUDA (``--device cuda``) it times the Triton kernels (``kernels/quant_triton.py``) at a 1.3B model
layer's size and more with CUDA events, and prints each one's bandwidth (bytes read + written per second)
beside the device's own copy bandwidth (a 2 GiB ``copy_``, read + written): a memory-bound kernel is
as good as it gets when it is near that figure.

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
from scripts._cli import InputError, at_least  # noqa: E402


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


def cuda_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median time of one call on the GPU (CUDA events around each call, after two warm-ups)."""
    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth_gbs(repeats: int) -> float:
    """The device's copy bandwidth, GB/s read + written: a 2 GiB ``copy_`` (what a memory-bound kernel can reach)."""
    big = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(big)
    return 2 * big.numel() * 2 / cuda_ms(lambda: dst.copy_(big), repeats) / 1e6


def cuda_main(repeats: int) -> None:
    from kernels import quant_triton as qt

    dev = torch.device("cuda")
    copy_gbs = copy_bandwidth_gbs(repeats)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, median of {repeats}; device copy "
          f"{copy_gbs:,.0f} GB/s (read + written)\n")
    print("| kernel | size | ms | GB/s | of copy bandwidth |")
    print("|---|---|---:|---:|---:|")
    g = torch.Generator(device=dev).manual_seed(0)
    for n in (50_331_648, 268_435_456):   # a gpt_1.3b layer; 256M values
        x = torch.randn(n, generator=g, device=dev).to(torch.bfloat16)
        for bits in (8, 4):
            block = 128
            nb = -(-n // block)
            pbytes = nb * block * bits // 8
            p, sc = qt.quantize_blockwise(x, bits, block)
            cases = [
                (f"quantize int{bits}", lambda: qt.quantize_blockwise(x, bits, block), 2 * n + pbytes + 4 * nb),
                (f"dequantize int{bits} -> bf16", lambda: qt.dequantize_blockwise(p, sc, bits, block, n,
                                                                                   torch.bfloat16),
                 pbytes + 4 * nb + 2 * n),
                (f"reorder+quantize int{bits} (8x2, 2 stages)",
                 lambda: qt.reorder_and_quantize(x, 8, 2, bits, block, 2), 2 * n + pbytes + 4 * nb),
            ]
            k = 8
            ps, ss = p[: pbytes // k * k].view(k, -1), sc[: nb // k * k].view(k, -1)
            m = ss.shape[1] * block
            cases += [(f"dequant_sum int{bits} ({k} copies)", lambda: qt.dequant_sum(ps, ss, bits, block, m),
                       ps.numel() + 4 * ss.numel() + 4 * m),
                      (f"dequant_sum_requant int{bits} ({k} copies)",
                       lambda: qt.dequant_sum_requant(ps, ss, bits, block, m, bits),
                       ps.numel() + 4 * ss.numel() + ps.shape[1] + 4 * ss.shape[1])]
            for name, fn, nbytes in cases:
                ms = cuda_ms(fn, repeats)
                gbs = nbytes / ms / 1e6
                print(f"| {name} | {n / 2**20:.0f}M bf16, block {block} | {ms:.3f} | {gbs:,.0f} | "
                      f"{100 * gbs / copy_gbs:.0f}% |", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per cell (median reported)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args(argv)
    at_least(args.threads, 1, "--threads")
    at_least(args.repeats, 1, "--repeats")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: CUDA is not available here (the CPU kernels: --device cpu)")
    if args.device == "cuda":
        cuda_main(args.repeats)
        return
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of {args.repeats}\n")
    print("| function | size | reference ms | fast ms | speed-up |")
    print("|---|---|---:|---:|---:|")
    for name, size, call in cases():
        ref = median_ms(lambda: call(quant), args.repeats)
        fast = median_ms(lambda: call(quant_cpu), args.repeats)
        print(f"| {name} | {size} | {ref:.3f} | {fast:.3f} | {ref / fast:.1f}x |")


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
