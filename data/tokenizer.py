"""Tokenizers: SentencePiece models and Hugging Face ``tokenizer.json`` files behind one interface.

Two kinds, both read by :func:`load_tokenizer` (or ``Tokenizer(path)``): a sentencepiece ``.model`` and a
Hugging Face ``tokenizer.json`` (or a directory holding one). Reading them (the :class:`Tokenizer` classes, what
a checkpoint was trained with) is ``data/tokenizer_load.py``; training them is ``data/tokenizer_train.py``; both
are importable from here.

Training, deterministic for both kinds (the same input files give a byte-identical result)::

    # sentencepiece: writes out/tok.model
    python -m data.tokenizer --input corpus.jsonl.gz --model-prefix out/tok --vocab-size 4096
    # Hugging Face byte-level BPE: writes out/bpe/tokenizer.json and out/bpe/tokenizer_config.json
    python -m data.tokenizer --input corpus.jsonl.gz --huggingface out/bpe --vocab-size 4096

Exactly one of ``--model-prefix`` and ``--huggingface`` is given; ``--model-type`` (bpe/unigram) is
sentencepiece's only.  The path written is printed; each file is written whole or not at all.  Bad input is one
line ``error: ...`` on stderr and exit code 2, as for train.py (see :func:`main`).
"""

from __future__ import annotations

import argparse
import os
import sys

from config import MAX_VOCAB_SIZE
from data.indexed import DataError
from data.tokenizer_load import (
    CONVENTIONAL_END_TOKENS,
    HF_CONFIG_FILE,
    HF_FILE,
    HF_SPECIAL_TOKENS_FILE,
    SENTENCEPIECE_FILE,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    check_trained_with,
    find_model_file,
    find_tokenizer,
    load_tokenizer,
    tokenizer_class,
    trained_with,
)
from data.tokenizer_train import (
    HF_END_TOKEN,
    HF_MIN_VOCAB,
    SPM_MIN_VOCAB,
    check_model_prefix,
    check_output_dir,
    check_text_file,
    check_vocab_size,
    read_texts,
    train_hf_tokenizer,
    train_tokenizer,
)

__all__ = ["CONVENTIONAL_END_TOKENS", "HF_CONFIG_FILE", "HF_END_TOKEN", "HF_FILE", "HF_SPECIAL_TOKENS_FILE",
           "SENTENCEPIECE_FILE", "HFTokenizer", "SentencePieceTokenizer", "Tokenizer", "check_trained_with",
           "find_model_file", "find_tokenizer", "load_tokenizer", "main", "read_texts", "tokenizer_class",
           "train_hf_tokenizer", "train_tokenizer", "trained_with"]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: train a tokenizer and print where it was written. Bad input (an input file that is
    missing, a directory, unreadable, not UTF-8 or holds no text; a ``--vocab-size`` out of range; an output that
    cannot be written; a usage error) is one line ``error: ...`` on stderr and exit code 2, as for train.py and
    ``python -m data.preprocess``; nothing is written then."""
    parser = _Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help=".txt/.jsonl/.json[.gz] files")
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("--model-prefix", help="sentencepiece: writes <prefix>.model")
    out.add_argument("--huggingface", metavar="OUTPUT_DIR",
                     help="byte-level BPE: writes OUTPUT_DIR/tokenizer.json and tokenizer_config.json")
    parser.add_argument("--vocab-size", type=int, required=True,
                        help=f"{HF_MIN_VOCAB} (byte-level BPE) or {SPM_MIN_VOCAB} (sentencepiece) to {MAX_VOCAB_SIZE}")
    parser.add_argument("--text-key", default="text", help="JSON field holding the text")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], help="sentencepiece only (default bpe)")
    args = parser.parse_args(argv)
    hf = args.huggingface is not None
    if hf and args.model_type is not None:
        parser.error("--model-type is for sentencepiece (--model-prefix); --huggingface trains a byte-level BPE")
    try:
        for path in args.input:
            check_text_file(path)
        if hf:  # the options named in the one line; the trainers check the same again
            check_vocab_size(args.vocab_size, "huggingface", "--vocab-size")
            check_output_dir(args.huggingface, "--huggingface")
            written = train_hf_tokenizer(args.input, args.huggingface, args.vocab_size, text_key=args.text_key)
        else:
            check_vocab_size(args.vocab_size, "sentencepiece", "--vocab-size")
            check_model_prefix(args.model_prefix, "--model-prefix")
            written = train_tokenizer(args.input, args.model_prefix, args.vocab_size, text_key=args.text_key,
                                      model_type=args.model_type or "bpe")
    except DataError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except OSError as err:  # writing the output: no permission, a full disk
        if err.filename is None:
            raise
        print(f"error: {os.fsdecode(err.filename)}: {err.strerror or err}", file=sys.stderr)
        return 2
    print(written)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's usage errors as one line ``error: ...`` and exit code 2 (as ``python -m data.preprocess``)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"error: {' '.join(message.split())} (see python -m data.tokenizer --help)\n")


if __name__ == "__main__":
    sys.exit(main())
