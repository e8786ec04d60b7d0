"""GPT training samples: document split, per-epoch shuffling, blending, batches.

Data-position contract
----------------------
The trainer's whole data position is one integer, ``consumed_samples``: how
many samples of the global batch stream (all data-parallel ranks together)
have been consumed.  A step reads the global indices ``consumed_samples ..
consumed_samples + global_batch - 1`` (each rank takes its slice of them with
:func:`get_batch`) and then adds ``global_batch``.  Sample ``i`` is a pure
function of the data files' contents, ``seed``, ``seq_len``, the split and
weights and ``i`` itself (not of the files' names or places): no iterator or
RNG state is kept, so a run resumed from a checkpoint's ``consumed_samples``
reads exactly the tokens it would have read without the interruption, whatever
was read before in the current process and wherever the files now lie.

Sample layout
-------------
Every sample holds ``seq_len + 1`` tokens; ``tokens = s[:-1]`` and
``labels = s[1:]``.  In epoch ``e`` a dataset orders its documents by a
permutation seeded by ``(seed, e, key)`` and reads their concatenation
(documents end with EOD) as one stream; sample ``i`` of the epoch is the
window ``[i * seq_len, i * seq_len + seq_len + 1)`` of that stream, so windows
overlap by one token and cross document boundaries.  Windows are visited in a
second permutation drawn from the same generator.

Data order versions
-------------------
``key`` is what :data:`DATA_ORDER` numbers (checkpoints record it):

1. ``CRC-32("<basename of prefix>/<train|valid>")``: the order before issue 17.
   Renaming a file changed its order (byte-identical data under another name
   read other samples after a resume).  Still built on request (``seed_names``
   of :func:`build_datasets`) so a checkpoint written in it resumes on its curve.
2. :func:`content_key`: from the data's content
   (:attr:`~data.indexed.IndexedDataset.content_sha256`) and the part, so the
   same data under any path or format gives the same order, and two different
   datasets of a blend get different ones.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from data.indexed import DataError, IndexedDataset
from data.tokenizer import Tokenizer

DATA_ORDER = 2
"""The data order version :func:`build_datasets` produces unless ``seed_names`` asks for version 1."""
_EPOCHS_CACHED = 3  # epochs whose permutations a GPTDataset keeps
_BLOCK = 4096  # global indices per blending block
_BLOCKS_CACHED = 4


class Sampleable(Protocol):
    """Anything that maps a global sample index to ``seq_len + 1`` token ids, or to those in ``[lo, hi)`` of them
    (context parallelism reads only its chunks of each sequence)."""

    def sample(self, index: int, lo: int = 0, hi: int | None = None) -> np.ndarray: ...


@dataclass(frozen=True)
class _Epoch:
    docs: np.ndarray  # document ids in stream order
    starts: np.ndarray  # stream offset of each document, plus the stream length
    order: np.ndarray  # sample permutation


class GPTDataset:
    """Infinite, indexable stream of ``seq_len + 1``-token samples over some documents."""

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_ids: np.ndarray,
        seq_len: int,
        seed: int,
        name: str,
        vocab_size: int | None = None,
        key: int | None = None,
    ) -> None:
        if seq_len < 1:
            raise DataError(f"dataset {name!r}: seq_len must be positive, got {seq_len}")
        self.indexed = indexed
        self.doc_ids = np.asarray(doc_ids, dtype=np.int64)
        self.seq_len = seq_len
        self.seed = seed
        self.name = name
        self.key = zlib.crc32(name.encode()) if key is None else key
        """Seeds the shuffling with ``seed``; default: CRC-32 of ``name`` (data order 1)."""
        self.vocab_size = vocab_size
        """When set, every sample is checked against it (corrupted bytes give an error naming the file)."""
        self.tokens_per_epoch = int(indexed.sizes[self.doc_ids].sum(dtype=np.int64))
        if self.tokens_per_epoch < seq_len + 1:
            raise DataError(
                f"dataset {name!r}: {self.tokens_per_epoch} tokens in {len(self.doc_ids)} documents, "
                f"need at least seq_len + 1 = {seq_len + 1} ({indexed.prefix}.bin)"
            )
        self.samples_per_epoch = (self.tokens_per_epoch - 1) // seq_len
        self.document_eod: int | None = None
        """The EOD id that ends every document, when checked for document masks (:func:`build_datasets`)."""
        self._epochs: OrderedDict[int, _Epoch] = OrderedDict()

    def _epoch(self, epoch: int) -> _Epoch:
        """Document order, stream offsets and sample order of ``epoch`` (cached).

        Both permutations come from one generator seeded by ``(seed, epoch,
        key)``: first the documents', then the samples'.
        """
        if epoch in self._epochs:
            self._epochs.move_to_end(epoch)
            return self._epochs[epoch]
        rng = np.random.default_rng([self.seed, epoch, self.key])
        docs = self.doc_ids[rng.permutation(len(self.doc_ids))]
        starts = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum(self.indexed.sizes[docs], out=starts[1:])
        self._epochs[epoch] = _Epoch(docs, starts, rng.permutation(self.samples_per_epoch))
        if len(self._epochs) > _EPOCHS_CACHED:
            self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def sample(self, index: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The ``index``-th sample (``epoch * samples_per_epoch + i``) as int64 ids: its tokens ``[lo, hi)`` of
        ``seq_len + 1`` (default all); only those are read."""
        if index < 0:
            raise IndexError(f"dataset {self.name!r}: negative sample index {index}")
        hi = self.seq_len + 1 if hi is None else hi
        if not 0 <= lo < hi <= self.seq_len + 1:
            raise IndexError(f"dataset {self.name!r}: token window [{lo}, {hi}) is not inside the "
                             f"{self.seq_len + 1} tokens of a sample")
        epoch, i = divmod(index, self.samples_per_epoch)
        ep = self._epoch(epoch)
        start = int(ep.order[i]) * self.seq_len + lo
        end = start + hi - lo
        first = int(np.searchsorted(ep.starts, start, side="right")) - 1
        last = int(np.searchsorted(ep.starts, end, side="left"))
        pieces = []
        for d in range(first, last):
            doc_start = int(ep.starts[d])
            lo = max(start, doc_start) - doc_start
            hi = min(end, int(ep.starts[d + 1])) - doc_start
            pieces.append(self.indexed.get(int(ep.docs[d]), lo, hi - lo))
        out = np.concatenate(pieces).astype(np.int64)
        if self.vocab_size is not None and out.max() >= self.vocab_size:
            raise DataError(
                f"{self.indexed.prefix}.bin: sample {index} holds token id {int(out.max())}, but the "
                f"vocabulary has only {self.vocab_size} ids (corrupted file?)"
            )
        return out


def _normalized(weights: Sequence[float]) -> np.ndarray:
    """Weights scaled to sum to 1; each must be positive and finite."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w) & (w > 0)):
        raise DataError(f"blend weights must be positive finite numbers, got {list(weights)}")
    return w / w.sum()


class BlendedDataset:
    """Deterministic low-discrepancy interleave of several datasets.

    The ``n``-th sample of dataset ``k`` gets the ideal time ``(n + 0.5) / w_k``
    (weights normalised to sum 1); the blend lists all samples by ideal time,
    ties going to the lower ``k``.  Every dataset is thus read in its own order
    0, 1, 2, ... and after ``N`` samples holds within about one sample of
    ``w_k * N``.  Global indices are resolved a block at a time with numpy,
    starting from a closed form count, so any index costs the same.
    """

    def __init__(self, datasets: Sequence[Sampleable], weights: Sequence[float]) -> None:
        if len(datasets) != len(weights):
            raise DataError(f"{len(datasets)} datasets but {len(weights)} blend weights")
        self.datasets = list(datasets)
        self.weights = _normalized(weights)
        eods = {getattr(d, "document_eod", None) for d in self.datasets}
        self.document_eod: int | None = eods.pop() if len(eods) == 1 else None
        """The EOD id of every dataset of the blend (None unless they share one)."""
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _counts_before(self, time: float) -> np.ndarray:
        """Per dataset, how many of its samples have an ideal time below ``time``."""
        w = self.weights
        n = np.maximum(np.ceil(time * w - 0.5), 0).astype(np.int64)
        # Exact against the float ideal times used for ordering: fix rounding at the edge.
        n += (n + 0.5) / w < time
        n -= (n > 0) & ((n - 0.5) / w >= time)
        return n

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, dataset-local index) of each global index in ``block`` (cached)."""
        if block in self._blocks:
            self._blocks.move_to_end(block)
            return self._blocks[block]
        num = len(self.weights)
        start = block * _BLOCK
        # Fewer than ``start`` samples precede time ``start - num`` (each dataset
        # contributes at most w_k * time + 0.5), so the block lies after them.
        base = self._counts_before(float(max(0, start - num)))
        skip = start - int(base.sum())
        count = skip + _BLOCK
        local = (base[:, None] + np.arange(count)).ravel()
        source = np.repeat(np.arange(num), count)
        order = np.lexsort((source, (local + 0.5) / self.weights[source]))[skip:]
        self._blocks[block] = (source[order], local[order])
        if len(self._blocks) > _BLOCKS_CACHED:
            self._blocks.popitem(last=False)
        return self._blocks[block]

    def sample(self, index: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """The ``index``-th sample of the blend (its tokens ``[lo, hi)``, default all)."""
        if index < 0:
            raise IndexError(f"negative sample index {index}")
        sources, locals_ = self._block(index // _BLOCK)
        k = int(sources[index % _BLOCK])
        return self.datasets[k].sample(int(locals_[index % _BLOCK]), lo, hi)


def split_documents(num_docs: int, split: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Train and valid document ids: contiguous ranges ``[0, a)`` and ``[a, num_docs)``.

    ``split`` holds the two (unnormalised) fractions, e.g. ``[0.95, 0.05]``.
    A split with non-zero weight gets at least one document, a zero-weight
    split none.
    """
    w = np.asarray(split, dtype=np.float64)
    if w.shape != (2,) or not np.all(np.isfinite(w) & (w >= 0)) or w.sum() == 0:
        raise DataError(f"split must be two non-negative numbers, not both 0; got {list(split)}")
    if num_docs < int(np.count_nonzero(w)):
        raise DataError(f"cannot split {num_docs} documents by {list(split)}")
    num_valid = round(num_docs * w[1] / w.sum())
    if w[1] > 0:
        num_valid = max(num_valid, 1)
    if w[0] > 0:
        num_valid = min(num_valid, num_docs - 1)
    return np.arange(num_docs - num_valid), np.arange(num_docs - num_valid, num_docs)


def _combine(datasets: list[GPTDataset], weights: Sequence[float] | None) -> Sampleable:
    """One dataset as is, several blended (by token count when no weights are given)."""
    if weights is None:
        weights = [d.tokens_per_epoch for d in datasets]
    return datasets[0] if len(datasets) == 1 else BlendedDataset(datasets, weights)


def check_tokenizer(indexed: IndexedDataset, tokenizer: Tokenizer, setting: str = "data.tokenizer") -> None:
    """Refuse a pair whose index records another tokenizer than ``tokenizer`` (by digest), in one line naming
    the data, the tokenizer that made it and ``setting`` (where ``tokenizer`` was configured).  Pairs without a
    record (index versions 1-2, Megatron-LM's) pass: nothing tells which tokenizer made them."""
    made_by = indexed.tokenizer_info
    if made_by is None or made_by["digest"] == tokenizer.digest:
        return
    raise DataError(
        f"{indexed.prefix}: made with the {made_by['kind']} tokenizer {made_by['name']!r}, not with "
        f"{setting}={tokenizer.path} ({tokenizer.kind}, another digest): preprocess the data with {setting}, "
        f"or set {setting} to the tokenizer that made it"
    )


def content_key(content_sha256: str, part: str) -> int:
    """Data order 2's shuffle key of one part (``"train"``/``"valid"``) of a dataset: the first 8 bytes,
    little-endian, of SHA-256 of ``"<content_sha256>/<part>"``."""
    return int.from_bytes(hashlib.sha256(f"{content_sha256}/{part}".encode()).digest()[:8], "little")


def build_datasets(
    paths: list[str],
    weights: list[float] | None,
    split: Sequence[float],
    seq_len: int,
    seed: int,
    vocab_size: int | None = None,
    seed_names: Sequence[str] | None = None,
    tokenizer: Tokenizer | None = None,
    document_eod: int | None = None,
) -> tuple[Sampleable, Sampleable | None]:
    """Train and valid sample streams over the ``.bin/.idx`` prefixes ``paths``.

    Each prefix is split by :func:`split_documents`; several prefixes are
    blended with ``weights`` (default: proportional to their tokens in the
    split).  A dataset's shuffling is seeded by ``seed`` and, in data order
    :data:`DATA_ORDER` = 2, its content (:func:`content_key`), so moving,
    renaming or copying the files does not change the samples.  With
    ``seed_names`` (one per path) it is data order 1 instead: seeded by
    ``"<seed name>/<train|valid>"`` as before issue 17, for resuming a
    checkpoint written in that order (its paths' basenames).  Valid is ``None``
    when its fraction is 0.  With ``vocab_size``, ids at or above it are
    refused: on opening (from the index's largest id) and in every sample read
    (corrupted bytes), naming the file.  With ``tokenizer`` (the run's
    ``data.tokenizer``), a file whose index records another tokenizer is
    refused (:func:`check_tokenizer`).  With ``document_eod`` (``data.document_mask``), data whose documents do
    not end with that EOD id is refused (:func:`check_document_ends`).
    """
    if not paths:
        raise DataError("no data paths given")
    if seed_names is not None and len(seed_names) != len(paths):
        raise DataError(f"{len(paths)} data paths but {len(seed_names)} seed names")
    if weights is not None:
        if len(weights) != len(paths):
            raise DataError(f"{len(paths)} data paths but {len(weights)} weights")
        _normalized(weights)
    indexed = [IndexedDataset(path) for path in paths]
    for path, d in zip(paths, indexed, strict=True):
        if d.num_docs == 0:
            raise DataError(f"{path}.idx: the dataset is empty (0 documents)")
        if tokenizer is not None:
            check_tokenizer(d, tokenizer)
        if vocab_size is not None:
            d.check_vocab(vocab_size)
        if document_eod is not None:
            check_document_ends(d, document_eod)
    dtypes = {path: str(d.dtype) for path, d in zip(paths, indexed, strict=True)}
    if len(set(dtypes.values())) > 1:
        raise DataError(f"blended datasets must share a token dtype (vocabulary), got {dtypes}")
    splits = [split_documents(d.num_docs, split) for d in indexed]

    def stream(part: int, part_name: str) -> Sampleable:
        datasets = []
        for i, (path, d, doc_ids) in enumerate(zip(paths, indexed, splits, strict=True)):
            name = f"{os.path.basename(path)}/{part_name}"
            key = (
                zlib.crc32(f"{seed_names[i]}/{part_name}".encode())
                if seed_names is not None
                else content_key(d.content_sha256, part_name)
            )
            datasets.append(GPTDataset(d, doc_ids[part], seq_len, seed, name, vocab_size, key))
            datasets[-1].document_eod = document_eod
        return _combine(datasets, weights)

    return stream(0, "train"), stream(1, "valid") if float(split[1]) > 0 else None


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """The document of each token of ``tokens`` ``[b, S]``, int32 ``[b, S]``: the number of EOD tokens before it in
    its row (an EOD ends its own document; the next token starts the next one)."""
    is_eod = (tokens == eod).to(torch.int32)
    return is_eod.cumsum(1, dtype=torch.int32) - is_eod


def check_document_ends(indexed: IndexedDataset, eod: int, setting: str = "data.document_mask",
                        docs: int = 8) -> None:
    """Refuse data whose documents do not end with the EOD id ``eod`` (read: the last token of the first ``docs``
    documents and of the last one), in one line naming the file and ``setting``: document masks find documents by
    their EOD, so data preprocessed without it (``--no-eod``) would be masked as one document."""
    for i in sorted({*range(min(docs, indexed.num_docs)), indexed.num_docs - 1}):
        size = int(indexed.sizes[i])
        last = int(indexed.get(i, size - 1, 1)[0]) if size else None
        if last != eod:
            raise DataError(f"{indexed.prefix}.bin: document {i} ends with token {last}, not the tokenizer's EOD "
                            f"id {eod}: {setting}=true finds documents by their EOD (preprocess without --no-eod, "
                            f"or set {setting}=false)")


def get_batch(dataset: Sampleable, indices: Sequence[int], spans: Sequence[tuple[int, int]] | None = None,
              eod: int | None = None) -> tuple[torch.Tensor, ...]:
    """``(tokens, labels)``, both int64 ``[len(indices), seq_len]``, for the given samples; with ``spans`` (token
    ranges ``[lo, hi)`` of a sequence, as context parallelism's chunks) only those positions, concatenated in that
    order: ``[len(indices), sum of hi - lo]``, each span's tokens and their next tokens read as one window. With
    ``eod`` (document masks), a third tensor: the whole sequences' ``document_ids`` ``[len(indices), seq_len]``,
    whatever the spans (each CP rank then reads the whole samples, to know every chunk's documents)."""
    if eod is not None:
        samples = torch.from_numpy(np.stack([dataset.sample(int(i)) for i in indices]))
        tokens, labels = samples[:, :-1], samples[:, 1:]
        docs = document_ids(tokens, eod)
        if spans is not None:
            tokens, labels = (torch.cat([t[:, lo:hi] for lo, hi in spans], dim=1) for t in (tokens, labels))
        return tokens.contiguous(), labels.contiguous(), docs
    if spans is None:
        samples = torch.from_numpy(np.stack([dataset.sample(int(i)) for i in indices]))
        return samples[:, :-1].contiguous(), samples[:, 1:].contiguous()
    windows = [[torch.from_numpy(dataset.sample(int(i), lo, hi + 1)) for lo, hi in spans] for i in indices]
    tokens = torch.stack([torch.cat([w[:-1] for w in row]) for row in windows])
    labels = torch.stack([torch.cat([w[1:] for w in row]) for row in windows])
    return tokens, labels
