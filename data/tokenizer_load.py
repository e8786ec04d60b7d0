"""Reading tokenizers: SentencePiece models and Hugging Face ``tokenizer.json`` files behind one interface.

Two kinds are read, both through :func:`load_tokenizer` (or ``Tokenizer(path)``, which is the same):

* **sentencepiece**: a ``.model`` file (or a directory holding ``tokenizer.model``), wrapped by
  :class:`SentencePieceTokenizer`.  Models trained here (``data/tokenizer_train.py``) are GPT-style: identity
  normalisation (text is kept verbatim, so ``decode(encode(text)) == text``), runs of spaces preserved, digits
  split, unseen characters encoded as UTF-8 bytes (``byte_fallback``); special ids are fixed: ``<unk>`` = 0,
  ``<s>`` (bos) = 1, ``</s>`` (eos) = 2, no padding piece; the eos id doubles as the end-of-document (EOD) token.
* **huggingface**: a ``tokenizer.json`` of the ``tokenizers`` library (any file name ending ``.json``,
  or a directory holding ``tokenizer.json``, as Llama 3 and Qwen2.5 ship), wrapped by
  :class:`HFTokenizer`.  ``encode`` gives the ids ``transformers.AutoTokenizer.from_pretrained(dir)(text)
  ["input_ids"]`` gives (the file's normalizer, pre-tokenizer, model and post-processor; special tokens
  added, as Megatron-LM's ``HuggingFaceTokenizer`` does); see :class:`HFTokenizer` for where the special
  tokens come from and what ``decode`` does.

A directory holding both files is read as Hugging Face (``tokenizer.json`` first).  Every problem (a
missing path, an unreadable or invalid file, a directory without a tokenizer, no end-of-document token)
is a :class:`~data.indexed.DataError` of one line naming the path and why.

Both kinds share: ``path`` (as given), ``model_path`` (the main file), ``kind``, ``vocab_size`` (one
more than the largest id), ``eod_id`` = ``eos_id``, ``bos_id`` (-1 when none), ``bos_token`` /
``eos_token`` (strings, None when absent), ``appends_eod`` (``encode`` already ends every encoding with
the eod id), ``files`` (what a copy of the tokenizer needs), ``digest`` (sha256 identity) and ``info``
(the record a ``.idx`` keeps of the tokenizer that made it, see ``data/indexed.py``).

Training tokenizers is ``data/tokenizer_train.py``; ``data/tokenizer.py`` offers both (and the command line).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import sentencepiece as spm
import tokenizers

from data.indexed import DataError

HF_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
HF_SPECIAL_TOKENS_FILE = "special_tokens_map.json"
SENTENCEPIECE_FILE = "tokenizer.model"
CONVENTIONAL_END_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
"""End-of-document candidates, in this order, among a ``tokenizer.json``'s added special tokens when neither
``tokenizer_config.json`` nor ``special_tokens_map.json`` names an ``eos_token``."""


def find_model_file(name: str, override: Optional[str] = None) -> Optional[Path]:
    """The sentencepiece model a script should use: ``override`` (e.g. ``--tokenizer``) if given, else a
    checkpoint's ``data.tokenizer`` as written or relative to the repository root; None if it is not a file."""
    repo = Path(__file__).resolve().parents[1]
    for candidate in ([Path(override)] if override else [Path(name), repo / name]):
        if candidate.is_file():
            return candidate
    return None


def find_tokenizer(name: str, override: Optional[str] = None) -> Optional[Path]:
    """Like :func:`find_model_file`, for any tokenizer :func:`load_tokenizer` reads: a file (``.model``,
    ``tokenizer.json``) or a directory; None if there is nothing at the path."""
    repo = Path(__file__).resolve().parents[1]
    for candidate in ([Path(override)] if override else [Path(name), repo / name]):
        if candidate.is_file() or candidate.is_dir():
            return candidate
    return None


def _repo_path(name: str) -> Optional[Path]:
    """``name`` as given when something is there, else relative to the repository root; None otherwise."""
    repo = Path(__file__).resolve().parents[1]
    for candidate in (Path(name), repo / name):
        if candidate.exists():
            return candidate
    return None


def trained_with(config: Any, data: Any) -> list[tuple[str, str]]:
    """What still tells, by content, which tokenizer a checkpoint was trained with: ``(where, digest)`` of the
    tokenizer its config's ``data.tokenizer`` names, where that path still holds one, and of the tokenizer record
    (``data/indexed.py``, version 3) of each data file its run read (meta.json's ``data.files``) whose ``.idx`` is
    still the one it read (the recorded sha256). ``config`` and ``data`` are meta.json's ``config`` and ``data``;
    whatever is missing, unreadable or of the wrong type is skipped (these are clues, not inputs)."""
    from data.indexed import IndexedDataset

    found: list[tuple[str, str]] = []
    section = config.get("data") if isinstance(config, dict) else None
    name = section.get("tokenizer") if isinstance(section, dict) else None
    path = find_tokenizer(name) if isinstance(name, str) and name.strip() else None
    if path is not None:
        try:
            found.append((f"its data.tokenizer {name}", load_tokenizer(str(path)).digest))
        except (DataError, OSError):
            pass
    files = data.get("files") if isinstance(data, dict) else None
    for entry in files if isinstance(files, list) else []:
        prefix = entry.get("path") if isinstance(entry, dict) else None
        content = entry.get("content") if isinstance(entry, dict) else None
        recorded = content.get("idx_sha256") if isinstance(content, dict) else None
        where = _repo_path(prefix + ".idx") if isinstance(prefix, str) and prefix else None
        if where is None or not isinstance(recorded, str):
            continue
        try:
            h = hashlib.sha256()
            with open(where, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
            if h.hexdigest() != recorded:
                continue  # not the data the run read any more
            record = IndexedDataset(str(where)[:-len(".idx")]).tokenizer_info
        except (DataError, OSError, ValueError):
            continue
        if record is not None:
            found.append((f"the tokenizer that made its data {prefix} ({record['name']!r})", record["digest"]))
    return found


def check_trained_with(tok: Tokenizer, config: Any, data: Any, what: str, setting: str) -> bool:
    """Refuse ``tok`` (given as ``setting``, e.g. ``--tokenizer``) for a checkpoint (``what``) trained with another
    tokenizer, as training refuses data made with another one: a :class:`DataError` of one line naming both when a
    record of :func:`trained_with` has another digest. Compared by content: the same files moved or copied pass.
    Returns whether anything could be compared (False: nothing left tells which tokenizer it was)."""
    found = trained_with(config, data)
    for where, digest in found:
        if digest != tok.digest:
            raise DataError(f"{setting} {tok.path} is not the tokenizer {what} was trained with: {where} is "
                            f"another (digest {digest[:12]}... vs {tok.digest[:12]}...); give that tokenizer "
                            "(a copy anywhere will do)")
    return bool(found)


def _first_line(err: BaseException) -> str:
    """An exception's message on one line (its first), or its class name when it has none."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _read_bytes(path: str) -> bytes:
    """A file's bytes; DataError naming it when it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from err


def tokenizer_class(path: str) -> type[Tokenizer]:
    """Which class reads ``path``: a directory by the file it holds (``tokenizer.json`` first), a file
    ending ``.json`` as Hugging Face, any other file as sentencepiece."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, HF_FILE)):
            return HFTokenizer
        if os.path.isfile(os.path.join(path, SENTENCEPIECE_FILE)):
            return SentencePieceTokenizer
        raise DataError(f"{path}: directory holds no {HF_FILE} (Hugging Face) and no {SENTENCEPIECE_FILE} "
                        "(sentencepiece)")
    if not os.path.exists(path):
        raise DataError(f"{path}: tokenizer not found (give a sentencepiece .model, a tokenizer.json or a "
                        "directory holding one)")
    return HFTokenizer if path.endswith(".json") else SentencePieceTokenizer


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer at ``path``: a sentencepiece ``.model``, a ``tokenizer.json`` (any ``*.json`` file of
    the ``tokenizers`` library) or a directory holding ``tokenizer.json`` (else ``tokenizer.model``)."""
    return tokenizer_class(str(path))(str(path))


class Tokenizer:
    """What every tokenizer offers the pipeline; ``Tokenizer(path)`` is :func:`load_tokenizer`.

    Calling the base class picks the subclass for ``path`` (:func:`tokenizer_class`), so code written
    for sentencepiece models (``Tokenizer("tok.model")``) reads every kind.
    """

    kind: str
    """``"sentencepiece"`` or ``"huggingface"``."""
    path: str
    """The path as given (a file or a directory)."""
    model_path: str
    """The main file: the ``.model`` or the ``tokenizer.json``."""
    files: list[str]
    """The files that make up the tokenizer, for copying it (the main file first)."""
    digest: str
    """SHA-256 (hex) identifying the tokenizer, the same wherever its files lie."""
    bos_token: Optional[str]
    """The beginning-of-sequence token's string (None when there is none)."""
    eos_token: Optional[str]
    """The end-of-sequence (and end-of-document) token's string."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Tokenizer:
        if cls is Tokenizer:
            path = args[0] if args else kwargs.get("path", kwargs.get("model_path"))
            cls = tokenizer_class(str(path))
        return super().__new__(cls)

    @property
    def vocab_size(self) -> int:
        """One more than the largest id."""
        raise NotImplementedError

    @property
    def eod_id(self) -> int:
        """End-of-document id: the eos token's id."""
        raise NotImplementedError

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id (-1 when the tokenizer has none)."""
        raise NotImplementedError

    @property
    def eos_id(self) -> int:
        """End-of-sequence id; the same as :attr:`eod_id`."""
        return self.eod_id

    @property
    def appends_eod(self) -> bool:
        """Whether :meth:`encode` already ends every encoding with :attr:`eod_id` (a post-processor that
        appends eos); preprocessing then appends no second one."""
        return False

    @property
    def name(self) -> str:
        """The file or directory name of :attr:`path` (what a ``.idx`` records)."""
        return os.path.basename(os.path.normpath(self.path))

    @property
    def info(self) -> dict[str, Any]:
        """The record a ``.idx`` (version 3) keeps of the tokenizer that made it."""
        return {"kind": self.kind, "digest": self.digest, "name": self.name, "vocab_size": self.vocab_size,
                "eod_id": self.eod_id}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text of ``texts``."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids (numpy integer arrays are accepted)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"


class SentencePieceTokenizer(Tokenizer):
    """A loaded SentencePiece model with the few operations the pipeline needs."""

    kind = "sentencepiece"

    def __init__(self, model_path: str) -> None:
        self.path = model_path
        if os.path.isdir(model_path):
            model_path = os.path.join(model_path, SENTENCEPIECE_FILE)
        if not os.path.isfile(model_path):
            raise DataError(f"{model_path}: tokenizer model not found")
        self.model_path = model_path
        data = _read_bytes(model_path)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except (OSError, RuntimeError) as err:
            raise DataError(f"{model_path}: not a valid SentencePiece model ({_first_line(err)})") from err
        if self._sp.eos_id() < 0:
            raise DataError(f"{model_path}: model has no eos piece to use as end-of-document")
        self.digest = hashlib.sha256(data).hexdigest()
        """SHA-256 of the ``.model`` bytes."""
        self.files = [model_path]
        self.eos_token = self._sp.id_to_piece(self._sp.eos_id())
        self.bos_token = self._sp.id_to_piece(self._sp.bos_id()) if self._sp.bos_id() >= 0 else None

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


def _read_json_object(path: str) -> Optional[dict[str, Any]]:
    """The JSON object in ``path``; None when there is no such file; DataError when it is not one."""
    if not os.path.isfile(path):
        return None
    try:
        doc = json.loads(_read_bytes(path).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({_first_line(err)})") from err
    if not isinstance(doc, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def _token_string(doc: Optional[dict[str, Any]], key: str, source: str) -> Optional[str]:
    """The token ``doc[key]`` names: a string, an AddedToken object's ``content``, or None (absent/null)."""
    if doc is None or doc.get(key) is None:
        return None
    value = doc[key]
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        value = value["content"]
    if not isinstance(value, str) or not value:
        raise DataError(f"{source}: {key} must be a token string, null or an object with \"content\"; got {value!r}")
    return value


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` library) with the pipeline's operations.

    ``path`` is the ``tokenizer.json`` (any ``*.json`` file name) or a directory holding it.  The file's
    bytes are read once, hashed and parsed (``tokenizers.Tokenizer.from_str`` of exactly those bytes).
    Truncation and padding stored in the file are switched off: documents are never cut or padded
    (``AutoTokenizer(text)`` ignores them as well).

    **Special tokens** come from the files beside the ``tokenizer.json``: ``eos_token`` / ``bos_token``
    of ``tokenizer_config.json`` (a string, null, or an AddedToken object with ``"content"``); where it
    names none (no file, no key, null), those of ``special_tokens_map.json``; for eos only, then the first
    of :data:`CONVENTIONAL_END_TOKENS` that is an added special token of the ``tokenizer.json``; else the
    tokenizer is refused (no end-of-document token).  A named token missing from the vocabulary is
    refused (transformers would add it as a new id).  The end of document is the eos token.  (Where both
    files name a different token, transformers lets ``special_tokens_map.json`` win; here the config does.)

    **Encoding** applies the file's whole pipeline, post-processor included (``add_special_tokens=True``),
    as ``AutoTokenizer`` does.  ``add_bos_token`` / ``add_eos_token`` of ``tokenizer_config.json`` are not
    read: transformers 5.23 ignores them too when it loads a ``tokenizer.json`` (the file's post-processor
    decides).  Caveat: a config naming a model-specific class (``Qwen2Tokenizer``, ``LlamaTokenizer``, ...)
    makes transformers 5 rebuild the normalizer and pre-tokenizer in code from the vocabulary and merges;
    ids agree whenever the file holds that class's own pipeline, as shipped checkpoints' files do.

    **Decoding** inverts encoding: the tokens the post-processor adds around every encoding (a leading
    bos, a trailing eos) are dropped when the ids start / end with them, and everything else is decoded
    with ``skip_special_tokens=False``, so special tokens inside the ids (an EOD between documents, a
    ``<|endoftext|>`` typed in the text) read back as their text and ``decode(encode(text)) == text`` for
    byte-level tokenizers.

    **Digest**: SHA-256 of the ``tokenizer.json`` bytes and the resolved bos/eos ids: the same for the
    file and for its directory.
    """

    kind = "huggingface"

    def __init__(self, path: str) -> None:
        self.path = path
        self.model_path = os.path.join(path, HF_FILE) if os.path.isdir(path) else path
        if not os.path.isfile(self.model_path):
            raise DataError(f"{self.model_path}: tokenizer not found")
        raw = _read_bytes(self.model_path)
        try:
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise DataError(f"{self.model_path}: not a tokenizers JSON file (not UTF-8 text: {err.reason})") from err
        except Exception as err:  # tokenizers raises plain Exception for any parse error
            raise DataError(f"{self.model_path}: not a valid tokenizers JSON file ({_first_line(err)})") from err
        self._tok.no_truncation()
        self._tok.no_padding()
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        if not self._vocab:
            raise DataError(f"{self.model_path}: the tokenizer has an empty vocabulary")

        directory = os.path.dirname(self.model_path)
        config_path = os.path.join(directory, HF_CONFIG_FILE)
        map_path = os.path.join(directory, HF_SPECIAL_TOKENS_FILE)
        config = _read_json_object(config_path)
        special_map = _read_json_object(map_path)
        beside = ((config_path, config), (map_path, special_map))
        self.files = [self.model_path] + [file for file, doc in beside if doc is not None]

        eos = self._special_token("eos_token", config, config_path, special_map, map_path)
        if eos is None:
            eos = self._conventional_end_token()
        if eos is None:
            raise DataError(f"{self.model_path}: names no end-of-document token (give it a {HF_CONFIG_FILE} "
                            "with eos_token)")
        bos = self._special_token("bos_token", config, config_path, special_map, map_path)
        self.eos_token, self.bos_token = eos[0], (bos[0] if bos else None)
        self._eos_id = self._id_of(*eos, "eos_token")
        self._bos_id = self._id_of(*bos, "bos_token") if bos else -1
        self._prefix, self._suffix = self._added_around()

        h = hashlib.sha256(b"huggingface-tokenizer-v1\0")
        h.update(raw)
        h.update(f"\0bos_id={self._bos_id}\0eos_id={self._eos_id}".encode())
        self.digest = h.hexdigest()

    def _special_token(self, key: str, config: Optional[dict[str, Any]], config_path: str,
                       special_map: Optional[dict[str, Any]], map_path: str) -> Optional[tuple[str, str]]:
        """(token, file naming it) for ``key`` from the config, else from the special-tokens map."""
        for doc, source in ((config, config_path), (special_map, map_path)):
            token = _token_string(doc, key, source)
            if token is not None:
                return token, source
        return None

    def _conventional_end_token(self) -> Optional[tuple[str, str]]:
        """(token, source) of the first :data:`CONVENTIONAL_END_TOKENS` among the added special tokens."""
        added = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        for token in CONVENTIONAL_END_TOKENS:
            if token in added:
                return token, self.model_path
        return None

    def _id_of(self, token: str, source: str, key: str) -> int:
        """The id of a special token; DataError naming it and its source when it is not in the vocabulary."""
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise DataError(f"{source}: {key} {token!r} is not in the vocabulary of {self.model_path}")
        return token_id

    def _added_around(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after every encoding, found on a probe text."""
        for probe in ("a", "The", "0", ".", " "):
            encoding = self._tok.encode(probe)
            content = [i for i, special in enumerate(encoding.special_tokens_mask) if not special]
            if content:
                return encoding.ids[: content[0]], encoding.ids[content[-1] + 1 :]
        raise DataError(f"{self.model_path}: encodes none of the probe texts 'a', 'The', '0', '.', ' ' to a "
                        "token, so what its post-processor adds cannot be told")

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (``get_vocab_size(with_added_tokens=True)`` when ids have no gaps)."""
        return max(self._vocab.values()) + 1

    @property
    def eod_id(self) -> int:
        """End-of-document id: the eos token's id."""
        return self._eos_id

    @property
    def bos_id(self) -> int:
        """The bos token's id (-1 when none is named)."""
        return self._bos_id

    @property
    def appends_eod(self) -> bool:
        """Whether the post-processor ends every encoding with the eod id."""
        return bool(self._suffix) and self._suffix[-1] == self._eos_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, the post-processor's special tokens included."""
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text of ``texts`` (threaded in Rust unless ``TOKENIZERS_PARALLELISM=false``)."""
        return [encoding.ids for encoding in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, without the post-processor's leading/trailing additions (see the class doc)."""
        ids = [int(i) for i in ids]
        if self._prefix and ids[: len(self._prefix)] == self._prefix:
            ids = ids[len(self._prefix) :]
        if self._suffix and ids[-len(self._suffix) :] == self._suffix:
            ids = ids[: -len(self._suffix)]
        return self._tok.decode(ids, skip_special_tokens=False)

