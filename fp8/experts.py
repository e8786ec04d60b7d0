"""FP8 GEMMs of the routed experts (``model/moe.py Experts`` under ``precision=fp8``; SPEC §4, FP8-LM §2.3).

Each stacked projection of the experts, ``w_up [E, (2,) F, d]`` and ``w_down [E, d, F]``, is one FP8 "linear"
over the token-slots sorted by expert (``x [N, in]``, ``counts[e]`` rows of expert e), with the numerics of
``fp8/linear.py`` on each expert's rows:

  forward   y_e  = x_e · W_eᵀ      E4M3 x E4M3
  backward  dx_e = dy_e · W_e      G    x E4M3      (G = fp8.gradient_format, E5M2 by default)
            dW_e = dy_eᵀ · x_e     G    x E4M3

Scale granularity: one ``Fp8States`` per stacked projection, shared by its experts (``Fp8ExpertProjection``):
x is cast once (every expert's rows of this forward, the input scale), the stacked weight once (every expert's
matrix, the weight scale), dy once (the gradient scale), as a dense FP8 linear casts its three operands. Each
cast is then one amax and one kernel whatever the routing, every rank makes the same casts (an expert with no rows
on this rank changes no collective of current or just-in-time scaling), and the states are named, reduced and
checkpointed like any linear's (``fp8/scaling.py``: ``layers.<i>.mlp.experts.up`` / ``.down``). Under expert
parallelism an EP rank holds only its experts, and delayed scaling's MAX over DP spans every EP rank: the scale is
that of the whole stacked tensor, as a TP-sharded weight has the scale of the whole logical tensor, so it is the
one-process run's. The cost: an expert whose weights or inputs are far below the stack's largest keeps fewer
significant bits (E4M3 reaches 2**-9 of its maximum as subnormals); per-expert scales would be the refinement.

The product, per expert: ``fp8/linear.py``'s ``_mm`` on the expert's rows (``torch._scaled_mm`` on CUDA; on CPU the
fp32 GEMM of the operands widened exactly, or torch's CPU ``_scaled_mm`` with ``GPT_CPU_FP8_GEMM=native``;
dequantized 16-bit GEMMs with ``fp8.emulate``). ``torch._scaled_grouped_mm`` (torch 2.13) is not used: it has no
CPU kernel (NotImplementedError) and on CUDA takes row-wise scales on compute capability 9.0+ only, a path no
machine here could run. CUDA's ``_scaled_mm`` needs every GEMM dimension but the first divisible by 16; the weight
gradient's reduction runs over the expert's rows, so there each expert's FP8 rows are padded with zero rows to a
multiple of 16 (``ROW_MULTIPLE``; zeros add nothing: the same sums). d_model and the experts' width must be
multiples of 16 on CUDA (checked up front, naming them).
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from config import Fp8Config
from fp8.linear import _check_device, _mm, compute_dtype
from fp8.scaling import Fp8States
from parallel.comm import Group

ROW_MULTIPLE: Dict[str, int] = {"cuda": 16}
"""Device type -> the multiple each expert's rows are padded to in the weight-gradient GEMM (1 elsewhere)."""


def _pad_rows(q: torch.Tensor, multiple: int) -> torch.Tensor:
    """FP8 ``q [n, k]`` with zero rows appended up to a multiple of ``multiple`` rows (+0 is byte 0 in E4M3 and
    E5M2)."""
    extra = -q.shape[0] % multiple
    if not extra:
        return q
    zeros = torch.zeros((extra,) + tuple(q.shape[1:]), dtype=torch.uint8, device=q.device)
    return torch.cat([q.view(torch.uint8), zeros]).view(q.dtype)


class _Fp8Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, qw, sw, counts: List[int], states: Fp8States, tp: Group, emulate: bool,
                out_dtype: torch.dtype, record: bool):
        # qw, sw: the stacked weight's E4M3 cast and scale (Fp8States.weight_operand); ``weight`` is here for its
        # gradient only (at FP8-LM's stage 0 it holds no data)
        experts, in_features = len(counts), x.shape[-1]
        qx, sx = states.input.cast(x, tp, record=record)
        qw = qw.reshape(experts, -1, in_features)  # [E, out, in]
        outs = [_mm(rows, sx, qw[e].t(), sw, out_dtype, emulate)
                for e, rows in enumerate(qx.split(counts)) if counts[e]]
        y = torch.cat(outs) if outs else torch.zeros((0, qw.shape[1]), dtype=out_dtype, device=x.device)
        ctx.save_for_backward(qx, qw, sx, sw)
        ctx.counts, ctx.states, ctx.tp, ctx.emulate, ctx.out_dtype = counts, states, tp, emulate, out_dtype
        ctx.x_dtype, ctx.w_dtype, ctx.w_shape = x.dtype, weight.dtype, weight.shape
        return y

    @staticmethod
    def backward(ctx, grad_y):
        qx, qw, sx, sw = ctx.saved_tensors
        counts, emulate = ctx.counts, ctx.emulate
        qg, sg = ctx.states.grad.cast(grad_y, ctx.tp)
        grad_x = grad_w = None
        pieces = [(e, g, x) for e, (g, x) in enumerate(zip(qg.split(counts), qx.split(counts))) if counts[e]]
        if ctx.needs_input_grad[0]:
            outs = [_mm(g, sg, qw[e], sw, ctx.out_dtype, emulate) for e, g, _ in pieces]
            grad_x = (torch.cat(outs) if outs else grad_y.new_zeros((0, qx.shape[-1]), dtype=ctx.out_dtype))
            grad_x = grad_x.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            # as fp8/linear.py: the GEMM writes the weight's dtype (emulated: fp32 products of the 16-bit operands)
            out = torch.float32 if emulate else ctx.w_dtype
            multiple = ROW_MULTIPLE.get(qx.device.type, 1)
            grad_w = torch.zeros(qw.shape, dtype=ctx.w_dtype, device=qw.device)  # an expert with no rows: zeros
            for e, g, x in pieces:
                grad_w[e] = _mm(_pad_rows(g, multiple).t(), sg, _pad_rows(x, multiple), sx, out, emulate)
            grad_w = grad_w.view(ctx.w_shape)
        return grad_x, grad_w, None, None, None, None, None, None, None, None


def fp8_experts(x: torch.Tensor, weight: torch.Tensor, counts: List[int], states: Fp8States, tp: Group, *,
                emulate: bool) -> torch.Tensor:
    """``x [N, in]`` (rows sorted by expert, ``counts[e]`` of expert e) through each expert's ``[out, in]`` matrix of
    the stacked ``weight [E, .., in]`` (``E = len(counts)``, its middle dims flattened into ``out``), in FP8 (see
    the module docstring) -> ``[N, out]`` in the compute dtype (autocast's where it is on, else x's)."""
    if weight.shape[0] != len(counts) or x.shape[-1] != weight.shape[-1] or x.dim() != 2:
        raise ValueError(f"fp8_experts: x {tuple(x.shape)} and {len(counts)} experts do not match the stacked "
                         f"weight {tuple(weight.shape)}")
    if sum(counts) != x.shape[0]:
        raise ValueError(f"fp8_experts: the experts' counts sum to {sum(counts)}, x has {x.shape[0]} rows")
    if not emulate:  # (the rows are padded to 16 where the GEMM needs it: only the features are checked)
        _check_device(x, 0, weight.shape[-1], weight[0].numel() // weight.shape[-1])
    record = torch.is_grad_enabled()  # a forward without autograd leaves the delayed-scaling amaxes alone
    qw, sw = states.weight_operand(weight, tp, record)
    return _Fp8Experts.apply(x, weight, qw, sw, counts, states, tp, emulate, compute_dtype(x), record)


class Fp8ExpertProjection(nn.Module):
    """The FP8 scaling states of one stacked projection of the routed experts, shared by every expert
    (``Experts.up`` / ``Experts.down``; their module paths, ``layers.<i>.mlp.experts.up`` / ``.down``, name the
    states in checkpoints: ``fp8.<path>.<role>.<field>``). It holds no parameter: the weight is the Experts'
    stacked ``w_up`` / ``w_down``, kept unregistered here so that the parameters keep their names, and read only
    through ``Fp8States.weight_operand`` (at FP8-LM's stage 0 it is cast from the masters: ``fp8_weight_params``,
    ``fp8/scaling.fp8_only_weights``)."""

    def __init__(self, weight: nn.Parameter, fp8: Fp8Config, tp: Group):
        super().__init__()
        self._weight = (weight,)  # a tuple: not registered
        self.fp8, self.tp = fp8, tp
        self.fp8_states = Fp8States(fp8)

    @property
    def weight(self) -> nn.Parameter:
        return self._weight[0]

    def fp8_weight_params(self) -> List[nn.Parameter]:
        """The parameter whose values, as ``[-1, in]`` rows, are the FP8 GEMMs' weight operand."""
        return [self._weight[0]]

    def forward(self, x: torch.Tensor, counts: List[int]) -> torch.Tensor:
        return fp8_experts(x, self._weight[0], counts, self.fp8_states, self.tp, emulate=self.fp8.emulate)
