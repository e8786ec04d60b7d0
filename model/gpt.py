"""The GPT decoder, built as pipeline model chunks.

A chunk holds a contiguous range of transformer blocks, plus the token embedding
if it is the first chunk of the whole model and the final norm, output projection
and loss if it is the last. The single-process model is the one chunk that holds
everything; pipeline stages (and interleaved virtual stages) hold several.

Parameter names are global (``layers.17.attn.qkv.weight``) whatever the layout,
which is what makes initialisation and checkpoints layout-independent.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from config import ModelConfig
from config.moe import is_moe_layer
from model.init import init_parameters
from model.doc_mask import DocumentMask
from model.layers import Block, Norm, TPContext, forked, rope_frequencies
from model.moe import MoE
from parallel.cross_entropy import vocab_parallel_cross_entropy
from parallel.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding

EMBEDDING = "embedding.weight"


class GPTChunk(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: TPContext, layers: Sequence[int], *, first: bool, last: bool,
                 tied_copy: bool = False):
        """``tied_copy``: the output projection is a copy of the embedding living on another stage."""
        super().__init__()
        self.cfg, self.ctx, self.first, self.last = cfg, ctx, first, last
        self.layer_ids = list(layers)
        self.rope_frequencies = rope_frequencies(cfg) if ctx.reset_position_ids else None
        """data.reset_position_ids: rotary positions restart at each document (model/doc_mask.py)."""
        sp = ctx.sequence_parallel
        if first:
            self.embedding = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, ctx.tp, sequence_parallel=sp,
                                                    std=cfg.init_std)
        self.layers = nn.ModuleDict({str(i): Block(cfg, ctx, MoE(cfg, ctx, cfg.moe) if is_moe_layer(cfg.moe, i)
                                                   else None) for i in self.layer_ids})
        if last:
            self.final_norm = Norm(cfg, ctx)
            # FP8 output head only when asked (fp8.output_head): by default it stays in the compute dtype
            head_fp8 = ctx.fp8 if (ctx.fp8 is not None and ctx.fp8.output_head) else None
            self.head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, ctx.tp, sequence_parallel=sp,
                                             std=cfg.init_std, fp8=head_fp8)
            if cfg.tie_embeddings and first:
                self.head.weight = self.embedding.weight
            elif cfg.tie_embeddings:
                assert tied_copy
                self.head.weight.spec.shared_with = EMBEDDING

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)  # [s(/tp), b, h]
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))  # the residual stream runs in the compute dtype
        if self.cfg.dropout > 0 and self.training:
            if self.ctx.sequence_parallel:
                x = forked(self.ctx.rng, F.dropout, x, self.cfg.dropout, True)
            else:
                x = F.dropout(x, self.cfg.dropout, True)
        return x

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss over the micro-batch; logits exist only as this rank's vocabulary slice."""
        logits = self.head(self.final_norm(x))  # [s, b, V/tp]
        return self.cross_entropy(logits, labels)

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean cross entropy of this rank's vocabulary slice of the logits ``[s, b, V/tp]`` against ``labels``
        ``[b, s]`` (upcast to fp32 inside; compiled by model/compile.py at tp = 1)."""
        return vocab_parallel_cross_entropy(logits, labels.t(), self.ctx.tp).mean()

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None,
                docs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [b, s] (first chunk) or hidden [s(/tp), b, h] -> hidden, or the loss on the last chunk. ``docs``:
        the micro-batch's document ids ``[b, S]`` (data.document_mask), from which its mask is built once here for
        every block (``model/doc_mask.py``); None = causal attention."""
        if self.first:
            x = self.embed(x)
        mask = () if docs is None else (DocumentMask.build(docs, self.ctx.cp, self.rope_frequencies),)
        full = self.cfg.activation_checkpointing == "full" and torch.is_grad_enabled()
        for block in self.layers.values():
            if full:
                x = checkpoint(block, x, *mask, use_reentrant=False, context_fn=self.ctx.rng.checkpoint_contexts)
            else:
                x = block(x, *mask)
        if self.last:
            if labels is None:
                raise ValueError("the last model chunk needs labels to compute the loss")
            return self.loss(x, labels)
        return x

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[b, s, V]`` of a whole single-process model (for sampling)."""
        assert self.first and self.last and self.ctx.tp.size == 1, "logits() is for a single-process model"
        x = self.embed(tokens)
        for block in self.layers.values():
            x = block(x)
        return self.head(self.final_norm(x)).transpose(0, 1)


def chunk_layers(cfg: ModelConfig, pp: int, virtual_stages: int, pp_rank: int) -> List[Tuple[int, range]]:
    """(virtual stage id, layer range) of each chunk on a pipeline rank: virtual stage v = chunk*pp + rank."""
    per_chunk = cfg.n_layers // (pp * virtual_stages)
    out = []
    for chunk in range(virtual_stages):
        v = chunk * pp + pp_rank
        out.append((v, range(v * per_chunk, (v + 1) * per_chunk)))
    return out


def build_chunks(cfg: ModelConfig, ctx: TPContext, pp: int, virtual_stages: int, pp_rank: int, seed: int,
                 device: torch.device) -> List[GPTChunk]:
    """This rank's model chunks, initialised to exactly the single-process model's values."""
    last_v = pp * virtual_stages - 1
    chunks = []
    for v, layers in chunk_layers(cfg, pp, virtual_stages, pp_rank):
        chunk = GPTChunk(cfg, ctx, layers, first=v == 0, last=v == last_v, tied_copy=cfg.tie_embeddings and last_v > 0)
        init_parameters(chunk, seed, ctx.tp.rank, ctx.tp.size, ctx.ep.rank if ctx.ep is not None else 0)
        chunks.append(chunk.to(device))
    return chunks


def named_parameters(chunks: Sequence[nn.Module]) -> Iterator[Tuple[str, nn.Parameter]]:
    """Global names of this rank's parameters (chunks hold disjoint global names)."""
    for chunk in chunks:
        yield from chunk.named_parameters()
