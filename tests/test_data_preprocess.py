"""Tests for data/preprocess.py: every input format against direct tokenization."""

from __future__ import annotations

import gzip
import json
import os
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


# ---- hostile input: one line "error: ..." and exit code 2 from the command line, never a traceback ----------


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """main(argv) as the command line runs it: (exit code, stderr); stderr is not a terminal here."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    return code, capsys.readouterr().err


def _assert_one_error_line(code: int, err: str, *parts: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for part in parts:
        assert part in lines[0], lines[0]


def _write_lines(path: Path, raw_lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in raw_lines))
    return path


BAD_TEXT = {  # a .jsonl whose "text" is not a string of UTF-8 -> what the error names
    "int": ([b'{"text": 123}'], ["document 0", "123", "not a string"]),
    "list": ([b'{"text": "fine"}', b'{"text": ["a", "b"]}'], ["document 1", "['a', 'b']", "not a string"]),
    "mixed": ([b'{"text": "fine"}', b'{"text": "also fine"}', b'{"text": 5}'], ["document 2", "not a string"]),
    "object": ([b'{"text": {"nested": "x"}}'], ["document 0", "not a string"]),
    "bad_utf8": ([b'{"text": "fine"}', b'{"text": "ab\xff\xfecd"}'], ["document 1", "not valid UTF-8"]),
}


@pytest.mark.parametrize("case", sorted(BAD_TEXT))
def test_cli_text_that_is_not_a_string_is_one_line(tmp_path: Path, capsys, case: str) -> None:
    lines, parts = BAD_TEXT[case]
    path = _write_lines(tmp_path / "a.jsonl", lines)
    code, err = _cli(["--input", str(path), "--output-prefix", str(tmp_path / "out"), "--tokenizer", TOKENIZER],
                     capsys)
    _assert_one_error_line(code, err, str(path), *parts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]  # nothing written


@pytest.mark.parametrize("name", ["empty.jsonl", "blank.jsonl", "empty.json", "empty.txt", "empty.jsonl.gz"])
def test_cli_a_file_without_documents(tmp_path: Path, capsys, name: str) -> None:
    """An empty (or blank) file has no documents: alone it is one error line; beside others it adds nothing."""
    empty = tmp_path / name
    content = b"\n  \n" if name.startswith("blank") else b""
    if name.endswith(".gz"):
        with gzip.open(empty, "wb") as f:
            f.write(content)
    else:
        empty.write_bytes(content)
    code, err = _cli(["--input", str(empty), "--output-prefix", str(tmp_path / "out"), "--tokenizer", TOKENIZER],
                     capsys)
    _assert_one_error_line(code, err, str(empty), "no documents")
    assert not list(tmp_path.glob("out*"))
    other = write_jsonl(tmp_path / "b.jsonl", ["Something to write."])
    stats = preprocess([str(empty), str(other)], str(tmp_path / "both"), TOKENIZER)
    assert read_docs(tmp_path / "both") == expected_docs(["Something to write."]) and stats["empty_docs"] == 0


@pytest.mark.parametrize("texts", [["", "  ", "\n"], [None, None]], ids=["empty_strings", "nulls"])
def test_all_documents_empty_is_one_line_and_writes_nothing(tmp_path: Path, capsys, texts) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", texts)
    code, err = _cli(["--input", str(path), "--output-prefix", str(tmp_path / "out" / "corpus"), "--tokenizer",
                      TOKENIZER], capsys)
    _assert_one_error_line(code, err, str(path), f"all {len(texts)} documents", "empty")
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p != path]  # nothing half-written


@pytest.mark.parametrize("workers", [1, 2])
def test_empty_documents_before_real_ones_are_skipped(tmp_path: Path, workers: int) -> None:
    """The first batch (1,000 documents) all empty used to fix the ids' type to null: every later batch failed."""
    real = [f"Real document {i}." for i in range(5)]
    path = write_jsonl(tmp_path / "a.jsonl", [""] * 1000 + real[:3] + ["   "] + real[3:])
    stats = preprocess([str(path)], str(tmp_path / "out"), TOKENIZER, workers=workers)
    want = expected_docs(real)
    assert read_docs(tmp_path / "out") == want
    assert stats == {"docs": 5, "tokens": sum(map(len, want)), "empty_docs": 1001}


def test_cli_bad_paths_are_one_line(tmp_path: Path, capsys) -> None:
    good = write_jsonl(tmp_path / "a.jsonl", ["Some text."])
    (tmp_path / "somefile").write_text("x")
    (tmp_path / "noise.jsonl").write_bytes(bytes(range(256)) * 8)
    cases = [
        (["--input", str(tmp_path / "absent.jsonl")], [str(tmp_path / "absent.jsonl"), "not found"]),
        (["--input", str(tmp_path / "noise.jsonl")], [str(tmp_path / "noise.jsonl"), "could not be read"]),
        (["--input", str(good), "--tokenizer", str(tmp_path / "absent.model")], ["absent.model"]),
        (["--input", str(good), "--tokenizer", str(tmp_path / "noise.jsonl")], ["noise.jsonl"]),
        (["--input", str(good), "--output-prefix", str(tmp_path / "somefile" / "out")], ["somefile"]),
        (["--input", str(good), "--workers", "0"], ["--workers"]),
        # a directory as the prefix wrote the hidden files <dir>/.bin and <dir>/.idx
        (["--input", str(good), "--output-prefix", str(tmp_path) + os.sep], [str(tmp_path), "has no file name"]),
        (["--input", str(good), "--output-prefix", str(tmp_path) + os.sep + "."], ["has no file name"]),
    ]
    for extra, parts in cases:
        argv = {"--output-prefix": str(tmp_path / "out"), "--tokenizer": TOKENIZER}
        args = list(extra)
        for option, value in argv.items():
            if option not in args:
                args += [option, value]
        code, err = _cli(args, capsys)
        _assert_one_error_line(code, err, *parts)
    assert not list(tmp_path.glob("out*"))


def test_the_command_exits_2_with_one_line(tmp_path: Path) -> None:
    """The real command line: exit code 2 and the one line (was the last line of a traceback, exit code 1)."""
    import subprocess
    import sys

    path = _write_lines(tmp_path / "a.jsonl", [b'{"text": 123}'])
    r = subprocess.run([sys.executable, "-m", "data.preprocess", "--input", str(path), "--output-prefix",
                        str(tmp_path / "out"), "--tokenizer", TOKENIZER], cwd=SAMPLE.parents[1], capture_output=True,
                       text=True, timeout=300)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"error: {path}: document 0"), r.stderr
