"""Where one training step's time goes: ``torch.profiler`` over one step of a preset on one device.

    python scripts/profile_step.py --preset gpt_1.3b --precision bf16          # on a GPU
    python scripts/profile_step.py --preset tiny --precision fp32 --device cpu # the same on CPU
    python scripts/profile_step.py --preset gpt_1.3b --precision fp8 --memory-peak 20   # what the peak holds

Builds the trainer's engine (``training/engine.py``) for ``configs/<preset>.yaml`` at world size 1, runs
``--warmup`` steps on the bundled sample corpus, profiles the next one and prints: the step's wall time,
the device's busy time (sum of kernel times) and so its idle share; time by kind of work (GEMMs,
attention, normalisation/elementwise casts, optimizer, quantization, communication, copies); host
synchronisations (device-to-host copies, stream/device syncs) and their count; and the top operators by
self device time. ``--trace FILE`` also writes a Chrome trace.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts._cli import InputError, at_least, load_config, output_file, preset as preset_file  # noqa: E402

KINDS = [  # (kind, pattern on a kernel / op name), first match wins
    ("gemm", r"gemm|matmul|\bmm\b|addmm|bmm|scaled_mm|cutlass|sm90_xmma|nvjet|cublas|linear"),
    ("attention", r"flash|attention|fmha|sdpa|efficient_attention|cudnn"),
    ("quantization", r"quant|_kernel_q|triton_.*quant|dequant|hadamard"),
    ("optimizer", r"adam|foreach|multi_tensor|lerp|addcdiv|addcmul|sqrt"),
    ("communication", r"nccl|all_reduce|allreduce|all_gather|reduce_scatter|broadcast"),
    ("copy / cast", r"copy|memcpy|memset|to_copy|cast|convert|fill"),
    ("norm / softmax / loss", r"norm|softmax|cross_entropy|nll|log_softmax"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|gelu|silu|mul|add|where"),
]
SYNCS = r"cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|Memcpy DtoH|cudaMemcpy(?!Async)|aten::item|aten::_local_scalar_dense"


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pat in KINDS:
        if re.search(pat, low):
            return kind
    return "other"


def peak_sites(snapshot: dict, root: Path, top: int):
    """``(peak_bytes, [(where, bytes, tensors), ...])``: replay the allocator's history (``torch.cuda.memory.
    _snapshot()['device_traces']``: alloc / free_completed events in order) to its largest allocated total, and group
    the blocks live at that moment by the innermost stack frame inside ``root`` (``path:line (function)``; blocks
    with no such frame under ``(elsewhere)``), the ``top`` largest groups first."""
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]
    live, total, peak, at = {}, 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, at = total, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
    live_at_peak = {}
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            live_at_peak[e["addr"]] = e
        elif e["action"] == "free_completed":
            live_at_peak.pop(e["addr"], None)
    groups = defaultdict(lambda: [0, 0])
    root = str(Path(root).resolve())
    for e in live_at_peak.values():
        where = "(elsewhere)"
        for f in e.get("frames", []):
            name = str(f.get("filename", ""))
            if name.startswith(root) and not name.endswith("profile_step.py"):
                where = f"{Path(name).relative_to(root)}:{f.get('line')} ({f.get('name')})"
                break
        groups[where][0] += e["size"]
        groups[where][1] += 1
    ranked = sorted(((w, b, n) for w, (b, n) in groups.items()), key=lambda g: -g[1])
    return peak, ranked[:top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt_350m", help="configs/<preset>.yaml, or a YAML file's path")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--kernels", type=int, default=0,
                    help="also list the N kernels with the most device time, full names (0: none)")
    ap.add_argument("--trace", default=None, help="also write a Chrome trace here")
    ap.add_argument("--memory-peak", type=int, default=0, metavar="N",
                    help="CUDA: record every allocation from the engine's construction on and list the N places "
                         "(first frame in this project) holding the most memory at the step's peak (0: off; the "
                         "recording slows the steps, so time a step without it)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    # bad input before anything is built: one line, exit code 2 (scripts/_cli.py)
    at_least(args.kernels, 0, "--kernels")
    at_least(args.memory_peak, 0, "--memory-peak")
    for option in ("micro_batch", "accum", "top"):
        at_least(getattr(args, option), 1, "--" + option.replace("_", "-"))
    at_least(args.warmup, 0, "--warmup")
    config = preset_file(args.preset)
    if args.trace:
        output_file(args.trace, "--trace")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise InputError(f"--device {args.device}: {str(e).splitlines()[0]}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {args.device}: CUDA is not available here (use --device cpu)")
    if args.memory_peak and device.type != "cuda":
        raise InputError("--memory-peak reads the CUDA allocator's history: it needs --device cuda")

    from model.flops import flops_per_token
    from parallel.launch import init_distributed, read_launch_env
    from parallel.layout import make_layout
    from parallel.mesh import Mesh
    from config import validate_config
    from training.engine import Engine
    from training.trainer import batch_source, check_data

    sample = ROOT / "data" / "sample"
    cfg = load_config(config, [
        f"precision={args.precision}", f"data.paths=[{sample / 'sample_text_document'}]",
        f"data.tokenizer={sample / 'tokenizer.model'}", f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch * args.accum}", "logging.wandb.mode=disabled",
        "parallel.ranks_per_node=1", *args.overrides], "--preset")
    validate_config(cfg)  # as train.py: a bad choice or range is one line here, not a silent default
    train_ds, _ = check_data(cfg)  # the data and tokenizer (overrides may name others) before the process group
    env = read_launch_env()
    init_distributed(env, device, 600.0)
    if args.memory_peak:
        torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    engine = Engine(cfg, Mesh(make_layout(cfg, 1, 1), device))
    g = cfg.train.global_batch_size
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in range(args.warmup):
        engine.train_step(batch_source(train_ds, step * g, cfg, engine.mesh))
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    batch = batch_source(train_ds, args.warmup * g, cfg, engine.mesh)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        engine.train_step(batch)
        sync()
        wall = time.perf_counter() - t0
    if args.trace:
        prof.export_chrome_trace(args.trace)

    events = prof.key_averages()
    on_device = device.type == "cuda"

    def dev_time(e) -> float:  # microseconds of this op's own kernels
        return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)

    kernels = [e for e in events if on_device and dev_time(e) > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(dev_time(e) for e in kernels) / 1e6 if on_device else float("nan")
    by_kind = defaultdict(float)
    for e in kernels:
        by_kind[kind_of(e.key)] += dev_time(e) / 1e6
    syncs = [(e.key, e.count, e.cpu_time_total / 1e3) for e in events if re.search(SYNCS, e.key)]
    tokens = g * cfg.model.seq_len
    tflops = tokens * flops_per_token(cfg.model) / wall / 1e12
    name = torch.cuda.get_device_name(device) if on_device else "cpu"
    print(f"# one step of {args.preset}, precision={cfg.precision}, recompute={cfg.model.activation_checkpointing}, "
          f"{args.micro_batch} x {args.accum} micro-batches of {cfg.model.seq_len} tokens on {name} "
          f"(torch {torch.__version__})\n")
    print(f"step wall {wall * 1e3:.1f} ms ({tokens / wall:,.0f} tokens/s, {tflops:.1f} TFLOP/s); device busy "
          f"{busy * 1e3:.1f} ms ({100 * busy / wall:.0f}% of the step); train.compile={engine.compiled}\n")
    # how much the host dispatches: every aten operator call (eager ones, and those inside compiled graphs that
    # inductor left as aten calls: GEMMs, attention) and, on a GPU, every kernel launched
    aten = [e for e in events if e.key.startswith("aten::")]
    top_level = sum(e.count for e in aten)
    launches = sum(e.count for e in kernels)
    compiled = sum(e.count for e in events if e.key.startswith(("CompiledFunction", "Torch-Compiled Region")))
    print(f"aten operator calls {top_level:,}; kernels launched {launches:,}" if on_device else
          f"aten operator calls {top_level:,}", f"; compiled-graph calls {compiled}")
    print("most called:", ", ".join(f"{e.key} {e.count}" for e in sorted(aten, key=lambda e: -e.count)[:8]), "\n")
    if on_device:
        print("| kind of work | device ms | share of busy |")
        print("|---|---:|---:|")
        for kind, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
            print(f"| {kind} | {t * 1e3:.1f} | {100 * t / busy:.1f}% |")
        print()
    print("| host synchronisation | calls | host ms |")
    print("|---|---:|---:|")
    for key, count, ms in sorted(syncs, key=lambda s: -s[2]):
        print(f"| {key} | {count} | {ms:.1f} |")
    print()
    if on_device and args.kernels:
        print(f"| kernel (top {args.kernels} by device time) | calls | device ms | us a call |")
        print("|---|---:|---:|---:|")
        for e in sorted(kernels, key=lambda e: -dev_time(e))[:args.kernels]:
            print(f"| {e.key} | {e.count} | {dev_time(e) / 1e3:.2f} | {dev_time(e) / e.count:.1f} |")
        print()
    sort = "self_device_time_total" if on_device else "self_cpu_time_total"
    try:
        print(events.table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
    except (AttributeError, KeyError):  # older torch names the column after CUDA
        print(events.table(sort_by="self_cuda_time_total" if on_device else sort, row_limit=args.top,
                           max_name_column_width=60))
    if args.memory_peak:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, sites = peak_sites(snapshot, ROOT, args.memory_peak)
        print(f"\nmemory at the peak of the run so far: {peak / 2**30:.2f} GiB allocated (torch.cuda."
              f"max_memory_allocated: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB); by where it was "
              f"allocated (the innermost frame in this project):\n")
        print("| allocated at | GiB | tensors |")
        print("|---|---:|---:|")
        for where, nbytes, count in sites:
            print(f"| {where} | {nbytes / 2**30:.3f} | {count} |")
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
