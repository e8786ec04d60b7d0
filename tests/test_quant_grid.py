"""The full-range quantization grid of kernels/quant.py against DeepSpeed's symmetric quantizer.

DeepSpeed's reference (written here from its definition, in float64): scale = absmax / 2**(bits-1),
q = clamp(round(x / scale), -2**(bits-1), 2**(bits-1) - 1), dequantized q * scale. Its top code is clipped:
a block's positive maximum never comes back. Ours puts the block's extreme on code -2**(bits-1) whatever its
sign (a signed scale), so it must be at least as accurate: its mean squared error (fp32 dequantized values
against the input in float64) within 5% of DeepSpeed's on every group size, input dtype and width, and it
must use all 2**bits codes.
"""
import numpy as np
import pytest
import torch

from kernels.quant import dequantize_blockwise, quantize_blockwise
from tests.test_quant_kernels import decode

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GROUPS = [8, 16, 64, 128, 512, 2048, 16384]
NUMEL = 2 ** 17


def sample(kind: str, seed: int) -> np.ndarray:
    """NUMEL float64 values: standard normal, Student's t with 3 degrees of freedom (heavy tails), or normal
    with one value in a thousand 50 times larger."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(NUMEL)
    if kind == "student_t3":
        return rng.standard_t(3, NUMEL)
    v = rng.standard_normal(NUMEL)
    v[rng.choice(NUMEL, NUMEL // 1000, replace=False)] *= 50
    return v


def deepspeed_mse(x: np.ndarray, bits: int, group: int) -> float:
    """Mean squared error of DeepSpeed's symmetric quantizer, float64 throughout."""
    m = 2 ** (bits - 1)
    blocks = x.reshape(-1, group)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / m
    q = np.clip(np.rint(blocks / np.where(scale > 0, scale, 1.0)), -m, m - 1)
    return float(np.mean((q * scale - blocks) ** 2))


def our_mse(x: torch.Tensor, bits: int, group: int) -> float:
    payload, scales = quantize_blockwise(x, bits, group)
    out = dequantize_blockwise(payload, scales, bits, group, x.numel(), torch.float32)
    return float(torch.mean((out.double() - x.double()) ** 2))


@pytest.mark.parametrize("kind", ["normal", "student_t3", "outliers"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_mse_at_most_deepspeed(bits, dtype, kind):
    x = torch.from_numpy(sample(kind, seed=bits)).to(dtype)
    x64 = x.double().numpy()                            # both quantize the same (rounded) input
    ratios = {g: our_mse(x, bits, g) / deepspeed_mse(x64, bits, g) for g in GROUPS}
    assert all(r <= 1.05 for r in ratios.values()), ratios


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_every_code_occurs_and_the_extreme_is_exact(bits, dtype):
    m, group = 2 ** (bits - 1), 128
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2 ** 16, generator=g).to(dtype)
    payload, scales = quantize_blockwise(x, bits, group)
    codes = decode(payload, bits).reshape(-1, group)
    assert np.array_equal(np.unique(codes), np.arange(-m, m))
    # the extreme (the positive one on a tie) is code -m and comes back exactly: scale = extreme / -m
    x64 = x.double().numpy().reshape(-1, group)
    top, bottom = x64.argmax(axis=1), x64.argmin(axis=1)
    rows = np.arange(len(x64))
    at = np.where(x64[rows, top] >= -x64[rows, bottom], top, bottom)
    assert (codes[rows, at] == -m).all()
    assert np.array_equal(scales.double().numpy(), x64[rows, at] / -m)
    out = dequantize_blockwise(payload, scales, bits, group, x.numel(), torch.float32).double().numpy()
    assert np.array_equal(out.reshape(-1, group)[rows, at], x64[rows, at])
