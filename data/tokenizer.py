"""SentencePiece tokenizer: deterministic training and a thin encode/decode wrapper.

Models are trained GPT-style: identity normalisation (text is kept verbatim,
so ``decode(encode(text)) == text``), runs of spaces preserved, digits split,
unseen characters encoded as UTF-8 bytes (``byte_fallback``).  Special ids are
fixed: ``<unk>`` = 0, ``<s>`` (bos) = 1, ``</s>`` (eos) = 2, no padding piece;
the eos id doubles as the end-of-document (EOD) token.

Command line::

    python -m data.tokenizer --input corpus.jsonl.gz --model-prefix out/tok --vocab-size 4096
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Optional, TextIO

import sentencepiece as spm

from data.indexed import DataError

# Fixed so that a model depends only on its input text, not on the machine.
_NUM_THREADS = 2


def read_texts(path: str, text_key: str = "text") -> Iterator[str]:
    """Yield the documents of a raw text file.

    ``.txt`` files give one document per line; ``.jsonl`` / ``.json`` files give
    the ``text_key`` field of each JSON Lines record (a ``.json`` file holding a
    single JSON array of records is accepted too).  A trailing ``.gz`` means
    gzip compression.
    """
    name = path.removesuffix(".gz")
    if not name.endswith((".txt", ".jsonl", ".json")):
        raise DataError(f"{path}: unsupported extension (use .txt, .json or .jsonl, maybe .gz)")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        if name.endswith(".txt"):
            yield from (line.rstrip("\n") for line in f)
            return
        for number, record in _json_records(f, path):
            if not isinstance(record, dict) or text_key not in record:
                fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}: record {number} has no field {text_key!r} ({fields})")
            yield record[text_key]


def _json_records(f: TextIO, path: str) -> Iterator[tuple[int, object]]:
    """(record number, record) of a JSON Lines file or of a file holding one JSON array."""
    first = f.read(1)
    f.seek(0)
    try:
        if first == "[":
            yield from enumerate(json.load(f), start=1)
            return
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, json.loads(line)
    except json.JSONDecodeError as err:
        where = "" if first == "[" else f" line {number}:"
        raise DataError(f"{path}:{where} invalid JSON ({err})") from err


def _sentences(paths: list[str], text_key: str, max_bytes: int) -> Iterator[str]:
    """Documents of all files, split at line breaks where longer than ``max_bytes``.

    SentencePiece silently drops training sentences above its length limit;
    cutting long documents into line-aligned chunks keeps their text in play.
    """
    for path in paths:
        for text in read_texts(path, text_key):
            if not text:
                continue
            if len(text.encode("utf-8")) <= max_bytes:
                yield text
                continue
            chunk = ""
            for line in text.splitlines(keepends=True):
                if chunk and len((chunk + line).encode("utf-8")) > max_bytes:
                    yield chunk
                    chunk = ""
                chunk += line
            yield chunk


def train_tokenizer(
    text_files: list[str],
    model_prefix: str,
    vocab_size: int,
    *,
    text_key: str = "text",
    model_type: str = "bpe",
    max_sentence_length: int = 16384,
) -> str:
    """Train a SentencePiece model on ``text_files`` and return the ``.model`` path.

    The whole input is used in file order (no sampling, no shuffling) with a
    fixed thread count, so the same files always give a byte-identical model.
    Only ``<model_prefix>.model`` is written (no ``.vocab`` file).
    """
    for path in text_files:
        if not os.path.isfile(path):
            raise DataError(f"{path}: file not found")
    read_errors: list[DataError] = []

    def sentences() -> Iterator[str]:
        # An exception raised inside SentencePiece's reader comes back as an opaque
        # RuntimeError; end the input instead and re-raise the original below.
        try:
            yield from _sentences(text_files, text_key, max_sentence_length)
        except DataError as err:
            read_errors.append(err)

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=max_sentence_length,
            num_threads=_NUM_THREADS,
            minloglevel=2,
        )
    except RuntimeError as err:
        if not read_errors:
            raise DataError(f"training a tokenizer on {text_files} failed: {err}") from err
    if read_errors:
        raise read_errors[0]
    path = model_prefix + ".model"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


def find_model_file(name: str, override: Optional[str] = None) -> Optional[Path]:
    """The sentencepiece model a script should use: ``override`` (e.g. ``--tokenizer``) if given, else a
    checkpoint's ``data.tokenizer`` as written or relative to the repository root; None if it is not a file."""
    repo = Path(__file__).resolve().parents[1]
    for candidate in ([Path(override)] if override else [Path(name), repo / name]):
        if candidate.is_file():
            return candidate
    return None


class Tokenizer:
    """A loaded SentencePiece model with the few operations the pipeline needs."""

    def __init__(self, model_path: str) -> None:
        if not os.path.isfile(model_path):
            raise DataError(f"{model_path}: tokenizer model not found")
        self.model_path = model_path
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(model_path)
        except (OSError, RuntimeError) as err:
            raise DataError(f"{model_path}: not a valid SentencePiece model ({err})") from err
        if self._sp.eos_id() < 0:
            raise DataError(f"{model_path}: model has no eos piece to use as end-of-document")

    @property
    def vocab_size(self) -> int:
        """Number of pieces, i.e. one more than the largest id."""
        return self._sp.vocab_size()

    @property
    def eod_id(self) -> int:
        """End-of-document id (the model's eos id)."""
        return self._sp.eos_id()

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id (-1 if the model has none)."""
        return self._sp.bos_id()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no bos/eos added)."""
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text of ``texts``."""
        return self._sp.encode(list(texts), out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids (numpy integer arrays are accepted)."""
        return self._sp.decode([int(i) for i in ids])


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: train a tokenizer and print the model path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help=".txt/.jsonl/.json[.gz] files")
    parser.add_argument("--model-prefix", required=True, help="writes <prefix>.model")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--text-key", default="text", help="JSON field holding the text")
    parser.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    args = parser.parse_args(argv)
    print(
        train_tokenizer(
            args.input,
            args.model_prefix,
            args.vocab_size,
            text_key=args.text_key,
            model_type=args.model_type,
        )
    )


if __name__ == "__main__":
    main()
