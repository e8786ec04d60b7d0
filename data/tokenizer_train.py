"""Training tokenizers, deterministic for both kinds (the same input files give a byte-identical result).

:func:`train_tokenizer` trains a GPT-style SentencePiece model (``<prefix>.model``), :func:`train_hf_tokenizer` a
GPT-2-style byte-level BPE (``tokenizer.json`` and ``tokenizer_config.json``); :func:`read_texts` reads the
documents of a raw text file. The command line is ``python -m data.tokenizer`` (``data/tokenizer.py``); what the
trained tokenizers are and how they are read is ``data/tokenizer_load.py``.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator
from typing import TextIO

import sentencepiece as spm
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from data.indexed import DataError
from data.tokenizer_load import HF_CONFIG_FILE, HF_FILE, _first_line

# Fixed so that a model depends only on its input text, not on the machine.
_NUM_THREADS = 2

HF_END_TOKEN = "<|endoftext|>"
"""The special token (id 0) of the byte-level BPE :func:`train_hf_tokenizer` trains: eos and end of document."""


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


def train_hf_tokenizer(
    text_files: list[str],
    output_dir: str,
    vocab_size: int,
    *,
    text_key: str = "text",
    model_max_length: int = 1 << 20,
) -> str:
    """Train a byte-level BPE with ``tokenizers`` on ``text_files``; write it to ``output_dir``; return that.

    GPT-2 style: the ``ByteLevel`` pre-tokenizer (GPT-2's split regex, no prefix space) and decoder, all
    256 bytes in the initial alphabet (so any text encodes and ``decode(encode(text)) == text``), no
    normalizer, no ``<unk>``, and one special token, ``<|endoftext|>`` (id 0), the eos and end of
    document; no bos.  Writes ``tokenizer.json`` (compact JSON) and a ``tokenizer_config.json``
    (``PreTrainedTokenizerFast``, ``eos_token`` ``<|endoftext|>``, ``bos_token`` null, ``model_max_length``,
    no clean-up of spaces on decode) that ``transformers.AutoTokenizer.from_pretrained(output_dir)``
    loads.  Documents are read in file order, empty ones skipped.

    Deterministic: the same files give a byte-identical ``tokenizer.json`` whatever the thread count
    (``RAYON_NUM_THREADS``, ``TOKENIZERS_PARALLELISM``): word counts are sums, the initial alphabet is
    sorted, and merge ties are broken by the (count, pair of ids) order, whose ids follow from that
    alphabet and the earlier merges.  (The trainer's one hash-order dependence, the ids of
    continuing-subword tokens, does not arise: no ``continuing_subword_prefix`` or ``end_of_word_suffix``.)
    """
    for path in text_files:
        if not os.path.isfile(path):
            raise DataError(f"{path}: file not found")
    smallest = len(pre_tokenizers.ByteLevel.alphabet()) + 1
    if vocab_size < smallest:
        raise DataError(f"vocab_size {vocab_size} is too small for a byte-level BPE (at least {smallest}: "
                        "256 bytes and <|endoftext|>)")
    read_errors: list[DataError] = []

    def documents() -> Iterator[str]:
        # An exception raised inside the trainer's reader comes back wrapped; end the input instead
        # and re-raise the original below.
        try:
            for path in text_files:
                yield from (text for text in read_texts(path, text_key) if text)
        except DataError as err:
            read_errors.append(err)

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only: no ids added
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[HF_END_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    try:
        tok.train_from_iterator(documents(), trainer)
    except Exception as err:  # tokenizers raises plain Exception
        if not read_errors:
            raise DataError(f"training a tokenizer on {text_files} failed: {_first_line(err)}") from err
    if read_errors:
        raise read_errors[0]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": HF_END_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, HF_FILE), "w", encoding="utf-8") as f:
        f.write(tok.to_str(pretty=False))
    with open(os.path.join(output_dir, HF_CONFIG_FILE), "w", encoding="utf-8") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    return output_dir
