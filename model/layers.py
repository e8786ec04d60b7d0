"""Transformer building blocks, sequence-first ``[s, b, h]``, parallel-aware.

With a TP group of one rank every parallel layer is a plain layer, so the same
code is the single-process model and each rank's shard of the parallel one.
Attention goes through ``scaled_dot_product_attention`` (flash / memory-efficient
kernels on GPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.doc_mask import DocumentMask
from parallel.comm import Group
from parallel.context import ContextParallel, context_attention
from parallel.cpu_gemm import attention
from parallel.random import RNGTracker
from parallel.tensor_parallel import (ColumnParallelLinear, GroupedQKVLinear, RowParallelLinear, new_param,
                                      scaled_init_std)
from config import Fp8Config, ModelConfig


@torch.compiler.disable
def forked(rng: RNGTracker, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` drawing from the per-TP-rank dropout stream (``parallel/random.py``). Swapping
    generator states is not traceable: under ``torch.compile`` this call runs eagerly between two compiled
    graphs (a resumable graph break), and only where dropout is on; without dropout nothing forks."""
    with rng.fork():
        return fn(*args, **kwargs)


@torch.compiler.disable
def forked_checkpoint(rng: RNGTracker, fn, *args):
    """``torch.utils.checkpoint`` of ``fn(*args)`` whose recompute replays the per-TP-rank dropout stream
    (``RNGTracker.checkpoint_contexts``); eager under ``torch.compile``, like ``forked``."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=rng.checkpoint_contexts)


@dataclass
class TPContext:
    """What a layer needs to know about tensor parallelism."""

    tp: Group
    sequence_parallel: bool
    rng: RNGTracker
    fp8: Optional[Fp8Config] = None
    """FP8 GEMMs in the transformer blocks' linear layers (None: the compute dtype, bf16)."""
    kv_group: Optional[Group] = None
    """Grouped-query attention with fewer KV heads than TP ranks: the consecutive TP ranks holding this
    rank's KV head (``Mesh.tp_kv_group``); None when KV heads are split over TP."""
    ep: Optional[Group] = None
    """Expert parallelism: the DP ranks that split the routed experts (``Mesh.ep``); None or one rank = every
    expert here."""
    cp: Optional[ContextParallel] = None
    """Context parallelism: the ranks splitting each sequence (``parallel/context.py``); this rank's tokens are two
    chunks of it (``parallel/layout.py cp_spans``). None = whole sequences here."""
    reset_position_ids: bool = False
    """data.reset_position_ids: with document masks, rotary positions restart at each document."""


class Norm(nn.Module):
    """RMSNorm or LayerNorm, computed in fp32, returned in the input's dtype.

    Under sequence parallelism each TP rank normalises its own sequence slice, so the
    weight's gradient is partial: its spec asks for a sum over TP.
    """

    def __init__(self, cfg: ModelConfig, ctx: TPContext):
        super().__init__()
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        sp = ctx.sequence_parallel
        self.weight = new_param((cfg.d_model,), None, 1, init="ones", sequence_parallel=sp)
        self.bias = new_param((cfg.d_model,), None, 1, init="zeros", sequence_parallel=sp) \
            if cfg.norm == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        with torch.autocast(x.device.type, enabled=False):
            # parameters may be held in the compute dtype (ZeRO): the arithmetic stays fp32
            weight = self.weight.float()
            if self.kind == "rmsnorm":
                y = F.rms_norm(x.float(), shape, weight, self.eps)
            else:
                y = F.layer_norm(x.float(), shape, weight, self.bias.float(), self.eps)
        return y.to(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The rotary angular frequencies (radians per position), float64 ``[head_dim / 2]``: theta^(-2i/head_dim),
    then ``model.rope_scaling``:

    - ``linear``: every frequency divided by the factor (positions interpolated);
    - ``llama3`` (Llama 3.1): with L the original context, a frequency whose wavelength 2 pi / f exceeds
      L / low_freq_factor is divided by the factor, one whose wavelength is below L / high_freq_factor is kept,
      and in between the two are blended, f ((1 - w) / factor + w) with w = (L / wavelength - low) / (high - low),
      which is 0 at the first edge and 1 at the second, so the frequencies are continuous.
    """
    hd = cfg.head_dim
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    factor = cfg.rope_scaling_factor
    if cfg.rope_scaling == "linear":
        return freq / factor
    if cfg.rope_scaling == "llama3":
        low, high, context = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_positions
        wavelength = 2 * math.pi / freq
        w = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
        return freq * ((1 - w) / factor + w)
    return freq


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half form) for ``[s, b, heads, head_dim]``. ``positions``: the global
    positions of the local tokens (context parallelism's two chunks); default 0, 1, ... max_positions - 1."""

    def __init__(self, cfg: ModelConfig, positions: Optional[torch.Tensor] = None):
        super().__init__()
        if positions is None:
            positions = torch.arange(cfg.max_positions)
        angles = torch.outer(positions.to(torch.float64), rope_frequencies(cfg))
        angles = torch.cat([angles, angles], dim=-1)  # [s, head_dim]
        self.register_buffer("cos", angles.cos().float()[:, None, None, :], persistent=False)
        self.register_buffer("sin", angles.sin().float()[:, None, None, :], persistent=False)

    def forward(self, x: torch.Tensor, rope: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """``rope``: (cos, sin) ``[s, b, 1, head_dim]`` at per-token positions (``model/doc_mask.py``) instead."""
        s = x.shape[0]
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        cos, sin = rope if rope is not None else (self.cos[:s], self.sin[:s])
        return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention; heads are split over TP (QKV column-parallel, output row-parallel).

    Multi-head (``n_kv_heads == n_heads``): one fused weight ``qkv`` ``[3, d, d]``. Grouped-query
    (``n_kv_heads < n_heads``, each KV head shared by ``n_heads / n_kv_heads`` consecutive query heads):
    ``q`` ``[n_heads * hd, d]`` and ``kv`` ``[2, n_kv_heads * hd, d]``, computed by one GEMM
    (``GroupedQKVLinear``); KV heads split over TP, or replicated when there are fewer than TP ranks.

    ``model.qk_norm`` (Qwen3, OLMo 2's per-head form): each head's query and key vectors are RMS-normalised over
    head_dim (``model.norm_eps``, in fp32 like ``Norm``) with a learned ``[head_dim]`` weight each,
    ``q_norm.weight`` and ``k_norm.weight`` shared by every head, before RoPE.
    """

    def __init__(self, cfg: ModelConfig, ctx: TPContext):
        super().__init__()
        self.ctx = ctx
        self.heads = cfg.n_heads // ctx.tp.size
        replicas = ctx.kv_group.size if ctx.kv_group is not None else 1
        self.kv_heads = cfg.kv_heads * replicas // ctx.tp.size
        self.head_dim = cfg.head_dim
        self.dropout = cfg.attention_dropout
        self.selective_checkpoint = cfg.activation_checkpointing == "selective"
        sp, std = ctx.sequence_parallel, cfg.init_std
        if cfg.kv_heads == cfg.n_heads:
            self.qkv = ColumnParallelLinear(cfg.d_model, cfg.q_size, ctx.tp, sequence_parallel=sp, bias=cfg.attn_bias,
                                            std=std, fused=3, fp8=ctx.fp8)
        else:
            qkv = GroupedQKVLinear(cfg.d_model, cfg.q_size, cfg.kv_heads * cfg.head_dim, ctx.tp, ctx.kv_group,
                                   sequence_parallel=sp, bias=cfg.attn_bias, std=std, fp8=ctx.fp8)
            self.q, self.kv = qkv.parts
            self.qkv = qkv
        self.proj = RowParallelLinear(cfg.q_size, cfg.d_model, ctx.tp, sequence_parallel=sp, bias=cfg.bias,
                                      std=scaled_init_std(std, cfg.n_layers), fp8=ctx.fp8)
        self.rotary = Rotary(cfg, ctx.cp.positions(cfg.seq_len) if ctx.cp is not None else None)
        self.qk_norm, self.eps = cfg.qk_norm, cfg.norm_eps
        if cfg.qk_norm:
            # each TP rank normalises only its own heads, so with tp > 1 (sequence parallel or not) these weights'
            # gradients are partial sums: the spec asks for their sum over TP, as sequence-parallel norms do
            partial = ctx.tp.size > 1
            self.q_norm = nn.ParameterDict({"weight": new_param((cfg.head_dim,), None, 1, init="ones",
                                                                sequence_parallel=partial)})
            self.k_norm = nn.ParameterDict({"weight": new_param((cfg.head_dim,), None, 1, init="ones",
                                                                sequence_parallel=partial)})

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of every head's vector ``x [..., head_dim]`` in fp32, returned in x's dtype."""
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x.float(), (self.head_dim,), weight.float(), self.eps).to(x.dtype)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              docs: Optional[DocumentMask] = None) -> torch.Tensor:
        if self.qk_norm:  # before RoPE; inside the selective checkpoint, so recomputed rather than saved
            q, k = self._head_norm(q, self.q_norm.weight), self._head_norm(k, self.k_norm.weight)
        rope = docs.rope if docs is not None else None
        # [s, b, heads, d] -> [b, heads, s, d]; heads are split over TP, so dropout draws per TP rank
        q, k, v = (t.permute(1, 2, 0, 3) for t in (self.rotary(q, rope), self.rotary(k, rope), v))
        gqa = {"enable_gqa": True} if self.kv_heads != self.heads else {}  # each KV head serves heads/kv_heads
        # the document mask (model/doc_mask.py) in place of the causal one, else exactly the causal call
        mask = {"attn_mask": docs.dense} if docs is not None else {"is_causal": True}
        p = self.dropout if self.training else 0.0
        if self.ctx.cp is not None:  # the sequence's other chunks live on the other CP ranks (no dropout: config)
            o = context_attention(q, k, v, self.ctx.cp, mask=None if docs is None else
                                  docs.dense if self.ctx.cp.comm == "a2a" else docs.ring)
        elif p > 0:  # the per-TP-rank stream (its swap is not traceable: see forked)
            o = forked(self.ctx.rng, attention, q, k, v, dropout_p=p, **mask, **gqa)
        else:
            o = attention(q, k, v, **mask, **gqa)
        return o.permute(2, 0, 1, 3).flatten(2)  # [s, b, heads * d]

    def forward(self, x: torch.Tensor, docs: Optional[DocumentMask] = None) -> torch.Tensor:
        qkv = self.qkv(x)
        s, b = qkv.shape[:2]
        if self.kv_heads == self.heads:
            q, k, v = qkv.view(s, b, 3, self.heads, self.head_dim).unbind(2)
        else:  # [q of this rank's heads | k | v of their KV heads]
            q, kv = qkv.split([self.heads * self.head_dim, 2 * self.kv_heads * self.head_dim], dim=-1)
            q = q.view(s, b, self.heads, self.head_dim)
            k, v = kv.view(s, b, 2, self.kv_heads, self.head_dim).unbind(2)
        # v's own buffer: q and k leave the QKV output through RoPE, and the attention's backward saves v; as a view
        # it would keep the whole output alive until the backward (3x the bytes: 1.5 GiB of gpt_1.3b's peak)
        v = v.contiguous()
        if self.selective_checkpoint and torch.is_grad_enabled():
            if self.dropout > 0 and self.training:  # the recompute must replay the tp stream's masks
                o = forked_checkpoint(self.ctx.rng, self._core, q, k, v, docs)
            else:  # nothing random inside: a checkpoint region torch.compile traces
                o = checkpoint(self._core, q, k, v, docs, use_reentrant=False)
        else:
            o = self._core(q, k, v, docs)
        return self.proj(o)


class MLP(nn.Module):
    """SwiGLU (gate and up fused in one column-parallel GEMM) or GELU; down projection row-parallel."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        sp, std = ctx.sequence_parallel, cfg.init_std
        self.up = ColumnParallelLinear(cfg.d_model, cfg.ffn_size, ctx.tp, sequence_parallel=sp, bias=cfg.bias,
                                       std=std, fused=2 if self.swiglu else 1, fp8=ctx.fp8)
        self.down = RowParallelLinear(cfg.ffn_size, cfg.d_model, ctx.tp, sequence_parallel=sp, bias=cfg.bias,
                                      std=scaled_init_std(std, cfg.n_layers), fp8=ctx.fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.swiglu:
            gate, up = h.unflatten(-1, (2, -1)).unbind(-2)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.down(h)


class ResidualDropout(nn.Module):
    """Dropout on a residual branch; per-TP-rank stream when the activation is sequence-split."""

    def __init__(self, p: float, ctx: TPContext):
        super().__init__()
        self.p, self.ctx = p, ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        if self.ctx.sequence_parallel:
            return forked(self.ctx.rng, F.dropout, x, self.p, True)
        return F.dropout(x, self.p, True)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.)). ``mlp``: what replaces the dense MLP
    (an MoE layer's ``model/moe.py MoE``, built by the caller); None = the dense MLP."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext, mlp: Optional[nn.Module] = None):
        super().__init__()
        self.attn_norm = Norm(cfg, ctx)
        self.attn = Attention(cfg, ctx)
        self.mlp_norm = Norm(cfg, ctx)
        self.mlp = mlp if mlp is not None else MLP(cfg, ctx)
        self.drop = ResidualDropout(cfg.dropout, ctx)

    def forward(self, x: torch.Tensor, docs: Optional[DocumentMask] = None) -> torch.Tensor:
        """``docs``: the micro-batch's document mask (``model/doc_mask.py``); None = causal attention."""
        x = x + self.drop(self.attn(self.attn_norm(x), docs))
        return x + self.drop(self.mlp(self.mlp_norm(x)))
