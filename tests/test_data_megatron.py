"""Tests for reading Megatron-LM ``MMIDIDX`` ``.bin``/``.idx`` pairs with data/indexed.py.

Pairs are written by hand from the byte layout of megatron-core's
``indexed_dataset.py`` (always), and by megatron-core's own ``IndexedDatasetBuilder``
when it is installed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from data.gpt_dataset import build_datasets
from data.indexed import DataError, IndexedDataset, IndexedDatasetWriter, fingerprint

# megatron-core's DType enum: code -> numpy dtype.
CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
HEADER = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document-index count

Docs = list[list[list[int]]]  # documents -> sequences -> token ids


def write_megatron(prefix: Path, docs: Docs, code: int, itemsize: int | None = None) -> str:
    """A Megatron-LM pair, byte by byte as megatron-core's _IndexWriter lays it out."""
    dtype = np.dtype(CODES[code]).newbyteorder("<")
    itemsize = itemsize or dtype.itemsize
    lengths = [len(seq) for doc in docs for seq in doc]
    pointers = [itemsize * sum(lengths[:i]) for i in range(len(lengths))]
    doc_idx = [0]
    for doc in docs:
        doc_idx.append(doc_idx[-1] + len(doc))
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<QQ", len(lengths), len(doc_idx))
    idx += struct.pack(f"<{len(lengths)}i", *lengths)
    idx += struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    flat = [t for doc in docs for seq in doc for t in seq]
    bin_dtype = dtype if itemsize == dtype.itemsize else np.dtype("<f8")
    Path(f"{prefix}.idx").write_bytes(idx)
    Path(f"{prefix}.bin").write_bytes(np.array(flat, dtype=bin_dtype).tobytes())
    return str(prefix)


def write_gptidx(prefix: Path, docs: list[list[int]], vocab_size: int) -> str:
    with IndexedDatasetWriter(str(prefix), vocab_size) as writer:
        for doc in docs:
            writer.add_document(doc)
    return str(prefix)


def random_docs(seed: int, high: int, count: int = 30, max_sequences: int = 1) -> Docs:
    """Documents of 1..max_sequences sequences (some empty) of ids in [0, high)."""
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(0, high, rng.integers(0, 20)).tolist()
         for _ in range(rng.integers(1, max_sequences + 1))]
        for _ in range(count)
    ]


def joined(docs: Docs) -> list[list[int]]:
    return [[t for seq in doc for t in seq] for doc in docs]


def check_reads(ds: IndexedDataset, docs: Docs, dtype: type) -> None:
    flat = joined(docs)
    assert ds.format == "megatron"
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == ds.num_docs == len(docs)
    assert ds.sizes.tolist() == [len(d) for d in flat]
    assert ds.offsets.tolist() == [sum(map(len, flat[:i])) for i in range(len(flat))]
    assert ds.total_tokens == sum(map(len, flat))
    assert ds.tokens.tolist() == [t for d in flat for t in d]
    for i, doc in enumerate(flat):
        assert ds.doc(i).tolist() == doc
        if len(doc) >= 3:
            assert ds.get(i, 1, 2).tolist() == doc[1:3]
    assert ds.max_token_id == max((t for d in flat for t in d), default=-1)


@pytest.mark.parametrize("code", sorted(CODES))
@pytest.mark.parametrize("max_sequences", [1, 4])
def test_hand_written_pairs_read_back(tmp_path: Path, code: int, max_sequences: int) -> None:
    high = 100 if CODES[code] in (np.uint8, np.int8) else 30000
    docs = random_docs(code, high, max_sequences=max_sequences) + [[[]], [[high - 1]]]
    check_reads(IndexedDataset(write_megatron(tmp_path / "m", docs, code)), docs, CODES[code])


def test_empty_megatron_dataset(tmp_path: Path) -> None:
    ds = IndexedDataset(write_megatron(tmp_path / "e", [], 8))
    assert (len(ds), ds.total_tokens, ds.tokens.size, ds.max_token_id) == (0, 0, 0, -1)


def test_legacy_code_7_means_float64_when_the_pointers_say_so(tmp_path: Path) -> None:
    """The older Megatron-LM wrote np.double under code 7: 8-byte pointers tell it apart."""
    docs = random_docs(3, 500, count=5, max_sequences=2) + [[[1, 2]]]
    ds = IndexedDataset(write_megatron(tmp_path / "m", docs, 7, itemsize=8))
    check_reads(ds, docs, np.float64)


@pytest.fixture(scope="module")
def megatron_indexed() -> Any:
    pytest.importorskip("torch")
    return pytest.importorskip("megatron.core.datasets.indexed_dataset")


@pytest.mark.parametrize("code", sorted(CODES))
def test_pairs_from_megatron_core_builder(
    tmp_path: Path, megatron_indexed: Any, code: int
) -> None:
    import torch

    dtype = CODES[code]
    high = 100 if dtype in (np.uint8, np.int8) else 30000
    docs = random_docs(10 + code, high, max_sequences=3) + [[[high - 1]]]
    prefix = tmp_path / "mc"
    builder = megatron_indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for n, doc in enumerate(docs):
        if n % 2:  # one call per document, as preprocess_data.py does
            flat = torch.tensor([t for seq in doc for t in seq], dtype=torch.float64)
            builder.add_document(flat, [len(s) for s in doc])
        else:  # one call per sequence (sentence), then end the document
            for seq in doc:
                builder.add_item(torch.tensor(seq, dtype=torch.float64))
            builder.end_document()
    builder.finalize(f"{prefix}.idx")

    check_reads(IndexedDataset(str(prefix)), docs, dtype)
    # Our hand-written layout is byte for byte what megatron-core writes.
    hand = write_megatron(tmp_path / "hand", docs, code)
    assert Path(hand + ".idx").read_bytes() == Path(f"{prefix}.idx").read_bytes()
    assert Path(hand + ".bin").read_bytes() == Path(f"{prefix}.bin").read_bytes()
    # And megatron-core's own reader agrees with ours on every sequence of a document.
    theirs = megatron_indexed.IndexedDataset(str(prefix))
    ours = IndexedDataset(str(prefix))
    doc_idx = theirs.document_indices
    for d in range(len(docs)):
        parts = [theirs[s] for s in range(int(doc_idx[d]), int(doc_idx[d + 1]))]
        expect = np.concatenate(parts).tolist() if parts else []
        assert ours.doc(d).tolist() == expect


def samples(prefix_paths: list[str], vocab_size: int, count: int = 200) -> list[list[list[int]]]:
    train, valid = build_datasets(prefix_paths, None, [0.8, 0.2], 16, 1234, vocab_size)
    assert valid is not None
    return [[ds.sample(i).tolist() for i in range(count)] for ds in (train, valid)]


@pytest.mark.parametrize("vocab_size, code", [(1000, 8), (70000, 4)])
@pytest.mark.parametrize("max_sequences", [1, 3])
def test_gpt_dataset_samples_match_todays_format(
    tmp_path: Path, vocab_size: int, code: int, max_sequences: int
) -> None:
    docs = random_docs(7, vocab_size - 1, count=60, max_sequences=max_sequences)
    docs = [doc[:-1] + [doc[-1] + [vocab_size - 1]] for doc in docs]  # end each with an "EOD"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ours = write_gptidx(tmp_path / "a" / "corpus", joined(docs), vocab_size)
    theirs = write_megatron(tmp_path / "b" / "corpus", docs, code)
    assert IndexedDataset(ours).dtype == IndexedDataset(theirs).dtype
    assert samples([theirs], vocab_size) == samples([ours], vocab_size)
    # Both formats blend together (same token dtype), and the fingerprint covers the Megatron index.
    (tmp_path / "c").mkdir()
    other = write_megatron(tmp_path / "c" / "other", random_docs(8, vocab_size, count=20), code)
    samples([ours, other], vocab_size, count=20)
    assert fingerprint(theirs)["bin_bytes"] == Path(theirs + ".bin").stat().st_size
    assert fingerprint(theirs) != fingerprint(ours)


def test_vocabulary_check_scans_megatron_bins(tmp_path: Path) -> None:
    prefix = write_megatron(tmp_path / "m", [[[1, 2], [3]], [[4, 999, 5]]], 4)
    ds = IndexedDataset(prefix)
    ds.check_vocab(1000)
    with pytest.raises(DataError, match=r"m\.bin holds token id 999, but the vocabulary has only 500 ids"):
        IndexedDataset(prefix).check_vocab(500)
    with pytest.raises(DataError, match=r"m\.bin holds token id 999"):
        build_datasets([prefix], None, [1, 0], 2, 0, 500)


@pytest.mark.parametrize(
    "code, tokens, reason",
    [(4, [1, -3, 2], "token 1 has negative id -3"), (7, [1.0, 2.5], "token 1 is 2.5, not a whole-number id")],
)
def test_ids_that_are_not_token_ids_are_refused(
    tmp_path: Path, code: int, tokens: list[float], reason: str
) -> None:
    prefix = write_megatron(tmp_path / "m", [[tokens]], code)  # type: ignore[list-item]
    with pytest.raises(DataError, match=reason) as info:
        IndexedDataset(prefix).check_vocab(100)
    assert f"{prefix}.bin" in str(info.value)


# --- corruptions: each names the file and what is wrong ---------------------------------

DOCS = random_docs(2, 1000, count=8, max_sequences=3)
NUM_SEQS = sum(len(d) for d in DOCS)
LENGTHS_AT = HEADER
POINTERS_AT = HEADER + 4 * NUM_SEQS
DOC_IDX_AT = POINTERS_AT + 8 * NUM_SEQS


def patch(path: Path, offset: int, data: bytes) -> Path:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))
    return path


def idx(prefix: Path) -> Path:
    return prefix.with_suffix(".idx")


def truncate_header(prefix: Path) -> Path:
    idx(prefix).write_bytes(idx(prefix).read_bytes()[:20])
    return idx(prefix)


def truncate_idx(prefix: Path) -> Path:
    idx(prefix).write_bytes(idx(prefix).read_bytes()[:-8])
    return idx(prefix)


def multimodal(prefix: Path) -> Path:
    idx(prefix).write_bytes(idx(prefix).read_bytes() + bytes(NUM_SEQS))
    return idx(prefix)


def bad_version(prefix: Path) -> Path:
    return patch(idx(prefix), 9, struct.pack("<Q", 2))


def bad_dtype(prefix: Path) -> Path:
    return patch(idx(prefix), 17, b"\x09")


def wrong_sequence_count(prefix: Path) -> Path:
    return patch(idx(prefix), 18, struct.pack("<Q", NUM_SEQS + 1))


def negative_length(prefix: Path) -> Path:
    return patch(idx(prefix), LENGTHS_AT + 4, struct.pack("<i", -5))


def length_not_matching_pointers(prefix: Path) -> Path:
    first = struct.unpack_from("<i", idx(prefix).read_bytes(), LENGTHS_AT)[0]
    return patch(idx(prefix), LENGTHS_AT, struct.pack("<i", first + 1))


def pointer_in_tokens(prefix: Path) -> Path:
    """Pointers must be bytes: a pointer written as a token count is refused."""
    raw = idx(prefix).read_bytes()
    pointer = struct.unpack_from("<q", raw, POINTERS_AT + 8 * 2)[0]
    return patch(idx(prefix), POINTERS_AT + 8 * 2, struct.pack("<q", pointer // 2))


def doc_idx_not_from_zero(prefix: Path) -> Path:
    return patch(idx(prefix), DOC_IDX_AT, struct.pack("<q", 1))


def doc_idx_decreasing(prefix: Path) -> Path:
    return patch(idx(prefix), DOC_IDX_AT + 8 * 2, struct.pack("<q", 0))


def doc_idx_short_of_the_sequences(prefix: Path) -> Path:
    return patch(idx(prefix), DOC_IDX_AT + 8 * len(DOCS), struct.pack("<q", NUM_SEQS - 1))


def truncate_bin(prefix: Path) -> Path:
    path = prefix.with_suffix(".bin")
    path.write_bytes(path.read_bytes()[:-2])
    return path


def bin_of_another_dtype(prefix: Path) -> Path:
    return patch(idx(prefix), 17, b"\x04")  # int32, but pointers and .bin hold uint16


def missing_idx(prefix: Path) -> Path:
    idx(prefix).unlink()
    return idx(prefix)


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (truncate_header, "truncated Megatron-LM header (20 bytes, need 34)"),
        (truncate_idx, f"expected {DOC_IDX_AT + 8 * (len(DOCS) + 1)} for {NUM_SEQS} sequences"),
        (multimodal, "multimodal index"),
        (bad_version, "unsupported version 2 of Megatron-LM's MMIDIDX index"),
        (bad_dtype, "unknown dtype code 9 in Megatron-LM index"),
        (wrong_sequence_count, f"for {NUM_SEQS + 1} sequences"),
        (negative_length, "negative length -5 of sequence 1"),
        (length_not_matching_pointers, "pointer of sequence 1 is"),
        (pointer_in_tokens, "pointer of sequence 2 is"),
        (doc_idx_not_from_zero, "document indices must start with 0, got 1"),
        (doc_idx_decreasing, "document indices decrease at document 1"),
        (doc_idx_short_of_the_sequences, f"expected the sequence count {NUM_SEQS}"),
        (truncate_bin, "truncated file or mismatched pair"),
        (bin_of_another_dtype, "bytes of int32"),
        (missing_idx, "not found"),
    ],
)
def test_invalid_megatron_pairs_name_the_file(
    tmp_path: Path, corrupt: Callable[[Path], Path], reason: str
) -> None:
    prefix = Path(write_megatron(tmp_path / "d", DOCS, 8))
    IndexedDataset(str(prefix))  # valid before the corruption
    bad_file = corrupt(prefix)
    with pytest.raises(DataError) as info:
        IndexedDataset(str(prefix))
    assert str(bad_file) in str(info.value)
    assert reason in str(info.value)


def test_unknown_magic_mentions_both_formats(tmp_path: Path) -> None:
    prefix = Path(write_megatron(tmp_path / "d", DOCS, 8))
    patch(idx(prefix), 0, b"MMIDIDY")
    with pytest.raises(DataError, match=r"bad magic .*GPTIDX.*MMIDIDX"):
        IndexedDataset(str(prefix))


def test_training_on_a_megatron_pair_gives_the_same_curve(tmp_path: Path, megatron_indexed: Any) -> None:
    """The bundled corpus rewritten by megatron-core's builder trains exactly like the original (train.py, 4 steps,
    validation included)."""
    import torch

    from tests.test_train_e2e import FAST, losses_by_step, records, run_forked

    ours = IndexedDataset("data/sample/sample_text_document")
    prefix = tmp_path / "megatron_rewrite"  # any name: shuffling follows the content
    builder = megatron_indexed.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for i in range(ours.num_docs):
        doc = torch.from_numpy(ours.doc(i).astype(np.int64))
        builder.add_document(doc, [len(doc)])
    builder.finalize(f"{prefix}.idx")
    assert IndexedDataset(str(prefix)).format == "megatron"

    curves = []
    for name, data in (("ours", "data/sample/sample_text_document"), ("megatron", str(prefix))):
        run_dir = tmp_path / name
        p = run_forked(*FAST, "train.max_steps=4", "train.eval_interval=4", "train.eval_iters=2",
                       f"data.paths=[{data}]", f"logging.run_dir={run_dir}", "checkpoint.save_at_exit=false")
        assert p.returncode == 0, p.stderr[-3000:]
        val = [r["val_loss"] for r in records(run_dir) if "val_loss" in r]
        curves.append((losses_by_step(run_dir)[0], val))
    assert len(curves[0][0]) == 4 and curves[0][1]
    assert curves[0] == curves[1]
