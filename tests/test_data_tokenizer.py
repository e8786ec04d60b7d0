"""Tests for data/tokenizer.py (and data/tokenizer_train.py): training, round trips, special ids, errors."""

from __future__ import annotations

import errno
import gzip
import json
import os
from pathlib import Path
from pydoc_data.topics import topics

import pytest

from data.indexed import DataError
from data.tokenizer import Tokenizer, main, train_tokenizer

VOCAB = 400
# Single-line documents, so that the .txt form (one document per line) holds the same texts.
TEXTS = [" ".join(topics[name].split()) for name in sorted(topics)[:25]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def model(corpus: Path) -> str:
    return train_tokenizer([str(corpus)], str(corpus.parent / "tiny"), VOCAB)


@pytest.mark.parametrize(
    "text",
    [
        "The assert statement is a convenient way to insert debugging assertions.",
        "  two leading spaces,\ttabs,   runs of spaces\nand\n\nblank lines\n",
        "digits 1234567 and unseen characters: é, ß, 中文, 😀",
        "",
    ],
)
def test_round_trip(model: str, text: str) -> None:
    tok = Tokenizer(model)
    ids = tok.encode(text)
    assert all(0 <= i < VOCAB for i in ids)
    assert tok.decode(ids) == text


def test_special_ids_and_batch(model: str) -> None:
    tok = Tokenizer(model)
    assert (tok.vocab_size, tok.eod_id, tok.bos_id) == (VOCAB, 2, 1)
    texts = ["hello world", "", "end of document"]
    batch = tok.encode_batch(texts)
    assert batch == [tok.encode(t) for t in texts]
    assert all(tok.eod_id not in ids and tok.bos_id not in ids for ids in batch)


def test_training_is_deterministic_and_reads_every_format(tmp_path: Path, model: str) -> None:
    txt = tmp_path / "corpus.txt"
    txt.write_text("".join(t + "\n" for t in TEXTS), encoding="utf-8")
    gz = tmp_path / "corpus.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"body": t}) + "\n" for t in TEXTS)
    array = tmp_path / "corpus.json"
    array.write_text(json.dumps([{"text": t} for t in TEXTS]), encoding="utf-8")
    reference = Path(model).read_bytes()
    assert Path(train_tokenizer([str(txt)], str(tmp_path / "a"), VOCAB)).read_bytes() == reference
    assert (
        Path(train_tokenizer([str(gz)], str(tmp_path / "b"), VOCAB, text_key="body")).read_bytes()
        == reference
    )
    assert Path(train_tokenizer([str(array)], str(tmp_path / "c"), VOCAB)).read_bytes() == reference


def test_cli_writes_the_model(
    tmp_path: Path, corpus: Path, model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main(
        [
            "--input",
            str(corpus),
            "--model-prefix",
            str(tmp_path / "cli"),
            "--vocab-size",
            str(VOCAB),
        ]
    )
    path = capsys.readouterr().out.strip()
    assert path == str(tmp_path / "cli.model")
    assert Path(path).read_bytes() == Path(model).read_bytes()


def test_missing_and_garbage_models(tmp_path: Path) -> None:
    missing = tmp_path / "missing.model"
    with pytest.raises(DataError, match="missing.model"):
        Tokenizer(str(missing))
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00\xffnot a sentencepiece model" * 50)
    with pytest.raises(DataError, match="garbage.model"):
        Tokenizer(str(garbage))


def test_training_input_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="absent.jsonl"):
        train_tokenizer([str(tmp_path / "absent.jsonl")], str(tmp_path / "m"), VOCAB)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"content": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl: record 2 has no field 'text'"):
        train_tokenizer([str(bad)], str(tmp_path / "m"), VOCAB)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken.jsonl: line 2: invalid JSON"):
        train_tokenizer([str(broken)], str(tmp_path / "m"), VOCAB)
    csv = tmp_path / "corpus.csv"
    csv.write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"corpus.csv: unsupported extension"):
        train_tokenizer([str(csv)], str(tmp_path / "m"), VOCAB)
    assert not (tmp_path / "m.model").exists()


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface"])
def test_cli_write_failure_leaves_the_earlier_tokenizer_whole(
    tmp_path: Path, corpus: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A full disk while the trained tokenizer is written: one line naming the file, exit code 2, and the tokenizer
    written there before is left as it was (no half-written file, no temporary file left beside it)."""
    out = tmp_path / "out"
    out.mkdir()
    if kind == "sentencepiece":
        target, option = out / "tok.model", ["--model-prefix", str(out / "tok")]
    else:
        target, option = out / "tokenizer.json", ["--huggingface", str(out)]
    target.write_bytes(b"the tokenizer written before")

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    assert main(["--input", str(corpus), *option, "--vocab-size", str(VOCAB)]) == 2
    assert capfd.readouterr().err == f"error: {target}: {os.strerror(errno.ENOSPC)}\n"
    assert target.read_bytes() == b"the tokenizer written before"
    assert [p.name for p in out.iterdir()] == [target.name]
