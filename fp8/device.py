"""Which GEMMs ``precision=fp8`` runs on a device: decided by compute capability, never by the GPU's name.

FP8-LM's savings are mostly not about FP8 tensor cores: FP8 weight gradients and their 1-byte reductions, the FP8
AdamW's 6 bytes a parameter and whole-tensor ZeRO hold on any GPU. So ``fp8.gemm=auto`` picks, per device:

  device                                   GEMMs   why
  CPU                                      fp8     torch's CPU FP8 product (``fp8/linear.py``): where FP8-LM's
                                                   numerics are tested
  compute capability >= 8.9 (Ada, Hopper,  fp8     FP8 tensor cores (``torch._scaled_mm``)
  Blackwell, and later)
  8.0 - 8.8 (A100, A10, RTX 30)            bf16    bf16 tensor cores, no FP8 ones
  below 8.0 (V100, T4)                     fp16    neither: fp16 GEMMs under the dynamic loss scaler

MS-AMP, FP8-LM's own code, matches "h100" in the device's name, so an H200 or an L40S silently loses its FP8
GEMMs and a renamed device gets them wrongly; only the capability is read here. ``fp8.gemm=fp8`` on a device
without FP8 tensor cores stops with an error naming the device, its capability and the ways forward; bf16 and
fp16 can be forced anywhere (on Hopper they time the A100 and V100 paths). ``fp8.emulate=true`` (FP8 numerics
around 16-bit GEMMs) with ``auto`` takes the device's 16-bit dtype.
"""
from __future__ import annotations

import importlib.util
from typing import Optional, Tuple

import torch

from config import ConfigError, Fp8Config

MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores (``torch._scaled_mm`` on CUDA)."""
BF16_CAPABILITY = (8, 0)
"""bf16 tensor cores (Ampere)."""


def te_available() -> bool:
    """Transformer Engine importable (a CUDA-only optional backend)."""
    return importlib.util.find_spec("transformer_engine") is not None


def _cap(c: Tuple[int, int]) -> str:
    return f"{c[0]}.{c[1]}"


def choose_gemm(cfg: Fp8Config, device_type: str, capability: Optional[Tuple[int, int]] = None,
                name: str = "") -> Tuple[str, str]:
    """``(gemm, why)``: the GEMM dtype ``precision=fp8`` runs on this device (fp8 | bf16 | fp16) and the reason, for
    the start-up line. ``capability`` and ``name`` describe a CUDA device (``name`` only appears in messages);
    raises ConfigError for a setting the device cannot run."""
    if cfg.backend == "te":
        if device_type != "cuda" or not te_available():
            raise ConfigError("fp8.backend=te needs Transformer Engine on a CUDA device "
                              f"({'not installed' if not te_available() else 'device is ' + device_type}); "
                              "use fp8.backend=torch (torch._scaled_mm, CPU and compute capability >= 8.9)")
        raise ConfigError("fp8.backend=te: Transformer Engine is installed, but this version routes FP8 GEMMs "
                          "through torch._scaled_mm only; use fp8.backend=torch")
    if device_type == "cuda":
        if capability is None:
            raise ValueError("choose_gemm: a CUDA device needs its compute capability")
        where = f"{name or 'this GPU'} (compute capability {_cap(capability)})"
        fp8_cores = tuple(capability) >= MIN_CAPABILITY
        sixteen = "bf16" if tuple(capability) >= BF16_CAPABILITY else "fp16"
    else:
        where, fp8_cores, sixteen = "CPU", True, "bf16"
    if cfg.gemm == "fp8":
        if not fp8_cores:
            raise ConfigError(
                f"fp8.gemm=fp8 needs FP8 tensor cores (compute capability >= {_cap(MIN_CAPABILITY)}); this device is "
                f"{where}. Use fp8.gemm=auto ({sixteen} GEMMs here, with FP8-LM's FP8 gradients, communication and "
                f"optimizer), or precision={sixteen}")
        return "fp8", f"fp8.gemm=fp8 on {where}"
    if cfg.gemm in ("bf16", "fp16"):
        slow = (" (no bf16 tensor cores here: slow)" if cfg.gemm == "bf16" and device_type == "cuda"
                and tuple(capability) < BF16_CAPABILITY else "")
        return cfg.gemm, f"fp8.gemm={cfg.gemm} (forced) on {where}{slow}"
    if cfg.gemm != "auto":
        raise ConfigError(f"fp8.gemm={cfg.gemm!r} is not one of ['auto', 'fp8', 'bf16', 'fp16']")
    if cfg.emulate:
        return sixteen, f"fp8.gemm=auto with fp8.emulate=true: FP8 numerics around the 16-bit GEMMs of {where}"
    if fp8_cores:
        return "fp8", f"fp8.gemm=auto: {where} " + ("runs FP8 GEMMs" if device_type != "cuda" else
                                                     "has FP8 tensor cores")
    if sixteen == "bf16":
        return "bf16", (f"fp8.gemm=auto: {where} has bf16 but no FP8 tensor cores (those need compute capability >= "
                        f"{_cap(MIN_CAPABILITY)})")
    return "fp16", (f"fp8.gemm=auto: {where} has neither FP8 nor bf16 tensor cores (compute capability >= "
                    f"{_cap(BF16_CAPABILITY)}): fp16 GEMMs under the dynamic loss scaler")


def resolve_gemm(device: torch.device, cfg: Fp8Config) -> Tuple[str, str]:
    """``choose_gemm`` for a torch device (its capability and name read from CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return choose_gemm(cfg, device.type)
    return choose_gemm(cfg, "cuda", tuple(torch.cuda.get_device_capability(device)),
                       torch.cuda.get_device_name(device))


def triton_has_e4m3(device: torch.device) -> bool:
    """Whether ``torch.compile`` can generate kernels that touch E4M3 tensors here: on CPU (inductor's C++), and on
    CUDA from compute capability 8.9 only: Triton has no E4M3 type (its fp8e4nv) below ("fp8e4nv data type is not
    supported on CUDA arch < 89", triton-lang/triton#4319), so on an A100 or V100 FP8-LM's per-unit work (E4M3
    first moments and weights) runs eager, and blocks with emulated FP8 casts are not compiled."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return tuple(torch.cuda.get_device_capability(device)) >= MIN_CAPABILITY


def startup_line(cfg: Fp8Config, why: str) -> str:
    """What a run prints at start-up, for a resolved ``cfg.gemm``: which GEMMs run, why, and what FP8-LM keeps."""
    kept = "FP8 gradients with mu and their FP8 communication, the FP8 AdamW (6 bytes a parameter)"
    fp16 = "; everything computes in fp16 under the dynamic loss scaler" if cfg.gemm == "fp16" else ""
    if cfg.gemm == "fp8":
        return f"[fp8] FP8 GEMMs ({why}); {kept}"
    if cfg.emulate:
        return f"[fp8] FP8 numerics emulated around {cfg.gemm} GEMMs ({why}); {kept}{fp16}"
    return (f"[fp8] {cfg.gemm} GEMMs of the step's {cfg.gemm} working weights, activations not quantized ({why}); "
            f"{kept}{fp16}")
