"""What the benchmark scripts write, read as calibration (``--calibrate``; calibrate.py applies the items).

  scripts/bench_fp8.py --json FILE    (and scripts/gpu_check.sh OUTDIR, whose step 4 writes OUTDIR/bench_fp8.json;
                                      --calibrate OUTDIR reads that file): this trainer's measured steps on one
                                      GPU. The GEMM ceiling is fitted so that the planner's one-GPU step of each
                                      16-bit row equals its measured tokens/s (the median over the rows), then the
                                      FP8 peak likewise for the fp8 rows (FP8-LM's 16-bit-GEMM rows, fp8:<gemm>,
                                      and the peers' rows are not this trainer's default step and are left out).
  scripts/bench_cluster.py --json     the emulated cluster's rows: with their unshaped pass, each row's measured
                                      overlap, (unshaped + bound - step) / unshaped clamped to [0, 1] (the share of
                                      the compute window that hid communication: formulas.exposed's ``overlap``),
                                      the median over the rows.
  scripts/bench_cluster.py --probe --json   the link as the collectives saw it: the median effective rate of the
                                      probe's rows (bytes on the busiest node link / time), as inter_node_gbit
                                      before LINK_EFFICIENCY (the planner then uses exactly the measured rate).

Each returns calibration items (calibrate.KEYS) with ``gpu`` set to the kind the figures belong to.
"""
from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Callable, List, Optional

from training.plan.devices import DEVICES, LINK_EFFICIENCY, PlanInputError, make_cluster

KIND_NAMES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("V100", "v100"))
"""A CUDA device name's marker, and the planner's kind (checked in this order)."""


def kind_of(device_name: str, path: str) -> str:
    for marker, kind in KIND_NAMES:
        if marker in device_name:
            return kind
    raise PlanInputError(f"--calibrate {path}: measured on '{device_name}', none of the planner's GPU kinds "
                         f"({', '.join(k for _, k in KIND_NAMES)})")


def detect(data: object) -> Optional[str]:
    """Which script wrote ``data`` ('bench_fp8', 'bench_cluster', 'probe'), or None (the planner's own keys)."""
    if not isinstance(data, dict):
        return None
    if data.get("source") == "scripts/bench_fp8.py":
        return "bench_fp8"
    if "probe" in data:
        return "probe"
    if "rows" in data and "header" in data:
        return "bench_cluster"
    return None


def items(kind: str, data: dict, path: str) -> List[dict]:
    return {"bench_fp8": from_bench_fp8, "bench_cluster": from_bench_cluster, "probe": from_probe}[kind](data, path)


def _solve(predicted: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """The x in [lo, hi] where the increasing ``predicted(x)`` meets ``target`` (bisection; an end when outside)."""
    if predicted(hi) <= target:
        return hi
    if predicted(lo) >= target:
        return lo
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < target else (lo, mid)
    return (lo + hi) / 2


def from_bench_fp8(data: dict, path: str) -> List[dict]:
    from config import load_config
    from training.plan import evaluate

    kind = kind_of(str(data.get("device", "")), path)
    device = DEVICES[kind]
    rows = [r for r in data.get("rows", []) if isinstance(r, dict) and "error" not in r and r.get("precision")
            in ("bf16", "fp16", "fp8") and isinstance(r.get("tokens_per_s"), (int, float)) and r["tokens_per_s"] > 0]
    if not rows:
        raise PlanInputError(f"--calibrate {path}: no row of this trainer with a measured tokens/s (bf16, fp16 or "
                             "fp8) in this scripts/bench_fp8.py file")
    mb, accum = data.get("micro_batch"), data.get("accum")
    if not (isinstance(mb, int) and isinstance(accum, int) and mb > 0 and accum > 0) or any(
            not isinstance(r.get("config"), str) or r.get("recompute") not in ("off", "selective", "full")
            for r in rows):
        raise PlanInputError(f"--calibrate {path}: a scripts/bench_fp8.py file without its micro_batch / accum "
                             "settings or a row's config / recompute")

    def config(r):
        overrides = [f"precision={r['precision']}", f"model.activation_checkpointing={r['recompute']}",
                     f"train.micro_batch_size={mb}", f"train.global_batch_size={mb * accum}",
                     *data.get("overrides", [])]
        return load_config(str(Path(__file__).resolve().parents[2] / r["config"]), overrides)

    def tokens_per_s(cfg, dev) -> float:
        return evaluate(cfg, dataclasses.replace(make_cluster(kind, 1), device=dev))["tokens_per_s"]

    out: dict = {"gpu": kind}
    sixteen = [r for r in rows if r["precision"] != "fp8"]
    ceiling = device.gemm_ceiling
    if sixteen:
        fits = []
        for r in sixteen:
            cfg = config(r)
            fits.append(_solve(lambda c: tokens_per_s(cfg, dataclasses.replace(device, gemm_ceiling=c)),
                               r["tokens_per_s"], 0.02, 1.0))
        ceiling = statistics.median(fits)
        out["gemm_tflops"] = ceiling * device.peak_tflops
    eights = [r for r in rows if r["precision"] == "fp8"]
    if eights and device.peak_fp8_tflops:
        base = dataclasses.replace(device, gemm_ceiling=ceiling)
        fits = []
        for r in eights:
            cfg = config(r)
            fits.append(_solve(lambda p: tokens_per_s(cfg, dataclasses.replace(base, peak_fp8_tflops=p)),
                               r["tokens_per_s"], 0.05 * device.peak_fp8_tflops, 2.0 * device.peak_fp8_tflops))
        out["fp8_gemm_tflops"] = statistics.median(fits) * ceiling
    return [out]


def from_bench_cluster(data: dict, path: str) -> List[dict]:
    shares = []
    for r in data.get("rows", []):
        step, unshaped, bound = (r.get(k) for k in ("step_time_s", "unshaped_step_time_s", "lower_bound_s"))
        if "error" in r or not all(isinstance(v, (int, float)) and v > 0 for v in (step, unshaped, bound)):
            continue
        shares.append(min(max((unshaped + bound - step) / unshaped, 0.0), 1.0))
    if not shares:
        raise PlanInputError(f"--calibrate {path}: no row with a shaped and an unshaped step in this "
                             "scripts/bench_cluster.py file (run it without --no-unshaped)")
    return [{"overlap": statistics.median(shares), "gpu": "cpu"}]


def from_probe(data: dict, path: str) -> List[dict]:
    probe = [r for r in data.get("probe") or [] if isinstance(r, dict)]
    nodes = next((r.get("group_size") for r in probe if r.get("group") == "inter"), None)
    if not isinstance(nodes, int) or nodes < 2:
        raise PlanInputError(f"--calibrate {path}: this scripts/bench_cluster.py --probe file has no 'inter' group "
                             "row to count the nodes by (run the probe with --probe-groups world,inter)")
    rates = []
    for r in probe:
        wire, took = r.get("wire_bytes"), r.get("time_s")
        if isinstance(wire, (int, float)) and isinstance(took, (int, float)) and wire > 0 and took > 0:
            rates.append(wire / nodes / took)  # bytes/s on the busiest node link, as bench_probe.py's table
    if not rates:
        raise PlanInputError(f"--calibrate {path}: no probe row with wire bytes and a time in this "
                             "scripts/bench_cluster.py --probe file")
    return [{"inter_node_gbit": statistics.median(rates) * 8 / 1e9 / LINK_EFFICIENCY, "gpu": "cpu"}]
