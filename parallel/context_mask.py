"""Document masks under context parallelism: each attention pair's slice of the mask, and the pairs to skip.

A micro-batch's documents are ``docs``, int32 ``[b, S]`` over the whole sequence: at each position the number of
EOD tokens before it (``data/gpt_dataset.py document_ids``), so ids never decrease along a row and a token sees
key k iff ``docs[q] == docs[k] and q >= k``. Every CP rank holds the whole ``docs`` (a few bytes a token, read with
the micro-batch: nothing travels with K/V), so the slice of any pair is known where it is computed.

``ContextMask`` turns the pairs of ``parallel/context.py`` (query chunk x key range) into masked pairs, once per
micro-batch (model/doc_mask.py builds it before the first layer; every layer reuses it):

- **skipped** when no row of the micro-batch sees any key of the range: ids are sorted, so an earlier key chunk is
  visible iff, in some row, its last key's document is the query chunk's first one. No kernel runs, nothing is
  merged (a kernel on such a pair would return an lse of 0 or NaN for its empty rows, not -inf);
- **unmasked** (the kernel of the dense ring, ``full`` or ``causal``) when every row of the query chunk and of the
  keys lies in one document;
- **masked** otherwise: the kernel with an additive mask ``[b, 1, C, L]`` (0 / -inf; on the diagonal with the causal
  flag too, so the kernel still skips the blocks above it), and the rows that see nothing in this pair set to lse
  -inf, output 0 (``PairMask.rows``), so the log-sum-exp merge ignores them.

The all-gather form's prefix pair (a query chunk over every earlier key) starts at the first key any row can see:
the start of the document of the chunk's first token, the earliest over the rows.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from parallel.layout import cp_chunks


class PairMask:
    """The mask of one pair: ``visible`` bool ``[b, 1, Lq, Lk]``; ``rows`` bool ``[b, 1, Lq]``, the rows that see
    some key of the pair (None: all do)."""

    def __init__(self, visible: torch.Tensor):
        self.visible = visible
        seen = visible.any(-1)
        self.rows = None if bool(seen.all()) else seen
        self._bias: Dict[Tuple[torch.dtype, int], torch.Tensor] = {}

    def bias(self, dtype: torch.dtype, align: int = 1) -> torch.Tensor:
        """The additive mask in ``dtype`` (0 where visible, -inf elsewhere), made once per micro-batch and dtype;
        ``align``: its rows start at multiples of this many elements (CUDA's memory-efficient kernel needs 16, which
        SDPA's own entry point pads to, as here)."""
        if (dtype, align) not in self._bias:
            shape, n = self.visible.shape, self.visible.shape[-1]
            rows = torch.zeros((*shape[:-1], n + (-n % align)), dtype=dtype, device=self.visible.device)
            self._bias[dtype, align] = rows[..., :n].masked_fill_(~self.visible, float("-inf"))
        return self._bias[dtype, align]


Pair = Tuple[int, int, int, bool, Optional[PairMask]]
"""(local query chunk, first key, key count, causal, mask): parallel/context.py's pair with its mask (None: none)."""


class ContextMask:
    """The document mask of one micro-batch at one CP rank: its pairs for either form (module docstring)."""

    def __init__(self, docs: torch.Tensor, cp: int, rank: int):
        b, seq = docs.shape
        if seq % (2 * cp):
            raise ValueError(f"a sequence of {seq} tokens cannot be cut into 2 x cp = {2 * cp} equal chunks")
        self.docs, self.cp, self.rank, self.c = docs, cp, rank, seq // (2 * cp)
        self.q_ids = cp_chunks(cp, rank)
        c = self.c
        # each chunk's first and last document per row, read to the host once: the pair decisions are made here
        self._first = docs[:, ::c].t().tolist()  # [2cp][b]
        self._last = docs[:, c - 1::c].t().tolist()
        self._pairs: Dict[Tuple[int, int], Optional[Pair]] = {}

    def _chunk_docs(self, g: int) -> torch.Tensor:
        return self.docs[:, g * self.c:(g + 1) * self.c]

    def _mask(self, qc: int, start: int, n: int, causal: bool) -> PairMask:
        """The mask of query chunk ``qc`` over the keys ``[start, start + n)`` of the sequence."""
        visible = self._chunk_docs(qc)[:, None, :, None] == self.docs[:, None, None, start:start + n]
        if causal:
            visible &= torch.ones(n, n, dtype=torch.bool, device=visible.device).tril()
        return PairMask(visible)

    def _pair(self, a: int, qc: int, kc: int, start: int) -> Optional[Pair]:
        """Query chunk ``qc`` (local ``a``) over key chunk ``kc <= qc``, held at ``start`` of the keys in hand;
        None = skipped."""
        first, last, c = self._first, self._last, self.c
        if kc == qc:  # every row sees its own token: never skipped
            if first[qc] == last[qc]:
                return a, start, c, True, None
            return a, start, c, True, self._mask(qc, kc * c, c, True)  # causal too: the kernel skips the upper half
        if not any(lk == fq for lk, fq in zip(last[kc], first[qc])):
            return None
        if first[kc] == last[qc]:
            return a, start, c, False, None
        return a, start, c, False, self._mask(qc, kc * c, c, False)

    def block_pairs(self, src: int) -> List[Pair]:
        """Ring attention: this rank's query chunks with the K/V block of CP rank ``src`` (its two chunks)."""
        out = []
        for j, kc in enumerate(cp_chunks(self.cp, src)):
            for a, qc in enumerate(self.q_ids):
                if kc > qc:
                    continue
                if (qc, kc) not in self._pairs:
                    self._pairs[qc, kc] = self._pair(a, qc, kc, 0)
                pair = self._pairs[qc, kc]
                if pair is not None:
                    out.append((pair[0], j * self.c, *pair[2:]))
        return sorted(out, key=lambda p: (p[0], p[1]))

    def prefix_pairs(self) -> List[Pair]:
        """All-gathered K/V (global order): each local query chunk over the earlier keys that some row sees (one
        pair, from the earliest start over the rows of the chunk's first document), then over itself."""
        if "prefix" not in self._pairs:
            pairs, c = [], self.c
            for a, qc in enumerate(self.q_ids):
                if qc == 0:
                    continue
                if self._first[0] == self._last[qc]:  # every row one document from the start: the dense pair
                    pairs.append((a, 0, qc * c, False, None))
                    continue
                # where each row's first document of the chunk starts (ids are sorted), the earliest over the rows
                start = int((self.docs[:, :qc * c] < self._chunk_docs(qc)[:, :1]).sum(1).min())
                if start < qc * c:  # else no row continues an earlier document into this chunk
                    pairs.append((a, start, qc * c - start, False, self._mask(qc, start, qc * c - start, False)))
            pairs += [self._pair(a, qc, qc, qc * c) for a, qc in enumerate(self.q_ids)]
            self._pairs["prefix"] = pairs
        return self._pairs["prefix"]
