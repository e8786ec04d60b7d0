"""Import a Hugging Face Llama, Qwen2, Mistral, Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE directory as a checkpoint
train.py starts from (``checkpoint.init_from``).

    python scripts/import_hf.py --model DIR --output CHECKPOINT_DIR [--force]

``DIR`` holds ``config.json`` and the weights: ``model.safetensors``, sharded safetensors with
``model.safetensors.index.json``, ``pytorch_model.bin`` or sharded ``pytorch_model.bin.index.json``;
grouped-query attention (``num_key_value_heads`` < ``num_attention_heads``) included. ``CHECKPOINT_DIR``
becomes one checkpoint of this repository (``torch.distributed.checkpoint`` files with every parameter
under its global name and shape, ``meta.json`` at step 0, ``manifest.json``), so any layout (tp, pp, dp,
ZeRO stages, fp8) loads it. Next to it: ``model.yaml``, the ``model.*`` settings the model implies plus
``checkpoint.init_from`` (and ``data.tokenizer`` when DIR has a tokenizer), usable as ``--config`` or merged
into one; the train command is printed. The tokenizer files (``tokenizer.model``, ``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``, whichever DIR has) are copied next to the checkpoint;
``data.tokenizer`` names the sentencepiece model where there is one, else ``tokenizer.json``.

Llama (Llama 3.x's ``llama3`` RoPE scaling included), Qwen2 (Qwen2.5), Mistral, Qwen3 (``model.qk_norm``) and the
mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE (``model.moe``, its MoE layers from ``decoder_sparse_step`` and
``mlp_only_layers``; ``router_aux_loss_coef`` becomes ``model.moe.aux_loss_coeff``, see ``model/hf/settings.py``)
import, ``model.hf_model_type`` naming the family where the other settings do not imply it (always for the last
four); what we cannot express (other RoPE types, sliding windows, router jitter, other families' QK-norm, Qwen3's
attention_bias, an MoE layer set that ``model.moe.layer_freq`` / ``first_dense`` cannot describe, hidden_act other
than silu, attention_bias != mlp_bias, another model_type) and bad inputs (missing directory, no weights, wrong
shapes) stop with one line naming the reason, exit code 2; a non-empty CHECKPOINT_DIR is refused unless ``--force``,
and with it unless it is an earlier import (nothing but the files an import writes, its meta.json recording
``imported_from``): a training run, its checkpoint or notes are refused naming them. The checkpoint is written whole
into a temporary directory beside CHECKPOINT_DIR and swapped in once complete, so a failure leaves CHECKPOINT_DIR as
it was, and ``--force`` leaves nothing of the earlier import (no tokenizer file of another kind); what a killed
import left beside it is cleared by the next, as ``export_hf.py`` does. config.json's fields are checked by type and
range before anything else (a string where a number or true/false belongs, a non-positive count,
``max_position_embeddings`` above ``config.MAX_SEQ_LEN``, a list where a name belongs such as
``"model_type": ["llama"]`` or a list as ``rope_type``: one line naming the key and its value), and weights holding
NaN or inf are refused naming the tensor. Every bad path is one line too: a missing one, a file where a directory
belongs or the reverse, random bytes as config.json, weights or index, an index naming files outside DIR, a
``pytorch_model.bin`` that is not a state dict, and a failed write of the checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""Tokenizer files copied next to the checkpoint, in the order data.tokenizer prefers them."""
IMPORT_FILES = re.compile(r"^(\.metadata|__\d+_\d+\.distcp|meta\.json|manifest\.json|model\.yaml|tokenizer\.model|"
                          r"tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json)$")
"""Every file an import writes: --force replaces only a directory holding nothing else."""
sys.path.insert(0, str(ROOT))  # the application runs from the repository root (like Megatron-LM)

import torch  # noqa: E402
import yaml  # noqa: E402

from config import Config, to_dict  # noqa: E402
from model.hf import HFError, check_output_dir, from_hf, model_config, model_settings  # noqa: E402
from scripts._hf_staging import MARKER, publish, staging_dir, sweep  # noqa: E402
from training.checkpoint import FORMAT_VERSION, file_digest, model_record  # noqa: E402


def read_config(model_dir: Path) -> Dict[str, Any]:
    if not model_dir.is_dir():
        raise HFError(f"--model {model_dir} is not a directory")
    path = model_dir / "config.json"
    if path.exists() and not path.is_file():
        raise HFError(f"{path} is not a file")
    if not path.is_file():
        raise HFError(f"{path} not found (a Hugging Face model directory has a config.json)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HFError(f"{path} is not readable JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise HFError(f"{path} is not a JSON object")
    return cfg


def _load_file(path: Path) -> Dict[str, torch.Tensor]:
    if path.exists() and not path.is_file():
        raise HFError(f"weights file {path} is not a file")
    if not path.is_file():
        raise HFError(f"weights file {path} not found")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(path))
        tensors = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(tensors, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                    for k, v in tensors.items()):
            raise HFError(f"weights file {path} holds a {type(tensors).__name__}, not tensors by name (a state dict)")
        return tensors
    except HFError:
        raise
    except ImportError:
        raise HFError("safetensors is needed to read .safetensors files (pip install safetensors)") from None
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line naming it
        first = str(e).splitlines()[0] if str(e) else ""
        raise HFError(f"cannot read weights file {path}: {e.__class__.__name__}: {first}") from None


def read_weights(model_dir: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of the model: one file or the shards an index names (safetensors preferred)."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = model_dir / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = list(weight_map.values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise HFError(f"{index} has no readable weight_map ({e.__class__.__name__})") from None
            bad = [n for n in names if not isinstance(n, str) or not n or Path(n).name != n or n in (".", "..")]
            if bad:
                raise HFError(f"{index}: weight_map names {json.dumps(bad[0])}, not a file name beside it")
            files = sorted(set(names))
            tensors: Dict[str, torch.Tensor] = {}
            for name in files:
                tensors.update(_load_file(model_dir / name))
            return tensors
        if (model_dir / single).is_file():
            return _load_file(model_dir / single)
    raise HFError(f"no weights in {model_dir} (expected model.safetensors, model.safetensors.index.json, "
                  "pytorch_model.bin or pytorch_model.bin.index.json)")


def read_tokenizer(model_dir: Path, vocab_size: int) -> List[str]:
    """The tokenizer files of DIR to copy next to the checkpoint, the one ``data.tokenizer`` names first: a
    sentencepiece ``tokenizer.model`` where DIR has one (Llama 2, Mistral: its ``tokenizer.json`` is a conversion of
    it), else ``tokenizer.json`` (Llama 3, Qwen2.5), then ``tokenizer_config.json`` / ``special_tokens_map.json``.
    Empty when DIR has no tokenizer. The tokenizer is loaded first: an unreadable one, or one with more tokens than
    the model has embedding rows, is an HFError."""
    from data.indexed import DataError
    from data.tokenizer import load_tokenizer

    names = [n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
    if not names or names[0] not in ("tokenizer.model", "tokenizer.json"):
        return []
    try:
        tok = load_tokenizer(str(model_dir / names[0]))
    except DataError as e:
        raise HFError(f"tokenizer: {e}") from None
    if tok.vocab_size > vocab_size:
        raise HFError(f"{model_dir / names[0]} has {tok.vocab_size} tokens but config.json's vocab_size is "
                      f"{vocab_size}")
    return names


def write_checkpoint(tensors: Dict[str, torch.Tensor], settings: Dict[str, Any], out: Path, source: Path,
                     tokenizer: Path | None, into: Path | None = None) -> None:
    """A step-0 checkpoint of the model weights only (what ``checkpoint.init_from`` reads), as train.py writes
    them: DCP files under ``model.<global name>``, meta.json (with the full config), manifest.json last. Written
    into ``into`` (a staging directory that becomes ``out``), else ``out``; errors name ``out``."""
    into = out if into is None else into
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.save({f"model.{k}": t.contiguous() for k, t in tensors.items()}, checkpoint_id=str(into),
                     no_dist=True)
        except CheckpointException as e:  # a write that failed (a full disk): DCP wraps the cause
            cause = next(iter(e.failures.values()), (None, None))[0]
            what = (f"{cause.strerror or cause}" + (f" ({cause.filename})" if cause.filename else "")
                    if isinstance(cause, OSError) else f"{cause.__class__.__name__}: {cause}")
            raise HFError(f"cannot write the checkpoint to {out}: {what.splitlines()[0] if what else ''}") from None
    config = to_dict(Config())
    for key, value in settings.items():  # model.moe is a section: its other keys keep their defaults
        if isinstance(value, dict):
            config["model"][key].update(value)
        else:
            config["model"][key] = value
    if tokenizer is not None:
        config["data"]["tokenizer"] = str(tokenizer)
    m = model_config(settings)
    model = model_record(m)  # what train.py records
    meta = {"format": FORMAT_VERSION, "step": 0, "consumed_samples": 0, "skipped_steps": 0, "config": config,
            "model": model, "layout": {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "virtual_stages": 1},
            "data": None, "fp8": None, "weights_only": True, "imported_from": str(source), "time": time.time(),
            "torch": torch.__version__}
    (into / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    extras = ("manifest.json", "model.yaml", MARKER, *TOKENIZER_FILES)  # next to the checkpoint, not part of it
    files = {p.name: file_digest(p) for p in sorted(into.iterdir()) if p.is_file() and p.name not in extras}
    (into / "manifest.json").write_text(json.dumps({"format": FORMAT_VERSION, "files": files}, indent=1,
                                                  sort_keys=True))


def model_yaml(settings: Dict[str, Any], out: Path, tokenizer: Path | None) -> str:
    """The settings a run needs to start from this checkpoint (``--config``, or merged into one)."""
    doc: Dict[str, Any] = {"model": dict(settings), "checkpoint": {"init_from": str(out)}}
    if tokenizer is not None:
        doc["data"] = {"tokenizer": str(tokenizer)}
    header = ("# Written by scripts/import_hf.py: the model.* settings of the imported model; train.py starts from\n"
              "# its weights (checkpoint.init_from, fresh optimizer, step 0). Set data.paths to data tokenized with\n"
              "# data.tokenizer; seq_len may be anything up to max_seq_len.\n")
    return header + yaml.safe_dump(doc, sort_keys=False)


def check_output(out: Path, force: bool) -> Path:
    """The directory to write the checkpoint to (``out``, a symbolic link to a directory followed). HFError when it
    cannot be one (a file, under a file), is the current directory, is not empty without ``force``, or with
    ``force`` is not an earlier import: ``--force`` replaces the whole directory, so one holding anything an import
    does not write (a training run, notes) or whose meta.json does not record an import (a checkpoint of a training
    run) is refused, naming what it holds. What killed imports left beside it is cleared first (``sweep``)."""
    check_output_dir(out)
    real = Path(os.path.realpath(out))
    cwd = Path(os.path.realpath(Path.cwd()))
    if real == cwd or real in cwd.parents:
        raise HFError(f"--output {out} " + ("is" if real == cwd else "holds") + " the current directory: an import "
                      "replaces its --output as a whole; give a directory of its own")
    sweep(real, "import_hf", "[import]")  # before the emptiness check: it may put an earlier import back
    if not real.is_dir() or not any(real.iterdir()):
        return real
    if not force:
        raise HFError(f"--output {out} is not empty (pass --force to replace the earlier import in it)")
    foreign = sorted(p.name for p in real.iterdir() if not IMPORT_FILES.match(p.name) or not p.is_file())
    if foreign:
        raise HFError(f"--output {out} holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, which "
                      "no import writes: it is not an earlier import, and --force replaces the whole directory "
                      "(move that away, or give another --output)")
    try:
        meta = json.loads((real / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or not meta.get("imported_from") or meta.get("weights_only") is not True:
        why = "records no imported_from (a training run's checkpoint?)" if isinstance(meta, dict) else \
            "is missing or not JSON"
        raise HFError(f"--output {out} is not an earlier import (its meta.json {why}): --force replaces only an "
                      "import (move it away, or give another --output)")
    return real


def import_model(model_dir: Path, out: Path, force: bool = False) -> Dict[str, Any]:
    """Convert; returns the settings (the model section) written. The checkpoint is written whole into a staging
    directory beside ``out`` and swapped in once complete (``_hf_staging.publish``): a failure leaves ``out`` as it
    was, and ``--force`` leaves exactly this import in it, nothing of the earlier one."""
    settings = model_settings(read_config(model_dir))
    out = check_output(out, force)
    tensors = from_hf(read_weights(model_dir), settings)
    tokenizer_files = read_tokenizer(model_dir, settings["vocab_size"])
    # what data.tokenizer names: sentencepiece's model where there is one (see read_tokenizer)
    tokenizer = out / tokenizer_files[0] if tokenizer_files else None
    staging = staging_dir(out, "import_hf")
    try:
        for name in tokenizer_files:
            shutil.copyfile(model_dir / name, staging / name)
        write_checkpoint(tensors, settings, out, model_dir.resolve(), tokenizer, into=staging)
        (staging / "model.yaml").write_text(model_yaml(settings, out, tokenizer))
        publish(staging, out, "import_hf")
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when published
    return settings


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory (config.json and weights)")
    p.add_argument("--output", required=True, help="checkpoint directory to write")
    p.add_argument("--force", action="store_true", help="replace an earlier import in --output")
    args = p.parse_args(argv)
    try:
        settings = import_model(Path(args.model), Path(args.output), force=args.force)
    except HFError as e:
        print("error: " + "; ".join(line.strip() for line in str(e).splitlines() if line.strip()), file=sys.stderr)
        return 2
    except OSError as e:  # writing the checkpoint (a full disk, no permission, a file where a directory belongs)
        where = f" ({e.filename})" if e.filename else ""
        print(f"error: cannot write the checkpoint to {args.output}: {e.strerror or e}{where}; {args.output} is "
              "unchanged", file=sys.stderr)
        return 2
    out = Path(args.output).resolve()
    print(f"[import] {args.model} -> {out} ({settings['n_layers']} layers, d_model {settings['d_model']}, "
          f"{settings['n_heads']} heads" + (f", {settings['n_kv_heads']} KV heads" if 'n_kv_heads' in settings else "")
          + (f", {settings['moe']['num_experts']} experts (top {settings['moe']['top_k']})" if "moe" in settings
             else "") + f", vocabulary {settings['vocab_size']}); train from it with:", file=sys.stderr)
    print(f"python train.py --config {out / 'model.yaml'} data.paths=[YOUR_DATA_PREFIX]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
