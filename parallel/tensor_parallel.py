"""Megatron tensor and sequence parallelism (SPEC §2).

Activations are sequence-first, ``[s, b, h]``, so that the sequence split of
sequence parallelism is a contiguous split of dim 0.

The conjugate operators, as in the Megatron paper:

  f   copy_to_tp        identity forward      / all-reduce backward
  g   reduce_from_tp    all-reduce forward    / identity backward
  with sequence parallelism, g and f become
  g   gather_from_sp    all-gather (seq) fwd  / reduce-scatter (seq) bwd    (before a column layer)
  g'  scatter_to_sp     reduce-scatter fwd    / all-gather bwd              (after a row layer)

Layers carry a ``ParamSpec`` on each parameter: its global shape, which dim is
split over TP, how the single-process model initialises it, and whether its
gradient must be summed over TP because each rank saw only part of the sequence.
``model/init.py`` uses the spec to build exactly the single-process tensor, then
keeps this rank's shard; checkpointing uses it to save global tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from config import Fp8Config
from fp8.linear import fp8_linear
from fp8.scaling import Fp8States
from parallel import comm
from parallel.comm import Group
from parallel.cpu_gemm import linear


@dataclass
class ParamSpec:
    global_shape: Tuple[int, ...]
    tp_dim: Optional[int]
    """Dimension split across the TP group (None: replicated)."""
    init: str = "normal"
    """normal | ones | zeros."""
    std: float = 0.02
    sequence_parallel: bool = False
    """Gradient is partial per TP rank (norms/biases in sequence-parallel regions): sum it over TP."""
    shared_with: Optional[str] = None
    """Global name of the parameter this one is a copy of (the tied output weight on the last pipeline
    stage is a copy of ``embedding.weight``): initialised, checkpointed and counted as that one, its
    gradient summed with it over the embedding group."""
    tp_replicas: int = 1
    """Consecutive TP ranks holding the same piece: the tensor is split along ``tp_dim`` into
    ``tp / tp_replicas`` pieces and TP rank r holds piece ``r // tp_replicas`` (grouped-query attention's
    K/V weights when there are fewer KV heads than TP ranks). Each holder's gradient is already the full
    gradient of its piece (the layer sums it over the holders in backward)."""

    ep_size: int = 1
    """Expert parallelism: dim 0 (the routed experts) is split into this many pieces, EP rank r holding piece r
    (``model/moe.py Experts``); its gradient is summed over the expert-data-parallel group, not DP."""

    @property
    def expert(self) -> bool:
        """Whether this parameter is split over the EP group (dim 0)."""
        return self.ep_size > 1

    def local_offset(self, local_shape: Tuple[int, ...], tp_rank: int, ep_rank: int) -> List[int]:
        """Where this rank's local tensor starts in the global one (its TP piece and its EP piece)."""
        offset = self.tp_offset(local_shape, tp_rank)
        if self.expert:
            offset[0] += ep_rank * local_shape[0]
        return offset

    def tp_pieces(self, tp_size: int) -> int:
        """How many distinct pieces the TP group holds (1: replicated)."""
        return 1 if self.tp_dim is None else tp_size // self.tp_replicas

    def tp_piece(self, tp_rank: int) -> int:
        """Which piece TP rank ``tp_rank`` holds."""
        return 0 if self.tp_dim is None else tp_rank // self.tp_replicas

    def tp_offset(self, local_shape: Tuple[int, ...], tp_rank: int) -> List[int]:
        """Where this rank's local tensor starts in the global one."""
        offset = [0] * len(local_shape)
        if self.tp_dim is not None:
            offset[self.tp_dim] = self.tp_piece(tp_rank) * local_shape[self.tp_dim]
        return offset

    def owns_once(self, tp_rank: int) -> bool:
        """Whether this TP rank is the one that counts this piece (norms): the first of its holders."""
        return (tp_rank if self.tp_dim is None else tp_rank % self.tp_replicas) == 0


def set_spec(p: nn.Parameter, spec: ParamSpec) -> nn.Parameter:
    p.spec = spec  # type: ignore[attr-defined]
    return p


def new_param(global_shape: Tuple[int, ...], tp_dim: Optional[int], tp_size: int, **spec) -> nn.Parameter:
    shape = list(global_shape)
    if tp_dim is not None:
        shape[tp_dim] //= tp_size // spec.get("tp_replicas", 1)
    shape[0] //= spec.get("ep_size", 1)
    return set_spec(nn.Parameter(torch.empty(shape)), ParamSpec(tuple(global_shape), tp_dim, **spec))


# ---- conjugate communication operators -------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        comm.all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        comm.all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * group.size,) + tuple(x.shape[1:]))
    comm.all_gather(out, x, group)
    return out


def _reduce_scatter_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous()
    if x.shape[0] % group.size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the TP size {group.size}")
    out = x.new_empty((x.shape[0] // group.size,) + tuple(x.shape[1:]))
    comm.reduce_scatter(out, x, group)
    return out


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromSP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ScatterToSP.apply(x, group)


# ---- layers ------------------------------------------------------------------------------------

def _fp8_states(fp8: Optional[Fp8Config], layer: str):
    """The FP8 scaling states of a linear layer, or None for a bf16 one (``fp8/scaling.py``)."""
    if fp8 is None:
        return None
    if fp8.backend != "torch":
        raise NotImplementedError(f"{layer}: fp8.backend={fp8.backend} is not implemented by the parallel linear "
                                  f"layers (only fp8.backend=torch, FP8 GEMMs through torch._scaled_mm); "
                                  f"fp8.backend=te is not implemented here")
    return Fp8States(fp8)


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A split along its output dim: each rank computes a slice of the features.

    ``fused`` > 1 stacks several matrices that share the input (QKV, SwiGLU gate/up) into one
    GEMM: the global weight is ``(fused, out, in)`` split on dim 1, so every rank holds the same
    slice of each (e.g. its heads' q, k and v) and the global layout is that of separate matrices.
    Input is the full activation (gathered along the sequence first under sequence parallelism);
    output stays split, ``[.., fused * out / tp]``, ready for a row-parallel layer.

    ``fp8``: run the GEMMs in FP8 (``fp8/linear.py``) with this layer's scaling states in
    ``self.fp8_states`` (None for a bf16 layer). Under sequence parallelism with
    ``fp8.sequence_parallel_fp8`` the sequence all-gather moves the E4M3 cast of the input (half the
    bytes); otherwise the bf16 input is gathered (or copied to TP) first, as without FP8.
    """

    def __init__(self, in_features: int, out_features: int, tp: Group, *, sequence_parallel: bool,
                 bias: bool = False, std: float = 0.02, fused: int = 1, fp8: Optional[Fp8Config] = None):
        super().__init__()
        if out_features % tp.size:
            raise ValueError(f"output size {out_features} is not divisible by the TP size {tp.size}")
        self.tp, self.sequence_parallel = tp, sequence_parallel
        lead = (fused,) if fused > 1 else ()
        self.weight = new_param(lead + (out_features, in_features), len(lead), tp.size, std=std)
        self.bias = new_param(lead + (out_features,), len(lead), tp.size, init="zeros") if bias else None
        self.fp8 = fp8
        self.fp8_states = _fp8_states(fp8, "ColumnParallelLinear")

    def weight_and_bias(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """This rank's weight as one ``[out, in]`` matrix (fused matrices stacked) and its bias."""
        return self.weight.flatten(0, -2), (self.bias.flatten() if self.bias is not None else None)

    def fp8_weight_params(self) -> List[nn.Parameter]:
        """The parameters whose values, each as ``[-1, in]`` rows in this order, are the FP8 GEMM's weight operand
        (``fp8/scaling.fp8_only_weights``)."""
        return [self.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight_and_bias()
        if self.fp8_states is not None:
            emulate = self.fp8.emulate
            if self.sequence_parallel and self.fp8.sequence_parallel_fp8 and self.tp.size > 1:
                return fp8_linear(x, weight, bias, self.fp8_states, self.tp, sp_gather=True, emulate=emulate)
            x = gather_from_sp(x, self.tp) if self.sequence_parallel else copy_to_tp(x, self.tp)
            return fp8_linear(x, weight, bias, self.fp8_states, self.tp, sp_gather=False, emulate=emulate)
        x = gather_from_sp(x, self.tp) if self.sequence_parallel else copy_to_tp(x, self.tp)
        return linear(x, weight, bias)


class LinearWeights(nn.Module):
    """The weight (and bias) of one column-parallel matrix computed inside a fused GEMM
    (``GroupedQKVLinear``): a module of its own so that its parameters keep their own global names."""

    reads_parameters = False
    """Its parameters are read by the GEMM of another module (``fp8/scaling.fp8_only_weights``)."""

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter]):
        super().__init__()
        self.weight, self.bias = weight, bias


class _GradientsOnlyCat(torch.autograd.Function):
    """``torch.cat([a, b])`` for the autograd graph only: the forward reads neither (they may hold no data) and gives
    a placeholder of the concatenation's shape (one element, expanded: nothing is allocated); the backward splits
    the gradient between them as the concatenation's would."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.rows = a.shape[0]
        return a.new_empty(1).expand(a.shape[0] + b.shape[0], *a.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        return grad[:ctx.rows], grad[ctx.rows:]


class GroupedQKVLinear(ColumnParallelLinear):
    """The Q, K and V projections of grouped-query attention as one column-parallel GEMM.

    Q (``q``: ``[n_heads * head_dim, in]``) is split over TP like any column-parallel weight. K and V
    (``kv``: ``[2, n_kv_heads * head_dim, in]``) are split the same way when TP divides the KV heads;
    with fewer KV heads than TP ranks (Megatron's rule: TP must then be a multiple of them) each KV head
    is *replicated* on the ``tp / n_kv_heads`` consecutive TP ranks whose query heads attend to it
    (``kv_group``). Those holders each see only part of the gradient of their KV head (from their own
    query heads), so the weight passes through f (identity forward, all-reduce over ``kv_group``
    backward) and every holder ends the backward with the full gradient; ``ParamSpec.tp_replicas`` tells
    initialisation, norms and checkpoints that the holders share one piece.

    ``q`` and ``kv`` are owned (registered) by the caller, which names them; this layer holds them
    unregistered, concatenates them per forward (a copy of the layer's weights) and runs the one GEMM
    (one input gather under sequence parallelism, one set of FP8 scaling states), output
    ``[.., (heads + 2 kv_heads) * head_dim / tp]`` as [q | k | v] of this rank's heads.
    """

    def __init__(self, in_features: int, q_features: int, kv_features: int, tp: Group, kv_group: Optional[Group],
                 *, sequence_parallel: bool, bias: bool = False, std: float = 0.02, fp8: Optional[Fp8Config] = None):
        nn.Module.__init__(self)
        replicas = kv_group.size if kv_group is not None else 1
        if q_features % tp.size or (kv_features * replicas) % tp.size:
            raise ValueError(f"Q size {q_features} / KV size {kv_features} do not split over TP size {tp.size} "
                             f"with {replicas} holder(s) per KV piece")
        self.tp, self.sequence_parallel, self.kv_group = tp, sequence_parallel, kv_group
        kv_spec = dict(tp_replicas=replicas)
        q = LinearWeights(new_param((q_features, in_features), 0, tp.size, std=std),
                          new_param((q_features,), 0, tp.size, init="zeros") if bias else None)
        kv = LinearWeights(new_param((2, kv_features, in_features), 1, tp.size, std=std, **kv_spec),
                           new_param((2, kv_features), 1, tp.size, init="zeros", **kv_spec) if bias else None)
        self._parts = (q, kv)  # a tuple: not registered here, the attention registers them as ``q`` and ``kv``
        self.fp8 = fp8
        self.fp8_states = _fp8_states(fp8, "GroupedQKVLinear")

    @property
    def parts(self) -> Tuple[LinearWeights, LinearWeights]:
        return self._parts

    def fp8_weight_params(self) -> List[nn.Parameter]:
        return [self._parts[0].weight, self._parts[1].weight]

    def weight_and_bias(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        q, kv = self._parts
        group = self.kv_group

        def kv_(t: torch.Tensor) -> torch.Tensor:  # replicated KV: sum the holders' gradients in backward
            return (copy_to_tp(t, group) if group is not None else t).flatten(0, 1)

        if self.fp8_states is not None and self.fp8_states.weight_source is not None:
            # the FP8 operand comes from the masters: the weights hold no data, only their gradients' path
            weight = _GradientsOnlyCat.apply(q.weight, kv_(kv.weight))
        else:
            weight = torch.cat([q.weight, kv_(kv.weight)])
        bias = torch.cat([q.bias, kv_(kv.bias)]) if q.bias is not None else None
        return weight, bias


class RowParallelLinear(nn.Module):
    """y = x A^T with A split along its input dim: partial sums reduced over TP.

    Input is split along features (the output of a column-parallel layer); output is
    the full activation, or this rank's sequence slice under sequence parallelism.
    The bias is added once, after the reduction.

    ``fp8``: run the GEMMs in FP8 (``fp8/linear.py``) with this layer's scaling states in
    ``self.fp8_states`` (None for a bf16 layer); the reduction stays in the compute dtype.
    """

    def __init__(self, in_features: int, out_features: int, tp: Group, *, sequence_parallel: bool,
                 bias: bool = False, std: float = 0.02, fp8: Optional[Fp8Config] = None):
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"input size {in_features} is not divisible by the TP size {tp.size}")
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.weight = new_param((out_features, in_features), 1, tp.size, std=std)
        self.bias = (new_param((out_features,), None, tp.size, init="zeros", sequence_parallel=sequence_parallel)
                     if bias else None)
        self.fp8 = fp8
        self.fp8_states = _fp8_states(fp8, "RowParallelLinear")

    def fp8_weight_params(self) -> List[nn.Parameter]:
        return [self.weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_states is not None:
            y = fp8_linear(x, self.weight, None, self.fp8_states, self.tp, sp_gather=False, emulate=self.fp8.emulate)
        else:
            y = linear(x, self.weight)
        y = scatter_to_sp(y, self.tp) if self.sequence_parallel else reduce_from_tp(y, self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; ids outside this rank's rows give zeros, then reduce.

    Output: ``[s, b, h]`` (or ``[s/tp, b, h]`` under sequence parallelism) from ids ``[b, s]``.
    """

    backward_reads_weights = False
    """The weight's gradient is the output gradient added into the looked-up rows; nothing in backward reads the
    weight (ZeRO-3 does not gather it for backward)."""

    def __init__(self, vocab_size: int, dim: int, tp: Group, *, sequence_parallel: bool, std: float = 0.02):
        super().__init__()
        if vocab_size % tp.size:
            raise ValueError(f"vocabulary size {vocab_size} is not divisible by the TP size {tp.size}")
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.rows = vocab_size // tp.size
        self.start = tp.rank * self.rows
        self.weight = new_param((vocab_size, dim), 0, tp.size, std=std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.t()  # [s, b]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return scatter_to_sp(out, self.tp) if self.sequence_parallel else reduce_from_tp(out, self.tp)


def scaled_init_std(std: float, n_layers: int) -> float:
    """Megatron's init for output projections of residual branches: std / sqrt(2 * n_layers)."""
    return std / math.sqrt(2.0 * n_layers)
