"""What a checkpoint must share with the run that loads it, checked from its meta.json alone: the model settings
(``model_record``), and for a full resume the optimizer. ``training/checkpoint.py`` applies these rules when it
loads a checkpoint, and the trainer applies the same ones at start-up (``training/trainer.py`` ``check_start``),
before it creates or locks anything, so a refusal leaves nothing behind.

Which differences are refused:

- a full resume (the run's own checkpoint, ``checkpoint.load``) refuses every recorded model setting that differs,
  and a ``train.optimizer`` whose state does not carry over (AdamW and 8-bit AdamW load each other's): the
  optimizer state, the loss curve and the data position all belong to the model as it was;
- ``checkpoint.init_from`` (the weights only, fresh optimizer, step 0) refuses the settings that shape a weight and
  takes new rotary settings (``ROPE_KEYS``: a long-context phase) and a new router (``ROUTER_KEYS``), naming each
  change on one line: none of them shapes a weight, and a new phase from a checkpoint's weights is where Megatron's
  ``--finetune`` or DeepSpeed's ``load_module_only`` would change them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from config import Config, ModelConfig
from training.checkpoint_files import STEP_DIR, checkpoint_root, newest_with_meta, read_verified_meta
from training.safe_load import CheckpointError

MODEL_KEYS = ("n_layers", "d_model", "n_heads", "kv_heads", "head_dim", "vocab_size", "ffn_size", "activation",
              "norm", "tie_embeddings", "bias", "qkv_bias", "norm_eps", "rope_theta", "rope_scaling", "qk_norm")
"""The model settings meta.json records; a checkpoint loads only into a model with the same ones."""
ROPE_SCALING_KEYS = {"linear": ("rope_scaling_factor",),
                     "llama3": ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                                "rope_original_max_positions")}
"""The settings each RoPE scaling also depends on (recorded with it)."""
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
             "rope_original_max_positions")
"""The rotary settings: no weight depends on them (``checkpoint.init_from`` may change them)."""


MOE_KEYS = ("num_experts", "top_k", "ffn_hidden", "shared_experts", "shared_ffn_hidden", "shared_gate", "layer_freq",
            "first_dense")
"""The model.moe settings recorded as ``moe`` for a model with experts since MoE came (all but top_k shape the
parameters)."""
ROUTER_KEYS = ("top_k", "score", "norm_topk", "routed_scale")
"""The router's settings: how many experts a token goes to and how the gates are computed from the router's
logits. No weight depends on them (``checkpoint.init_from`` may change them); recorded with MOE_KEYS (score,
norm_topk and routed_scale since issue 53: older checkpoints are compared by the config they record)."""


def model_record(model: ModelConfig) -> Dict[str, Any]:
    """What meta.json records of the model: MODEL_KEYS, the RoPE scaling's own settings and, with experts, the
    model.moe settings (``moe``: MOE_KEYS and ROUTER_KEYS; None for a dense model)."""
    keys = MODEL_KEYS + ROPE_SCALING_KEYS.get(model.rope_scaling, ())
    record = {k: getattr(model, k) for k in keys}
    moe = model.moe
    record["moe"] = {k: getattr(moe, k) for k in MOE_KEYS + ROUTER_KEYS} if moe.num_experts else None
    return record


INIT_FROM_MAY_CHANGE = frozenset([f"model.{k}" for k in ROPE_KEYS] + [f"model.moe.{k}" for k in ROUTER_KEYS])
"""The settings (as differences name them) that ``checkpoint.init_from`` takes changed: they shape no weight."""


def _saved_moe(meta: Dict[str, Any]) -> Dict[str, Any]:
    """The checkpoint's model.moe settings: its record, and for the keys older checkpoints did not record there the
    config they record (every training checkpoint and import records one); ``num_experts`` 0 for a dense model."""
    record = meta["model"].get("moe")
    if not record:
        return {"num_experts": 0}
    config = ((meta.get("config") or {}).get("model") or {}).get("moe") or {}
    return {**{k: config[k] for k in ROUTER_KEYS if k in config}, **record}


def model_differences(meta: Dict[str, Any], model: ModelConfig) -> List[Tuple[str, str]]:
    """The run's model settings that differ from those the checkpoint records: (setting, phrase) each, e.g.
    ``("model.moe.top_k", "model.moe.top_k: checkpoint 2 vs config 1")``. Settings it does not record are not
    compared (older checkpoints lack norm_eps and rope_theta); before grouped-query attention every checkpoint had
    n_kv_heads = n_heads. Between a dense model and one with experts only model.moe.num_experts is named."""
    saved = {"kv_heads": meta["model"].get("n_heads"), "qkv_bias": False, "rope_scaling": "none", "qk_norm": False,
             **meta["model"]}
    if "head_dim" not in saved and "d_model" in saved and saved.get("n_heads"):
        saved["head_dim"] = saved["d_model"] // saved["n_heads"]  # before model.kv_channels
    ours = model_record(model)
    names = {"kv_heads": "n_kv_heads", "head_dim": "kv_channels"}
    out = [(f"model.{names.get(k, k)}", f"model.{names.get(k, k)}: checkpoint {saved[k]!r} vs config {ours[k]!r}")
           for k in ours if k != "moe" and k in saved and saved[k] != ours[k]]
    saved_moe, our_moe = _saved_moe(meta), ours["moe"] or {"num_experts": 0}
    keys = ["num_experts"] if 0 in (saved_moe["num_experts"], our_moe["num_experts"]) else list(our_moe)
    out += [(f"model.moe.{k}", f"model.moe.{k}: checkpoint {saved_moe[k]!r} vs config {our_moe[k]!r}")
            for k in keys if k in saved_moe and saved_moe[k] != our_moe[k]]
    return out


def resumable(cfg: Config, ckpt_dir: Path) -> Optional[Path]:
    """``ckpt_dir`` when the run resumes from it (checkpoint.resume) and it holds a published checkpoint, else None:
    then, and only then, checkpoint.init_from is not read."""
    holds = ckpt_dir.is_dir() and any(STEP_DIR.match(p.name) for p in ckpt_dir.iterdir())
    return ckpt_dir if cfg.checkpoint.resume and holds else None


def fresh_start_advice(cfg: Config, path: Path, resumable: Optional[Path]) -> str:
    """How to start a run from the weights of checkpoint ``path`` with a fresh optimizer: ``checkpoint.init_from``,
    which is read only when the run has nothing of its own to resume (``resumable``: the checkpoint.dir that holds
    a checkpoint to resume, else None), so then in a new run directory (or a new checkpoint.dir, where one is
    set). Not checkpoint.resume=false in the same directory: that run would save among the old run's checkpoints,
    whose higher steps stay the newest (the next resume finds them again), and drop the old run's metrics."""
    if resumable is None:
        return (f"start from its weights with checkpoint.init_from={path}"
                + (" in place of checkpoint.load" if cfg.checkpoint.load else ""))
    where = "checkpoint.dir" if cfg.checkpoint.dir else "logging.run_dir"
    return (f"start from its weights in a new run: {where}=<a new directory> checkpoint.init_from={path} "
            f"(checkpoint.init_from is not read while {resumable} holds a checkpoint to resume)")


def check_resume(meta: Dict[str, Any], cfg: Config, path: Path, resumable: Optional[Path],
                 with_optimizer: bool = True) -> None:
    """A full resume from checkpoint ``path`` (its meta.json ``meta``): CheckpointError (one line) when a recorded
    model setting differs or, ``with_optimizer``, the optimizer state does not carry over. ``resumable``: the
    checkpoint.dir that holds a checkpoint of the run's own to resume, or None (what the advice says to do)."""
    differences = model_differences(meta, cfg.model)
    if differences:
        advice = ""
        if all(k in INIT_FROM_MAY_CHANGE for k, _ in differences):  # a new phase may change them, not a resume
            advice = (f"; to change {'them' if len(differences) > 1 else 'it'}, "
                      + fresh_start_advice(cfg, path, resumable))
        raise CheckpointError(f"checkpoint {path} was trained with a different model "
                              f"({', '.join(p for _, p in differences)}){advice}")
    if not with_optimizer:
        return
    then, now = ((meta.get("config") or {}).get("train") or {}).get("optimizer", "adamw"), cfg.train.optimizer
    if then != now and not {then, now} <= {"adamw", "adamw8bit"}:  # both keep exp_avg(_sq), fp32
        raise CheckpointError(f"checkpoint {path} was trained with train.optimizer={then}, this run uses "
                              f"train.optimizer={now}: its optimizer state does not carry over; "
                              + fresh_start_advice(cfg, path, resumable))


def check_weights(meta: Dict[str, Any], model: ModelConfig, path: Path, key: str) -> Dict[str, List[str]]:
    """``key``=``path`` (checkpoint.init_from, or a weights-only checkpoint.load) starts from the checkpoint's
    weights: CheckpointError (one line) when a setting that shapes a weight differs; else the rotary and router
    settings that changed, ``{"rope": [phrase, ...], "router": [...]}``."""
    differences = model_differences(meta, model)
    refused = [p for k, p in differences if k not in INIT_FROM_MAY_CHANGE]
    if refused:
        raise CheckpointError(f"{key}={path} holds a different model ({', '.join(refused)}); "
                              "set the run's model.* to the checkpoint's (an import writes them to model.yaml)")
    return {"rope": [p for k, p in differences if k.startswith("model.rope")],
            "router": [p for k, p in differences if k.startswith("model.moe.")]}


def check_start_checkpoint(cfg: Config, ckpt_dir: Path) -> None:
    """The checkpoint a run will start from (checkpoint.load, else the newest in ``ckpt_dir`` when it resumes, else
    checkpoint.init_from), checked by its meta.json alone with the rules above; the trainer calls this at start-up,
    before it creates or locks anything. A checkpoint whose meta.json its manifest does not verify is left to the
    load, which names what is wrong."""
    c, own = cfg.checkpoint, resumable(cfg, ckpt_dir)
    if c.load:
        path = Path(c.load)
        if not path.exists():
            raise CheckpointError(f"checkpoint.load={path} does not exist")
        meta = read_verified_meta(path)
        if meta is not None and meta.get("weights_only"):
            check_weights(meta, cfg.model, path, "checkpoint.load")
        elif meta is not None:
            check_resume(meta, cfg, path, own)
    elif own is not None:
        path, meta = newest_with_meta(own)
        if meta is not None:
            check_resume(meta, cfg, path, own)
    elif c.init_from:
        given = Path(c.init_from)
        check_init_from_path(given, "checkpoint.init_from")
        if (given / "meta.json").is_file():
            path, meta = given, read_verified_meta(given)
        else:
            path, meta = newest_with_meta(checkpoint_root(given))
        if meta is not None:
            check_weights(meta, cfg.model, path, "checkpoint.init_from")


def check_init_from_path(given: Path, key: str) -> None:
    """``key``=``given`` must be a checkpoint, a checkpoint root or a run directory with one."""
    if not given.exists():
        raise CheckpointError(f"{key}={given} does not exist")
    root = checkpoint_root(given)
    if not (given / "meta.json").is_file() and not (root.is_dir() and any(p.name.startswith("step_")
                                                                           for p in root.iterdir())):
        raise CheckpointError(f"{key}={given} holds no checkpoint (expected meta.json, step_*/ or checkpoints/step_*/ "
                              "there)")
