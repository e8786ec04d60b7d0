"""Build the shipped sample corpus ``data/sample/`` offline and deterministically.

The text is real English documentation installed with CPython (PSF licence):
the ``pydoc_data.topics`` help texts and the docstrings of a fixed, sorted list
of standard-library modules (their classes, functions and methods), read with
``inspect.getdoc``, short ones skipped and exact duplicates dropped.  Texts
are cut at paragraph breaks into documents of roughly 500-3000 characters.

Outputs in ``--output-dir`` (default ``data/sample``):

* ``corpus.jsonl.gz`` - the documents, one ``{"text": ...}`` per line;
* ``tokenizer.model`` - SentencePiece BPE model, vocabulary 4096;
* ``sample_text_document.bin/.idx`` - the tokenized corpus;
* ``bpe/tokenizer.json`` + ``bpe/tokenizer_config.json`` - a Hugging Face byte-level BPE,
  vocabulary 4096 (``data.tokenizer.train_hf_tokenizer``);
* ``bpe_text_document.bin/.idx`` - the corpus tokenized with it;
* ``README.md`` - provenance and counts.

Docstrings vary between Python versions, so the committed files, not this
script, are the reference; the README records the Python that made them.

Usage (from the repository root): ``python scripts/make_sample_corpus.py``
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import json
import os
import platform
import re
import sys
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.preprocess import preprocess
from data.tokenizer import train_hf_tokenizer, train_tokenizer

MODULES = sorted(
    """
    _collections_abc _pydecimal _pyio _strptime abc argparse array ast asyncio.base_events
    asyncio.events asyncio.futures asyncio.locks asyncio.protocols asyncio.queues
    asyncio.runners asyncio.streams asyncio.subprocess asyncio.tasks asyncio.transports
    base64 bdb binascii bisect builtins bz2 calendar cmd code codecs collections
    collections.abc colorsys concurrent.futures configparser contextlib contextvars copy
    copyreg csv ctypes dataclasses datetime decimal difflib dis doctest email._header_value_parser
    email._policybase email.charset email.feedparser email.generator email.header
    email.headerregistry email.message email.parser email.policy email.utils enum filecmp
    fileinput fnmatch fractions ftplib functools gc getopt gettext glob graphlib gzip hashlib
    heapq hmac html.parser http.client http.cookiejar http.cookies http.server imaplib
    importlib.abc importlib.machinery importlib.metadata importlib.resources importlib.util
    inspect io ipaddress itertools json json.decoder json.encoder linecache locale logging
    logging.config logging.handlers lzma mailbox math mimetypes mmap modulefinder
    multiprocessing.connection multiprocessing.context multiprocessing.managers
    multiprocessing.pool multiprocessing.queues multiprocessing.shared_memory
    multiprocessing.synchronize netrc numbers operator optparse os pathlib pdb pickle
    pickletools pkgutil platform plistlib poplib posixpath pprint profile pstats py_compile
    pydoc queue quopri random re reprlib rlcompleter runpy sched secrets select selectors
    shelve shlex shutil signal site smtplib socket socketserver sqlite3 ssl stat statistics
    string struct subprocess symtable sys sysconfig tabnanny tarfile tempfile textwrap
    threading time timeit token tokenize tomllib trace traceback tracemalloc types typing
    unicodedata unittest.case unittest.loader unittest.main unittest.mock unittest.result
    unittest.runner unittest.suite urllib.error urllib.parse urllib.request urllib.response
    urllib.robotparser uuid warnings wave weakref wsgiref.handlers wsgiref.headers
    wsgiref.simple_server wsgiref.util wsgiref.validate xml.dom.minidom xml.dom.pulldom
    xml.etree.ElementTree xml.sax.handler xml.sax.saxutils xml.sax.xmlreader xmlrpc.client
    xmlrpc.server zipapp zipfile zipimport zlib zoneinfo
""".split()
)
MIN_DOCSTRING_CHARS = 100
MIN_DOC_CHARS = 500
MAX_DOC_CHARS = 3000
VOCAB_SIZE = 4096


def topic_texts() -> Iterator[str]:
    """The pydoc help topics, in sorted topic order."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]


def documented_objects(module_name: str) -> Iterator[tuple[str, object]]:
    """The module, then the classes and functions it defines, each class followed by its methods.

    Names are visited in sorted order; module attributes named ``__*`` are skipped.
    """
    module = importlib.import_module(module_name)
    yield module_name, module
    for name, obj in sorted(vars(module).items()):
        defined_here = getattr(obj, "__module__", None) == module.__name__
        if name.startswith("__") or not defined_here:
            continue
        if inspect.isroutine(obj):
            yield f"{module_name}.{name}", obj
        elif inspect.isclass(obj):
            yield f"{module_name}.{name}", obj
            for member_name, member in sorted(vars(obj).items()):
                if inspect.isroutine(member) or isinstance(member, property):
                    yield f"{module_name}.{name}.{member_name}", member


def docstring_texts() -> Iterator[str]:
    """``"<qualified name>\\n\\n<docstring>"`` for each long enough, not yet seen docstring."""
    seen: set[str] = set()
    for module_name in MODULES:
        try:
            objects = list(documented_objects(module_name))
        except ImportError:  # not built on this platform
            continue
        for qualname, obj in objects:
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS and doc not in seen:
                seen.add(doc)
                yield f"{qualname}\n\n{doc}"


def _pieces(paragraph: str) -> Iterator[str]:
    """``paragraph`` cut at line breaks (huge lines hard) into <= MAX_DOC_CHARS pieces."""
    piece = ""
    for line in paragraph.splitlines(keepends=True):
        for start in range(0, len(line), MAX_DOC_CHARS):
            part = line[start : start + MAX_DOC_CHARS]
            if piece and len(piece) + len(part) > MAX_DOC_CHARS:
                yield piece.rstrip("\n")
                piece = ""
            piece += part
    if piece.strip():
        yield piece.rstrip("\n")


def pack_documents(sections: Iterator[str]) -> Iterator[str]:
    """Join paragraphs into documents of MIN_DOC_CHARS..MAX_DOC_CHARS characters.

    A document ends before a paragraph that would push it past MAX_DOC_CHARS,
    and at the end of a section once it has at least MIN_DOC_CHARS.
    """
    paragraphs: list[str] = []
    length = 0
    for section in sections:
        for paragraph in re.split(r"\n\s*\n", section.strip("\n")):
            for piece in _pieces(paragraph):
                if paragraphs and length + 2 + len(piece) > MAX_DOC_CHARS:
                    yield "\n\n".join(paragraphs)
                    paragraphs, length = [], 0
                paragraphs.append(piece)
                length += len(piece) + 2
        if length >= MIN_DOC_CHARS:
            yield "\n\n".join(paragraphs)
            paragraphs, length = [], 0
    if paragraphs:
        yield "\n\n".join(paragraphs)


def write_corpus(path: str, documents: list[str]) -> None:
    """Write JSON Lines, gzip-compressed with a fixed header (no name, mtime 0)."""
    with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz:
        for text in documents:
            gz.write((json.dumps({"text": text}, ensure_ascii=False) + "\n").encode("utf-8"))


def write_readme(
    out_dir: str, documents: list[str], stats: dict[str, int], bpe_stats: dict[str, int]
) -> None:
    """Describe where the corpus comes from and what the files hold."""
    files = [
        "corpus.jsonl.gz",
        "tokenizer.model",
        "sample_text_document.bin",
        "sample_text_document.idx",
        "bpe/tokenizer.json",
        "bpe/tokenizer_config.json",
        "bpe_text_document.bin",
        "bpe_text_document.idx",
    ]
    sizes = "\n".join(
        f"| `{name}` | {os.path.getsize(os.path.join(out_dir, name)):,} |" for name in files
    )
    text = f"""# Sample corpus

A small real-English corpus for tests, smoke runs and examples, built offline by
`scripts/make_sample_corpus.py` (run from the repository root).

**Source.** Documentation installed with CPython {platform.python_version()}: the
`pydoc_data.topics` help texts and the docstrings (`inspect.getdoc`) of the
modules, classes, functions and methods of {len(MODULES)} standard-library modules
listed in the script; docstrings under {MIN_DOCSTRING_CHARS} characters and exact
duplicates are dropped. Texts are cut at paragraph breaks into documents of about
{MIN_DOC_CHARS}-{MAX_DOC_CHARS} characters.

**Licence.** Python Software Foundation License (the text is part of CPython).

**Contents.**

| file | bytes |
|---|---|
{sizes}

* `corpus.jsonl.gz`: {len(documents):,} documents, {sum(map(len, documents)):,} characters,
  one JSON object `{{"text": ...}}` per line.
* `tokenizer.model`: SentencePiece BPE, vocabulary {VOCAB_SIZE}, byte fallback,
  `<unk>`=0, `<s>`=1, `</s>`=2 (end of document), trained on the whole corpus
  (`data/tokenizer.py`).
* `sample_text_document.bin/.idx`: the corpus tokenized by `data/preprocess.py`,
  {stats["docs"]:,} documents, {stats["tokens"]:,} tokens including one EOD per document
  (uint16 ids); the index (version 3) records `tokenizer.model`.
* `bpe/tokenizer.json`, `bpe/tokenizer_config.json`: a Hugging Face byte-level BPE
  (the `tokenizers` library), vocabulary {VOCAB_SIZE}, `<|endoftext|>`=0 (end of document,
  no bos), trained on the whole corpus by `data.tokenizer.train_hf_tokenizer`
  (`python -m data.tokenizer --input corpus.jsonl.gz --huggingface bpe --vocab-size {VOCAB_SIZE}`);
  `transformers.AutoTokenizer.from_pretrained("data/sample/bpe")` loads it.
* `bpe_text_document.bin/.idx`: the corpus tokenized with `bpe/` by `data/preprocess.py`
  (`--tokenizer data/sample/bpe`), {bpe_stats["docs"]:,} documents, {bpe_stats["tokens"]:,} tokens
  including one EOD per document (uint16 ids); the index records `bpe`.
  Train on it with `data.paths=[data/sample/bpe_text_document] data.tokenizer=data/sample/bpe`.

Docstrings differ between Python versions, so rerunning the script elsewhere may
give different files; the committed files are the reference. The tests check that
preprocessing `corpus.jsonl.gz` with `tokenizer.model` reproduces the `.bin/.idx`
byte for byte, and the same for `bpe/` (trained again) and `bpe_text_document.bin/.idx`.
"""
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> None:
    """Build every file of the sample corpus and print a summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default=os.path.join("data", "sample"))
    out_dir = parser.parse_args(argv).output_dir
    from scripts._cli import output_dir

    output_dir(out_dir, "--output-dir")  # a file in the way: one line, exit code 2 (scripts/_cli.py)
    os.makedirs(out_dir, exist_ok=True)

    documents = list(pack_documents(topic_texts())) + list(pack_documents(docstring_texts()))
    corpus = os.path.join(out_dir, "corpus.jsonl.gz")
    write_corpus(corpus, documents)
    model = train_tokenizer([corpus], os.path.join(out_dir, "tokenizer"), VOCAB_SIZE)
    stats = preprocess([corpus], os.path.join(out_dir, "sample_text_document"), model)
    bpe = train_hf_tokenizer([corpus], os.path.join(out_dir, "bpe"), VOCAB_SIZE)
    bpe_stats = preprocess([corpus], os.path.join(out_dir, "bpe_text_document"), bpe)
    write_readme(out_dir, documents, stats, bpe_stats)
    print(f"{len(documents)} documents, {sum(map(len, documents))} characters, {stats}, byte-level BPE {bpe_stats}")


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
