"""Which implementation of the quantization kernels runs on a device.

``kernels/quant.py`` defines every kernel in plain torch; ``kernels/quant_triton.py``
implements the same functions (same signatures, bit-identical payloads and scales)
as Triton kernels. CUDA tensors use the Triton kernels; CPU tensors use the
references, unless ``ZEROPP_TRITON=1`` asks for the Triton kernels (run them on CPU
with ``TRITON_INTERPRET=1``: slow, for testing the wiring end to end). CUDA without
an importable Triton is an error, not a silent switch to the slow path.
"""
from __future__ import annotations

import os
from types import ModuleType

import torch

from kernels import quant


def quant_ops(device: torch.device) -> ModuleType:
    """The module whose quantize_blockwise / dequantize_blockwise / reorder_and_quantize /
    dequant_sum / dequant_sum_requant run on ``device``."""
    want_triton = torch.device(device).type == "cuda" or os.environ.get("ZEROPP_TRITON") == "1"
    if not want_triton:
        return quant
    try:
        from kernels import quant_triton
    except ImportError as e:
        raise RuntimeError(f"ZeRO++ quantized communication on {device} needs Triton "
                           f"(pip install -r requirements-gpu.txt): {e}") from e
    return quant_triton
