"""Tests for data/preprocess.py: every input format against direct tokenization."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.indexed import DataError, IndexedDataset
from data.preprocess import main, preprocess
from data.tokenizer import Tokenizer

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample"
TOKENIZER = str(SAMPLE / "tokenizer.model")
TEXTS = [
    "The first document.\n\nIt has two paragraphs.",
    "",
    "Second one: digits 2024, unicode é 中文 😀 and  double  spaces.",
    "   \n  ",
    "Third.",
]
NON_EMPTY = [t for t in TEXTS if t.strip()]


def expected_docs(texts: list[str]) -> list[list[int]]:
    tok = Tokenizer(TOKENIZER)
    return [tok.encode(t) + [tok.eod_id] for t in texts]


def read_docs(prefix: Path) -> list[list[int]]:
    ds = IndexedDataset(str(prefix))
    return [ds.doc(i).tolist() for i in range(len(ds))]


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    lines = "".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts))
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def test_jsonl_and_gz(tmp_path: Path) -> None:
    first = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    second = write_jsonl(tmp_path / "b.jsonl.gz", ["Another file, read second."])
    stats = preprocess([str(first), str(second)], str(tmp_path / "out"), TOKENIZER)
    want = expected_docs(NON_EMPTY + ["Another file, read second."])
    assert read_docs(tmp_path / "out") == want
    assert stats == {"docs": len(want), "tokens": sum(map(len, want)), "empty_docs": 2}


def test_parquet_with_text_key(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"content": TEXTS, "n": range(len(TEXTS))}), path, row_group_size=2)
    preprocess([str(path)], str(tmp_path / "out"), TOKENIZER, text_key="content")
    assert read_docs(tmp_path / "out") == expected_docs(NON_EMPTY)


@pytest.mark.parametrize("name", ["a.txt", "a.txt.gz"])
def test_txt_is_one_document_per_line(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("first line\n\nsecond  line\nthird\n")
    stats = preprocess([str(path)], str(tmp_path / "out"), TOKENIZER, text_key="ignored")
    assert read_docs(tmp_path / "out") == expected_docs(["first line", "second  line", "third"])
    assert stats["empty_docs"] == 1


def test_json_array(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"text": t} for t in TEXTS]), encoding="utf-8")
    preprocess([str(path)], str(tmp_path / "out"), TOKENIZER)
    assert read_docs(tmp_path / "out") == expected_docs(NON_EMPTY)


def test_missing_text_field_lists_columns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", TEXTS, key="body")
    with pytest.raises(DataError) as info:
        preprocess([str(path)], str(tmp_path / "out"), TOKENIZER)
    message = str(info.value)
    assert all(part in message for part in (str(path), "'text'", "'body'", "'id'"))
    assert list(tmp_path.iterdir()) == [path]


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="absent.jsonl"):
        preprocess([str(tmp_path / "absent.jsonl")], str(tmp_path / "out"), TOKENIZER)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match="broken.jsonl"):
        preprocess([str(broken)], str(tmp_path / "out"), TOKENIZER)
    odd = tmp_path / "a.csv"
    odd.write_text("text\nx\n")
    with pytest.raises(DataError, match="a.csv: unsupported"):
        preprocess([str(odd)], str(tmp_path / "out"), TOKENIZER)


def test_workers_give_identical_bytes(tmp_path: Path) -> None:
    texts = [f"Document number {i}. " * (1 + i % 7) for i in range(300)]
    path = write_jsonl(tmp_path / "a.jsonl", texts)
    preprocess([str(path)], str(tmp_path / "one"), TOKENIZER, workers=1, batch_size=16)
    preprocess([str(path)], str(tmp_path / "two"), TOKENIZER, workers=2, batch_size=16)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"two{suffix}").read_bytes() == (tmp_path / f"one{suffix}").read_bytes()
    assert read_docs(tmp_path / "two") == expected_docs(texts)


def test_cli_prints_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    main(["--input", str(path), "--output-prefix", str(tmp_path / "out"), "--tokenizer", TOKENIZER])
    want = expected_docs(NON_EMPTY)
    assert f"docs={len(want)} tokens={sum(map(len, want))} empty_docs=2" in capsys.readouterr().out


SHIPPED = [SAMPLE / name for name in ("corpus.jsonl.gz", "tokenizer.model")] + [
    SAMPLE / f"sample_text_document{suffix}" for suffix in (".bin", ".idx")
]


@pytest.mark.skipif(not all(p.exists() for p in SHIPPED), reason="shipped sample corpus absent")
def test_shipped_sample_is_reproducible(tmp_path: Path) -> None:
    preprocess([str(SAMPLE / "corpus.jsonl.gz")], str(tmp_path / "again"), TOKENIZER)
    for suffix in (".bin", ".idx"):
        shipped = (SAMPLE / f"sample_text_document{suffix}").read_bytes()
        assert (tmp_path / f"again{suffix}").read_bytes() == shipped
