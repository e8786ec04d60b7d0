"""Training tokenizers, deterministic for both kinds (the same input files give a byte-identical result).

:func:`train_tokenizer` trains a GPT-style SentencePiece model (``<prefix>.model``), :func:`train_hf_tokenizer` a
GPT-2-style byte-level BPE (``tokenizer.json`` and ``tokenizer_config.json``); :func:`read_texts` reads the
documents of a raw text file. The command line is ``python -m data.tokenizer`` (``data/tokenizer.py``); what the
trained tokenizers are and how they are read is ``data/tokenizer_load.py``.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Iterator
from typing import TextIO

import sentencepiece as spm
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from config import MAX_VOCAB_SIZE
from data.indexed import DataError
from data.tokenizer_load import HF_CONFIG_FILE, HF_FILE, _first_line

# Fixed so that a model depends only on its input text, not on the machine.
_NUM_THREADS = 2

HF_END_TOKEN = "<|endoftext|>"
"""The special token (id 0) of the byte-level BPE :func:`train_hf_tokenizer` trains: eos and end of document."""
TEXT_SUFFIXES = (".txt", ".jsonl", ".json")
"""The input files read (each maybe with ``.gz``); see :func:`read_texts`."""
HF_MIN_VOCAB = 257
"""The least vocabulary of the byte-level BPE trained here: 256 bytes and :data:`HF_END_TOKEN`."""
SPM_MIN_VOCAB = 260
"""The least vocabulary of a sentencepiece model trained here: 3 special pieces, 256 byte pieces (byte fallback)
and the text's characters (at least one; sentencepiece says how many a corpus needs)."""


def read_texts(path: str, text_key: str = "text") -> Iterator[str]:
    """Yield the documents of a raw text file.

    ``.txt`` files give one document per line; ``.jsonl`` / ``.json`` files give
    the ``text_key`` field of each JSON Lines record (a ``.json`` file holding a
    single JSON array of records is accepted too).  A trailing ``.gz`` means
    gzip compression.  A null text is an empty document; any other text that is not a string, and a file that
    cannot be read, is not UTF-8 or not valid gzip, is a :class:`DataError` naming the file.
    """
    check_text_file(path)
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            if path.removesuffix(".gz").endswith(".txt"):
                yield from (line.rstrip("\n") for line in f)
                return
            for number, record in _json_records(f, path):
                if not isinstance(record, dict) or text_key not in record:
                    fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(f"{path}: record {number} has no field {text_key!r} ({fields})")
                text = record[text_key]
                if text is not None and not isinstance(text, str):
                    raise DataError(f"{path}: record {number}: field {text_key!r} is not a string (got "
                                    f"{type(text).__name__})")
                yield text or ""
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason}: byte 0x{err.object[err.start]:02x})") from err
    except gzip.BadGzipFile as err:
        raise DataError(f"{path}: not a gzip file, though named .gz ({err})") from err
    except (EOFError, zlib.error) as err:
        raise DataError(f"{path}: truncated or corrupt gzip data ({err})") from err
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from err


def check_text_file(path: str) -> None:
    """A DataError naming ``path`` unless it is a regular file :func:`read_texts` reads (by its suffix)."""
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, not a text file")
    if not os.path.exists(path):
        raise DataError(f"{path}: file not found")
    if not os.path.isfile(path):
        raise DataError(f"{path}: not a regular file")
    if not path.removesuffix(".gz").endswith(TEXT_SUFFIXES):
        raise DataError(f"{path}: unsupported extension (use .txt, .json or .jsonl, maybe .gz)")


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
    except (json.JSONDecodeError, RecursionError) as err:
        where = "" if first == "[" else f" line {number}:"
        why = err if isinstance(err, json.JSONDecodeError) else "nested too deeply"
        raise DataError(f"{path}:{where} invalid JSON ({why})") from err


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
    Only ``<model_prefix>.model`` is written (no ``.vocab`` file), whole or not
    at all (under a temporary name, then renamed).  Bad input (a missing or
    unreadable file, no text at all, a vocabulary size out of range, a prefix
    that cannot be written) is a :class:`DataError` of one line, raised before
    training wherever it can be told then.
    """
    for path in text_files:
        check_text_file(path)
    check_vocab_size(vocab_size, "sentencepiece")
    path = check_model_prefix(model_prefix)
    read_errors: list[DataError] = []
    count = [0]

    def sentences() -> Iterator[str]:
        # An exception raised inside SentencePiece's reader comes back as an opaque
        # RuntimeError; end the input instead and re-raise the original below.
        try:
            for sentence in _sentences(text_files, text_key, max_sentence_length):
                count[0] += 1
                yield sentence
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
        if not read_errors and count[0]:
            raise DataError(f"training a tokenizer on {text_files} failed: {_spm_reason(err)}") from err
    if read_errors:
        raise read_errors[0]
    if not count[0]:
        raise DataError(f"no text to train a tokenizer on: {text_files} hold no non-empty document")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, model.getvalue())
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

    Each file is written whole or not at all (under a temporary name, then renamed).  Bad input is a
    :class:`DataError` of one line, as for :func:`train_tokenizer`.
    """
    for path in text_files:
        check_text_file(path)
    check_vocab_size(vocab_size, "huggingface")
    check_output_dir(output_dir)
    read_errors: list[DataError] = []
    count = [0]

    def documents() -> Iterator[str]:
        # An exception raised inside the trainer's reader comes back wrapped; end the input instead
        # and re-raise the original below.
        try:
            for path in text_files:
                for text in read_texts(path, text_key):
                    if text:
                        count[0] += 1
                        yield text
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
    if not count[0]:
        raise DataError(f"no text to train a tokenizer on: {text_files} hold no non-empty document")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": HF_END_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    os.makedirs(output_dir, exist_ok=True)
    write_atomic(os.path.join(output_dir, HF_FILE), tok.to_str(pretty=False).encode("utf-8"))
    write_atomic(os.path.join(output_dir, HF_CONFIG_FILE), (json.dumps(config, indent=2) + "\n").encode("utf-8"))
    return output_dir


def check_vocab_size(vocab_size: int, kind: str, name: str = "vocab_size") -> None:
    """A DataError naming ``name`` unless the vocabulary size of a ``kind`` tokenizer (``"sentencepiece"`` or
    ``"huggingface"``) trained here is at least :data:`SPM_MIN_VOCAB` or :data:`HF_MIN_VOCAB` and at most
    ``config.MAX_VOCAB_SIZE`` (the ceiling of ``model.vocab_size``: a larger vocabulary could not be trained with)."""
    least, what, why = ((HF_MIN_VOCAB, "a byte-level BPE", "256 bytes and <|endoftext|>") if kind == "huggingface"
                        else (SPM_MIN_VOCAB, "a sentencepiece model", "3 special pieces, 256 byte pieces and the "
                              "text's characters"))
    if vocab_size < least:
        raise DataError(f"{name} {vocab_size} is too small for {what} (at least {least}: {why})")
    if vocab_size > MAX_VOCAB_SIZE:
        raise DataError(f"{name} {vocab_size} is above the ceiling of {MAX_VOCAB_SIZE} (config.MAX_VOCAB_SIZE, "
                        "the largest model.vocab_size: 16x the largest published vocabulary)")


def check_model_prefix(model_prefix: str, name: str = "model prefix") -> str:
    """The ``.model`` path of ``model_prefix``, checked before training: it has a file name (``dir/`` would write
    ``dir/.model``), is not a directory, and no file stands where a directory of its path must be."""
    stem = os.path.basename(model_prefix)
    if stem in ("", ".", ".."):
        example = os.path.join(os.path.normpath(model_prefix) if model_prefix else "out", "tok")
        raise DataError(f"{name} {model_prefix!r} has no file name: give a directory and a name, e.g. {example} "
                        f"(writes {example}.model)")
    path = model_prefix + ".model"
    if os.path.isdir(path):
        raise DataError(f"{name} {model_prefix}: {path} is a directory")
    _check_writable_ancestor(os.path.dirname(os.path.abspath(path)), name, model_prefix)
    return path


def check_output_dir(output_dir: str, name: str = "output directory") -> None:
    """``output_dir`` is a directory or can be made one (with its parents), checked before training."""
    if not output_dir:
        raise DataError(f"{name} is an empty path")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise DataError(f"{name} {output_dir} is a file, not a directory")
    _check_writable_ancestor(os.path.abspath(output_dir), name, output_dir)


def _check_writable_ancestor(directory: str, name: str, given: str) -> None:
    """The nearest existing directory of ``directory`` (itself or a parent) is a directory, not a file."""
    while not os.path.exists(directory) and directory != os.path.dirname(directory):
        directory = os.path.dirname(directory)
    if not os.path.isdir(directory):
        raise DataError(f"{name} {given} cannot be written: {directory} is a file, not a directory")


def write_atomic(path: str, data: bytes) -> None:
    """``path`` holds ``data`` whole, or is left as it was: written beside it under a temporary name (this
    process's), flushed to disk, then renamed over it; the temporary file is removed on failure. An error writing
    it (a full disk) is an OSError naming ``path``."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(err, OSError) and err.filename is None:  # write(), flush() and fsync() name no file
            raise OSError(err.errno, err.strerror or str(err), path) from err
        raise


def _spm_reason(err: BaseException) -> str:
    """SentencePiece's message without its source location and failed check (``INTERNAL: src/x.cc(744) [a == b]``):
    the sentence saying what is wrong, e.g. "Vocabulary size too high (300). Please set it to a value <= 287."."""
    text = _first_line(err)
    return re.sub(r"^[A-Z_]+: \S+\(\d+\) \[.*?\] ", "", text) or text
