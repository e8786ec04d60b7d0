"""FP8 formats and per-tensor scaled casts: the one definition every FP8 path uses.

Convention (FP8-LM's and Transformer Engine's): a tensor ``x`` is stored as
``q = cast(x * s)`` together with its scale ``s``; ``x ≈ q / s``. The cast
saturates: values beyond the format's maximum become ±max (never inf), NaN stays
NaN so a broken tensor is still seen as broken.

  E4M3  torch.float8_e4m3fn  max 448     weights and activations (more mantissa)
  E5M2  torch.float8_e5m2    max 57344   gradients (more range)

``scale_from_amax`` is the one scale rule: ``s = max / amax / 2**margin``, optionally
rounded down to a power of two (then ``q / s`` is exact in any wider float); an amax
that is zero or not finite keeps the previous scale (1 if none), so one bad step
cannot poison every later cast.

The same helpers serve FP16 with a scale (the FP8 optimizer's master weights and
second moment): ``format_max(torch.float16)`` is 65504.

Collectives never see float8 dtypes: ``parallel/comm.py`` moves them as uint8 views.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
"""Config name -> dtype."""


def format_max(dtype: torch.dtype) -> float:
    """Largest finite value of ``dtype`` (448 for E4M3, 57344 for E5M2, 65504 for FP16)."""
    return float(torch.finfo(dtype).max)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim fp32 tensor (0 for an empty tensor); NaN if x holds a NaN."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().max().float()


def scale_from_amax(amax_value: torch.Tensor, dtype: Optional[torch.dtype], margin: int = 0, power_of_two: bool = False,
                    previous: Optional[torch.Tensor] = None, maximum: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``max(dtype) / amax / 2**margin`` as an fp32 tensor of amax's shape (0-dim for one tensor, [T] for T at
    once), rounded down to 2**k if ``power_of_two``.

    Where amax is 0, inf or NaN, or the scale would not be a finite positive number, the previous scale is
    kept (1 when there is none). The power of two is read off the scale's exponent bits (its sign and
    mantissa cleared): exactly 2**floor(log2(scale)) for every normal scale, and the same bits element by
    element however many scales are computed at once (an fp32 ``log2`` may round up to the next integer
    just below a power of two, and vectorised and scalar ``log2`` need not agree).

    ``maximum`` (instead of ``dtype``): each element's format maximum, an fp32 tensor of amax's shape, for scales
    of several formats at once (the same bits as one call per format)."""
    amax_value = amax_value.float()
    # a true fp32 division (``python_float / tensor`` is a reciprocal then a product: two roundings, which
    # can round a quotient just below 2**k up to 2**k and so scale the amax past the format's maximum)
    top = maximum if maximum is not None else torch.full_like(amax_value, format_max(dtype))
    scale = top / amax_value / (2.0 ** margin)
    ok = torch.isfinite(amax_value) & (amax_value > 0) & torch.isfinite(scale) & (scale > 0)
    if power_of_two:  # scale >= max / FLT_MAX > 2**-126 wherever ok: always normal there
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    fallback = previous.float() if previous is not None else torch.ones_like(scale)
    return torch.where(ok, scale, fallback)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast of ``x * scale`` to ``dtype`` (an FP8 format or FP16)."""
    m = format_max(dtype)
    return (x.float() * scale).clamp_(-m, m).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q / scale`` in ``dtype`` (computed in fp32)."""
    return (q.float() / scale).to(dtype)


@dataclass
class Scaled:
    """A tensor stored in a narrow format with its per-tensor scale (``value ≈ data / scale``)."""

    data: torch.Tensor
    scale: torch.Tensor
    """0-dim fp32."""

    @classmethod
    def of(cls, x: torch.Tensor, dtype: torch.dtype, margin: int = 0, power_of_two: bool = False) -> "Scaled":
        """Cast with a fresh scale from x's own amax (current scaling)."""
        s = scale_from_amax(amax(x), dtype, margin, power_of_two)
        return cls(quantize(x, s, dtype), s)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.data, self.scale, dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()
