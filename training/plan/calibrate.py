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
    """The calibration objects of ``path`` (one JSON object, or JSON lines)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        items = [json.loads(text)]
    except json.JSONDecodeError:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    for item in items:
        if not isinstance(item, dict):
            raise PlanInputError(f"--calibrate {path}: expected JSON objects, got {type(item).__name__}")
        unknown = sorted(set(item) - set(KEYS))
        if unknown:
            raise PlanInputError(f"--calibrate {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
        for k, v in item.items():
            if k != "gpu" and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
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
    """The cpu kind's figures measured here: GEMM TFLOP/s at the model's MLP shape, copy bandwidth; per rank
    (the machine's / the cluster's ranks, which share it)."""
    import torch

    m = cfg.model
    dtype = torch.float32 if cfg.precision == "fp32" else torch.bfloat16
    tokens = max(min(cfg.train.micro_batch_size * m.seq_len // max(cfg.parallel.cp, 1), 4096), 1)
    t = max(cfg.parallel.tp, 1)
    a = torch.randn(tokens, m.d_model, dtype=dtype)
    b = torch.randn(m.d_model, max(m.ffn_size // t, 1), dtype=dtype)
    flops = 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    rate = _rate(lambda: a @ b, flops, seconds / 2)
    x = torch.empty(2**24, dtype=torch.float32)
    y = torch.empty_like(x)
    bandwidth = _rate(lambda: y.copy_(x), 2 * 4.0 * x.numel(), seconds / 4)
    share = max(cluster.gpus, 1)
    dev = dataclasses.replace(cluster.device, peak_tflops=rate / share / 1e12, gemm_ceiling=1.0,
                              memory_gbps=bandwidth / share / 1e9 / 0.9)
    return dataclasses.replace(cluster, device=dev)


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
