"""What a checkpoint must share with the run that loads it: the model settings meta.json records, and the rule that
compares them (``training/checkpoint.py`` applies it when loading)."""
from __future__ import annotations

from typing import Any, Dict, List

from config import ModelConfig

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
"""The model.moe settings that shape the parameters (recorded as ``moe`` for a model with experts)."""


def model_record(model: ModelConfig) -> Dict[str, Any]:
    """What meta.json records of the model: MODEL_KEYS, the RoPE scaling's own settings and, with experts, the
    model.moe settings that shape the parameters (``moe``; None for a dense model)."""
    keys = MODEL_KEYS + ROPE_SCALING_KEYS.get(model.rope_scaling, ())
    record = {k: getattr(model, k) for k in keys}
    moe = model.moe
    record["moe"] = {k: getattr(moe, k) for k in MOE_KEYS} if moe.num_experts else None
    return record


def model_mismatch(meta: Dict[str, Any], model: ModelConfig, rope: bool = True) -> List[str]:
    """The run's model settings that differ from those the checkpoint records, one phrase each. Settings it
    does not record are not compared (older checkpoints lack norm_eps and rope_theta); before grouped-query
    attention every checkpoint had n_kv_heads = n_heads. ``rope=False``: leave out the rotary settings (base,
    scaling and its factors), which shape no weight."""
    saved = {"kv_heads": meta["model"].get("n_heads"), "qkv_bias": False, "rope_scaling": "none", "moe": None,
             "qk_norm": False,
             **meta["model"]}
    if "head_dim" not in saved and "d_model" in saved and saved.get("n_heads"):
        saved["head_dim"] = saved["d_model"] // saved["n_heads"]  # before model.kv_channels
    ours = model_record(model)
    names = {"kv_heads": "n_kv_heads", "head_dim": "kv_channels"}
    skip = () if rope else ROPE_KEYS
    return [f"model.{names.get(k, k)}: checkpoint {saved[k]!r} vs config {ours[k]!r}"
            for k in ours if k in saved and saved[k] != ours[k] and k not in skip]
