"""What each ``precision`` computes in: the rules every layer reads instead of restating them.

Under ``precision=fp8`` the linear layers' GEMMs follow ``fp8.gemm`` (resolved from ``auto`` by the device at
start-up, ``fp8/device.py``; a config not yet resolved, as the estimators read it, counts ``auto`` as CPU does:
FP8 GEMMs) and everything else computes in bf16, or in fp16 when the GEMMs are fp16 (a V100 has no bf16).
"""
from __future__ import annotations

from config.schema import Config, Fp8Config


def fp8_gemms(f: Fp8Config) -> bool:
    """Whether the linears' GEMMs run in FP8 (not emulated; an unresolved ``auto`` counts as FP8)."""
    return f.gemm in ("fp8", "auto") and not f.emulate


def fp8_operands(f: Fp8Config) -> bool:
    """Whether FP8 linears cast their GEMM operands to FP8 (with scaling states): FP8 GEMMs, or their emulation
    around 16-bit GEMMs. False for 16-bit GEMMs, whose linears are the 16-bit ones of every other precision."""
    return f.emulate or fp8_gemms(f)


def compute_precision(cfg: Config) -> str:
    """The dtype (a precision name: fp32 | bf16 | fp16) of the computation outside FP8 GEMMs: the precision itself,
    for fp8 bf16, or fp16 with ``fp8.gemm=fp16``."""
    if cfg.precision != "fp8":
        return cfg.precision
    return "fp16" if cfg.fp8.gemm == "fp16" else "bf16"


def gemm_precision(cfg: Config) -> str:
    """The dtype the linear layers' GEMMs run in (what their peak FLOP/s is read for): fp8 where FP8 GEMMs run
    (not emulated), else ``compute_precision``."""
    if cfg.precision == "fp8" and fp8_gemms(cfg.fp8):
        return "fp8"
    return compute_precision(cfg)


def grad_accumulation_precision(cfg: Config) -> str:
    """``fp8.grad_accumulation`` as a dtype name (bf16 | fp16 | fp32): ``compute`` is the compute dtype's."""
    acc = cfg.fp8.grad_accumulation
    return compute_precision(cfg) if acc == "compute" else acc
