"""Where FP8 GEMMs can run: decided by compute capability, never by the GPU's name.

``torch._scaled_mm`` needs FP8 tensor cores: compute capability >= 8.9 (Ada,
Hopper and later). It also runs on CPU (torch >= 2.13), which is how every FP8
path is tested without a GPU. Elsewhere (V100 7.0, A100 8.0) ``precision=fp8``
stops with an error naming the device and the ways forward, unless
``fp8.emulate=true`` asks for FP8 numerics around bf16 GEMMs.
"""
from __future__ import annotations

import importlib.util

import torch

from config import ConfigError, Fp8Config

MIN_CAPABILITY = (8, 9)


def te_available() -> bool:
    """Transformer Engine importable (a CUDA-only optional backend)."""
    return importlib.util.find_spec("transformer_engine") is not None


def check_fp8_device(device: torch.device, cfg: Fp8Config) -> None:
    """Raise ConfigError when ``precision=fp8`` cannot run as configured on ``device``."""
    if cfg.backend == "te":
        if device.type != "cuda" or not te_available():
            raise ConfigError("fp8.backend=te needs Transformer Engine on a CUDA device "
                              f"({'not installed' if not te_available() else 'device is ' + device.type}); "
                              "use fp8.backend=torch (torch._scaled_mm, CPU and compute capability >= 8.9)")
        raise ConfigError("fp8.backend=te: Transformer Engine is installed, but this version routes FP8 GEMMs "
                          "through torch._scaled_mm only; use fp8.backend=torch")
    if device.type != "cuda" or cfg.emulate:
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"precision=fp8 needs FP8 tensor cores (compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}); "
            f"{device} is {name} with compute capability {major}.{minor}. Use precision=bf16 "
            f"(precision=fp16 on V100), or fp8.emulate=true for FP8 numerics around bf16 GEMMs (no speed-up)")
