"""Tokenize text corpora with Hugging Face ``datasets`` into a ``.bin``/``.idx`` pair.

Accepted inputs (local files only; the hub is never contacted):

* ``.jsonl`` / ``.json`` (optionally ``.gz``): one record per document, text in
  the ``text_key`` field;
* ``.parquet``: one row per document, text in the ``text_key`` column;
* ``.txt`` (optionally ``.gz``): one document per line (the ``datasets`` "text"
  builder); the text is always its ``text`` column, whatever ``text_key``.

The tokenizer is anything ``data/tokenizer.py``'s ``load_tokenizer`` reads: a
sentencepiece ``.model``, a Hugging Face ``tokenizer.json`` or a model directory
holding one of them.  Each document becomes ``tokenizer.encode(text) + [eod]``
(a Hugging Face tokenizer's ``encode`` applies its post-processor, e.g. a bos
in front; when that post-processor already ends every encoding with the eod
id, no second one is appended); documents that are empty, whitespace only or
null are skipped and counted, wherever they are (an empty or blank file has
no documents).  A text value that is not a string (a number, a list) or not
valid UTF-8 is a ``DataError`` naming the file and the document, and so are
inputs without a single non-empty document (nothing is written then).  The
``.idx`` records the tokenizer (index version 3, ``data/indexed.py``), which
training checks against ``data.tokenizer``.

Documents are written in input order (files in the order given, rows in file
order) regardless of the number of worker processes, so the output is
byte-identical for any ``workers``.  A process loads the tokenizer at most
once (forked workers inherit the parent's).  With more than one worker,
``TOKENIZERS_PARALLELISM=false`` is set while preprocessing runs (and restored
after): the workers are forked, and a fork after the ``tokenizers`` thread pool
has run can deadlock (the workers are the parallelism then).

Command line::

    python -m data.preprocess --input a.jsonl b.parquet --output-prefix out/corpus \\
        --tokenizer tok.model --workers 4
    python -m data.preprocess --input a.jsonl --output-prefix out/corpus --tokenizer path/to/llama3

It prints the statistics; progress bars only when stderr is a terminal.  Bad input (an input, tokenizer or
output prefix that is missing, unreadable or malformed) is one line ``error: ...`` on stderr and exit code 2,
as for train.py.
"""

from __future__ import annotations

import os

# Preprocessing reads local files only; never reach for the hub.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import argparse
import contextlib
import functools
import gzip
import itertools
import sys
import tempfile
import zlib
from collections.abc import Iterator

import datasets
import numpy as np
import pyarrow as pa

from data.indexed import DataError, IndexedDatasetWriter
from data.tokenizer import Tokenizer, load_tokenizer

_BUILDERS = {
    ".jsonl": "json",
    ".jsonl.gz": "json",
    ".json": "json",
    ".json.gz": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".txt.gz": "text",
}


def builder_for(path: str) -> str:
    """Name of the ``datasets`` builder reading ``path``, from its extension."""
    for suffix, builder in _BUILDERS.items():
        if path.endswith(suffix):
            return builder
    raise DataError(f"{path}: unsupported file type (use one of {', '.join(_BUILDERS)})")


_TOKENIZED = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64"))})
"""The type of ``map``'s output, given up front: otherwise the first batch fixes it, and a batch of only empty
documents (``[]``, a list of nulls) makes every later batch's ids fail to cast."""

_TEXT_TYPES = ("string", "large_string", "null")


def _is_blank(path: str) -> bool:
    """True if ``path`` (gzip-compressed for ``.gz``) holds nothing but whitespace: a file without documents,
    which the ``datasets`` json and text builders cannot read ("generator raised StopIteration")."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            while chunk := f.read(1 << 16):
                if chunk.strip():
                    return False
    except (OSError, EOFError, zlib.error):  # e.g. a corrupt .gz: the builder reports it
        return False
    return True


def _check_texts(path: str, table: datasets.Dataset, key: str) -> None:
    """Every value of column ``key`` is a string (or null) of valid UTF-8; else a DataError naming the document."""
    feature = table.features[key]
    if not (isinstance(feature, datasets.Value) and feature.dtype in _TEXT_TYPES):
        for row, value in enumerate(table[key]):  # the first value that is not text
            if value is not None and not isinstance(value, str):
                raise DataError(f"{path}: document {row}: its {key!r} value {_short(value)} is not a string "
                                f"({type(value).__name__})")
        raise DataError(f"{path}: field {key!r} holds {feature}, not strings")
    row = 0
    for chunk in table.data.column(key).chunks:
        try:
            chunk.validate(full=True)  # checks that every string is UTF-8 (the json reader does not)
        except pa.ArrowInvalid as invalid:
            for i, scalar in enumerate(chunk):
                try:
                    scalar.as_py()
                except UnicodeDecodeError as err:
                    raise DataError(f"{path}: document {row + i}: its {key!r} value is not valid UTF-8 text "
                                    f"({err.reason} at byte {err.start})") from None
            raise DataError(f"{path}: field {key!r} is not valid text ({invalid})") from None
        row += len(chunk)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@functools.cache
def _load_tokenizer(path: str) -> Tokenizer:
    """One tokenizer per process: tokenizer objects are not shipped between workers."""
    return load_tokenizer(path)


@contextlib.contextmanager
def _tokenizers_parallelism(enabled: bool) -> Iterator[None]:
    """``TOKENIZERS_PARALLELISM`` set to false inside the block unless ``enabled``; restored afterwards."""
    if enabled:
        yield
        return
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _tokenize_batch(
    batch: dict[str, list[str | None]], *, text_key: str, tokenizer_path: str, append_eod: bool
) -> dict[str, list[list[int]]]:
    """``datasets.map`` function: texts to id lists; empty documents give ``[]``."""
    tokenizer = _load_tokenizer(tokenizer_path)
    texts = [text if text and not text.isspace() else "" for text in batch[text_key]]
    suffix = [tokenizer.eod_id] if append_eod and not tokenizer.appends_eod else []
    return {
        "input_ids": [
            ids + suffix if text else []
            for text, ids in zip(texts, tokenizer.encode_batch(texts), strict=True)
        ]
    }


def _tokenized_documents(
    path: str,
    tokenizer_path: str,
    text_key: str,
    workers: int,
    batch_size: int,
    append_eod: bool,
    cache_dir: str,
) -> Iterator[np.ndarray]:
    """Token ids of every document of ``path`` in file order (``[]`` for empty ones)."""
    builder = builder_for(path)
    if builder != "parquet" and _is_blank(path):
        return  # no documents (the builders fail on an empty file)
    try:
        table = datasets.load_dataset(
            builder, data_files=[path], split="train", cache_dir=cache_dir
        )
    except (datasets.exceptions.DatasetGenerationError, pa.ArrowInvalid, ValueError) as err:
        reason = err.__cause__ or err  # DatasetGenerationError wraps the parser's error
        raise DataError(f"{path}: could not be read by the {builder!r} builder: {reason}") from err
    key = "text" if builder == "text" else text_key
    if key not in table.column_names:
        raise DataError(f"{path}: no text field {key!r}; available columns: {table.column_names}")
    _check_texts(path, table, key)
    tokenized = table.map(
        _tokenize_batch,
        batched=True,
        batch_size=batch_size,
        num_proc=workers if workers > 1 else None,
        remove_columns=table.column_names,
        features=_TOKENIZED,
        fn_kwargs={"text_key": key, "tokenizer_path": tokenizer_path, "append_eod": append_eod},
        desc=f"tokenizing {os.path.basename(path)}",
    )
    for chunk in tokenized.data.column("input_ids").chunks:
        # For a sliced chunk the offsets index into the unsliced values.
        offsets = chunk.offsets.to_numpy()
        values = chunk.values.to_numpy()
        for start, end in itertools.pairwise(offsets):
            yield values[start:end]


def preprocess(
    inputs: list[str],
    output_prefix: str,
    tokenizer_path: str,
    *,
    text_key: str = "text",
    workers: int = 1,
    append_eod: bool = True,
    batch_size: int = 1000,
) -> dict[str, int]:
    """Tokenize ``inputs`` into ``<output_prefix>.bin`` / ``.idx``.

    ``tokenizer_path`` is a sentencepiece ``.model``, a ``tokenizer.json`` or a
    directory holding one.  Returns ``{"docs": written documents, "tokens":
    written tokens, "empty_docs": skipped empty documents}``.  Nothing is
    written under the output names unless every input was processed.
    """
    for path in inputs:
        if os.path.isdir(path):
            raise DataError(f"{path}: a directory, not an input file")
        if not os.path.isfile(path):
            raise DataError(f"{path}: input file not found")
        builder_for(path)
    tokenizer = _load_tokenizer(tokenizer_path)
    stats = {"docs": 0, "tokens": 0, "empty_docs": 0}
    with (
        _tokenizers_parallelism(workers <= 1),
        tempfile.TemporaryDirectory(prefix="preprocess-cache-") as cache_dir,
        IndexedDatasetWriter(output_prefix, tokenizer.vocab_size, tokenizer=tokenizer.info) as writer,
    ):
        for path in inputs:
            documents = _tokenized_documents(
                path, tokenizer_path, text_key, workers, batch_size, append_eod, cache_dir
            )
            for row, ids in enumerate(documents):
                if ids.size == 0:
                    stats["empty_docs"] += 1
                    continue
                if ids.min() < 0 or ids.max() >= tokenizer.vocab_size:  # nothing out of range reaches the .bin
                    raise DataError(
                        f"{path}: document {row} was tokenized to id {int(ids.max())} (or {int(ids.min())}), "
                        f"outside the vocabulary [0, {tokenizer.vocab_size}) of {tokenizer_path}"
                    )
                writer.add_document(ids)
                stats["docs"] += 1
                stats["tokens"] += ids.size
        if stats["docs"] == 0:  # raised inside the writer's block: nothing is left under the output names
            files = ", ".join(inputs)
            if stats["empty_docs"]:
                raise DataError(f"no documents to write: all {stats['empty_docs']} documents of {files} are "
                                "empty or whitespace only")
            raise DataError(f"no documents to write: {files} holds no documents")
    return stats


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: preprocess and print the statistics. Bad input (a missing, unreadable or
    malformed input or tokenizer, an output prefix that cannot be written) is one line ``error: ...`` on
    stderr and exit code 2, as for train.py."""
    parser = _Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help=".jsonl/.json/.parquet/.txt")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin/.idx")
    parser.add_argument("--tokenizer", required=True,
                        help="sentencepiece .model, tokenizer.json, or a directory holding one")
    parser.add_argument("--text-key", default="text", help="field holding the document text")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--no-eod", action="store_true",
                        help="do not append the EOD token (one the tokenizer's post-processor adds stays)")
    args = parser.parse_args(argv)
    if not sys.stderr.isatty():  # progress bars only on a terminal: in a log or a pipe, an error is the one line
        datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors come back as the one line (DataError)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    stem = os.path.basename(args.output_prefix)
    if stem in ("", ".", ".."):  # 'dir/' would write the hidden files dir/.bin and dir/.idx
        example = os.path.join(os.path.normpath(args.output_prefix), "corpus")
        parser.error(f"--output-prefix {args.output_prefix} has no file name: give a directory and a name, e.g. "
                     f"{example} (writes {example}.bin and {example}.idx)")
    try:
        stats = preprocess(
            args.input,
            args.output_prefix,
            args.tokenizer,
            text_key=args.text_key,
            workers=args.workers,
            append_eod=not args.no_eod,
        )
    except DataError as err:
        print(f"error: {_one_line(str(err))}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. the output prefix: a directory in its path is a file, no permission, disk full
        if err.filename is None:
            raise
        where = os.path.abspath(os.fsdecode(err.filename))
        output = os.path.abspath(args.output_prefix)
        what = f"cannot write --output-prefix {args.output_prefix}: " if output.startswith(where) else ""
        print(f"error: {what}{err.filename}: {err.strerror}", file=sys.stderr)
        return 2
    print(" ".join(f"{name}={value}" for name, value in stats.items()))
    return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _Parser(argparse.ArgumentParser):
    """argparse's usage errors as one line ``error: ...`` and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {message} (see python -m data.preprocess --help)\n")


if __name__ == "__main__":
    sys.exit(main())
