"""Tests for data/gpt_dataset.py against plain-Python reference implementations."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    Sampleable,
    build_datasets,
    get_batch,
    split_documents,
)
from data.indexed import DataError, IndexedDataset, IndexedDatasetWriter

EOD = 0
SEQ_LEN = 16
SEED = 1234
Corpus = tuple[str, list[list[int]]]


def make_docs(seed: int, count: int, vocab_size: int = 1000) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab_size, rng.integers(1, 40)).tolist() + [EOD] for _ in range(count)]


def write(prefix: Path, docs: list[list[int]], vocab_size: int = 1000) -> str:
    with IndexedDatasetWriter(str(prefix), vocab_size) as writer:
        for doc in docs:
            writer.add_document(doc)
    return str(prefix)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[int]]]:
    docs = make_docs(0, 60)
    return write(tmp_path_factory.mktemp("gpt") / "corpus", docs), docs


def reference_content_key(docs: list[list[int]], part: str) -> int:
    """Data order 2's shuffle key of a small corpus (every token hashed), from the specification."""
    numbers = [len(docs), sum(map(len, docs))] + [len(d) for d in docs] + [t for d in docs for t in d]
    content = hashlib.sha256(b"gpt-data-content-v1" + np.array(numbers, "<i8").tobytes()).hexdigest()
    return int.from_bytes(hashlib.sha256(f"{content}/{part}".encode()).digest()[:8], "little")


def reference_epoch(
    docs: list[list[int]], doc_ids: list[int], seed: int, epoch: int, name: str | int
) -> tuple[list[int], np.ndarray]:
    """(stream, sample order) of one epoch, written out from the specification; ``name`` is
    the shuffle key, or a name whose CRC-32 is (data order 1)."""
    key = name if isinstance(name, int) else zlib.crc32(name.encode())
    rng = np.random.default_rng([seed, epoch, key])
    stream: list[int] = []
    for position in rng.permutation(len(doc_ids)):
        stream += docs[doc_ids[position]]
    order = rng.permutation((len(stream) - 1) // SEQ_LEN)
    return stream, order


def reference_sample(
    docs: list[list[int]], doc_ids: list[int], seed: int, index: int, name: str | int
) -> list[int]:
    tokens = sum(len(docs[d]) for d in doc_ids)
    epoch, j = divmod(index, (tokens - 1) // SEQ_LEN)
    stream, order = reference_epoch(docs, doc_ids, seed, epoch, name)
    return stream[order[j] * SEQ_LEN : order[j] * SEQ_LEN + SEQ_LEN + 1]


def test_samples_match_reference_across_epochs(corpus: Corpus) -> None:
    prefix, docs = corpus
    doc_ids = list(range(5, 45))
    ds = GPTDataset(IndexedDataset(prefix), np.array(doc_ids), SEQ_LEN, SEED, "c/train")
    tokens = sum(len(docs[d]) for d in doc_ids)
    assert ds.samples_per_epoch == (tokens - 1) // SEQ_LEN
    for index in range(4 * ds.samples_per_epoch):
        sample = ds.sample(index)
        assert sample.dtype == np.int64 and sample.shape == (SEQ_LEN + 1,)
        assert sample.tolist() == reference_sample(docs, doc_ids, SEED, index, "c/train")


def test_windows_overlap_by_one_token_and_epochs_reshuffle(corpus: Corpus) -> None:
    prefix, docs = corpus
    doc_ids = list(range(60))
    ds = GPTDataset(IndexedDataset(prefix), np.arange(60), SEQ_LEN, SEED, "c/train")
    n = ds.samples_per_epoch
    streams = []
    for epoch in range(2):
        stream, order = reference_epoch(docs, doc_ids, SEED, epoch, "c/train")
        by_position = [ds.sample(epoch * n + j) for j in np.argsort(order)]
        for left, right in itertools.pairwise(by_position):
            assert left[-1] == right[0]
        assert np.concatenate([w[:-1] for w in by_position]).tolist() == stream[: n * SEQ_LEN]
        streams.append(stream)
    assert streams[0] != streams[1] and sorted(streams[0]) == sorted(streams[1])


def test_independent_of_instance_and_access_order(corpus: Corpus) -> None:
    prefix, _ = corpus
    indexed = IndexedDataset(prefix)
    first = GPTDataset(indexed, np.arange(60), SEQ_LEN, SEED, "c/train")
    indices = list(range(0, 12 * first.samples_per_epoch, 7))
    forward = [first.sample(i).tolist() for i in indices]
    second = GPTDataset(indexed, np.arange(60), SEQ_LEN, SEED, "c/train")
    backward = {i: second.sample(i).tolist() for i in reversed(indices)}
    assert forward == [backward[i] for i in indices]
    other_seed = GPTDataset(indexed, np.arange(60), SEQ_LEN, SEED + 1, "c/train")
    assert [other_seed.sample(i).tolist() for i in indices] != forward


def test_resumed_run_reads_the_same_batches(tmp_path: Path) -> None:
    paths = [write(tmp_path / "a", make_docs(1, 50)), write(tmp_path / "b", make_docs(2, 30))]
    resume_at, batch = 5000, 8  # past a blending block and several epochs

    def fresh() -> Sampleable:
        return build_datasets(paths, [0.7, 0.3], [0.9, 0.1], SEQ_LEN, SEED)[0]

    used = fresh()
    for consumed in range(0, resume_at, 997):
        get_batch(used, range(consumed, consumed + batch))
    before = get_batch(used, range(resume_at, resume_at + batch))
    after = get_batch(fresh(), range(resume_at, resume_at + batch))
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_get_batch_shifts_labels(corpus: Corpus) -> None:
    prefix, _ = corpus
    ds = GPTDataset(IndexedDataset(prefix), np.arange(60), SEQ_LEN, SEED, "c/train")
    tokens, labels = get_batch(ds, [3, 1, 4])
    assert tokens.dtype == labels.dtype == torch.int64
    assert tokens.shape == labels.shape == (3, SEQ_LEN)
    for row, index in enumerate([3, 1, 4]):
        sample = ds.sample(index).tolist()
        assert tokens[row].tolist() == sample[:-1] and labels[row].tolist() == sample[1:]


@pytest.mark.parametrize(
    "num_docs, split, train, valid",
    [
        (100, [0.9, 0.1], 90, 10),
        (100, [95, 5], 95, 5),
        (10, [0.99, 0.01], 9, 1),
        (10, [0.01, 0.99], 1, 9),
        (7, [1, 0], 7, 0),
        (7, [0, 1], 0, 7),
        (2, [0.5, 0.5], 1, 1),
    ],
)
def test_split_documents(num_docs: int, split: list[float], train: int, valid: int) -> None:
    train_ids, valid_ids = split_documents(num_docs, split)
    assert train_ids.tolist() == list(range(train))
    assert valid_ids.tolist() == list(range(train, train + valid))


@pytest.mark.parametrize(
    "num_docs, split", [(1, [0.9, 0.1]), (10, [1, -1]), (10, [0, 0]), (10, [1])]
)
def test_split_documents_errors(num_docs: int, split: list[float]) -> None:
    with pytest.raises(DataError):
        split_documents(num_docs, split)


class Recorder:
    """Stand-in dataset whose sample ``n`` is ``[k, n]``."""

    def __init__(self, k: int) -> None:
        self.k = k

    def sample(self, index: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
        return np.array([self.k, index])[lo:hi]


def reference_position(weights: list[float], k: int, n: int) -> int:
    """Position of sample n of dataset k when all samples are merged by ideal time."""
    w = [x / sum(weights) for x in weights]
    time = (n + 0.5) / w[k]
    before = 0
    for j, wj in enumerate(w):  # count samples of j that come first, ties to lower j
        m = max(int(time * wj - 0.5) - 2, 0)
        while (m + 0.5) / wj < time or ((m + 0.5) / wj == time and j < k):
            m += 1
        before += m if j != k else n
    return before


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1, 1], [1, 3], [3, 1, 1, 1], [0.001, 1]])
def test_blend_proportions_and_order(weights: list[float]) -> None:
    blend = BlendedDataset([Recorder(k) for k in range(len(weights))], weights)
    w = np.array(weights) / sum(weights)
    counts = np.zeros(len(weights), dtype=int)
    for index in range(6000):
        k, n = blend.sample(index).tolist()
        assert n == counts[k]  # every dataset is read in its own order 0, 1, 2, ...
        counts[k] += 1
        assert np.all(np.abs(counts - w * (index + 1)) <= 1)
        if index % 97 == 0:
            assert reference_position(weights, k, n) == index
    for index in (10**6, 10**9 + 4095, 10**12 + 4096):
        k, n = blend.sample(index).tolist()
        assert reference_position(weights, k, n) == index


def test_blend_counts_are_exact_at_float_boundaries() -> None:
    weights = [0.37, 0.21, 0.42]
    blend = BlendedDataset([Recorder(k) for k in range(3)], weights)
    w = [x / sum(weights) for x in weights]
    rng = np.random.default_rng(0)
    for n, k in rng.integers([0, 0], [10**9, 3], size=(100, 2)).tolist():
        ideal = (n + 0.5) / w[k]
        for time in (np.nextafter(ideal, 0.0), ideal, np.nextafter(ideal, np.inf)):
            expected = [
                bisect.bisect_left(range(10**12), True, key=lambda m: (m + 0.5) / wk >= time)
                for wk in w
            ]
            assert blend._counts_before(float(time)).tolist() == expected


def test_build_datasets(tmp_path: Path) -> None:
    docs_a, docs_b = make_docs(3, 40), make_docs(4, 20)
    paths = [write(tmp_path / "a", docs_a), write(tmp_path / "b", docs_b)]
    train, valid = build_datasets(paths, [2, 1], [0.75, 0.25], SEQ_LEN, SEED)
    sources = {"a": (docs_a, list(range(30))), "b": (docs_b, list(range(15)))}
    keys = {
        (n, part): reference_content_key(docs, part)
        for n, docs in (("a", docs_a), ("b", docs_b))
        for part in ("train", "valid")
    }
    seen = {"a": 0, "b": 0}
    for index in range(300):
        sample = train.sample(index).tolist()
        a = reference_sample(*sources["a"], SEED, seen["a"], keys["a", "train"])
        name = "a" if sample == a else "b"
        assert sample == reference_sample(*sources[name], SEED, seen[name], keys[name, "train"])
        seen[name] += 1
    assert seen == {"a": 200, "b": 100}
    assert valid.sample(0).tolist() in (
        reference_sample(docs_a, list(range(30, 40)), SEED, 0, keys["a", "valid"]),
        reference_sample(docs_b, list(range(15, 20)), SEED, 0, keys["b", "valid"]),
    )
    single_train, no_valid = build_datasets(paths[:1], None, [1, 0], SEQ_LEN, SEED)
    assert no_valid is None
    assert single_train.sample(7).tolist() == reference_sample(
        docs_a, list(range(40)), SEED, 7, keys["a", "train"]
    )


def test_errors(tmp_path: Path) -> None:
    path = write(tmp_path / "a", make_docs(5, 10))
    wide = write(tmp_path / "wide", make_docs(6, 10), vocab_size=70000)
    short = write(tmp_path / "short", [[5, 6, EOD]] * 3)
    with pytest.raises(
        DataError, match=r"'short/train': 9 tokens in 3 documents, need at least .* 17"
    ):
        build_datasets([short], None, [1, 0], SEQ_LEN, SEED)
    for weights in ([1, 0], [1, -2], [1, float("nan")]):
        with pytest.raises(DataError, match="positive"):
            build_datasets([path, path], weights, [1, 0], SEQ_LEN, SEED)
        with pytest.raises(DataError, match="positive"):
            BlendedDataset([Recorder(0), Recorder(1)], weights)
    with pytest.raises(DataError, match="2 data paths but 1 weights"):
        build_datasets([path, path], [1], [1, 0], SEQ_LEN, SEED)
    with pytest.raises(DataError, match="dtype"):
        build_datasets([path, wide], None, [1, 0], SEQ_LEN, SEED)
    with pytest.raises(DataError, match="missing.idx"):
        build_datasets([str(tmp_path / "missing")], None, [1, 0], SEQ_LEN, SEED)


def first_samples(paths: list[str], count: int = 200, **kwargs: object) -> list[list[int]]:
    train = build_datasets(paths, None, [1, 0], SEQ_LEN, SEED, **kwargs)[0]  # type: ignore[arg-type]
    return [train.sample(i).tolist() for i in range(count)]


def test_the_same_data_under_another_name_gives_the_same_samples(tmp_path: Path) -> None:
    """Issue 17: the order follows the content, not the name (it used to follow the basename)."""
    a = write(tmp_path / "x" / "corpus", make_docs(7, 50))
    b = str(tmp_path / "y" / "renamed")
    (tmp_path / "y").mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(a + ext, b + ext)
    assert first_samples([b]) == first_samples([a])
    assert first_samples([b, a]) == first_samples([a, b])  # a blend of two copies too


def test_different_data_of_identical_index_gets_another_order(tmp_path: Path) -> None:
    """Equal document sizes give byte-identical .idx files (pre-chunked data): the tokens still
    tell the two apart, in the shuffling and in the content hash."""
    docs = make_docs(8, 50)
    same_sizes = [[(t % 998) + 1 for t in doc[:-1]] + [EOD] for doc in docs]
    a, b = write(tmp_path / "a", docs), write(tmp_path / "b", same_sizes)
    assert Path(a + ".idx").read_bytes() == Path(b + ".idx").read_bytes()
    content = [IndexedDataset(p).content_sha256 for p in (a, b)]
    assert content[0] != content[1]
    blend = build_datasets([a, b], [1, 1], [1, 0], SEQ_LEN, SEED)[0]
    keys = [d.key for d in blend.datasets]  # type: ignore[attr-defined]
    assert keys == [reference_content_key(docs, "train"), reference_content_key(same_sizes, "train")]
    assert keys[0] != keys[1]


def test_content_hash_of_a_large_corpus_samples_spread_blocks(tmp_path: Path) -> None:
    """Over 65,536 tokens: the sizes and 64 blocks of 1,024 tokens, as specified."""
    rng = np.random.default_rng(9)
    docs = [rng.integers(1, 1000, int(rng.integers(100, 3000))).tolist() + [EOD] for _ in range(60)]
    path = write(tmp_path / "big", docs)
    stream = [t for d in docs for t in d]
    total = len(stream)
    assert total > 65536
    starts = [k * (total - 1024) // 63 for k in range(64)]
    numbers = [len(docs), total] + [len(d) for d in docs]
    numbers += [t for s in starts for t in stream[s : s + 1024]]
    expected = hashlib.sha256(b"gpt-data-content-v1" + np.array(numbers, "<i8").tobytes())
    assert IndexedDataset(path).content_sha256 == expected.hexdigest()


def test_seed_names_give_data_order_1(tmp_path: Path) -> None:
    """What checkpoints written before issue 17 read: each file shuffled by CRC-32 of its
    basename and part, whatever its name is now."""
    docs = make_docs(10, 40)
    path = write(tmp_path / "renamed", docs)
    train, valid = build_datasets([path], None, [0.75, 0.25], SEQ_LEN, SEED, seed_names=["orig"])
    assert valid is not None
    for i in range(0, 300, 7):
        assert train.sample(i).tolist() == reference_sample(docs, list(range(30)), SEED, i, "orig/train")
    assert valid.sample(3).tolist() == reference_sample(
        docs, list(range(30, 40)), SEED, 3, "orig/valid"
    )
    with pytest.raises(DataError, match="1 data paths but 2 seed names"):
        build_datasets([path], None, [1, 0], SEQ_LEN, SEED, seed_names=["a", "b"])
