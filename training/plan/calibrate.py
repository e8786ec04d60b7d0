"""Measurements in place of the device table's figures, so that the model improves as measurements arrive.

``--calibrate FILE`` reads a JSON object (or JSON lines, applied in order) with any of these keys:

  gemm_tflops        GEMM TFLOP/s measured at the model's shapes (scripts/bench_fp8.py's or a profile's GEMM
                     rate): the GEMM ceiling becomes gemm_tflops / peak
  fp8_gemm_tflops    the same for FP8 GEMMs (sets the FP8 peak to gemm_tflops_fp8 / ceiling)
  memory_gbps        memory bandwidth a memory-bound kernel reaches (a device copy)
  inter_node_gbit    measured inter-node rate per node (scripts/bench_cluster.py's calibrated rate, nccl-tests)
  intra_node_gbps    measured NVLink rate per GPU, one way
  overlap            the share of a compute window communication hid behind (bench_cluster.py's overlap)
  gpu                (optional) the kind the figures belong to: refused when it is not --gpu's

or what a benchmark script wrote, read by measured.py: scripts/bench_fp8.py --json (or a scripts/gpu_check.sh
OUTDIR: its bench_fp8.json), scripts/bench_cluster.py --json, scripts/bench_cluster.py --probe --json.

The ``cpu`` kind measures this CPU by itself (``measure_cpu``, a few seconds): the GEMM rate at the model's own
shapes (the MLP's [tokens, d] x [d, ffn] in the compute dtype) and a large copy's bandwidth. The ranks of an
emulated cluster share this machine's cores, so a rank's rate is the machine's divided by the ranks.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Optional

from training.plan.devices import Cluster, PlanInputError

KEYS = ("gemm_tflops", "fp8_gemm_tflops", "memory_gbps", "inter_node_gbit", "intra_node_gbps", "overlap", "gpu")


def read(path: str) -> list:
    """The calibration objects of ``path``: one JSON object or JSON lines of KEYS, or what a benchmark script
    wrote (measured.py: scripts/bench_fp8.py's or scripts/bench_cluster.py's --json file, or a
    scripts/gpu_check.sh OUTDIR, whose bench_fp8.json is read)."""
    from pathlib import Path

    from training.plan import measured

    if Path(path).is_dir():
        inside = Path(path) / "bench_fp8.json"
        if not inside.is_file():
            raise PlanInputError(f"--calibrate {path}: a directory without bench_fp8.json (a scripts/gpu_check.sh "
                                 "OUTDIR has one after its step 4)")
        path = str(inside)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise PlanInputError(f"--calibrate {path}: not UTF-8 text (byte {e.start + 1})") from None
    try:
        items = [json.loads(text)]
    except json.JSONDecodeError:
        try:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise PlanInputError(f"--calibrate {path}: malformed JSON ({e.msg} at line {e.lineno})") from None
    if len(items) == 1 and measured.detect(items[0]):
        items = measured.items(measured.detect(items[0]), items[0], path)
    for item in items:
        if not isinstance(item, dict):
            raise PlanInputError(f"--calibrate {path}: expected JSON objects, got {type(item).__name__}")
        unknown = sorted(set(item) - set(KEYS))
        if unknown:
            raise PlanInputError(f"--calibrate {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
        for k, v in item.items():
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if k == "overlap" and not (number and 0 <= v <= 1):
                raise PlanInputError(f"--calibrate {path}: overlap must be a share in [0, 1], got {v!r}")
            if k not in ("gpu", "overlap") and not (number and v > 0):
                raise PlanInputError(f"--calibrate {path}: {k} must be a positive number, got {v!r}")
    return items


def apply(cluster: Cluster, item: dict, path: str = "") -> Cluster:
    dev = cluster.device
    if "gpu" in item and item["gpu"] != dev.name:
        raise PlanInputError(f"--calibrate {path}: its figures are for {item['gpu']}, not --gpu {dev.name}")
    if "gemm_tflops" in item:
        dev = dataclasses.replace(dev, gemm_ceiling=item["gemm_tflops"] / dev.peak_tflops)
    if "fp8_gemm_tflops" in item:
        dev = dataclasses.replace(dev, peak_fp8_tflops=item["fp8_gemm_tflops"] / dev.gemm_ceiling)
    if "memory_gbps" in item:
        dev = dataclasses.replace(dev, memory_gbps=item["memory_gbps"] / 0.9)  # formulas.MEMORY_EFFICIENCY
    out = dataclasses.replace(cluster, device=dev)
    for key, field in (("inter_node_gbit", "inter_node_gbit"), ("intra_node_gbps", "intra_node_gbps"),
                       ("overlap", "overlap")):
        if key in item:
            out = dataclasses.replace(out, **{field: float(item[key])})
    return out


def measure_cpu(cluster: Cluster, cfg, seconds: float = 2.0) -> Cluster:
    """The cpu kind's figures measured here, per rank: GEMM TFLOP/s at the model's MLP shape in the dtype the
    trainer multiplies in on this CPU (``parallel/cpu_gemm.py``: fp32 upcasts where the CPU has no 16-bit matrix
    instructions) and copy bandwidth, on the threads a rank gets (the emulated cluster's ranks run one thread each
    and share this machine's cores: a rank's rate is a thread's x cores / ranks when there are more ranks)."""
    import os

    import torch

    from parallel.cpu_gemm import upcasts

    m = cfg.model
    dtype = torch.float32 if cfg.precision == "fp32" else torch.bfloat16
    if dtype != torch.float32 and upcasts(dtype):
        dtype = torch.float32
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = max(cluster.gpus, 1)
    threads = max(cores // ranks, 1)
    share = min(1.0, cores / (ranks * threads))
    tokens = max(min(cfg.train.micro_batch_size * m.seq_len // max(cfg.parallel.cp, 1), 4096), 1)
    t = max(cfg.parallel.tp, 1)
    a = torch.randn(tokens, m.d_model, dtype=dtype)
    b = torch.randn(m.d_model, max(m.ffn_size // t, 1), dtype=dtype)
    flops = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    x = torch.empty(2**22, dtype=torch.float32)
    y = torch.empty_like(x)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rate = _rate(lambda: a @ b, flops, seconds / 2) * share
        bandwidth = _rate(lambda: y.copy_(x), 2 * 4.0 * x.numel(), seconds / 4) * share
    finally:
        torch.set_num_threads(before)
    dev = dataclasses.replace(cluster.device, peak_tflops=rate / 1e12, gemm_ceiling=1.0,
                              memory_gbps=bandwidth / 1e9 / 0.9)
    out = dataclasses.replace(cluster, device=dev)
    step = measure_cpu_step(cfg, threads, seconds) if _small(cfg) else None
    if step is None:
        return out
    from parallel.layout import make_layout
    from training.plan.step import micro_batch_compute

    cfg1 = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1, pp=1, cp=1, ep=1,
                                                                 virtual_stages=1, sequence_parallel=False),
                               zero=dataclasses.replace(cfg.zero, stage=0, hpz_size=1, quantized_weights=False,
                                                        quantized_gradients=False, weight_delta=False),
                               train=dataclasses.replace(cfg.train, global_batch_size=cfg.train.micro_batch_size))
    modelled = micro_batch_compute(cfg1, make_layout(cfg1, 1, 1), out)
    slower = step / share / modelled  # the GEMM and copy rates at the measured step's pace
    dev = dataclasses.replace(dev, peak_tflops=dev.peak_tflops / slower, memory_gbps=dev.memory_gbps / slower)
    return dataclasses.replace(cluster, device=dev)


MAX_MEASURED_PARAMETERS = 200_000_000
"""A model up to this size is run for one micro-batch on this CPU (``measure_cpu_step``); a larger one keeps the
GEMM and copy rates alone."""


def _small(cfg) -> bool:
    from training.plan.costs import parameters

    return parameters(cfg)["total"] <= MAX_MEASURED_PARAMETERS


def measure_cpu_step(cfg, threads: int, seconds: float) -> Optional[float]:
    """Seconds of one micro-batch's forward and backward of the whole model (``model.gpt.build_chunks``, one
    process, ``threads`` threads, the config's precision under autocast as the trainer runs it on CPU): what the
    GEMM rate alone misses on a CPU -- the per-operation overhead of small layers, the loss, autograd."""
    import torch

    from model.gpt import build_chunks
    from model.layers import TPContext
    from parallel.comm import Group, Ledger
    from parallel.random import RNGTracker

    cpu = torch.device("cpu")
    alone = Group("tp", None, [0], 0, "intra", Ledger())
    ctx = TPContext(alone, False, RNGTracker(cpu, cfg.train.seed, 0, 0, 0))
    model_cfg = dataclasses.replace(cfg.model, activation_checkpointing="off")
    [model] = build_chunks(model_cfg, ctx, 1, 1, 0, cfg.train.seed, cpu)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)

    def once():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model(tokens, tokens)
        loss.backward()

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _rate(once, 1.0, seconds / 2) ** -1
    finally:
        torch.set_num_threads(before)


def _rate(fn, work: float, budget: float) -> float:
    fn()
    n, started = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - started
        if elapsed >= budget and n >= 2:
            return work * n / elapsed


def calibrated(cluster: Cluster, cfg, path: Optional[str]) -> Cluster:
    """``cluster`` with the cpu kind measured and ``path``'s figures applied (in that order)."""
    if cluster.device.name == "cpu":
        cluster = measure_cpu(cluster, cfg)
    if path:
        for item in read(path):
            cluster = apply(cluster, item, path)
    return cluster
