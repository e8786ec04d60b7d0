"""Planning a run before it is launched: a step-time model and a layout search (issue 54; docs/planning.md).

  devices.py    the GPU kinds and the cluster, every figure with its source
  formulas.py   the model's formulas: GEMM roofline, attention, memory-bound time, bubble, ring, overlap
  costs.py      bytes (parallel/volume.py), memory (training/memory.py), parameters (model/flops.py), cached
  step.py       one layout's prediction: compute, bubble, each group's exposed communication, optimizer
  search.py     every valid layout, ranked by predicted tokens/s among those that fit
  calibrate.py  measurements in place of the table's figures (--calibrate FILE; the cpu kind measures itself)
  measured.py   what the benchmark scripts write (bench_fp8.py, gpu_check.sh, bench_cluster.py), read as calibration
  seeds.py      seed 003's (ZeRO++) cluster tables, for scripts/plan_check.py
"""
from __future__ import annotations

from config import Config, validate_config
from parallel.layout import make_layout
from training.plan.devices import DEVICES, Cluster, PlanInputError, make_cluster


def evaluate(cfg: Config, cluster: Cluster) -> dict:
    """The prediction for ``cfg``'s own layout on ``cluster``: checked as train.py checks it (validate_config,
    make_layout: a ConfigError names what is wrong)."""
    from training.plan import costs
    from training.plan.step import predict

    validate_config(cfg)
    layout = make_layout(cfg, cluster.gpus, cluster.gpus_per_node)
    with costs.shared_meta():
        return predict(cfg, layout, cluster)


__all__ = ["DEVICES", "Cluster", "PlanInputError", "evaluate", "make_cluster"]
