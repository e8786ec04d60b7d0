"""Document masking (``data.document_mask``): each token attends only to the earlier tokens of its own document
(Llama 3's mask; Megatron's ``--reset-attention-mask``), and with ``data.reset_position_ids`` its rotary position
counts from its document's first token (Megatron's ``--reset-position-ids``).

A micro-batch's documents arrive as ``docs``, int32 ``[b, S]`` over the whole sequence: at each position the number
of EOD tokens before it (``data/gpt_dataset.py document_ids``; the EOD token ends its document, and its loss, the
next document's first token, is kept as without masking). ``DocumentMask.build`` derives everything the layers need
from it once per micro-batch and model chunk (``GPTChunk.forward``), before the first layer; every layer reads it:

- ``dense``: without context parallelism (and under its all-to-all form, ``parallel/ulysses.py``, which attends over
  the whole sequence), the boolean mask ``[b, 1, S, S]`` (docs[q] == docs[k] and q >= k) for
  SDPA. On CPU, SDPA runs it in the same flash kernel as the causal mask, at the same speed at the default shapes
  (torch 2.13 has no FlexAttention backward on CPU; docs/data.md has the measurements);
- ``ring``: with context parallelism's p2p and all_gather forms, each attention pair's slice and the pairs to skip
  (``parallel/context_mask.py``);
- ``rope``: with ``reset_position_ids``, the rotary cos and sin ``[s, b, 1, head_dim]`` of this rank's tokens at
  their positions inside their documents (position - the document's first position).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from parallel.context import ContextParallel, local_chunks
from parallel.context_mask import ContextMask


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document, int64 ``[b, S]``: its position minus its document's first one."""
    b, seq = docs.shape
    pos = torch.arange(seq, device=docs.device).expand(b, seq)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return pos - torch.where(starts, pos, torch.zeros_like(pos)).cummax(dim=1).values


def dense_mask(docs: torch.Tensor) -> torch.Tensor:
    """The boolean attention mask ``[b, 1, S, S]``: True where query q may see key k (same document, k <= q)."""
    seq = docs.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=docs.device).tril()
    return (docs[:, None, :, None] == docs[:, None, None, :]) & causal


@dataclass(frozen=True)
class DocumentMask:
    """One micro-batch's document mask at this rank, as the attention layers read it (module docstring)."""

    dense: Optional[torch.Tensor] = None
    ring: Optional[ContextMask] = None
    rope: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    @staticmethod
    def build(docs: torch.Tensor, cp: Optional[ContextParallel], frequencies: Optional[torch.Tensor] = None
              ) -> "DocumentMask":
        """From ``docs`` ``[b, S]`` (the whole sequence, on every CP rank); ``frequencies``: the rotary angular
        frequencies (``model.layers.rope_frequencies``) when positions restart at each document, else None."""
        rope = None
        if frequencies is not None:
            pos = document_positions(docs)
            if cp is not None:
                pos = local_chunks(pos, cp.size, cp.group.rank, dim=1)
            angles = pos.t().to(torch.float64)[..., None] * frequencies.to(docs.device)  # [s, b, head_dim / 2]
            angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
            rope = (angles.cos().float(), angles.sin().float())
        if cp is not None and cp.comm != "a2a":
            return DocumentMask(ring=ContextMask(docs, cp.size, cp.group.rank), rope=rope)
        # without CP, and under the all-to-all form, whose attention runs over the whole sequence in global order
        return DocumentMask(dense=dense_mask(docs), rope=rope)
