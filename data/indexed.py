"""Memory-mapped token storage: a ``.bin`` / ``.idx`` file pair.

``<prefix>.bin`` holds the token ids of all documents back to back, as
``uint16`` when the vocabulary has fewer than 65536 entries and ``int32``
otherwise.  ``<prefix>.idx`` describes the documents (all little-endian)::

    magic         8 bytes   b"GPTIDX\\x00\\x00"
    version       uint64    3 (2 when no tokenizer is recorded)
    dtype code    uint8     1 = uint16, 2 = int32
    padding       7 bytes   zero
    num_docs      uint64
    total_tokens  uint64
    max_token_id  int64     largest token id in .bin (-1 when empty); versions 2 and 3
    sizes         int32[num_docs]   document lengths in tokens (EOD included)
    offsets       int64[num_docs]   token offset of each document in .bin
    record_bytes  uint32    length of the tokenizer record; version 3 only
    record        UTF-8 JSON object, record_bytes long; version 3 only

Version 3's record names the tokenizer that made the pair (``data/tokenizer.py``'s
``Tokenizer.info``): ``{"digest", "eod_id", "kind", "name", "vocab_size"}``, written with
sorted keys and no spaces, where ``kind`` is ``"sentencepiece"`` or ``"huggingface"``,
``digest`` the tokenizer's sha256 (64 hex digits), ``name`` its file or directory name,
``vocab_size`` and ``eod_id`` its vocabulary size and end-of-document id.  The file ends
right after the record.  Training refuses data whose record names another tokenizer than
``data.tokenizer`` (:attr:`IndexedDataset.tokenizer_info`, ``data/gpt_dataset.py``).
:class:`IndexedDatasetWriter` writes version 3 when given the record, else version 2.

Version 1 files (no ``max_token_id``) are still read; their largest id is then found
by scanning the ``.bin`` once, when a vocabulary check asks for it (slow for big
files: re-run preprocessing to upgrade them).  Versions 1 and 2 record no tokenizer.

Megatron-LM pairs
-----------------
Pairs written by Megatron-LM's ``tools/preprocess_data.py`` (megatron-core's
``IndexedDatasetBuilder``) are read as they are; the format is told apart by the
magic at the start of the ``.idx``.  Their index (all little-endian)::

    magic           9 bytes   b"MMIDIDX\x00\x00"
    version         uint64    1
    dtype code      uint8     1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                              6 float64, 7 float32, 8 uint16
    num_sequences   uint64
    num_doc_idx     uint64    number of document indices (documents + 1)
    lengths         int32[num_sequences]   sequence lengths in tokens
    pointers        int64[num_sequences]   BYTE offset of each sequence in .bin
    document_idx    int64[num_doc_idx]     0, then the end sequence of each document

Megatron's own GPT dataset samples *sequences*; here a document is a Megatron
*document*: its sequences ``document_idx[d] .. document_idx[d + 1] - 1`` read back
to back (they are contiguous in ``.bin``).  With the default preprocessing (no
sentence splitting) every document holds one sequence and the two agree; with
``--split-sentences`` the sentences of a document stay together, and the EOD
Megatron appends after the last one ends it.  Dtype code 7 meant float64
(``np.double``) in the older Megatron-LM ``indexed_dataset.py``; such a file is
recognised by its 8-byte pointers.  The index stores no largest id: it is found
by scanning the ``.bin`` once when a vocabulary check asks for it, which also
refuses negative or non-integer ids.  Multimodal indices (a trailing
``sequence_modes`` array) are refused.

:class:`IndexedDatasetWriter` builds a pair and only moves it under its final
names once complete; :class:`IndexedDataset` opens a pair with ``np.memmap``
and refuses any pair that is not self-consistent.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import re
import struct
import uuid
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np

MAGIC = b"GPTIDX\x00\x00"
VERSION = 3
"""The newest version: 2's layout and a tokenizer record."""
VERSION_WITHOUT_TOKENIZER = 2
_HEADER_V1 = struct.Struct("<8sQB7xQQ")  # magic, version, dtype code, pad, num_docs, total_tokens
_HEADER = struct.Struct("<8sQB7xQQq")  # ... and max_token_id (versions 2 and 3)
_HEADERS = {1: _HEADER_V1, 2: _HEADER, 3: _HEADER}
_RECORD_LENGTH = struct.Struct("<I")  # version 3: bytes of the tokenizer record that follows
TOKENIZER_KEYS: dict[str, type] = {"kind": str, "digest": str, "name": str, "vocab_size": int, "eod_id": int}
"""The fields of a version 3 tokenizer record and their JSON types."""
TOKENIZER_KINDS = ("sentencepiece", "huggingface")
_DTYPES: dict[int, np.dtype] = {1: np.dtype("<u2"), 2: np.dtype("<i4")}
_SIZE_DTYPE = np.dtype("<i4")
_OFFSET_DTYPE = np.dtype("<i8")

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
_MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices
_MEGATRON_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("u1"),
    2: np.dtype("i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),  # megatron-core; the older Megatron-LM wrote np.double (see _open_megatron)
    8: np.dtype("<u2"),
}


CONTENT_ALL_TOKENS = 1 << 16
"""Up to this many tokens, :attr:`IndexedDataset.content_sha256` hashes them all."""
CONTENT_BLOCKS, CONTENT_BLOCK_TOKENS = 64, 1024
"""Beyond it, this many evenly spread blocks of this many tokens."""


class DataError(ValueError):
    """Raised for unreadable, inconsistent or otherwise invalid input data."""


def _dtype_code_for(vocab_size: int) -> int:
    """The ``.idx`` dtype code able to hold every id of a ``vocab_size`` vocabulary."""
    if vocab_size <= 0:
        raise DataError(f"vocab_size must be positive, got {vocab_size}")
    return 1 if vocab_size < 2**16 else 2


def check_tokenizer_record(record: object, where: str) -> dict[str, Any]:
    """``record`` checked as a version 3 tokenizer record (see the module docstring) and returned as a dict.

    Exactly the :data:`TOKENIZER_KEYS`, each of its JSON type; ``kind`` one of :data:`TOKENIZER_KINDS`;
    ``digest`` 64 lowercase hex digits; ``name`` not empty; ``vocab_size`` positive and ``eod_id`` inside
    it.  A problem is a DataError starting with ``where``.
    """
    if not isinstance(record, Mapping):
        raise DataError(f"{where} must be a JSON object, got {type(record).__name__}")
    record = dict(record)
    if set(record) != set(TOKENIZER_KEYS):
        missing, unknown = sorted(set(TOKENIZER_KEYS) - set(record)), sorted(set(record) - set(TOKENIZER_KEYS))
        raise DataError(f"{where} must hold exactly the keys {sorted(TOKENIZER_KEYS)} (missing {missing}, "
                        f"unknown {unknown})")
    for key, kind in TOKENIZER_KEYS.items():
        if not isinstance(record[key], kind) or isinstance(record[key], bool):
            raise DataError(f"{where}: {key} must be a{'n' if kind is int else ''} {kind.__name__}, "
                            f"got {record[key]!r}")
    if record["kind"] not in TOKENIZER_KINDS:
        raise DataError(f"{where}: kind must be one of {list(TOKENIZER_KINDS)}, got {record['kind']!r}")
    if not re.fullmatch(r"[0-9a-f]{64}", record["digest"]):
        raise DataError(f"{where}: digest must be 64 lowercase hex digits (sha256), got {record['digest']!r}")
    if not record["name"]:
        raise DataError(f"{where}: name must not be empty")
    if record["vocab_size"] <= 0 or not 0 <= record["eod_id"] < record["vocab_size"]:
        raise DataError(f"{where}: eod_id {record['eod_id']} must lie in [0, vocab_size={record['vocab_size']})")
    return record


def _encode_record(record: dict[str, Any]) -> bytes:
    """A tokenizer record as stored: UTF-8 JSON, sorted keys, no spaces."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class IndexedDatasetWriter:
    """Streams documents into a new ``<prefix>.bin`` / ``<prefix>.idx`` pair.

    Data goes to temporary files next to the destination; :meth:`finalize`
    renames them into place, so the final names never hold a partial pair.
    Used as a context manager, the pair is finalized on success and the
    temporary files are removed if the block raises.  With ``tokenizer`` (the
    record of the tokenizer that made the ids, ``Tokenizer.info`` of
    ``data/tokenizer.py``; its ``vocab_size`` must be ``vocab_size``) the index
    is version 3 and keeps it; without, version 2.
    """

    def __init__(self, prefix: str, vocab_size: int, tokenizer: Mapping[str, Any] | None = None) -> None:
        self.prefix = prefix
        self.vocab_size = vocab_size
        self._record: bytes | None = None
        if tokenizer is not None:
            record = check_tokenizer_record(tokenizer, f"{prefix}: tokenizer record")
            if record["vocab_size"] != vocab_size:
                raise DataError(f"{prefix}: the tokenizer record's vocab_size {record['vocab_size']} is not the "
                                f"writer's {vocab_size}")
            self._record = _encode_record(record)
        self._dtype_code = _dtype_code_for(vocab_size)
        self._dtype = _DTYPES[self._dtype_code]
        self._sizes = array.array("q")
        self._max_id = -1
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        unique = uuid.uuid4().hex[:12]
        self._tmp_bin = f"{prefix}.{unique}.bin.tmp"
        self._tmp_idx = f"{prefix}.{unique}.idx.tmp"
        self._bin = open(self._tmp_bin, "xb")
        self._done = False

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document (its ids, normally ending with the EOD id)."""
        if self._done:
            raise RuntimeError(f"writer for {self.prefix} is already closed")
        tokens = np.asarray(ids, dtype=np.int64)
        if tokens.ndim != 1:
            raise DataError(f"{self.prefix}: a document must be 1-D, got shape {tokens.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise DataError(
                f"{self.prefix}: token ids must lie in [0, {self.vocab_size}), "
                f"got range [{tokens.min()}, {tokens.max()}]"
            )
        if tokens.size >= 2**31:
            raise DataError(f"{self.prefix}: document of {tokens.size} tokens is too long")
        self._bin.write(tokens.astype(self._dtype).tobytes())
        self._sizes.append(tokens.size)
        if tokens.size:
            self._max_id = max(self._max_id, int(tokens.max()))

    def finalize(self) -> None:
        """Write the index and move both files under their final names."""
        if self._done:
            raise RuntimeError(f"writer for {self.prefix} is already closed")
        self._done = True
        self._bin.close()
        sizes = np.array(self._sizes, dtype=np.int64)
        offsets = (np.cumsum(sizes) - sizes).astype(_OFFSET_DTYPE)
        version = VERSION_WITHOUT_TOKENIZER if self._record is None else VERSION
        header = _HEADER.pack(MAGIC, version, self._dtype_code, len(sizes), int(sizes.sum()), self._max_id)
        record = b"" if self._record is None else _RECORD_LENGTH.pack(len(self._record)) + self._record
        try:
            with open(self._tmp_idx, "wb") as f:
                f.write(header + sizes.astype(_SIZE_DTYPE).tobytes() + offsets.tobytes() + record)
            # Drop a stale index first: a reader then sees either no pair or the new one.
            if os.path.exists(self.prefix + ".idx"):
                os.remove(self.prefix + ".idx")
            os.replace(self._tmp_bin, self.prefix + ".bin")
            os.replace(self._tmp_idx, self.prefix + ".idx")
        finally:
            self._remove_temporaries()

    def abort(self) -> None:
        """Discard everything written so far; the final names are left untouched."""
        if not self._done:
            self._done = True
            self._bin.close()
            self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        """Delete whichever temporary files still exist."""
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only, memory-mapped view of a ``<prefix>.bin`` / ``<prefix>.idx`` pair.

    Reads this project's ``GPTIDX`` pairs and Megatron-LM's ``MMIDIDX`` pairs
    (see the module docstring) behind one interface: ``sizes`` and ``offsets``
    (in tokens) per document, ``dtype``, ``total_tokens``, ``tokens``.
    ``format`` says which (``"gptidx"`` or ``"megatron"``).  ``tokenizer_info``
    is the tokenizer record of a version 3 index (a dict, see the module
    docstring), None for older versions and Megatron-LM pairs.  Every structural
    property of the pair is checked on open; any problem raises
    :class:`DataError` naming the offending file.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataError(f"{path}: file not found")

        idx_bytes = os.path.getsize(idx_path)
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r") if idx_bytes else np.empty(0, np.uint8)
        start = idx[: len(MEGATRON_MAGIC)].tobytes()
        self._max_token_id: int | None = None  # None: scanned from .bin when asked
        self._content_sha256: str | None = None  # computed when asked
        self.tokenizer_info: dict[str, Any] | None = None  # version 3 only
        if start == MEGATRON_MAGIC:
            self.format = "megatron"
            self._open_megatron(idx, idx_path, bin_path)
        else:
            maybe_magic = MAGIC.startswith(start[:8]) or MEGATRON_MAGIC.startswith(start)
            if idx_bytes < _HEADER_V1.size and maybe_magic:
                raise DataError(
                    f"{idx_path}: truncated header ({idx_bytes} bytes, need {_HEADER_V1.size})"
                )
            self.format = "gptidx"
            self._open_gptidx(idx, idx_path)

        bin_bytes = os.path.getsize(bin_path)
        total_tokens = self.total_tokens
        if bin_bytes != total_tokens * self.dtype.itemsize:
            raise DataError(
                f"{bin_path}: {bin_bytes} bytes, expected {total_tokens} tokens x "
                f"{self.dtype.itemsize} bytes = {total_tokens * self.dtype.itemsize} "
                f"(per {idx_path}); truncated file or mismatched pair"
            )
        self.tokens: np.ndarray = (
            np.memmap(bin_path, dtype=self.dtype, mode="r")
            if total_tokens
            else np.empty(0, dtype=self.dtype)
        )

    def _open_gptidx(self, idx: np.ndarray, idx_path: str) -> None:
        """Parse and check this project's ``GPTIDX`` index."""
        idx_bytes = len(idx)
        magic, version = struct.unpack("<8sQ", idx[:16].tobytes().ljust(16, b"\x00"))
        if magic != MAGIC:
            raise DataError(
                f"{idx_path}: bad magic {magic!r}, expected {MAGIC!r} (or Megatron-LM's {MEGATRON_MAGIC!r})"
            )
        if version not in _HEADERS:
            raise DataError(f"{idx_path}: unsupported version {version} (supported: {sorted(_HEADERS)})")
        header = _HEADERS[version]
        if idx_bytes < header.size:
            raise DataError(f"{idx_path}: truncated header ({idx_bytes} bytes, need {header.size})")
        _, _, code, num_docs, total_tokens, *rest = header.unpack(idx[: header.size].tobytes())
        self._max_token_id = rest[0] if rest else None  # version 1: scanned when asked
        if code not in _DTYPES:
            raise DataError(f"{idx_path}: unknown dtype code {code} (known: {sorted(_DTYPES)})")
        offsets_end = header.size + num_docs * (_SIZE_DTYPE.itemsize + _OFFSET_DTYPE.itemsize)
        expected = offsets_end
        if version == 3:
            expected += _RECORD_LENGTH.size
            if idx_bytes >= expected:
                expected += _RECORD_LENGTH.unpack(idx[offsets_end:expected].tobytes())[0]
        if idx_bytes != expected:
            what = f"{num_docs} documents" + (" and the tokenizer record" if version == 3 else "")
            raise DataError(f"{idx_path}: {idx_bytes} bytes, expected {expected} for {what}")

        sizes_end = header.size + num_docs * _SIZE_DTYPE.itemsize
        self.sizes: np.ndarray = idx[header.size : sizes_end].view(_SIZE_DTYPE)
        self.offsets: np.ndarray = idx[sizes_end:offsets_end].view(_OFFSET_DTYPE)
        self.dtype: np.dtype = _DTYPES[code]
        self.total_tokens: int = total_tokens
        self._check_index(idx_path)
        if version == 3:
            self.tokenizer_info = self._read_record(idx[offsets_end + _RECORD_LENGTH.size :].tobytes(), idx_path)
            vocab_size = self.tokenizer_info["vocab_size"]
            if code != _dtype_code_for(vocab_size) or self._max_token_id >= vocab_size:
                raise DataError(
                    f"{idx_path}: the tokenizer record's vocab_size {vocab_size} does not fit the index "
                    f"(dtype code {code}, largest token id {self._max_token_id})"
                )

    @staticmethod
    def _read_record(raw: bytes, idx_path: str) -> dict[str, Any]:
        """The tokenizer record of a version 3 index, parsed and checked."""
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise DataError(f"{idx_path}: the tokenizer record is not valid UTF-8 JSON ({err})") from err
        return check_tokenizer_record(record, f"{idx_path}: the tokenizer record")

    def _open_megatron(self, idx: np.ndarray, idx_path: str, bin_path: str) -> None:
        """Parse and check a Megatron-LM ``MMIDIDX`` index; documents group their sequences."""
        idx_bytes = len(idx)
        head = _MEGATRON_HEADER
        if idx_bytes < head.size:
            raise DataError(
                f"{idx_path}: truncated Megatron-LM header ({idx_bytes} bytes, need {head.size})"
            )
        _, version, code, num_seqs, num_doc_idx = head.unpack(idx[: head.size].tobytes())
        if version != MEGATRON_VERSION:
            raise DataError(
                f"{idx_path}: unsupported version {version} of Megatron-LM's MMIDIDX index "
                f"(supported: [{MEGATRON_VERSION}])"
            )
        if code not in _MEGATRON_DTYPES:
            raise DataError(
                f"{idx_path}: unknown dtype code {code} in Megatron-LM index "
                f"(known: {sorted(_MEGATRON_DTYPES)})"
            )
        expected = head.size + num_seqs * (4 + 8) + num_doc_idx * 8
        if idx_bytes != expected:
            multimodal = " (a multimodal index with sequence modes, not supported)" if (
                idx_bytes == expected + num_seqs and num_seqs
            ) else "; truncated or corrupted file"
            raise DataError(
                f"{idx_path}: {idx_bytes} bytes, expected {expected} for {num_seqs} sequences and "
                f"{num_doc_idx} document indices{multimodal}"
            )
        lengths_end = head.size + 4 * num_seqs
        pointers_end = lengths_end + 8 * num_seqs
        self.sequence_lengths: np.ndarray = idx[head.size : lengths_end].view("<i4")
        self.sequence_pointers: np.ndarray = idx[lengths_end:pointers_end].view("<i8")
        self.document_indices: np.ndarray = idx[pointers_end:].view("<i8")

        lengths = self.sequence_lengths.astype(np.int64)
        if lengths.size and lengths.min() < 0:
            bad = int(np.argmax(lengths < 0))
            raise DataError(f"{idx_path}: negative length {int(lengths[bad])} of sequence {bad}")
        doc_idx = self.document_indices
        if num_doc_idx == 0 or doc_idx[0] != 0:
            first = "none" if num_doc_idx == 0 else int(doc_idx[0])
            raise DataError(f"{idx_path}: document indices must start with 0, got {first}")
        steps = np.diff(doc_idx)
        if steps.size and steps.min() < 0:
            bad = int(np.argmax(steps < 0))
            raise DataError(
                f"{idx_path}: document indices decrease at document {bad} "
                f"({int(doc_idx[bad])} -> {int(doc_idx[bad + 1])})"
            )
        if doc_idx[-1] != num_seqs:
            raise DataError(
                f"{idx_path}: last document index is {int(doc_idx[-1])}, expected the sequence count "
                f"{num_seqs} (every sequence must belong to a document)"
            )

        starts = np.cumsum(lengths) - lengths  # token offset of each sequence
        self.total_tokens = int(lengths.sum())
        bin_bytes = os.path.getsize(bin_path)
        candidates = [_MEGATRON_DTYPES[code]]
        if code == 7:  # np.double in the older Megatron-LM
            candidates.append(np.dtype("<f8"))
        matching = [d for d in candidates if np.array_equal(self.sequence_pointers, starts * d.itemsize)]
        if not matching:
            dtype = candidates[0]
            expect = starts * dtype.itemsize
            bad = int(np.argmax(self.sequence_pointers != expect))
            raise DataError(
                f"{idx_path}: pointer of sequence {bad} is {int(self.sequence_pointers[bad])} bytes, "
                f"expected {int(expect[bad])} (= {int(starts[bad])} tokens before it x "
                f"{dtype.itemsize} bytes of {dtype.name})"
            )
        fits_bin = [d for d in matching if bin_bytes == self.total_tokens * d.itemsize]
        dtype = (fits_bin or matching)[0]  # a wrong .bin size is reported by the caller
        self.dtype = dtype

        if num_doc_idx - 1 == num_seqs:  # one sequence per document: the usual case, no copies
            self.sizes = self.sequence_lengths
            self.offsets = starts
        else:
            bounds = np.append(starts, self.total_tokens)[doc_idx]  # token offset of each document boundary
            self.offsets = bounds[:-1]
            self.sizes = np.diff(bounds)

    def _check_index(self, idx_path: str) -> None:
        """Check that sizes are non-negative, sum to total_tokens and match offsets."""
        sizes = self.sizes.astype(np.int64)
        if sizes.size and sizes.min() < 0:
            raise DataError(f"{idx_path}: negative document size {sizes.min()}")
        if int(sizes.sum()) != self.total_tokens:
            raise DataError(
                f"{idx_path}: document sizes sum to {int(sizes.sum())} tokens, "
                f"header says total_tokens={self.total_tokens}"
            )
        starts = np.cumsum(sizes) - sizes
        if not np.array_equal(self.offsets, starts):
            bad = int(np.argmax(self.offsets != starts))
            raise DataError(
                f"{idx_path}: offset of document {bad} is {int(self.offsets[bad])}, "
                f"expected {int(starts[bad])} from the sizes"
            )

    def _scan_ids(self) -> None:
        """Find the largest id by reading the ``.bin`` once (Megatron pairs: also refuse bad ids)."""
        chunk = 1 << 24
        largest = -1
        floating = self.dtype.kind == "f"
        for i in range(0, len(self.tokens), chunk):
            block = self.tokens[i : i + chunk]
            if self.format == "megatron":
                whole = np.isfinite(block) & (block == np.floor(block)) if floating else None
                if floating and not whole.all():
                    bad = i + int(np.argmax(~whole))
                    raise DataError(
                        f"{self.prefix}.bin: token {bad} is {block[bad - i].item()}, not a whole-number id"
                    )
                if self.dtype.kind in "if" and block.min() < 0:
                    bad = i + int(np.argmax(block < 0))
                    raise DataError(f"{self.prefix}.bin: token {bad} has negative id {block[bad - i].item()}")
            largest = max(largest, int(block.max()))
        self._max_token_id = largest

    @property
    def max_token_id(self) -> int:
        """Largest token id in the ``.bin`` (-1 if empty).

        From the index, or scanned once for version 1 and Megatron-LM pairs.
        """
        if self._max_token_id is None:
            self._scan_ids()
        assert self._max_token_id is not None
        return self._max_token_id

    @property
    def content_sha256(self) -> str:
        """SHA-256 (hex) of what the pair holds, whatever its name, directory, format or token dtype.

        Hashed, each number as a little-endian int64 after the tag ``b"gpt-data-content-v1"``: the
        document count and total token count, every document size, then the tokens: all of them
        when there are at most :data:`CONTENT_ALL_TOKENS`, else :data:`CONTENT_BLOCKS` blocks of
        :data:`CONTENT_BLOCK_TOKENS` starting at ``k * (total - CONTENT_BLOCK_TOKENS) //
        (CONTENT_BLOCKS - 1)`` (the first and last tokens included).  Reads the index and at most
        ~0.5 MiB of tokens; computed once per instance.  It seeds the shuffling
        (``data/gpt_dataset.py``) and is the data's identity in checkpoints (:func:`fingerprint`).
        """
        if self._content_sha256 is None:
            h = hashlib.sha256(b"gpt-data-content-v1")
            h.update(np.array([self.num_docs, self.total_tokens], dtype="<i8").tobytes())
            for i in range(0, self.num_docs, 1 << 22):
                h.update(np.asarray(self.sizes[i : i + (1 << 22)]).astype("<i8").tobytes())
            total = self.total_tokens
            if total <= CONTENT_ALL_TOKENS:
                starts, length = [0], total
            else:
                span = total - CONTENT_BLOCK_TOKENS
                starts = [k * span // (CONTENT_BLOCKS - 1) for k in range(CONTENT_BLOCKS)]
                length = CONTENT_BLOCK_TOKENS
            for start in starts:
                h.update(np.asarray(self.tokens[start : start + length]).astype("<i8").tobytes())
            self._content_sha256 = h.hexdigest()
        return self._content_sha256

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse ids the model cannot embed (data built with another tokenizer, or corrupted)."""
        if self.max_token_id >= vocab_size:
            raise DataError(
                f"{self.prefix}.bin holds token id {self.max_token_id}, but the vocabulary has only "
                f"{vocab_size} ids (data built with another tokenizer, or a corrupted file)"
            )

    @property
    def num_docs(self) -> int:
        """Number of documents."""
        return len(self.sizes)

    def __len__(self) -> int:
        return self.num_docs

    def doc(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` (a read-only view into the memory map)."""
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """``length`` tokens of document ``i`` starting at ``offset`` (default: to its end)."""
        if not 0 <= i < self.num_docs:
            raise IndexError(f"{self.prefix}: document {i} out of range [0, {self.num_docs})")
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"{self.prefix}: tokens [{offset}, {offset + length}) outside document {i} "
                f"of {size} tokens"
            )
        start = int(self.offsets[i]) + offset
        return self.tokens[start : start + length]


def fingerprint(prefix: str) -> dict[str, object]:
    """Identity of a ``.bin``/``.idx`` pair that survives moving or renaming it.

    ``content_sha256`` (:attr:`IndexedDataset.content_sha256`: document sizes and sampled
    tokens, the same for a rewrite in the other format or token dtype) identifies the data;
    the index's sha256 and the ``.bin`` size are kept as well, the identity checkpoints
    written before ``content_sha256`` recorded.  Cheap next to the data itself (the index is
    ~12 bytes per document) and different for any other tokenization or document set.
    """
    h = hashlib.sha256()
    with open(prefix + ".idx", "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return {"idx_sha256": h.hexdigest(), "bin_bytes": os.path.getsize(prefix + ".bin"),
            "content_sha256": IndexedDataset(prefix).content_sha256}
