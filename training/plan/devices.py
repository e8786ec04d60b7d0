"""What the planner knows about a GPU and a cluster: one row per kind, every number with its source.

A figure is a datasheet's, a paper's, or a measurement of ours with the command that made it. Where a figure is
an assumption (no source we could cite), the source says so. The step-time model (``formulas.py``) reads these
rows only; ``calibrate.py`` replaces them with measurements.

Units: TFLOP/s (dense, no sparsity), bytes (memory), GB/s (1e9 bytes/s; memory bandwidth, NVLink one way per
GPU), Gbit/s (the inter-node network per node, all NICs together, as clusters are sold), seconds (latency).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional


ZERO_INTRA_EFFICIENCY = 0.4
"""ZeRO's parameter and gradient collectives inside a node reach 0.4 of LINK_EFFICIENCY x NVLink (each GPU kind's
``zero_intra_efficiency``; the cpu kind has its own fit): ONE CONSTANT for the GPU kinds, fitted by hand to seed
003's Tables 1(a), 1(b) and 7 (scripts/plan_check.py) together with the DGX-2's ``nic_cap_gbit``, where ZeRO++'s
rows at 8 IB connections (bound by the NVSwitch hops: hpZ's secondary gather, qwZ's and qgZ's intra-node steps)
need it. Our reading, not measured: the gathered parameters and the reduced gradients are also copied in and out
of flat buffers, memory-bound work the byte count alone does not see. TP, CP, EP and PP use the link at
LINK_EFFICIENCY."""


@dataclass(frozen=True)
class Device:
    name: str
    peak_tflops: float
    """Dense fp16/bf16 tensor-core peak."""
    peak_fp8_tflops: Optional[float]
    """Dense FP8 peak; None where the GPU has no FP8 tensor cores (FP8 GEMMs then run at the 16-bit rate)."""
    gemm_ceiling: float
    """Fraction of the peak that a large, square GEMM reaches (the flat top of the roofline)."""
    memory_bytes: int
    memory_gbps: float
    """Memory bandwidth, GB/s."""
    nvlink_gbps: float
    """Intra-node bandwidth per GPU, one direction, GB/s."""
    gpus_per_node: int
    inter_node_gbit: float
    """Default inter-node bandwidth per node (all NICs together), Gbit/s."""
    overlap: float = 0.25
    """The share of a compute window communication can hide behind (formulas.exposed)."""
    sources: Dict[str, str] = field(default_factory=dict, compare=False)
    fp32_ratio: float = 0.5
    """fp32 GEMMs' peak over the 16-bit one (TF32 tensor cores on A100/H100/H200: half; V100 has no TF32)."""
    zero_intra_efficiency: float = ZERO_INTRA_EFFICIENCY
    """The share of the intra-node link ZeRO's parameter and gradient collectives reach (ZERO_INTRA_EFFICIENCY)."""
    nic_cap_gbit: Optional[float] = None
    """The most a node's NICs carry together in collectives (Gbit/s after LINK_EFFICIENCY), where that is less
    than their count times their rate; None: no such limit known."""

    def peak(self, fp8: bool, fp32: bool = False) -> float:
        """The dense peak in FLOP/s for 16-bit GEMMs, FP8 ones where the GPU has FP8 tensor cores, or fp32 ones."""
        t = self.peak_fp8_tflops if fp8 and self.peak_fp8_tflops else self.peak_tflops
        return t * 1e12 * (self.fp32_ratio if fp32 and not fp8 else 1.0)


GEMM_CEILING_MEASURED = ("our measurement: docs/benchmarks.md 'Where an fp8 step goes (H200)': gpt_1.3b's bf16 "
                         "GEMMs ran at ~761 TFLOP/s (the FP8 ones at 1,375 TFLOP/s for ~175 ms against ~316 ms in "
                         "bf16), 0.77 of 989; command: python scripts/profile_step.py --preset gpt_1.3b "
                         "--precision fp8 --micro-batch 4 --accum 4 --warmup 3 --kernels 45")

OVERLAP_GPU = 0.25
"""The share of a compute window that communication hides behind on the GPU kinds: ONE GLOBAL CONSTANT, fitted by
hand to seed 003's Tables 1(a), 1(b) and 7 (scripts/plan_check.py), not per row. Compute and communication
share the GPU's memory bandwidth and SMs (NCCL's kernels); 1.0 would be perfect overlap."""

OVERLAP_EMULATED = 0.0
"""The same on the cpu kind (the emulated cluster): ONE GLOBAL CONSTANT, fitted by hand to scripts/bench_cluster.py's
rows (docs/benchmarks.md 'Emulated cluster (CPU)', and plan_check.py's runs): nothing hides. Four ranks and their
gloo threads share two cores, so the CPU work of sending (copies, TCP) takes the compute's cores; on a quiet
machine 0.5 fits as well (within 10%), under other jobs' load only 0."""

DGX2_NIC_CAP_SOURCE = (
    "fitted by hand to seed 003's Table 1(a) 8 IB rows (one constant for every DGX-2 row): the 8 NICs of a DGX-2 "
    "carry ~320 Gbit/s together in ZeRO's collectives, not 8 x 90. The paper's own reading requires a cap of this "
    "kind: at 8 IB ZeRO++, which cuts the cross-node bytes 4x and not the NVSwitch ones, is still 1.3x faster than "
    "ZeRO-3 (Table 1(a), §4.2), and ZeRO++ at 2 IB beats ZeRO-3 at 8 IB (Figure 7), so ZeRO-3 at 8 IB is bound by the "
    "cross-node link; its published step times imply ~40 GB/s per node")

DEVICES: Dict[str, Device] = {
    "v100": Device(
        "v100", 125.0, None, 0.70, 32 * 10**9, 900.0, 150.0, 16, 800.0,
        OVERLAP_GPU, {"peak_tflops": "NVIDIA V100 SXM2/SXM3 datasheet: 125 TFLOP/s tensor (the ZeRO++ paper, seed 003 §4.2, "
                        "uses 120)",
         "gemm_ceiling": "fitted by hand to seed 003's Table 1(a) (one constant for every V100 row): 87.5 of 125 "
                         "TFLOP/s for the models' large fp16 GEMMs, 0.70",
         "memory": "V100 SXM3 32 GB HBM2, 900 GB/s (datasheet); the DGX-2 of seed 003 §4.1",
         "nvlink_gbps": "NVSwitch (DGX-2): 300 GB/s bidirectional per GPU = 150 one way (datasheet; SPEC §10)",
         "node": "DGX-2: 16 GPUs, 8 x 100 Gbit/s InfiniBand EDR = 800 Gbit/s (seed 003 §4.1)",
         "fp32_ratio": "V100 datasheet: 15.7 TFLOP/s fp32 (no TF32) of 125",
         "nic_cap_gbit": DGX2_NIC_CAP_SOURCE}, fp32_ratio=15.7 / 125, nic_cap_gbit=320.0),
    "a100": Device(
        "a100", 312.0, None, 0.80, 80 * 10**9, 2039.0, 300.0, 8, 1600.0,
        OVERLAP_GPU, {"peak_tflops": "NVIDIA A100 datasheet: 312 TFLOP/s bf16/fp16 dense tensor",
         "gemm_ceiling": "assumption: ~250 of 312 TFLOP/s for large bf16 GEMMs; checked against seed 003 Table 1(b)",
         "memory": "A100 SXM4 80 GB HBM2e, 2,039 GB/s (datasheet)",
         "nvlink_gbps": "NVLink 3: 600 GB/s bidirectional per GPU = 300 one way (datasheet; SPEC §10)",
         "node": "DGX A100: 8 GPUs, 8 x 200 Gbit/s HDR = 1,600 Gbit/s (SPEC §10)",
         "fp32_ratio": "A100 datasheet: 156 TFLOP/s TF32 dense of 312"}),
    "h100": Device(
        "h100", 989.0, 1979.0, 0.77, 80 * 10**9, 3350.0, 450.0, 8, 3200.0,
        OVERLAP_GPU, {"peak_tflops": "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16 dense, 1,979 FP8 dense (SPEC §10)",
         "gemm_ceiling": GEMM_CEILING_MEASURED,
         "memory": "H100 SXM5 80 GB HBM3, 3.35 TB/s (datasheet)",
         "nvlink_gbps": "NVLink 4: 900 GB/s bidirectional per GPU = 450 one way (datasheet; SPEC §10)",
         "node": "DGX H100: 8 GPUs, 8 x 400 Gbit/s NDR = 3,200 Gbit/s (SPEC §10)",
         "fp32_ratio": "H100 SXM5 datasheet: 494.5 TFLOP/s TF32 dense of 989"}),
    "h200": Device(
        "h200", 989.0, 1979.0, 0.77, 141 * 10**9, 4800.0, 450.0, 8, 3200.0,
        OVERLAP_GPU, {"peak_tflops": "NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense, 1,979 FP8 dense (SPEC §10)",
         "gemm_ceiling": GEMM_CEILING_MEASURED,
         "memory": "H200 SXM 141 GB HBM3e, 4.8 TB/s (datasheet)",
         "nvlink_gbps": "NVLink 4: 450 GB/s one way per GPU (datasheet)",
         "node": "HGX H200: 8 GPUs, 8 x 400 Gbit/s NDR = 3,200 Gbit/s (as DGX H100)",
         "fp32_ratio": "H200 SXM datasheet: 494.5 TFLOP/s TF32 dense of 989"}),
    "cpu": Device(
        "cpu", 0.1, None, 1.0, 8 * 2**30, 10.0, 1.0, 2, 0.1,
        OVERLAP_EMULATED, {"peak_tflops": "placeholder: the cpu kind measures this machine's GEMM rate at the model's shapes "
                        "(calibrate.measure_cpu, a few seconds) and uses that as its peak",
         "gemm_ceiling": "1.0: the measured rate is already what a GEMM of the model's shape reaches",
         "memory": "placeholder: measured by calibrate.measure_cpu (a large copy); 8 GiB of memory per rank "
                   "assumed",
         "nvlink_gbps": "assumption: 1 GB/s between two ranks of one emulated node (gloo over loopback)",
         "node": "the emulated cluster (scripts/bench_cluster.py): 2 ranks per namespace, 100 Mbit/s tbf link",
         "fp32_ratio": "1: the measured rate is the dtype the trainer multiplies in (calibrate.measure_cpu)",
         "zero_intra_efficiency": "1/3, fitted by hand with OVERLAP_EMULATED to scripts/bench_cluster.py's rows "
                                  "(with the assumed 1 GB/s loopback link: their product is what the fit sets)"},
        fp32_ratio=1.0, zero_intra_efficiency=1 / 3),
}

LINK_EFFICIENCY = 0.90
"""Fraction of a link's line rate a bandwidth-bound collective reaches. Source: assumption in line with
nccl-tests' bus bandwidth over InfiniBand (~90% of line rate); one global constant, not fitted per row."""

LATENCY_INTRA_S = 2e-6
"""Per ring step inside a node. Source: assumption (NVLink/NVSwitch NCCL step latency, a few microseconds)."""

LATENCY_INTER_S = 10e-6
"""Per ring step across nodes. Source: assumption (NCCL over InfiniBand, ~10 us per step with the protocol's
overheads)."""


@dataclass(frozen=True)
class Cluster:
    device: Device
    gpus: int
    gpus_per_node: int
    inter_node_gbit: float
    """Per node, all NICs together (Gbit/s)."""
    intra_node_gbps: float
    """Per GPU, one direction (GB/s)."""
    overlap: float = 0.25
    """The device's overlap (formulas.exposed), or a calibration's."""

    @property
    def nodes(self) -> int:
        return max(self.gpus // self.gpus_per_node, 1)

    @property
    def inter_node_Bps(self) -> float:
        rate = self.inter_node_gbit * 1e9 / 8 * LINK_EFFICIENCY
        cap = self.device.nic_cap_gbit
        return min(rate, cap * 1e9 / 8) if cap else rate

    @property
    def intra_node_Bps(self) -> float:
        return self.intra_node_gbps * 1e9 * LINK_EFFICIENCY


class PlanInputError(ValueError):
    """Bad planner input (a kind, a cluster shape): one line, exit code 2 (scripts/_cli.py)."""


def make_cluster(kind: str, gpus: int, gpus_per_node: Optional[int] = None, inter_node_gbps: Optional[float] = None,
                 intra_node_gbps: Optional[float] = None, device: Optional[Device] = None) -> Cluster:
    """The cluster of ``gpus`` GPUs of ``kind`` (a ``DEVICES`` key), checked: the node size divides the GPUs."""
    if device is None:
        if kind not in DEVICES:
            raise PlanInputError(f"--gpu {kind}: unknown GPU kind; the kinds are {', '.join(DEVICES)}")
        device = DEVICES[kind]
    g = gpus_per_node if gpus_per_node is not None else device.gpus_per_node
    if gpus < 1:
        raise PlanInputError(f"--gpus must be at least 1, got {gpus}")
    if g < 1:
        raise PlanInputError(f"--gpus-per-node must be at least 1, got {g}")
    if gpus > g and gpus % g:
        raise PlanInputError(f"--gpus {gpus} is not divisible by --gpus-per-node {g} (whole nodes only)")
    for name, v in (("--inter-node-gbps", inter_node_gbps), ("--intra-node-gbps", intra_node_gbps)):
        if v is not None and not v > 0:
            raise PlanInputError(f"{name} must be positive, got {v}")
    return Cluster(device, gpus, min(g, gpus), inter_node_gbps or device.inter_node_gbit,
                   intra_node_gbps or device.nvlink_gbps, device.overlap)


def with_device(cluster: Cluster, **changes) -> Cluster:
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, **changes))
