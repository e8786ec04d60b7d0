"""Export a checkpoint as a Hugging Face Llama, Qwen2 or Mistral directory that ``transformers`` loads with
``from_pretrained``.

    python scripts/export_hf.py --checkpoint RUN_OR_STEP_DIR --output DIR [--dtype float32|bfloat16|float16]
                                [--max-shard-size 5GB] [--tokenizer PATH | --no-tokenizer] [--force]
                                [--model-type llama|qwen2|mistral]

``--checkpoint`` is one checkpoint (``.../step_00000200``), a checkpoint root (its newest valid checkpoint)
or a run directory holding ``checkpoints/``, written at any layout (tp, pp, dp, any ZeRO stage, fp8):
checkpoints hold every parameter under its global name and shape, read here in one process with
``torch.distributed.checkpoint`` (no process group). The family is ``--model-type``, else the checkpoint's
``model.hf_model_type`` (an import sets it), else Qwen2 for q/k/v-only biases and Llama otherwise. ``DIR``
receives ``config.json``, the weights as ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` shards
plus ``model.safetensors.index.json`` when larger than ``--max-shard-size``) and the tokenizer: for our
sentencepiece model ``tokenizer.model``, ``tokenizer_config.json``, ``special_tokens_map.json``, and
``tokenizer.json`` when transformers is installed; for a Hugging Face tokenizer its ``tokenizer.json`` with the
``tokenizer_config.json`` / ``special_tokens_map.json`` beside it (a minimal config naming its bos/eos tokens
when it has none). With transformers installed, the exported tokenizer is loaded back with ``AutoTokenizer``
and must encode a few probe texts as ours does, else the export is refused (transformers 5 rebuilds Qwen2's
tokenizer in code as byte-level BPE: a sentencepiece tokenizer cannot travel as Qwen2). A model the family
cannot express (``model.activation=gelu``, ``model.norm=layernorm``, biases Qwen2 or Mistral lack) is refused
with one line naming the setting; so is a non-empty ``DIR`` unless ``--force``. Exit code 2 on any error.
The export is written into a temporary directory and moved into ``DIR`` only when complete, so a failed
export (bad checkpoint or tokenizer, full disk) leaves ``DIR`` as it was, a previous export included;
``--force`` replaces the previous export's files and leaves other files in ``DIR`` alone.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the application runs from the repository root (like Megatron-LM)

import torch  # noqa: E402

from model.hf import ARCHITECTURES, HFError, export_problems, hf_config, hf_model_type, model_config, to_hf  # noqa: E402
from training.checkpoint import CheckpointError, find_checkpoint  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
WEIGHT_FILES = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json)$")


def parse_size(text: str) -> int:
    """Bytes of '5GB', '200MB', '64KiB' or '1000' (decimal units as transformers reads them, binary with 'i')."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise HFError(f"--max-shard-size {text!r} is not a size like 5GB, 500MB or 1000000")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


# ---- the checkpoint -----------------------------------------------------------------------------------------

def read_model_tensors(step_dir: Path) -> Dict[str, torch.Tensor]:
    """Every ``model.<name>`` tensor of a checkpoint, whole (global shape), read in this process without a
    process group; names without the ``model.`` prefix."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    import warnings

    from training.safe_load import load_dcp, read_dcp_metadata  # nothing in the files runs

    try:
        metadata = read_dcp_metadata(step_dir)
    except CheckpointError as e:
        raise HFError(str(e)) from None
    state = {key: torch.empty(md.size, dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    if not state:
        raise HFError(f"checkpoint {step_dir} holds no model.* tensors")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        try:
            load_dcp(state, step_dir, no_dist=True)
        except CheckpointError as e:
            raise HFError(str(e)) from None
    return {key[len("model."):]: t for key, t in state.items()}


# ---- writing ------------------------------------------------------------------------------------------------

def shard(tensors: Dict[str, torch.Tensor], max_bytes: int) -> List[Dict[str, torch.Tensor]]:
    """Tensors in order, cut into groups of at most ``max_bytes`` (a larger tensor gets a shard of its own)."""
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def write_weights(tensors: Dict[str, torch.Tensor], out: Path, max_bytes: int) -> List[str]:
    """model.safetensors, or shards plus model.safetensors.index.json (transformers' layout); the file names."""
    from safetensors.torch import save_file as save_private

    def save_file(group: Dict[str, torch.Tensor], path: str, metadata: Dict[str, str]) -> None:
        save_private(group, path, metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(path, 0o666 & ~umask)  # safetensors creates its files 0600: readable as the other files are

    groups = shard(tensors, max_bytes)
    if len(groups) == 1:
        save_file(groups[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for k, group in enumerate(groups, start=1):
        name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(out / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update({t: name for t in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names + ["model.safetensors.index.json"]


def resolve_tokenizer(name: str, override: str | None) -> Path:
    """The tokenizer: --tokenizer, or the checkpoint's data.tokenizer (as given, or under the repo); a sentencepiece
    model, a ``tokenizer.json`` or a directory holding one."""
    from data.tokenizer import find_tokenizer
    found = find_tokenizer(name, override)
    if found is not None:
        return found
    raise HFError(f"tokenizer {override or name} not found (the checkpoint's data.tokenizer; pass --tokenizer PATH)")


def check_tokenizer(path: Path, vocab_size: int):
    """The loaded tokenizer; HFError unless it loads and its ids fit the model's vocabulary."""
    from data.indexed import DataError
    from data.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(str(path))
    except DataError as e:
        raise HFError(f"tokenizer {e}") from None
    if tok.vocab_size > vocab_size:
        raise HFError(f"tokenizer {path} has {tok.vocab_size} tokens but the model's vocabulary has "
                      f"{vocab_size} rows")
    return tok


def write_tokenizer(tok, out: Path, max_positions: int) -> Tuple[int | None, int]:
    """The tokenizer's files in ``out`` as transformers reads them; returns the (bos, eos) ids for config.json
    (bos None when the tokenizer has none)."""
    if tok.kind == "sentencepiece":
        return _write_sentencepiece(tok, Path(tok.model_path), out, max_positions)
    names = {Path(tok.model_path): "tokenizer.json"}
    for path in map(Path, tok.files[1:]):
        names[path] = path.name
    for path, name in names.items():
        shutil.copyfile(path, out / name)
    if not (out / "tokenizer_config.json").exists():  # transformers needs no more than the file and its specials
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
                  "eos_token": tok.eos_token, "clean_up_tokenization_spaces": False, "model_max_length": max_positions}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return (tok.bos_id if tok.bos_id >= 0 else None), tok.eod_id


def _write_sentencepiece(tok, model_file: Path, out: Path, max_positions: int) -> Tuple[int, int]:
    """tokenizer.model (ours, copied) and the files transformers' LlamaTokenizer reads; returns (bos, eos) ids."""
    shutil.copyfile(model_file, out / "tokenizer.model")
    piece = tok._sp.id_to_piece
    special = {"bos_token": piece(tok.bos_id), "eos_token": piece(tok.eod_id), "unk_token": piece(tok._sp.unk_id())}
    config = {"tokenizer_class": "LlamaTokenizer", **special, "pad_token": None, "add_bos_token": False,
              "add_eos_token": False, "legacy": False, "clean_up_tokenization_spaces": False,
              "model_max_length": max_positions}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    try:  # the converted fast tokenizer, so that loading needs no sentencepiece conversion
        from transformers import AutoTokenizer
    except ImportError:
        pass
    else:
        AutoTokenizer.from_pretrained(str(out)).backend_tokenizer.save(str(out / "tokenizer.json"))
        if _always_prefix_a_space(model_file, out / "tokenizer.json"):
            # transformers' LlamaTokenizer rebuilds its pre-tokenizer in code; the generic class takes the file
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.bos_id, tok.eod_id


PROBES = ("The function returns 12345 values, doesn't it?", "  two leading spaces", "tabs\tand\nnew lines\n\n",
          "x=1;y=22;z=333", "Tiếng Việt, 中文, emoji 🙂")
"""Texts the exported tokenizer must encode as ours does: digits, contractions, whitespace runs, non-Latin text."""


def verify_tokenizer(out: Path, tok, family: str) -> None:
    """Load the export's tokenizer with transformers' AutoTokenizer (when installed) and refuse the export if it
    encodes any of PROBES otherwise than ``tok``: transformers 5 rebuilds some families' tokenizers in code (Qwen2's
    as byte-level BPE with its own pre-tokenizer), which would silently not be the tokenizer the model learned."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return
    loaded = AutoTokenizer.from_pretrained(str(out))
    specials = tok.kind == "huggingface"  # our HF tokenizers apply the file's post-processor, as AutoTokenizer does
    for text in PROBES:
        theirs = loaded(text, add_special_tokens=specials)["input_ids"]
        ours = tok.encode(text)
        if theirs != ours:
            raise HFError(f"transformers loads the exported tokenizer as {type(loaded).__name__}, which encodes "
                          f"{text!r} as {theirs[:8]}... where {tok.model_path} gives {ours[:8]}...: a {tok.kind} "
                          f"tokenizer does not survive export as {ARCHITECTURES[family]} (pass --model-type llama, "
                          "or --no-tokenizer)")


def _always_prefix_a_space(model_file: Path, tokenizer_json: Path) -> bool:
    """Make the fast tokenizer add sentencepiece's dummy prefix even to text that starts with a space.

    transformers converts a sentencepiece model into a ``Metaspace`` pre-tokenizer, which prepends "▁" only
    when the text does not already start with one, so " x" encodes as "▁x" where sentencepiece (with
    ``add_dummy_prefix``, as ours is trained) gives "▁▁x". The normalizer of the original Llama
    ``tokenizer.json`` (prepend "▁", then spaces to "▁", no pre-tokenizer) is sentencepiece's behaviour.
    Returns whether the file was changed."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    spec = proto.normalizer_spec
    if not spec.add_dummy_prefix or spec.remove_extra_whitespaces:
        return False  # transformers' conversion already behaves as sentencepiece does
    data = json.loads(tokenizer_json.read_text())
    data["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    data["pre_tokenizer"] = None
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))
    return True


def _staging_dir(out: Path) -> Path:
    """An empty directory on ``out``'s file system to write the export into: inside ``out`` when it exists (the
    files then move in one by one), else beside it (then renamed to ``out``); readable as ``out`` would be."""
    if out.is_dir():
        where, prefix = out, ".export_hf-"
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        where, prefix = out.parent, f".{out.name}.export_hf-"
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=where))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp creates it 0700
    return staging


def _publish(staging: Path, out: Path) -> None:
    """Move a complete export from ``staging`` into ``out``. A new ``out`` is one rename. Into an existing one, the
    files the export replaces (its names, and every weight file of an earlier export, which would mix with these)
    are first moved aside, then the new ones in; a failing rename puts everything back. Other files stay."""
    if not out.exists():
        os.rename(staging, out)
        return
    new = sorted(p.name for p in staging.iterdir())
    old = sorted(p.name for p in out.iterdir() if (p.is_file() or p.is_symlink())
                 and (WEIGHT_FILES.match(p.name) or p.name in new))
    aside = Path(tempfile.mkdtemp(prefix=".export_hf-previous-", dir=out))
    moved_aside: List[str] = []
    moved_in: List[str] = []
    try:
        for name in old:
            os.rename(out / name, aside / name)
            moved_aside.append(name)
        for name in new:
            os.rename(staging / name, out / name)
            moved_in.append(name)
    except OSError:
        for name in reversed(moved_in):
            os.rename(out / name, staging / name)
        for name in reversed(moved_aside):
            os.rename(aside / name, out / name)
        raise
    finally:
        if len(moved_in) == len(new):
            shutil.rmtree(aside, ignore_errors=True)
        elif not any(aside.iterdir()):
            aside.rmdir()


def export(checkpoint: Path, out: Path, *, dtype: str = "float32", max_shard_size: str = "5GB",
           tokenizer: str | None = None, no_tokenizer: bool = False, force: bool = False,
           model_type: str | None = None) -> Dict[str, Any]:
    """Write the Hugging Face directory; returns a summary (checkpoint, step, files).

    Everything is read and checked first (checkpoint, settings, tokenizer), then the whole export is written into
    a temporary directory and moved into ``out`` only once complete: a failure at any point (a bad tokenizer or
    checkpoint, a full disk) leaves ``out``, e.g. a previous export overwritten with ``--force``, as it was."""
    max_bytes = parse_size(max_shard_size)
    try:
        step_dir = find_checkpoint(checkpoint, "exporting")
    except CheckpointError as e:
        raise HFError(str(e)) from None
    try:
        meta = json.loads((step_dir / "meta.json").read_text())
        config = meta["config"]
        settings = config["model"]
    except (OSError, ValueError, KeyError) as e:
        raise HFError(f"{step_dir / 'meta.json'}: no model config in it ({e.__class__.__name__}: {e})") from None
    family = hf_model_type(settings, model_type)
    problems = export_problems(settings, family)
    if problems:
        raise HFError(f"cannot export {step_dir} as {ARCHITECTURES[family]}: " + "; ".join(problems))
    if out.exists() and not out.is_dir():
        raise HFError(f"--output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise HFError(f"--output {out} is not empty (pass --force to write into it)")
    m = model_config(settings)
    tok_file = None if no_tokenizer else resolve_tokenizer(config.get("data", {}).get("tokenizer", ""), tokenizer)
    tok = check_tokenizer(tok_file, m.vocab_size) if tok_file is not None else None
    tensors = to_hf(read_model_tensors(step_dir), settings)
    tensors = {k: t.to(DTYPES[dtype]) for k, t in tensors.items()}
    staging = _staging_dir(out)
    try:
        files = write_weights(tensors, staging, max_bytes)
        bos, eos = write_tokenizer(tok, staging, m.max_positions) if tok is not None else (None, None)
        config_json = hf_config(settings, dtype=dtype, bos_id=bos, eos_id=eos, model_type=family)
        (staging / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        if tok is not None:
            verify_tokenizer(staging, tok, family)
        (staging / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos})
                                                        + "\n")
        _publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when published
    return {"checkpoint": str(step_dir), "step": meta.get("step"), "files": files, "architecture": ARCHITECTURES[family],
            "parameters": sum(t.numel() for t in tensors.values())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="checkpoint dir, checkpoint root or run dir")
    p.add_argument("--output", required=True, help="directory to write the Hugging Face model into")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the saved weights")
    p.add_argument("--max-shard-size", default="5GB", help="largest weights file before sharding (e.g. 5GB, 500MB)")
    p.add_argument("--tokenizer", help="sentencepiece model, tokenizer.json or a directory holding one (default: "
                                       "the checkpoint's data.tokenizer)")
    p.add_argument("--no-tokenizer", action="store_true", help="write the model only (config and weights)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --output")
    p.add_argument("--model-type", choices=sorted(ARCHITECTURES),
                   help="Hugging Face family to write (default: the checkpoint's model.hf_model_type, else qwen2 "
                        "for q/k/v-only biases, else llama)")
    args = p.parse_args(argv)
    try:
        summary = export(Path(args.checkpoint), Path(args.output), dtype=args.dtype,
                         max_shard_size=args.max_shard_size, tokenizer=args.tokenizer,
                         no_tokenizer=args.no_tokenizer, force=args.force, model_type=args.model_type)
    except HFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: {e.name or e} is needed to write safetensors files (pip install safetensors)",
              file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a full disk: nothing of --output changed
        where = f" ({e.filename})" if e.filename else ""
        print(f"error: cannot write the export to {args.output}: {e.strerror or e}{where}; {args.output} is "
              "unchanged", file=sys.stderr)
        return 2
    print(f"[export] {summary['checkpoint']} (step {summary['step']}, {summary['parameters'] / 1e6:.2f}M "
          f"parameters) -> {args.output}: {', '.join(summary['files'])}", file=sys.stderr)
    print(f"from transformers import AutoModelForCausalLM, AutoTokenizer; "
          f"AutoModelForCausalLM.from_pretrained({str(args.output)!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
