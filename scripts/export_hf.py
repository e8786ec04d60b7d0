"""Export a checkpoint as a Hugging Face Llama, Qwen2, Mistral, Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE directory
that ``transformers`` loads with ``from_pretrained``.

    python scripts/export_hf.py --checkpoint RUN_OR_STEP_DIR --output DIR [--dtype float32|bfloat16|float16]
                                [--max-shard-size 5GB] [--tokenizer PATH | --no-tokenizer] [--force]
                                [--model-type llama|qwen2|mistral|qwen3|mixtral|qwen2_moe|qwen3_moe]

``--checkpoint`` is one checkpoint (``.../step_00000200``), a checkpoint root (its newest valid checkpoint)
or a run directory holding ``checkpoints/``, written at any layout (tp, pp, dp, any ZeRO stage, fp8):
checkpoints hold every parameter under its global name and shape, read here in one process with
``torch.distributed.checkpoint`` (no process group). The family is ``--model-type``, else the checkpoint's
``model.hf_model_type`` (an import sets it), else by what the model has (``model/hf/families.py``
``hf_model_type``: experts make Qwen3-MoE with QK-norm, Qwen2-MoE with shared experts, Mixtral otherwise; QK-norm
alone Qwen3; q/k/v-only biases Qwen2; anything else Llama). Experts are written one tensor per expert and
projection, as ``save_pretrained`` writes them; an MoE layer's expert bias (aux-loss-free balancing) must be zero,
since the families' routers have none. ``DIR``
receives ``config.json``, the weights as ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` shards
plus ``model.safetensors.index.json`` when larger than ``--max-shard-size``) and the tokenizer: for our
sentencepiece model ``tokenizer.model``, ``tokenizer_config.json``, ``special_tokens_map.json``, and
``tokenizer.json`` when transformers is installed; for a Hugging Face tokenizer its ``tokenizer.json`` with the
``tokenizer_config.json`` / ``special_tokens_map.json`` beside it (a minimal config naming its bos/eos tokens
when it has none). With transformers installed, the exported tokenizer is loaded back with ``AutoTokenizer``
and must encode a few probe texts as ours does, else the export is refused (transformers 5 rebuilds Qwen2's
tokenizer in code as byte-level BPE: a sentencepiece tokenizer cannot travel as Qwen2). A model the family
cannot express (``model.activation=gelu``, ``model.norm=layernorm``, biases Qwen2 or Mistral lack, QK-norm outside
Qwen3's families, a sigmoid router, scaled gates, shared experts Mixtral and Qwen3-MoE lack) is refused with one
line naming the setting; so is a non-empty ``DIR`` unless ``--force``. Exit code 2 on any error.
The export is written into a temporary directory beside ``DIR`` and swapped in only when complete (the previous
``DIR`` renamed aside, the new one renamed in, the previous one removed), so a failed export (bad checkpoint or
tokenizer, full disk) leaves ``DIR`` as it was, a previous export included, and a ``--force`` export leaves
``DIR`` holding exactly what it wrote, nothing of the previous export (no weight shards, no tokenizer files of
another kind of tokenizer). The temporary directory (``.<name>.export_hf-*``) holds a marker naming its process:
an export that was killed leaves it, and the next export to ``DIR`` removes those whose process has ended (putting
the previous export back where the kill fell mid-swap) and names in one line those it leaves (no marker, a process
still running or on another host). ``--force`` replaces only a previous export: a directory holding anything
else (notes, a checkpoint, a repository, an entry named like a temporary directory) is refused naming it, as
are the root, a home directory, this repository, the current directory and the checkpoint's. Checkpoint weights
holding NaN or inf are refused naming the first such tensor (as ``--dtype float16`` values beyond its range are),
and so is a tokenizer other than the one the checkpoint was trained with, compared by content as training compares
the data's tokenizer (the tokenizer at its data.tokenizer, the tokenizer records of the data it read; a copy
anywhere passes).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the application runs from the repository root (like Megatron-LM)

import torch  # noqa: E402

from model.hf import (ARCHITECTURES, EXPERT_BIAS, HFError, check_output_dir, export_problems,  # noqa: E402
                      first_non_finite, hf_config, hf_model_type, model_config, to_hf)
from scripts._hf_staging import publish, staging_dir, sweep  # noqa: E402
from training.checkpoint import CheckpointError, find_checkpoint  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
EXPORT_FILES = re.compile(r"^(config\.json|generation_config\.json|model(-\d{5}-of-\d{5})?\.safetensors|"
                          r"model\.safetensors\.index\.json|tokenizer\.model|tokenizer\.json|tokenizer_config\.json|"
                          r"special_tokens_map\.json)$")
"""Every file an export writes: --force replaces only a directory holding nothing else (an entry merely named like
a staging directory, ``.export_hf-*``, is not provably an export's: it is refused too)."""


def parse_size(text: str) -> int:
    """Bytes of '5GB', '200MB', '64KiB' or '1000' (decimal units as transformers reads them, binary with 'i')."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise HFError(f"--max-shard-size {text!r} is not a size like 5GB, 500MB or 1000000")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


# ---- the checkpoint -----------------------------------------------------------------------------------------

def model_shapes(m) -> Dict[str, Tuple[int, ...]]:
    """``model.<name>`` -> the global shape of every parameter a checkpoint of model config ``m`` holds, and of its
    MoE layers' expert biases (the model built on the meta device: shapes only)."""
    from model.gpt import GPTChunk
    from model.layers import TPContext
    from parallel.comm import Group, Ledger

    tp = Group("tp", None, [0], 0, "intra", Ledger())
    with torch.device("meta"):
        chunk = GPTChunk(m, TPContext(tp, False, rng=None), range(m.n_layers), first=True, last=True)  # type: ignore
    shapes = {f"model.{name}": tuple(p.shape) for name, p in chunk.named_parameters()}
    shapes.update({f"model.{name}": tuple(b.shape) for name, b in chunk.named_buffers() if name.endswith(EXPERT_BIAS)})
    return shapes


def read_model_tensors(step_dir: Path, shapes: Dict[str, Tuple[int, ...]]) -> Dict[str, torch.Tensor]:
    """Every ``model.<name>`` tensor of a checkpoint, whole (global shape), read in this process without a
    process group; names without the ``model.`` prefix. ``shapes`` (``model_shapes`` of its config): what the
    metadata must say of them before anything is allocated (a re-hashed metadata file can claim any size)."""
    import warnings

    from training.safe_load import check_sizes, load_dcp, read_dcp_metadata  # nothing in the files runs

    try:
        metadata = read_dcp_metadata(step_dir)
        check_sizes(metadata, shapes, step_dir / ".metadata")
    except CheckpointError as e:
        raise HFError(str(e)) from None
    extra = sorted(k for k in metadata.state_dict_metadata if k.startswith("model.") and k not in shapes)
    if extra:
        raise HFError(f"{step_dir / '.metadata'}: holds {extra[0]}, which this model (its meta.json) has not")
    state = {key: torch.empty(shape, dtype=metadata.state_dict_metadata[key].properties.dtype)
             for key, shape in shapes.items() if key in metadata.state_dict_metadata}
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
    if not override and not name.strip():
        raise HFError("the checkpoint names no data.tokenizer: pass --tokenizer PATH (or --no-tokenizer)")
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


def check_trained(tok, meta: Dict[str, Any], step_dir: Path, override: str | None) -> None:
    """HFError when ``tok`` is not the tokenizer the checkpoint was trained with, compared by content as training
    compares the data's tokenizer (``data/tokenizer.py`` ``check_trained_with``); where nothing is left to compare
    with, a ``--tokenizer`` is taken on trust and stderr says so."""
    from data.indexed import DataError
    from data.tokenizer import check_trained_with

    try:
        checked = check_trained_with(tok, meta["config"], meta.get("data"), f"checkpoint {step_dir}",
                                     "--tokenizer" if override else "data.tokenizer")
    except DataError as e:
        raise HFError(str(e)) from None
    if not checked and override:
        print(f"[export] note: nothing left tells which tokenizer {step_dir} was trained with (its data.tokenizer "
              f"is not found, its data records none): --tokenizer {override} is taken on trust", file=sys.stderr,
              flush=True)


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


def check_output(out: Path, force: bool, step_dir: Path) -> Path:
    """The directory to write the export to: ``out``, a symbolic link to a directory followed. HFError when it
    cannot be one (a file, under a file), is not empty without ``force``, or with ``force`` is not a previous
    export: ``--force`` replaces the whole directory, so one holding anything an export does not write (notes, a
    checkpoint, a repository) or that is a place no export belongs (the root, a home directory, the repository, the
    current directory or one above it, the checkpoint's) is refused, naming what it holds. What killed exports left
    beside it is cleared first (``_hf_staging.sweep``)."""
    check_output_dir(out)
    real = Path(os.path.realpath(out))
    places = {Path("/"): "the root directory", Path(os.path.realpath(os.path.expanduser("~"))): "a home directory",
              Path(os.path.realpath(ROOT)): "this repository", Path(os.path.realpath(Path.cwd())): "the current "
              "directory", Path(os.path.realpath(step_dir)): "the checkpoint"}
    for place, what in places.items():
        if real == place or real in place.parents:
            raise HFError(f"--output {out} " + (f"is {what}" if real == place else f"holds {what} ({place})")
                          + ": an export replaces its --output as a whole; give a directory of its own")
    if Path(os.path.realpath(step_dir)) in real.parents:
        raise HFError(f"--output {out} lies inside the checkpoint {step_dir}; give a directory outside it")
    sweep(real, "export_hf", "[export]")  # before the emptiness check: it may put a previous export back
    if not real.is_dir() or not any(real.iterdir()):
        return real
    if not force:
        raise HFError(f"--output {out} is not empty (pass --force to replace the export in it)")
    foreign = sorted(p.name for p in real.iterdir() if not EXPORT_FILES.match(p.name) or not p.is_file())
    if foreign or not (real / "config.json").is_file():
        held = f"holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, which no export writes" \
            if foreign else "has no config.json"
        raise HFError(f"--output {out} {held}: it is not a previous export, and --force replaces the whole "
                      "directory (move that away, or give another --output)")
    return real


def read_settings(step_dir: Path) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(meta.json, its model settings checked by type and range as training checks them); HFError naming the key
    otherwise. Model settings this version does not know are ignored."""
    import dataclasses

    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from config import Config, ConfigError, ModelConfig, validate_config

    meta_file = step_dir / "meta.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise HFError(f"{meta_file} is not readable JSON ({e.__class__.__name__}: {e})") from None
    config = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise HFError(f"{meta_file}: no model config in it (a mapping under config.model)")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    settings = {k: v for k, v in config["model"].items() if k in known}
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), {
            "model": settings, "train": {"micro_batch_size": 1, "global_batch_size": 1}}))
        validate_config(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e).splitlines()[0] if str(e) else e.__class__.__name__
        raise HFError(f"{meta_file}: invalid model config ({key + ': ' if key and key not in msg else ''}{msg})") \
            from None
    except ConfigError as e:
        problems = "; ".join(e.problems or [str(e)])
        raise HFError(f"{meta_file}: invalid model config ({problems})") from None
    return meta, dataclasses.asdict(cfg.model)


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
    meta, settings = read_settings(step_dir)
    config = meta["config"]
    family = hf_model_type(settings, model_type)
    problems = export_problems(settings, family)
    if problems:
        raise HFError(f"cannot export {step_dir} as {ARCHITECTURES[family]}: " + "; ".join(problems))
    out = check_output(out, force, step_dir)
    m = model_config(settings)
    tok = None
    if not no_tokenizer:
        data = config.get("data")
        name = data.get("tokenizer") if isinstance(data, dict) else None
        tok = check_tokenizer(resolve_tokenizer(name if isinstance(name, str) else "", tokenizer), m.vocab_size)
        check_trained(tok, meta, step_dir, tokenizer)
    ours = read_model_tensors(step_dir, model_shapes(m))
    broken = first_non_finite(ours)
    if broken is not None:
        raise HFError(f"checkpoint {step_dir}: model.{broken[0]} holds {broken[1]}: the weights are broken, "
                      "nothing to export")
    tensors = {k: t.to(DTYPES[dtype]) for k, t in to_hf(ours, settings, family).items()}
    broken = first_non_finite(tensors)
    if broken is not None:  # finite before: too large for the dtype
        raise HFError(f"{broken[0]} holds values beyond {dtype}'s range ({broken[1]} as {dtype}): export with "
                      "--dtype bfloat16 or float32")
    staging = staging_dir(out, "export_hf")
    try:
        files = write_weights(tensors, staging, max_bytes)
        bos, eos = write_tokenizer(tok, staging, m.max_positions) if tok is not None else (None, None)
        config_json = hf_config(settings, dtype=dtype, bos_id=bos, eos_id=eos, model_type=family)
        (staging / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        if tok is not None:
            verify_tokenizer(staging, tok, family)
        (staging / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos})
                                                        + "\n")
        publish(staging, out, "export_hf")
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when published
    return {"checkpoint": str(step_dir), "step": meta.get("step"), "files": files,
            "architecture": ARCHITECTURES[family], "parameters": sum(t.numel() for t in tensors.values())}


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
                   help="Hugging Face family to write (default: the checkpoint's model.hf_model_type, else "
                        "qwen3_moe / qwen2_moe / mixtral for experts with QK-norm / shared experts / neither, qwen3 "
                        "for QK-norm, qwen2 for q/k/v-only biases, else llama)")
    args = p.parse_args(argv)
    try:
        summary = export(Path(args.checkpoint), Path(args.output), dtype=args.dtype,
                         max_shard_size=args.max_shard_size, tokenizer=args.tokenizer,
                         no_tokenizer=args.no_tokenizer, force=args.force, model_type=args.model_type)
    except HFError as e:
        print("error: " + "; ".join(line.strip() for line in str(e).splitlines() if line.strip()), file=sys.stderr)
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
