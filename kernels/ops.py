"""Which implementation of the quantization kernels runs on a device.

``kernels/quant.py`` defines every kernel in plain torch (the references: they define the
semantics and are the slow, obvious way to compute them). Two implementations reproduce them
bit for bit (same signatures, same payload bytes and scales):

* ``kernels/quant_cpu.py``: the fast CPU path in plain torch (fewer, in-place passes; the
  reasoning that makes each shortcut exact is in its docstring);
* ``kernels/quant_triton.py``: Triton kernels.

CUDA tensors use the Triton kernels. CPU tensors use ``quant_cpu``, unless
``ZEROPP_TRITON=1`` asks for the Triton kernels (run them on CPU with ``TRITON_INTERPRET=1``:
slow, for testing the wiring end to end) or ``ZEROPP_REFERENCE=1`` asks for the plain
references of ``quant`` (to rule the fast path out when chasing a difference; ``ZEROPP_TRITON``
wins if both are set). CUDA without an importable Triton is an error, not a silent switch to a
plain-torch path.
"""
from __future__ import annotations

import os
from types import ModuleType

import torch

from kernels import quant, quant_cpu


def quant_ops(device: torch.device) -> ModuleType:
    """The module whose quantize_blockwise / dequantize_blockwise / reorder_and_quantize /
    dequant_sum / dequant_sum_requant run on ``device``: ``quant_triton`` on CUDA or with
    ``ZEROPP_TRITON=1``; otherwise ``quant`` (the references) with ``ZEROPP_REFERENCE=1``, else
    ``quant_cpu`` (the fast CPU path, bit-identical to the references)."""
    want_triton = torch.device(device).type == "cuda" or os.environ.get("ZEROPP_TRITON") == "1"
    if not want_triton:
        return quant if os.environ.get("ZEROPP_REFERENCE") == "1" else quant_cpu
    try:
        from kernels import quant_triton
    except ImportError as e:
        raise RuntimeError(f"ZeRO++ quantized communication on {device} needs Triton "
                           f"(pip install -r requirements-gpu.txt): {e}") from e
    return quant_triton
