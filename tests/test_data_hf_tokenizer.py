"""Hugging Face tokenizer.json files in the data pipeline, checked against transformers' AutoTokenizer.

A tiny byte-level BPE is trained here on the bundled corpus; variants of it (a Llama 3 style bos
post-processor, a Qwen2-style pipeline loaded through transformers' own class, an eos-appending
post-processor, special tokens named in each of the ways transformers reads) are built with the
``tokenizers`` library.  Every id and special token is compared with
``transformers.AutoTokenizer.from_pretrained(dir)``, never with our own code.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import transformers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors, trainers

import train
from config import load_config
from data.gpt_dataset import check_tokenizer
from data.indexed import DataError, IndexedDataset, IndexedDatasetWriter
from data.preprocess import preprocess
from data.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
    train_hf_tokenizer,
)
from tests.as_python import forked_python
from tests.test_train_e2e import FAST, records, run_train
from training.trainer import check_data

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data" / "sample"
CORPUS = SAMPLE / "corpus.jsonl.gz"
SP_MODEL = SAMPLE / "tokenizer.model"
VOCAB = 512
END = "<|endoftext|>"
BEGIN = "<|begin_of_text|>"
EDGE_CASES = [
    "",
    " ",
    "   ",
    "  two leading spaces, trailing too  ",
    "\n\nblank lines\n\n\n",
    "tabs\tand\r\nwindows line ends\r\n",
    "no-break\u00a0space, thin\u2009space, ideographic\u3000space, line\u2028separator",
    "zero\u200bwidth\u200djoiner and \ufeffbyte order mark",
    "accents: é (one code point) vs e\u0301 (combining), ß, Ångström, naïve",
    "中文 日本語のテキスト 한국어 текст по-русски العربية עברית",
    "emoji 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 🏳️‍🌈 and a lone 🤖",
    "the end token inside text: <|endoftext|> and a near miss <|endoftext| >",
    "digits 1234567890, 3.14159, 1e-10, 0x1F and 2024-06-01",
    "contractions: don't, it's, we're, they've, I'll, she'd, I'M",
    "control \x00 \x07 \x1b[31mred\x1b[0m characters",
    "x" * 3000,
    "a" + " " * 200 + "b",
    "<|begin_of_text|> typed by hand",
]


def corpus_texts() -> list[str]:
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


TEXTS = corpus_texts()


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def write_json(path: Path, doc: object) -> None:
    path.write_text(json.dumps(doc), encoding="utf-8")


def auto(directory: Path):
    """transformers' tokenizer for a directory (the reference)."""
    return transformers.AutoTokenizer.from_pretrained(str(directory))


# ---- tokenizers built for the tests --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_tok")


@pytest.fixture(scope="module")
def bpe(work: Path) -> Path:
    """Our trainer's tiny byte-level BPE on the bundled corpus: tokenizer.json + tokenizer_config.json."""
    return Path(train_hf_tokenizer([str(CORPUS)], str(work / "bpe"), VOCAB))


def variant(work: Path, name: str, bpe: Path, config: dict | None, post=None, extra_tokens=(),
            special_map: dict | None = None) -> Path:
    """A copy of ``bpe`` with added special tokens, another post-processor and other config files."""
    out = work / name
    out.mkdir()
    tok = tokenizers.Tokenizer.from_file(str(bpe / "tokenizer.json"))
    if extra_tokens:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_tokens])
    if post is not None:
        tok.post_processor = post(tok)
    tok.save(str(out / "tokenizer.json"))
    if config is not None:
        write_json(out / "tokenizer_config.json", config)
    if special_map is not None:
        write_json(out / "special_tokens_map.json", special_map)
    return out


def llama3_bos(tok: tokenizers.Tokenizer) -> processors.PostProcessor:
    """Llama 3's post-processor: ByteLevel offsets, then a template putting <|begin_of_text|> first."""
    bos = (BEGIN, tok.token_to_id(BEGIN))
    template = processors.TemplateProcessing(single=f"{BEGIN}:0 $A:0", pair=f"{BEGIN}:0 $A:0 {BEGIN}:1 $B:1",
                                             special_tokens=[bos])
    return processors.Sequence([processors.ByteLevel(trim_offsets=False), template])


def eos_after(tok: tokenizers.Tokenizer) -> processors.PostProcessor:
    """A post-processor that ends every encoding with the end token."""
    return processors.TemplateProcessing(single=f"$A:0 {END}:0", pair=f"$A:0 {END}:0 $B:1 {END}:1",
                                         special_tokens=[(END, tok.token_to_id(END))])


@pytest.fixture(scope="module")
def llama(work: Path, bpe: Path) -> Path:
    """Llama 3 style: a bos template; bos/eos named in tokenizer_config.json (eos in AddedToken form)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BEGIN,
              "eos_token": {"__type": "AddedToken", "content": "<|end_of_text|>", "lstrip": False,
                            "normalized": False, "rstrip": False, "single_word": False, "special": True},
              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 20}
    return variant(work, "llama", bpe, config, llama3_bos, extra_tokens=[BEGIN, "<|end_of_text|>"])


@pytest.fixture(scope="module")
def qwen(work: Path) -> Path:
    """Qwen2.5 style: the pipeline of transformers' Qwen2Tokenizer (NFC, its split regex, byte level), loaded by
    transformers through that class (which rebuilds the pipeline in code from the vocabulary and merges)."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[END, "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS[:400], trainer)
    out = work / "qwen"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None,
                                               "eos_token": END, "pad_token": END, "unk_token": None,
                                               "clean_up_tokenization_spaces": False, "errors": "replace"})
    return out


@pytest.fixture(scope="module")
def eos_template(work: Path, bpe: Path) -> Path:
    return variant(work, "eos_template", bpe, json.loads((bpe / "tokenizer_config.json").read_text()), eos_after)


# ---- training ------------------------------------------------------------------------------------------------

def test_trained_tokenizer_loads_in_transformers_and_training_is_deterministic(bpe: Path, tmp_path: Path) -> None:
    reference = auto(bpe)
    assert type(reference).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert (reference.eos_token, reference.eos_token_id, reference.bos_token) == (END, 0, None)
    assert len(reference) == VOCAB
    again = Path(train_hf_tokenizer([str(CORPUS)], str(tmp_path / "again"), VOCAB))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (bpe / name).read_bytes()
    # the command line, in another process with one thread: the same bytes
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "data.tokenizer", "--input", str(CORPUS), "--huggingface",
                           str(tmp_path / "cli"), "--vocab-size", str(VOCAB)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "cli")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "cli" / name).read_bytes() == (bpe / name).read_bytes()


def test_training_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="absent.jsonl: file not found"):
        train_hf_tokenizer([str(tmp_path / "absent.jsonl")], str(tmp_path / "t"), VOCAB)
    with pytest.raises(DataError, match="vocab_size 100 is too small"):
        train_hf_tokenizer([str(CORPUS)], str(tmp_path / "t"), 100)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl: record 2 has no field 'text'"):
        train_hf_tokenizer([str(bad)], str(tmp_path / "t"), VOCAB)
    assert not (tmp_path / "t").exists()


def test_shipped_bpe_sample_is_reproducible(tmp_path: Path) -> None:
    """data/sample/bpe is what the trainer gives on the corpus; bpe_text_document what preprocessing gives."""
    shipped = SAMPLE / "bpe"
    retrained = Path(train_hf_tokenizer([str(CORPUS)], str(tmp_path / "bpe"), 4096))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (retrained / name).read_bytes() == (shipped / name).read_bytes()
    preprocess([str(CORPUS)], str(tmp_path / "again"), str(shipped))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"again{suffix}").read_bytes() == (SAMPLE / f"bpe_text_document{suffix}").read_bytes()
    data = IndexedDataset(str(SAMPLE / "bpe_text_document"))
    reference = auto(shipped)
    assert data.tokenizer_info["name"] == "bpe" and data.tokenizer_info["kind"] == "huggingface"
    for i in (0, 1, 799, 1599):
        assert data.doc(i).tolist() == reference(TEXTS[i])["input_ids"] + [reference.eos_token_id]


# ---- encoding and decoding against transformers --------------------------------------------------------------

@pytest.mark.parametrize("name", ["bpe", "llama", "qwen", "eos_template"])
def test_ids_equal_transformers(request: pytest.FixtureRequest, name: str) -> None:
    directory = request.getfixturevalue(name)
    reference = auto(directory)
    ours = load_tokenizer(str(directory))
    texts = EDGE_CASES + (TEXTS if name == "bpe" else TEXTS[::5])
    expected = [reference(t)["input_ids"] for t in texts]
    assert [ours.encode(t) for t in texts] == expected
    assert ours.encode_batch(texts) == expected
    assert ours.encode_batch([]) == []
    assert ours.vocab_size == len(reference) == tokenizers.Tokenizer.from_file(
        str(directory / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    assert ours.eos_id == ours.eod_id == reference.eos_token_id
    assert ours.bos_id == (-1 if reference.bos_token_id is None else reference.bos_token_id)
    assert (ours.eos_token, ours.bos_token) == (reference.eos_token, reference.bos_token)
    assert ours.appends_eod == (name == "eos_template")


@pytest.mark.parametrize("name", ["bpe", "llama", "qwen", "eos_template"])
def test_decode_inverts_encode(request: pytest.FixtureRequest, name: str) -> None:
    """decode drops only what the post-processor adds around every encoding; the rest reads as transformers
    decodes it (special tokens kept), so the text comes back exactly (Qwen's NFC aside)."""
    directory = request.getfixturevalue(name)
    reference = auto(directory)
    ours = load_tokenizer(str(directory))

    def core(ids: list[int]) -> list[int]:
        """The ids without what the post-processor adds around them."""
        return ids[1:] if name == "llama" else ids[:-1] if name == "eos_template" else ids

    for text in EDGE_CASES + TEXTS[::7]:
        ids = reference(text)["input_ids"]
        decoded = ours.decode(np.array(ids))
        assert decoded == reference.decode(core(ids))
        if name != "qwen":
            assert decoded == text
    assert ours.decode([]) == ""
    # an end of document between two documents reads back as its text
    joined = core(reference("one")["input_ids"]) + [reference.eos_token_id] + core(reference("two")["input_ids"])
    assert ours.decode(joined) == reference.decode(joined) == f"one{reference.eos_token}two"


# ---- loading: every path form, special tokens from each source, errors ----------------------------------------

def test_every_path_form_loads(bpe: Path, tmp_path: Path) -> None:
    as_file, as_dir = load_tokenizer(str(bpe / "tokenizer.json")), load_tokenizer(str(bpe))
    assert isinstance(as_file, HFTokenizer) and isinstance(as_dir, HFTokenizer)
    assert isinstance(Tokenizer(str(bpe)), HFTokenizer) and isinstance(Tokenizer(str(SP_MODEL)), SentencePieceTokenizer)
    assert as_file.kind == as_dir.kind == "huggingface"
    assert as_file.digest == as_dir.digest and len(as_file.digest) == 64
    assert as_file.files == as_dir.files == [str(bpe / "tokenizer.json"), str(bpe / "tokenizer_config.json")]
    assert (as_file.name, as_dir.name) == ("tokenizer.json", "bpe")
    assert as_dir.info == {"kind": "huggingface", "digest": as_dir.digest, "name": "bpe", "vocab_size": VOCAB,
                           "eod_id": 0}
    renamed = tmp_path / "my_tokenizer.json"  # any *.json name; no config beside it: the conventional end token
    shutil.copy(bpe / "tokenizer.json", renamed)
    other = load_tokenizer(str(renamed))
    assert (other.eod_id, other.files) == (0, [str(renamed)])
    assert other.digest == as_file.digest  # same file, same bos/eos

    sp = load_tokenizer(str(SP_MODEL))
    assert (sp.kind, sp.vocab_size, sp.eod_id, sp.eos_id, sp.bos_id) == ("sentencepiece", 4096, 2, 2, 1)
    assert (sp.bos_token, sp.eos_token, sp.files, sp.appends_eod) == ("<s>", "</s>", [str(SP_MODEL)], False)
    (tmp_path / "spdir").mkdir()
    shutil.copy(SP_MODEL, tmp_path / "spdir" / "tokenizer.model")
    in_dir = load_tokenizer(str(tmp_path / "spdir"))
    assert isinstance(in_dir, SentencePieceTokenizer) and in_dir.digest == sp.digest
    assert in_dir.encode("Hello world") == sp.encode("Hello world")


@pytest.mark.parametrize("files, expected_eos, expected_bos", [
    ({"tokenizer_config.json": {"eos_token": "<|eos|>"}}, "<|eos|>", None),
    ({"tokenizer_config.json": {"eos_token": {"__type": "AddedToken", "content": "<|eos|>", "special": True},
                                "bos_token": "<s>"}}, "<|eos|>", "<s>"),
    ({"special_tokens_map.json": {"eos_token": {"content": "</s>", "lstrip": False}, "bos_token": "<s>"}},
     "</s>", "<s>"),
    ({"tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None},
      "special_tokens_map.json": {"eos_token": "<|eos|>"}}, "<|eos|>", None),
])
def test_special_tokens_as_transformers_reads_them(bpe: Path, tmp_path: Path, files: dict, expected_eos: str,
                                                   expected_bos: str | None) -> None:
    tok = tokenizers.Tokenizer.from_file(str(bpe / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|eos|>", "</s>", "<s>")])
    tok.save(str(tmp_path / "tokenizer.json"))
    for name, doc in files.items():
        write_json(tmp_path / name, doc)
    reference, ours = auto(tmp_path), load_tokenizer(str(tmp_path))
    assert (reference.eos_token, reference.bos_token) == (expected_eos, expected_bos)
    assert (ours.eos_token, ours.bos_token) == (expected_eos, expected_bos)
    assert ours.eod_id == reference.eos_token_id
    assert ours.bos_id == (-1 if reference.bos_token_id is None else reference.bos_token_id)
    assert ours.files == [str(tmp_path / "tokenizer.json")] + [str(tmp_path / n) for n in
                                                                ("tokenizer_config.json", "special_tokens_map.json")
                                                                if n in files]


@pytest.mark.parametrize("flags", [{"add_bos_token": True, "add_eos_token": True},
                                   {"add_bos_token": False, "add_eos_token": False}])
def test_the_post_processor_decides_not_add_bos_or_eos_flags(llama: Path, tmp_path: Path, flags: dict) -> None:
    """transformers reads a tokenizer.json's special tokens from its post-processor, whatever the config's flags."""
    shutil.copytree(llama, tmp_path / "t")
    config = json.loads((llama / "tokenizer_config.json").read_text())
    write_json(tmp_path / "t" / "tokenizer_config.json", {**config, **flags})
    reference, ours = auto(tmp_path / "t"), load_tokenizer(str(tmp_path / "t"))
    for text in EDGE_CASES[:6] + TEXTS[:20]:
        assert ours.encode(text) == reference(text)["input_ids"]
    assert ours.digest == load_tokenizer(str(llama)).digest


def one_line_error(path: str) -> str:
    with pytest.raises(DataError) as info:
        load_tokenizer(path)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_bad_tokenizers_are_one_line_errors_naming_the_path(bpe: Path, tmp_path: Path) -> None:
    missing = tmp_path / "absent" / "tokenizer.json"
    assert one_line_error(str(missing)).startswith(f"{missing}: tokenizer not found")
    not_json = tmp_path / "tokenizer.json"
    not_json.write_text("this is not JSON")
    assert one_line_error(str(not_json)).startswith(f"{not_json}: not a valid tokenizers JSON file")
    other_json = tmp_path / "config.json"
    write_json(other_json, {"model_type": "llama"})
    assert one_line_error(str(other_json)).startswith(f"{other_json}: not a valid tokenizers JSON file")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    assert one_line_error(str(empty_dir)) == (f"{empty_dir}: directory holds no tokenizer.json (Hugging Face) and "
                                              "no tokenizer.model (sentencepiece)")
    garbage_model = tmp_path / "garbage.model"
    garbage_model.write_bytes(b"\x00\xffnot a sentencepiece model" * 20)
    assert one_line_error(str(garbage_model)).startswith(f"{garbage_model}: not a valid SentencePiece model")

    unknown_eos = tmp_path / "unknown_eos"
    shutil.copytree(bpe, unknown_eos)
    write_json(unknown_eos / "tokenizer_config.json", {"eos_token": "<|nope|>"})
    assert one_line_error(str(unknown_eos)) == (f"{unknown_eos / 'tokenizer_config.json'}: eos_token '<|nope|>' is "
                                                f"not in the vocabulary of {unknown_eos / 'tokenizer.json'}")
    bad_config = tmp_path / "bad_config"
    shutil.copytree(bpe, bad_config)
    (bad_config / "tokenizer_config.json").write_text("{not json")
    assert one_line_error(str(bad_config)).startswith(f"{bad_config / 'tokenizer_config.json'}: not valid JSON")
    write_json(bad_config / "tokenizer_config.json", {"eos_token": 7})
    assert "eos_token must be a token string" in one_line_error(str(bad_config))

    no_end = tmp_path / "no_end"  # no special token at all and no config naming one
    no_end.mkdir()
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS[:20], trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(no_end / "tokenizer.json"))
    assert one_line_error(str(no_end)) == (f"{no_end / 'tokenizer.json'}: names no end-of-document token (give it a "
                                           "tokenizer_config.json with eos_token)")


# ---- preprocessing -------------------------------------------------------------------------------------------

PREPROCESS_TEXTS = [t for t in EDGE_CASES if t.strip()] + TEXTS[:120]


def expected_docs(directory: Path, texts: list[str]) -> list[list[int]]:
    """transformers' ids of each non-empty document, then its eos unless the tokenizer already ended with it."""
    reference = auto(directory)
    docs = []
    for text in texts:
        if text.strip():
            ids = reference(text)["input_ids"]
            docs.append(ids if ids[-1:] == [reference.eos_token_id] else ids + [reference.eos_token_id])
    return docs


def read_docs(prefix: Path) -> list[list[int]]:
    data = IndexedDataset(str(prefix))
    return [data.doc(i).tolist() for i in range(len(data))]


def test_preprocess_command_line_with_a_tokenizer_json(bpe: Path, tmp_path: Path) -> None:
    texts = ["", "   \n "] + PREPROCESS_TEXTS
    source = write_jsonl(tmp_path / "docs.jsonl", texts)
    proc = subprocess.run([sys.executable, "-m", "data.preprocess", "--input", str(source), "--output-prefix",
                           str(tmp_path / "out"), "--tokenizer", str(bpe / "tokenizer.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    want = expected_docs(bpe, texts)
    assert f"docs={len(want)} tokens={sum(map(len, want))} empty_docs=2" in proc.stdout
    assert read_docs(tmp_path / "out") == want
    info = IndexedDataset(str(tmp_path / "out")).tokenizer_info
    assert info == {"kind": "huggingface", "digest": load_tokenizer(str(bpe)).digest, "name": "tokenizer.json",
                    "vocab_size": VOCAB, "eod_id": 0}
    assert struct.unpack_from("<Q", (tmp_path / "out.idx").read_bytes(), 8)[0] == 3


@pytest.mark.parametrize("name", ["llama", "eos_template"])
def test_preprocess_in_process_is_the_same_for_any_worker_count(request: pytest.FixtureRequest, tmp_path: Path,
                                                                name: str) -> None:
    """A bos template's bos leads each document; an eos-appending post-processor's eos is not doubled."""
    directory = request.getfixturevalue(name)
    source = write_jsonl(tmp_path / "docs.jsonl", PREPROCESS_TEXTS)
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    preprocess([str(source)], str(tmp_path / "one"), str(directory), workers=1, batch_size=16)
    preprocess([str(source)], str(tmp_path / "two"), str(directory), workers=2, batch_size=16)
    assert os.environ.get("TOKENIZERS_PARALLELISM") == before
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"two{suffix}").read_bytes() == (tmp_path / f"one{suffix}").read_bytes()
    docs = read_docs(tmp_path / "one")
    assert docs == expected_docs(directory, PREPROCESS_TEXTS)
    end = auto(directory).eos_token_id
    assert all(doc[-1] == end and doc[-2] != end for doc in docs)
    if name == "llama":
        assert all(doc[0] == auto(directory).bos_token_id for doc in docs)


def test_sentencepiece_preprocessing_records_its_tokenizer(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "docs.jsonl", TEXTS[:5])
    preprocess([str(source)], str(tmp_path / "sp"), str(SP_MODEL))
    info = IndexedDataset(str(tmp_path / "sp")).tokenizer_info
    assert info == {"kind": "sentencepiece", "digest": load_tokenizer(str(SP_MODEL)).digest,
                    "name": "tokenizer.model", "vocab_size": 4096, "eod_id": 2}
    assert IndexedDataset(str(SAMPLE / "sample_text_document")).tokenizer_info == info


# ---- the .idx tokenizer record -------------------------------------------------------------------------------

def test_version_2_index_still_reads_without_a_record(tmp_path: Path) -> None:
    docs = [[1, 2, 3], [4, 5], [6]]
    with IndexedDatasetWriter(str(tmp_path / "v2"), 100) as writer:
        for doc in docs:
            writer.add_document(doc)
    idx = (tmp_path / "v2.idx").read_bytes()
    assert struct.unpack_from("<Q", idx, 8)[0] == 2 and len(idx) == 48 + 3 * 12
    data = IndexedDataset(str(tmp_path / "v2"))
    assert data.tokenizer_info is None and read_docs(tmp_path / "v2") == docs


def write_v3(prefix: Path, docs: list[list[int]], record: dict) -> Path:
    with IndexedDatasetWriter(str(prefix), record["vocab_size"], tokenizer=record) as writer:
        for doc in docs:
            writer.add_document(doc)
    return prefix.with_suffix(".idx")


RECORD = {"kind": "huggingface", "digest": "ab" * 32, "name": "tok", "vocab_size": 100, "eod_id": 0}


def test_version_3_layout_and_strict_checks(tmp_path: Path) -> None:
    docs = [[1, 2, 0], [3, 0]]
    idx_path = write_v3(tmp_path / "d", docs, RECORD)
    raw = idx_path.read_bytes()
    body = 48 + 2 * 12
    length = struct.unpack_from("<I", raw, body)[0]
    assert struct.unpack_from("<Q", raw, 8)[0] == 3 and len(raw) == body + 4 + length
    assert json.loads(raw[body + 4:]) == RECORD
    assert IndexedDataset(str(tmp_path / "d")).tokenizer_info == RECORD

    def refused(data: bytes, reason: str) -> None:
        idx_path.write_bytes(data)
        with pytest.raises(DataError) as info:
            IndexedDataset(str(tmp_path / "d"))
        assert str(idx_path) in str(info.value) and reason in str(info.value), str(info.value)

    refused(raw[:-1], f"{len(raw) - 1} bytes, expected {len(raw)}")
    refused(raw + b" ", f"{len(raw) + 1} bytes, expected {len(raw)}")
    refused(raw[:body + 2], f"{body + 2} bytes, expected {body + 4}")
    record = json.dumps(RECORD).encode()
    refused(raw[:body] + struct.pack("<I", len(record)) + record.replace(b"{", b"["), "not valid UTF-8 JSON")
    without = json.dumps({k: v for k, v in RECORD.items() if k != "digest"}).encode()
    refused(raw[:body] + struct.pack("<I", len(without)) + without, "missing ['digest']")
    small = json.dumps({**RECORD, "vocab_size": 2}).encode()
    refused(raw[:body] + struct.pack("<I", len(small)) + small, "does not fit the index")

    with pytest.raises(DataError, match="eod_id 100 must lie in"):
        write_v3(tmp_path / "e", docs, {**RECORD, "eod_id": 100})
    with pytest.raises(DataError, match="kind must be one of"):
        write_v3(tmp_path / "e", docs, {**RECORD, "kind": "tiktoken"})
    assert not list(tmp_path.glob("e*"))


# ---- the train-time check, train.py and generate.py ----------------------------------------------------------

@pytest.fixture(scope="module")
def bpe_data(work: Path, bpe: Path) -> Path:
    """The first 300 corpus documents preprocessed with the tiny BPE given as its tokenizer.json."""
    source = write_jsonl(work / "train.jsonl", TEXTS[:300])
    preprocess([str(source)], str(work / "bpe_docs"), str(bpe / "tokenizer.json"))
    return work / "bpe_docs"


def run_config(data: Path, tokenizer: Path, vocab_size: int = VOCAB) -> list[str]:
    return [f"data.paths=[{data}]", f"data.tokenizer={tokenizer}", f"model.vocab_size={vocab_size}",
            "model.seq_len=64"]


def test_data_made_with_another_tokenizer_is_refused(bpe: Path, llama: Path, bpe_data: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    check_data(load_config(None, run_config(bpe_data, bpe)))  # file or directory: the same tokenizer
    check_data(load_config(None, run_config(bpe_data, bpe / "tokenizer.json")))
    with pytest.raises(DataError) as info:
        check_data(load_config(None, run_config(bpe_data, llama, VOCAB + 2)))
    assert str(info.value) == (
        f"{bpe_data}: made with the huggingface tokenizer 'tokenizer.json', not with data.tokenizer={llama} "
        "(huggingface, another digest): preprocess the data with data.tokenizer, or set data.tokenizer to the "
        "tokenizer that made it")
    with pytest.raises(DataError, match="made with the huggingface tokenizer 'tokenizer.json', not with "
                                        f"data.tokenizer={SP_MODEL} \\(sentencepiece"):
        check_tokenizer(IndexedDataset(str(bpe_data)), load_tokenizer(str(SP_MODEL)))
    # the bundled sentencepiece data under a BPE configuration: refused at start-up, one line, exit code 2
    assert train.main([f"logging.run_dir={tmp_path}", *run_config(SAMPLE / "sample_text_document", bpe, 4096)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "made with the sentencepiece tokenizer 'tokenizer.model'" in err
    # data without a record (index version 2) is accepted as before
    data = IndexedDataset(str(bpe_data))
    with IndexedDatasetWriter(str(tmp_path / "v2"), VOCAB) as writer:
        for i in range(len(data)):
            writer.add_document(data.doc(i))
    check_data(load_config(None, run_config(tmp_path / "v2", llama, VOCAB + 2)))


@pytest.mark.slow
def test_train_and_generate_with_a_tokenizer_json(bpe: Path, bpe_data: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_train(*FAST, *run_config(bpe_data, bpe / "tokenizer.json"), "train.max_steps=1",
                     "checkpoint.interval=1", f"logging.run_dir={run_dir}", "device=cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in records(run_dir) if "loss" in r] == [1]
    prompt = "The function returns"
    gen = forked_python(str(ROOT / "scripts" / "generate.py"), "--checkpoint", str(run_dir), "--prompt", prompt,
                        "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu", "--tokenizer", str(bpe),
                        timeout=120, env={"OMP_NUM_THREADS": "1"})
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.startswith(prompt)
