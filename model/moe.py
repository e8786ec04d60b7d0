"""Mixture of experts (``model.moe``, ``config/moe.py``): the MLP of an MoE layer, one process for now.

``MoE(x)`` for ``x [s, b, h]``: a ``Router`` picks each token's top-k routed experts (scores in fp32), the
``Experts`` run them as grouped GEMMs and sum their outputs weighted by the gates, optional shared experts add
one FFN every token passes through (Qwen2-MoE gates it with a sigmoid), and the block keeps the step's balancing
terms on itself: the Switch/GShard auxiliary loss and the router z-loss (tensors the trainer adds to the loss,
times their coefficients) and the expert load behind DeepSeek-V3's aux-loss-free bias (``MoE.update_bias``, once
an optimizer step).

Tokens are the flattened ``[s * b]`` rows (position-major, as Megatron flattens its sequence-first activations);
"token order" below (which slots a capacity keeps) means that order. A token-slot is one (token, chosen expert)
pair: ``tokens x top_k`` of them per forward.

Parameters carry ``ParamSpec``s like every other (replicated: ``tp_dim`` None), so ``model/init.py`` draws them
from the seed and their global names; routed experts are stacked, ``w_up [E, (2,) F, d]`` (SwiGLU's gate then
up, ``[out, in]`` per expert as ``nn.Linear`` and Hugging Face's ``gate_up_proj`` store them) and
``w_down [E, d, F]``, so each projection is one grouped GEMM over the token-slots sorted by expert.

``torch._grouped_mm`` (torch 2.13) runs where ``grouped_gemm_runs`` says: on CPU for fp32, bf16 and fp16 (not
float64), with every row stride a multiple of 16 bytes (d_model and the FFN width multiples of 4 in fp32, of 8 in
16 bits) and int32 offsets; under ``torch.compile`` its fake kernel accepts bf16 only. On CUDA torch documents
bf16 (SM >= 80: CUTLASS kernels on sm90/sm100, a loop over groups elsewhere). Anywhere else, a Python loop over
the experts computes the same products (16-bit CPU GEMMs through ``parallel/cpu_gemm.linear``, in fp32 where that
is faster). What is said to be fp32 here (router, gates, the sum of the experts' outputs) is float64 in a float64
model, which then computes in float64 throughout.

Under ``precision=fp8`` with FP8 operands (``config.fp8_operands``) each expert's projections are FP8 GEMMs on its
rows, as every FP8 linear's (``fp8/experts.py``: E4M3 forward, both backward GEMMs in FP8 with the gradient format,
one set of scaling states per stacked projection, named ``layers.<i>.mlp.experts.up`` / ``.down``); the router and
the shared experts' gate stay fp32, the shared experts are FP8 linears like the dense MLP's.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from config import Fp8Config, ModelConfig
from config.moe import MoeConfig
from fp8.experts import Fp8ExpertProjection
from model.layers import MLP, TPContext
from parallel import comm
from parallel.comm import Group
from parallel.cpu_gemm import linear, upcasts
from parallel.expert_parallel import run_experts
from parallel.tensor_parallel import new_param, scaled_init_std


@torch.compiler.assume_constant_result
def _upcasts(dtype: torch.dtype) -> bool:
    """``cpu_gemm.upcasts`` (it reads /proc/cpuinfo once), a constant to ``torch.compile`` instead of a graph break."""
    return upcasts(dtype)


def grouped_gemm_runs(dtype: torch.dtype, device: torch.device, *widths: int) -> bool:
    """Whether ``torch._grouped_mm`` computes the experts' projections for activations of ``dtype`` on
    ``device`` whose rows (and the weights' rows) are ``widths`` elements long (see the module's docstring)."""
    if not hasattr(torch, "_grouped_mm") or any(w * dtype.itemsize % 16 for w in widths):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16
    if device.type != "cpu" or (torch.compiler.is_compiling() and dtype != torch.bfloat16):
        return False
    # a 16-bit CPU GEMM without 16-bit matrix instructions is faster on fp32 upcasts: the loop's cpu_gemm.linear
    return dtype == torch.float32 or (dtype in (torch.bfloat16, torch.float16) and not _upcasts(dtype))


@torch.compiler.disable
def _sequence_counts(counts: torch.Tensor, sp: Group) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sequence parallelism: (every slice's counts summed, the counts of the slices before this TP rank's)."""
    every = counts.new_empty((sp.size,) + tuple(counts.shape))
    comm.all_gather(every, counts[None].contiguous(), sp)
    return every.sum(0), every[:sp.rank].sum(0)


@torch.compiler.disable
def _context_counts(counts: torch.Tensor, cp: Group) -> torch.Tensor:
    """Context parallelism: the token-slots of every CP rank's chunks of the same sequences, summed."""
    total = counts.clone()
    comm.all_reduce(total, cp)
    return total


def _count(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64: how many of ``experts`` name each expert (``bincount`` with a shape ``torch.compile`` knows)."""
    return torch.zeros(num_experts, dtype=torch.int64, device=experts.device).scatter_add_(
        0, experts, torch.ones_like(experts))


@dataclass
class Routing:
    """One forward's routing of ``T`` tokens to ``k`` of ``E`` experts (fp32 but the indices; float64 in a float64
    model)."""
    experts: torch.Tensor
    """``[T, k]`` int64: each token's chosen experts, by decreasing biased score."""
    gates: torch.Tensor
    """``[T, k]``: their weights, the unbiased scores (renormalised when norm_topk, times routed_scale)."""
    scores: torch.Tensor
    """``[T, E]``: the router probabilities (softmax or sigmoid of the logits)."""
    logits: torch.Tensor
    """``[T, E]``: the router's logits."""
    counts: torch.Tensor
    """``[E]`` int64: token-slots routed to each expert (before any capacity drops them)."""
    aux_loss: torch.Tensor
    """Switch/GShard load-balancing loss, ``E sum_e f_e P_e`` (1 when balanced), unweighted."""
    z_loss: torch.Tensor
    """Router z-loss, ``mean_t logsumexp(logits_t)^2``, unweighted."""
    before: Optional[torch.Tensor] = None
    """Sequence parallelism: ``[E]`` token-slots of each expert on the TP ranks holding earlier sequence slices
    (a capacity keeps the first slots in the whole sequence's token order); None otherwise."""
    tokens: int = 0
    """Tokens of the whole forward (the sequences', under sequence and context parallelism): what a capacity is
    taken of."""


class Router(nn.Module):
    """Top-k token-choice router: ``logits = x W^T`` (``W [E, d]``, no bias) in fp32, scores by softmax or sigmoid.

    The top-k is taken over ``scores + expert_bias``: the bias (DeepSeek-V3's aux-loss-free balancing, a buffer
    saved in the state dict and moved by ``MoE.update_bias``) changes which experts are chosen, never the gates,
    which are the unbiased scores of the chosen experts. With sigmoid scores the auxiliary loss's P_e is the mean
    of the scores normalised per token (they do not sum to 1 otherwise), as Megatron-Core does.
    """

    def __init__(self, cfg: ModelConfig, moe: MoeConfig, sp: Optional[Group] = None, cp: Optional[Group] = None):
        super().__init__()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.score, self.norm_topk, self.routed_scale = moe.score, moe.norm_topk, moe.routed_scale
        self.sp, self.cp = sp, cp
        self.weight = new_param((moe.num_experts, cfg.d_model), None, 1, std=cfg.init_std,
                                sequence_parallel=sp is not None)
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route the tokens ``x [T, d]`` (this TP rank's sequence slice under sequence parallelism)."""
        E, k = self.num_experts, self.top_k
        wide = torch.promote_types(x.dtype, torch.float32)  # fp32 (float64 for a float64 model)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.to(wide), self.weight.to(wide))
            scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
            with torch.no_grad():
                experts = torch.topk(scores + self.expert_bias.to(wide), k, dim=-1).indices
            gates = scores.gather(1, experts)
            if self.norm_topk:
                gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
            if self.routed_scale != 1.0:
                gates = gates * self.routed_scale
            counts = _count(experts.flatten(), E)
            total, before, tokens = counts, None, x.shape[0]
            if self.sp is not None:  # the whole sequence's counts, and those of the slices before this one
                total, before = _sequence_counts(counts, self.sp)
                tokens *= self.sp.size
            whole = tokens  # the tokens of the sequences these are part of
            if self.cp is not None:  # and their other chunks, on the other CP ranks
                total = _context_counts(total, self.cp)
                whole *= self.cp.size
            probs = scores if self.score == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
            fraction = total.to(wide) / max(whole * k, 1)  # f_e: share of the sequences' token-slots (no gradient)
            # P_e and the z-loss as sums over this slice's tokens / the sequence's: the slices' terms add up to
            # the whole sequence's losses, and each slice's gradient is theirs restricted to its tokens. Under CP
            # the chunks' terms are over this rank's tokens (/ tokens, not / whole): the gradients are averaged
            # over the dp x cp ranks, and the CP ranks' mean of these terms is the whole sequence's loss
            aux = E * (fraction * probs.sum(0) / max(tokens, 1)).sum()
            z = torch.logsumexp(logits, -1).square().sum() / max(tokens, 1)
        return Routing(experts, gates, scores, logits, counts, aux, z, before, whole)


class Experts(nn.Module):
    """``E`` FFNs (SwiGLU or GELU, as ``model.activation``; no biases), stacked so each projection is one grouped
    GEMM over the token-slots sorted by expert; a loop over the experts where the grouped GEMM does not run.

    ``grouped``: None picks by ``grouped_gemm_runs``; True or False forces a path (tests compare the two).

    ``fp8`` (``precision=fp8`` where the run casts GEMM operands to FP8): each projection is an FP8 GEMM per expert
    (``fp8/experts.py``), with one set of FP8 scaling states per stacked projection shared by its experts, in the
    children ``up`` and ``down`` (``layers.<i>.mlp.experts.up`` / ``.down``); the weights keep their names and are
    read only through those states (``reads_parameters`` false). With 16-bit GEMMs (``fp8.gemm=bf16 | fp16``) the
    experts are the 16-bit ones, as every linear then is."""

    def __init__(self, cfg: ModelConfig, moe: MoeConfig, ep: Optional[Group] = None, sp: bool = False,
                 tp: Optional[Group] = None, fp8: Optional[Fp8Config] = None):
        """``ep``: the expert-parallel group (this rank holds its share of the experts); ``sp``: the tokens are a
        TP rank's sequence slice, so the gradients are partial sums over TP (``ParamSpec.sequence_parallel``);
        ``tp``: the TP group FP8 casts reduce their amaxes over (``fp8/scaling.py``); ``fp8``: FP8 GEMMs."""
        super().__init__()
        self.num_experts, self.d_model = moe.num_experts, cfg.d_model
        self.ffn = moe.ffn_hidden if moe.ffn_hidden is not None else cfg.ffn_size
        self.swiglu = cfg.activation == "swiglu"
        self.ep = ep if ep is not None and ep.size > 1 else None
        split = {"ep_size": ep.size} if self.ep is not None else {}  # this EP rank's experts (dim 0)
        split["sequence_parallel"] = sp
        lead = (2,) if self.swiglu else ()
        E, d, f = moe.num_experts, cfg.d_model, self.ffn
        self.w_up = new_param((E,) + lead + (f, d), None, 1, std=cfg.init_std, **split)
        self.w_down = new_param((E, d, f), None, 1, std=scaled_init_std(cfg.init_std, cfg.n_layers), **split)
        self.grouped: Optional[bool] = None
        self.fp8 = fp8 is not None
        if fp8 is not None:
            if tp is None:
                raise ValueError("Experts: FP8 GEMMs need the TP group their casts reduce amaxes over")
            self.up = Fp8ExpertProjection(self.w_up, fp8, tp)
            self.down = Fp8ExpertProjection(self.w_down, fp8, tp)
            self.reads_parameters = False  # (fp8/scaling.fp8_only_weights: only the FP8 GEMMs read the weights)

    def use_grouped(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this forward's projections run as ``torch._grouped_mm``."""
        if self.grouped is not None:
            return self.grouped
        return grouped_gemm_runs(dtype, device, self.d_model, self.ffn)

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = h.unflatten(-1, (2, -1)).unbind(-2)
            return F.silu(gate) * up
        return F.gelu(h, approximate="tanh")

    def _ffn(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert's FFN of its rows of ``xs`` (``[N, d]``, sorted by expert, ``counts [E]`` rows each; this EP
        rank's experts under expert parallelism)."""
        if self.fp8:
            return self._fp8_ffn(xs, counts)
        up = self.w_up.flatten(1, -2).to(xs.dtype)  # [E, (2) F, d]
        down = self.w_down.to(xs.dtype)  # [E, d, F]
        if self.use_grouped(xs.dtype, xs.device):
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # where each expert's rows end
            h = self._activation(torch._grouped_mm(xs, up.transpose(1, 2), offs=offsets))
            return torch._grouped_mm(h, down.transpose(1, 2), offs=offsets)
        outs = [linear(self._activation(linear(rows, up[e])), down[e])
                for e, rows in enumerate(xs.split(counts.tolist())) if rows.shape[0]]
        return torch.cat(outs) if outs else xs.new_zeros((0, self.d_model))

    @torch.compiler.disable
    def _fp8_ffn(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``_ffn`` with FP8 GEMMs, each expert on its rows (``fp8/experts.py``). Eager under ``train.compile``: the
        per-expert loop runs over the routing's row counts, which a compiled graph would be specialised on."""
        sizes = counts.tolist()
        return self.down(self._activation(self.up(xs, sizes)), sizes)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor, capacity: Optional[int] = None,
                before: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x [T, d]``, each token's ``experts`` and ``gates`` ``[T, k]`` -> ``(y, kept)``: ``y [T, d]`` fp32 (or
        wider), each token's sum over its kept slots of gate x FFN_e(x); ``kept [T, k]`` bool. ``capacity``: each
        expert keeps its first this many slots in token order and drops the rest (None: dropless); ``before [E]``:
        slots of each expert earlier in token order on other ranks (sequence parallelism), which count against
        the capacity first. In autocast's dtype when it is on, else in x's."""
        T, k = experts.shape
        flat = experts.flatten()  # slot t * k + j
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, in token order within each
        counts = _count(flat, self.num_experts)
        kept = torch.ones_like(flat, dtype=torch.bool)
        if capacity is not None:
            first = torch.cumsum(counts, 0) - counts  # each expert's first position in ``order``
            within = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
            room = torch.full_like(counts, capacity) if before is None else (capacity - before).clamp(min=0)
            keep = within < room[flat[order]]
            kept[order] = keep
            order, counts = order[keep], torch.minimum(counts, room)
        token = order // k
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        wide = torch.promote_types(dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            if self.ep is not None:  # the slots travel to their experts' EP ranks and back (expert_parallel.py)
                out = run_experts(x[token].to(dtype), counts, self.ep, self._ffn)
            else:
                out = self._ffn(x[token].to(dtype), counts)
            weighted = out.to(wide) * gates.flatten()[order].to(wide)[:, None]
            y = torch.zeros((T, x.shape[-1]), dtype=wide, device=x.device).index_add(0, token, weighted)
        return y, kept.view(T, k)


class _AddAuxLoss(torch.autograd.Function):
    """Identity on the block's output whose backward also starts the balancing loss's: ``d loss / d loss = scale``,
    the factor the trainer multiplies each micro-batch's LM loss by before its backward (loss scale / micro-batches),
    so the auxiliary terms are added to the training loss as if summed into it, on any pipeline stage, without the
    schedule carrying them (Megatron-Core's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.loss_meta = (loss.shape, loss.dtype)
        ctx.save_for_backward(scale)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (scale,) = ctx.saved_tensors
        shape, dtype = ctx.loss_meta
        return grad, scale.to(dtype).expand(shape), None


class MoE(nn.Module):
    """Router, routed experts and optional shared experts in place of an MLP; ``forward(x [s, b, h]) -> [s, b, h]``
    in x's dtype (the routed and shared outputs summed in fp32, rounded once).

    After each forward it holds, for the trainer: ``aux_loss`` and ``z_loss`` (fp32 scalars with gradients,
    unweighted), ``loss`` (their sum weighted by model.moe.aux_loss_coeff and z_loss_coeff: add it to the
    training loss, scaled as the micro-batch's LM loss is), ``counts`` (``[E]`` int64, this forward's token-slots
    per expert before capacity) and ``dropped`` (int64 scalar, token-slots the capacity dropped); and, summed
    over the training forwards since the last ``update_bias`` (the step's micro-batches), the buffers ``load``
    (``[E]``), ``dropped_slots``, ``aux_sum``, ``z_sum`` and ``forwards``. A forward recomputed by full activation
    checkpointing counts again: every sum then doubles alike, which changes neither the load's shares, the dropped
    fraction, the losses' means nor the sign rule of ``update_bias``.

    In training (``self.training`` with gradients on) ``loss`` reaches the backward through ``_AddAuxLoss`` with
    the factor in the buffer ``aux_scale``, which the trainer sets to its LM loss's (loss scale / micro-batches).
    """

    def __init__(self, cfg: ModelConfig, ctx: TPContext, moe: MoeConfig):
        super().__init__()
        # under sequence parallelism each TP rank routes its own slice of the sequence (experts whole on every TP
        # rank, their gradients partial sums over TP); with TP alone every TP rank routes the same tokens
        sp = ctx.tp if ctx.sequence_parallel and ctx.tp.size > 1 else None
        # under context parallelism each CP rank routes its two chunks of every sequence (config/context.py refuses
        # a capacity: its token order spans the ranks' chunks)
        cp = ctx.cp.group if ctx.cp is not None and ctx.cp.size > 1 else None
        self.num_experts, self.top_k, self.capacity_factor = moe.num_experts, moe.top_k, moe.capacity_factor
        self.aux_loss_coeff, self.z_loss_coeff = moe.aux_loss_coeff, moe.z_loss_coeff
        self.bias_update_rate = moe.bias_update_rate
        self.router = Router(cfg, moe, sp, cp)
        self.experts = Experts(cfg, moe, ctx.ep, sp=sp is not None, tp=ctx.tp, fp8=ctx.fp8)
        self.shared: Optional[MLP] = None
        self.shared_gate: Optional[nn.Parameter] = None
        if moe.shared_experts > 0:
            width = moe.shared_ffn_hidden
            if width is None:  # the shared experts as one FFN of their summed width (DeepSeek)
                width = self.experts.ffn * moe.shared_experts
            self.shared = MLP(dataclasses.replace(cfg, ffn_hidden=width, bias=False), ctx)
            if moe.shared_gate:
                self.shared_gate = new_param((1, cfg.d_model), None, 1, std=cfg.init_std,
                                             sequence_parallel=sp is not None)
        self.register_buffer("load", torch.zeros(moe.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped_slots", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("aux_sum", torch.zeros((), dtype=torch.float64), persistent=False)
        self.register_buffer("z_sum", torch.zeros((), dtype=torch.float64), persistent=False)
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("aux_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.aux_loss: Optional[torch.Tensor] = None
        self.z_loss: Optional[torch.Tensor] = None
        self.loss: Optional[torch.Tensor] = None
        self.counts: Optional[torch.Tensor] = None
        self.dropped: Optional[torch.Tensor] = None

    def capacity(self, tokens: int) -> Optional[int]:
        """Token-slots each expert keeps per forward of ``tokens`` tokens: ceil(factor x tokens x k / E); None
        when dropless: with no factor, and with a capacity of ``tokens`` or more, which drops nothing (a token
        sends at most one slot to an expert), however large the factor (1e30: ``tokens`` x 1e30 is no int64)."""
        if self.capacity_factor is None:
            return None
        slots = self.capacity_factor * tokens * self.top_k / self.num_experts  # a float: inf beyond 1.8e308
        return math.ceil(slots) if slots < tokens else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        flat = x.reshape(s * b, h)
        routing = self.router(flat)
        y, kept = self.experts(flat, routing.experts, routing.gates, self.capacity(routing.tokens), routing.before)
        if self.shared is not None:
            shared = self.shared(x).reshape(s * b, h).to(y.dtype)
            if self.shared_gate is not None:
                with torch.autocast(x.device.type, enabled=False):
                    shared = shared * torch.sigmoid(F.linear(flat.to(y.dtype), self.shared_gate.to(y.dtype)))
            y = y + shared
        self.aux_loss, self.z_loss = routing.aux_loss, routing.z_loss
        self.loss = self.aux_loss_coeff * routing.aux_loss + self.z_loss_coeff * routing.z_loss
        with torch.no_grad():
            self.counts, self.dropped = routing.counts, (~kept).sum()
        out = y.to(x.dtype).view(s, b, h)
        if self.training:
            with torch.no_grad():
                self.load += routing.counts
                self.dropped_slots += self.dropped
                self.aux_sum += routing.aux_loss.detach().double()
                self.z_sum += routing.z_loss.detach().double()
                self.forwards += 1
            if (self.aux_loss_coeff or self.z_loss_coeff) and torch.is_grad_enabled() and self.loss.requires_grad:
                out = _AddAuxLoss.apply(out, self.loss, self.aux_scale)
        return out

    @torch.no_grad()
    def update_bias(self, global_counts: Optional[torch.Tensor] = None) -> None:
        """DeepSeek-V3's aux-loss-free balancing, once an optimizer step, outside autograd: ``expert_bias_e +=
        rate x sign(mean load - load_e)`` (an overloaded expert is chosen less often, an idle one more).
        ``global_counts [E]``: each expert's token-slots of the step over all data-parallel ranks (the
        all-reduced ``load``); None uses this rank's ``load``. Resets ``load`` and ``dropped_slots``."""
        counts = (self.load if global_counts is None else global_counts).to(torch.float64)
        if self.bias_update_rate > 0:
            step = self.bias_update_rate * torch.sign(counts.mean() - counts)
            self.router.expert_bias += step.to(self.router.expert_bias)
        self.reset_stats()

    @torch.no_grad()
    def reset_stats(self) -> None:
        """Zero the sums kept over a step's forwards (``load``, ``dropped_slots``, ``aux_sum``, ``z_sum``,
        ``forwards``)."""
        for t in (self.load, self.dropped_slots, self.aux_sum, self.z_sum, self.forwards):
            t.zero_()
