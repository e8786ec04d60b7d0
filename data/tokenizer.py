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
sentencepiece's only.  The path written is printed.
"""

from __future__ import annotations

import argparse

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
from data.tokenizer_train import HF_END_TOKEN, read_texts, train_hf_tokenizer, train_tokenizer

__all__ = ["CONVENTIONAL_END_TOKENS", "HF_CONFIG_FILE", "HF_END_TOKEN", "HF_FILE", "HF_SPECIAL_TOKENS_FILE",
           "SENTENCEPIECE_FILE", "HFTokenizer", "SentencePieceTokenizer", "Tokenizer", "check_trained_with",
           "find_model_file", "find_tokenizer", "load_tokenizer", "main", "read_texts", "tokenizer_class",
           "train_hf_tokenizer", "train_tokenizer", "trained_with"]


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: train a tokenizer and print where it was written."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help=".txt/.jsonl/.json[.gz] files")
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("--model-prefix", help="sentencepiece: writes <prefix>.model")
    out.add_argument("--huggingface", metavar="OUTPUT_DIR",
                     help="byte-level BPE: writes OUTPUT_DIR/tokenizer.json and tokenizer_config.json")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--text-key", default="text", help="JSON field holding the text")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], help="sentencepiece only (default bpe)")
    args = parser.parse_args(argv)
    if args.huggingface is not None:
        if args.model_type is not None:
            parser.error("--model-type is for sentencepiece (--model-prefix); --huggingface trains a byte-level BPE")
        print(train_hf_tokenizer(args.input, args.huggingface, args.vocab_size, text_key=args.text_key))
        return
    print(
        train_tokenizer(
            args.input,
            args.model_prefix,
            args.vocab_size,
            text_key=args.text_key,
            model_type=args.model_type or "bpe",
        )
    )


if __name__ == "__main__":
    main()
