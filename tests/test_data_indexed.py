"""Tests for data/indexed.py: exact round trips, the on-disk layout, validation, atomicity."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from data.indexed import DataError, IndexedDataset, IndexedDatasetWriter


def random_docs(seed: int, vocab_size: int, count: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, rng.integers(1, 60)).tolist() for _ in range(count)]


def write(prefix: Path, docs: list[list[int]], vocab_size: int) -> str:
    with IndexedDatasetWriter(str(prefix), vocab_size) as writer:
        for doc in docs:
            writer.add_document(doc)
    return str(prefix)


@pytest.mark.parametrize("vocab_size, itemsize", [(1000, 2), (65535, 2), (70000, 4)])
def test_round_trip(tmp_path: Path, vocab_size: int, itemsize: int) -> None:
    docs = random_docs(0, vocab_size) + [[vocab_size - 1], []]
    ds = IndexedDataset(write(tmp_path / "d", docs, vocab_size))
    assert len(ds) == ds.num_docs == len(docs)
    assert ds.dtype.itemsize == itemsize
    assert ds.sizes.tolist() == [len(d) for d in docs]
    assert ds.total_tokens == sum(map(len, docs))
    assert ds.tokens.tolist() == [t for d in docs for t in d]
    for i, doc in enumerate(docs):
        assert ds.doc(i).tolist() == doc
    assert ds.get(3, 1, 2).tolist() == docs[3][1:3]
    assert ds.get(3, 2).tolist() == docs[3][2:]
    with pytest.raises(IndexError):
        ds.doc(len(docs))
    with pytest.raises(IndexError):
        ds.get(0, 0, len(docs[0]) + 1)


def test_file_layout_matches_the_spec(tmp_path: Path) -> None:
    docs = random_docs(1, 500, count=7)
    prefix = write(tmp_path / "d", docs, 500)
    idx = Path(prefix + ".idx").read_bytes()
    magic, version, code = struct.unpack_from("<8sQB", idx, 0)
    assert (magic, version, code) == (b"GPTIDX\x00\x00", 2, 1)
    assert idx[17:24] == bytes(7)
    num_docs, total, max_id = struct.unpack_from("<QQq", idx, 24)
    sizes = [len(d) for d in docs]
    assert (num_docs, total, max_id) == (7, sum(sizes), max(max(d) for d in docs))
    assert list(struct.unpack_from("<7i", idx, 48)) == sizes
    assert list(struct.unpack_from("<7q", idx, 48 + 28)) == [sum(sizes[:i]) for i in range(7)]
    assert len(idx) == 48 + 7 * 12
    flat = [t for d in docs for t in d]
    assert Path(prefix + ".bin").read_bytes() == struct.pack(f"<{len(flat)}H", *flat)


def test_empty_dataset(tmp_path: Path) -> None:
    ds = IndexedDataset(write(tmp_path / "e", [], 100))
    assert (len(ds), ds.total_tokens, ds.tokens.size, ds.max_token_id) == (0, 0, 0, -1)


def as_version_1(prefix: str) -> None:
    """Rewrite a pair's index in the version 1 layout (no max_token_id), as older preprocessing wrote it."""
    idx = Path(prefix + ".idx").read_bytes()
    magic, _, code, num_docs, total, _ = struct.unpack_from("<8sQB7xQQq", idx, 0)
    Path(prefix + ".idx").write_bytes(struct.pack("<8sQB7xQQ", magic, 1, code, num_docs, total) + idx[48:])


def test_version_1_index_still_reads_and_its_ids_are_scanned(tmp_path: Path) -> None:
    docs = random_docs(5, 300)
    prefix = write(tmp_path / "d", docs, 300)
    as_version_1(prefix)
    ds = IndexedDataset(prefix)
    assert [ds.doc(i).tolist() for i in range(len(docs))] == docs
    assert ds.max_token_id == max(max(d) for d in docs)


@pytest.mark.parametrize("version", [1, 2])
def test_token_ids_beyond_the_vocabulary_are_refused_naming_the_file(tmp_path: Path, version: int) -> None:
    docs = [[1, 2, 3], [4, 999, 5]]
    prefix = write(tmp_path / "d", docs, 1000)
    if version == 1:
        as_version_1(prefix)
    ds = IndexedDataset(prefix)
    ds.check_vocab(1000)
    with pytest.raises(DataError, match=r"d\.bin holds token id 999, but the vocabulary has only 500 ids"):
        ds.check_vocab(500)


def patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def truncate_bin(prefix: Path) -> Path:
    path = prefix.with_suffix(".bin")
    path.write_bytes(path.read_bytes()[:-2])
    return path


def truncate_idx(prefix: Path) -> Path:
    path = prefix.with_suffix(".idx")
    path.write_bytes(path.read_bytes()[:-8])
    return path


def bad_magic(prefix: Path) -> Path:
    patch(prefix.with_suffix(".idx"), 0, b"MMIDIDX\x00")
    return prefix.with_suffix(".idx")


def bad_version(prefix: Path) -> Path:
    patch(prefix.with_suffix(".idx"), 8, struct.pack("<Q", 4))
    return prefix.with_suffix(".idx")


def bad_dtype(prefix: Path) -> Path:
    patch(prefix.with_suffix(".idx"), 16, b"\x07")
    return prefix.with_suffix(".idx")


def bad_total(prefix: Path) -> Path:
    patch(prefix.with_suffix(".idx"), 32, struct.pack("<Q", 10**6))
    return prefix.with_suffix(".idx")


def bad_offset(prefix: Path) -> Path:
    num_docs = struct.unpack_from("<Q", prefix.with_suffix(".idx").read_bytes(), 24)[0]
    patch(prefix.with_suffix(".idx"), 48 + 4 * num_docs + 8, struct.pack("<q", 1))
    return prefix.with_suffix(".idx")


def mismatched_pair(prefix: Path) -> Path:
    other = write(prefix.parent / "other", random_docs(99, 1000), 1000)
    prefix.with_suffix(".bin").write_bytes(Path(other + ".bin").read_bytes())
    return prefix.with_suffix(".bin")


def missing_bin(prefix: Path) -> Path:
    prefix.with_suffix(".bin").unlink()
    return prefix.with_suffix(".bin")


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (truncate_bin, "truncated file or mismatched pair"),
        (truncate_idx, "expected"),
        (bad_magic, "bad magic"),
        (bad_version, "unsupported version 4"),
        (bad_dtype, "unknown dtype code 7"),
        (bad_total, "total_tokens=1000000"),
        (bad_offset, "offset of document 1"),
        (mismatched_pair, "mismatched pair"),
        (missing_bin, "not found"),
    ],
)
def test_invalid_pairs_name_the_file(
    tmp_path: Path, corrupt: Callable[[Path], Path], reason: str
) -> None:
    prefix = Path(write(tmp_path / "d", random_docs(2, 1000), 1000))
    bad_file = corrupt(prefix)
    with pytest.raises(DataError) as info:
        IndexedDataset(str(prefix))
    assert str(bad_file) in str(info.value)
    assert reason in str(info.value)


def test_writer_is_atomic(tmp_path: Path) -> None:
    prefix = tmp_path / "d"
    with pytest.raises(RuntimeError, match="boom"), IndexedDatasetWriter(str(prefix), 100) as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []

    old = random_docs(3, 100)
    write(prefix, old, 100)
    with pytest.raises(DataError, match=r"\[0, 100\)"), IndexedDatasetWriter(str(prefix), 100) as w:
        w.add_document([5, 6])
        w.add_document([7, 100])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]
    assert [IndexedDataset(str(prefix)).doc(i).tolist() for i in range(len(old))] == old


def test_writer_rejects_use_after_finalize(tmp_path: Path) -> None:
    writer = IndexedDatasetWriter(str(tmp_path / "d"), 10)
    writer.finalize()
    with pytest.raises(RuntimeError):
        writer.add_document([1])
