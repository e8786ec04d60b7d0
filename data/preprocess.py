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
id, no second one is appended); documents that are empty or whitespace only
are skipped and counted.  The ``.idx`` records the tokenizer (index version 3,
``data/indexed.py``), which training checks against ``data.tokenizer``.

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
"""

from __future__ import annotations

import os

# Preprocessing reads local files only; never reach for the hub.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import argparse
import contextlib
import functools
import itertools
import tempfile
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
    tokenized = table.map(
        _tokenize_batch,
        batched=True,
        batch_size=batch_size,
        num_proc=workers if workers > 1 else None,
        remove_columns=table.column_names,
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
    return stats


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: preprocess and print the statistics."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help=".jsonl/.json/.parquet/.txt")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin/.idx")
    parser.add_argument("--tokenizer", required=True,
                        help="sentencepiece .model, tokenizer.json, or a directory holding one")
    parser.add_argument("--text-key", default="text", help="field holding the document text")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--no-eod", action="store_true",
                        help="do not append the EOD token (one the tokenizer's post-processor adds stays)")
    args = parser.parse_args(argv)
    stats = preprocess(
        args.input,
        args.output_prefix,
        args.tokenizer,
        text_key=args.text_key,
        workers=args.workers,
        append_eod=not args.no_eod,
    )
    print(" ".join(f"{name}={value}" for name, value in stats.items()))


if __name__ == "__main__":
    main()
