"""The read direction of the settings: a Hugging Face config.json checked field by field (``field_problems``) and
turned into our ``model.*`` settings (``model_settings``), every feature we cannot compute refused by name."""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Mapping, Tuple

from config import MAX_D_MODEL, MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB_SIZE
from model.hf.families import ARCHITECTURES, ROPE_SETTINGS, ROPE_TYPES, UNSUPPORTED_FAMILIES, HFError, hf_model_type

HF_ROPE_KEYS = ("rope_parameters", "rope_scaling")
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
QK_NORM_KEYS = ("qk_norm", "use_qk_norm", "qk_layernorm")
HF_INTS = {  # config.json key: (required, the setting it becomes, its largest value: config/schema.py's bound of it)
    "vocab_size": (True, "model.vocab_size", MAX_VOCAB_SIZE), "hidden_size": (True, "model.d_model", MAX_D_MODEL),
    "intermediate_size": (True, "model.ffn_hidden", 4 * MAX_D_MODEL),
    "num_hidden_layers": (True, "model.n_layers", MAX_LAYERS),
    "num_attention_heads": (True, "model.n_heads", MAX_D_MODEL),
    "num_key_value_heads": (False, "model.n_kv_heads", MAX_D_MODEL),
    "head_dim": (False, "model.kv_channels", MAX_D_MODEL),
    "max_position_embeddings": (False, "model.max_seq_len", MAX_SEQ_LEN),
}
HF_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
HF_STRINGS = ("model_type", "hidden_act")  # names looked up in tables: a list or mapping there is refused by key
HF_POSITIVE_NUMBERS = {"rms_norm_eps": 1.0, "rope_theta": math.inf}  # key: exclusive upper bound


def _json(value: Any) -> str:
    """A config.json value as JSON spells it (true, "false", 1e-05)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _rope(cfg: Mapping[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
    """Our ``rope_*`` settings from config.json (transformers 5's ``rope_parameters`` or 4's ``rope_theta`` and
    ``rope_scaling``) and what we cannot express, one phrase per key."""
    problems: List[str] = []
    found: List[Tuple[str, str, Mapping[str, Any]]] = []  # (key, rope_type, mapping) of each one given
    for key in HF_ROPE_KEYS:
        rope = cfg.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            problems.append(f"{key}={_json(rope)} is not a mapping")
            continue
        found.append((key, rope.get("rope_type", rope.get("type", "default")), rope))
    given = {key: rope for key, _, rope in found}
    thetas = (given.get("rope_parameters", {}).get("rope_theta"), cfg.get("rope_theta"),
              given.get("rope_scaling", {}).get("rope_theta"))  # transformers 5's first, as it reads them
    theta = next((t for t in thetas if t is not None), None)
    scaled = [(key, kind, rope) for key, kind, rope in found if kind != "default"]
    if len(scaled) == 2 and (scaled[0][1] != scaled[1][1] or any(
            scaled[0][2].get(p) != scaled[1][2].get(p) for p in ROPE_TYPES.get(scaled[0][1], ()))):
        problems.append(f"rope_parameters={_json(scaled[0][2])} and rope_scaling={_json(scaled[1][2])} disagree")
    settings: Dict[str, Any] = {"rope_theta": float(theta if theta is not None else 10000.0)}
    key, kind, rope = scaled[0] if scaled else (found[0] if found else ("rope_parameters", "default", {}))
    if kind not in ROPE_TYPES:
        problems.append(f"{key}.rope_type={_json(kind)} (only default, linear and llama3 RoPE are supported)")
        return settings, problems
    params = dict(rope)
    if kind == "llama3" and params.get("original_max_position_embeddings") is None:
        params["original_max_position_embeddings"] = cfg.get("max_position_embeddings")  # transformers' fallback
    for name, value in params.items():
        if name in ("rope_type", "type", "rope_theta") or (name in ROPE_TYPES[kind] and value is not None):
            continue
        if name == "partial_rotary_factor" and value == 1:
            continue
        if name == "attention_factor" and value in (None, 1):
            continue
        problems.append(f"{key}.{name}={_json(value)} (not supported with rope_type {kind})")
    for name in ROPE_TYPES[kind]:
        value = params.get(name)
        if name == "original_max_position_embeddings":
            ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_SEQ_LEN
        else:
            ok = _is_number(value) and value > 0 and (name != "factor" or value >= 1)
        if not ok:
            problems.append(f"{key}.{name}={_json(value)} is not a " + (
                "positive integer" if name == "original_max_position_embeddings" else
                "finite number >= 1" if name == "factor" else "finite number above 0"))
        else:
            settings[ROPE_SETTINGS[name]] = float(value) if name != "original_max_position_embeddings" else value
    if kind == "llama3" and not problems and settings["rope_low_freq_factor"] >= settings["rope_high_freq_factor"]:
        problems.append(f"{key}.low_freq_factor={_json(params['low_freq_factor'])} is not below high_freq_factor="
                        f"{_json(params['high_freq_factor'])}")
    if kind != "default":
        settings["rope_scaling"] = kind
    return settings, problems


def field_problems(cfg: Mapping[str, Any]) -> List[str]:
    """What is wrong with the types and ranges of the config.json fields we read, one phrase per key naming the key
    and its value (empty when nothing is); a field that is absent (or null) takes its default unless required."""
    problems = []
    missing = [k for k, (required, _, _) in HF_INTS.items() if required and cfg.get(k) is None]
    if missing:
        problems.append(f"lacks a positive integer {', '.join(missing)}")
    for key, (_, ours, most) in HF_INTS.items():
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{key}={_json(value)} is not a positive integer")
        elif value > most:
            problems.append(f"{key}={value} exceeds {most}, the largest {ours}")
    for key in HF_BOOLS:
        value = cfg.get(key)
        if value is not None and not isinstance(value, bool):
            problems.append(f"{key}={_json(value)} is not true or false")
    for key in HF_STRINGS:
        value = cfg.get(key)
        if value is not None and not isinstance(value, str):
            problems.append(f"{key}={_json(value)} is not a string")
    for key in HF_ROPE_KEYS:
        rope = cfg.get(key)
        for name in ("rope_type", "type"):
            value = rope.get(name) if isinstance(rope, dict) else None
            if value is not None and not isinstance(value, str):
                problems.append(f"{key}.{name}={_json(value)} is not a string")
    numbers = [(key, cfg.get(key), most) for key, most in HF_POSITIVE_NUMBERS.items()]
    numbers += [(f"{key}.rope_theta", cfg[key].get("rope_theta"), math.inf) for key in HF_ROPE_KEYS
                if isinstance(cfg.get(key), dict)]
    for key, value, most in numbers:
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < most:
            what = f"a number in (0, {most:g})" if math.isfinite(most) else "a finite number above 0"
            problems.append(f"{key}={_json(value)} is not {what}")
    return problems


def _unsupported(cfg: Mapping[str, Any], model_type: Any) -> List[str]:
    """Architectural features of config.json we do not compute (sliding windows, QK-norm, experts), by key."""
    problems = []
    if model_type not in ARCHITECTURES:
        why = UNSUPPORTED_FAMILIES.get(model_type) if isinstance(model_type, str) else None
        problems.append(f"model_type={model_type!r} (" + (f"{why}; " if why else "")
                        + "only llama, qwen2 and mistral are supported)")
    for key in MOE_KEYS:
        if cfg.get(key):
            problems.append(f"{key}={_json(cfg[key])} (mixture-of-experts is not supported)")
    for key in QK_NORM_KEYS:
        if cfg.get(key):
            problems.append(f"{key}={_json(cfg[key])} (QK-norm is not supported)")
    # Qwen2's family (qwen2, qwen2_moe, qwen3, ...) switches its window with use_sliding_window: sliding_window is
    # then only the width it would have (Qwen2-MoE's config even writes 0), not a window in use. Mistral's and
    # Llama's configs have no such flag: a sliding_window there is one.
    flag = cfg.get("use_sliding_window")
    if model_type == "qwen2" or (model_type not in ARCHITECTURES and isinstance(flag, bool)):
        if flag:
            problems.append(f"use_sliding_window=true, sliding_window={_json(cfg.get('sliding_window'))} "
                            "(sliding-window attention is not supported)")
    elif cfg.get("sliding_window") is not None:
        problems.append(f"sliding_window={_json(cfg['sliding_window'])} (sliding-window attention is not supported; "
                        "null means full attention)")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or any(t != "full_attention" for t in layer_types)):
        other = sorted({str(t) for t in layer_types if t != "full_attention"}) if isinstance(layer_types, list) \
            else layer_types
        problems.append(f"layer_types holds {_json(other)} (only full_attention layers are supported)")
    partial = cfg.get("partial_rotary_factor")
    if partial is not None and partial != 1:
        problems.append(f"partial_rotary_factor={_json(partial)} (rotary embeddings on part of each head are not "
                        "supported)")
    return problems


def model_settings(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """Our ``model.*`` settings equal to a Llama / Qwen2 / Mistral config.json: HFError naming every field of a
    wrong type or out of range (by key and value), else every setting we cannot express."""
    bad = field_problems(cfg)
    if bad:
        raise HFError("config.json: " + "; ".join(bad))
    model_type = cfg.get("model_type")
    problems = _unsupported(cfg, model_type)
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        problems.append(f"hidden_act={act!r} (only silu, i.e. SwiGLU, is supported)")
    head_dim = cfg.get("head_dim") or (d // heads)
    if cfg.get("head_dim") is None and d % heads:
        problems.append(f"hidden_size={d} is not divisible by num_attention_heads={heads} (and no head_dim given)")
    if head_dim % 2:
        problems.append(f"head_dim={head_dim} is odd (rotary embeddings need an even head dim)")
    if heads * head_dim > 4 * MAX_D_MODEL:
        problems.append(f"num_attention_heads x head_dim = {heads * head_dim} exceeds {4 * MAX_D_MODEL}")
    if heads % kv:
        problems.append(f"num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    bias, qkv_bias = False, model_type == "qwen2"  # Qwen2's q/k/v projections always have biases, o_proj none
    if model_type == "llama":
        attn_bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
        if attn_bias != mlp_bias:
            problems.append(f"attention_bias={attn_bias} with mlp_bias={mlp_bias} (one model.bias "
                            "covers both: they must be equal)")
        bias = attn_bias
    rope, rope_problems = _rope(cfg)
    problems += rope_problems
    if cfg.get("quantization_config"):
        problems.append("quantization_config is set (quantized checkpoints are not supported)")
    if problems:
        raise HFError("cannot import this model: " + "; ".join(problems))
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    settings: Dict[str, Any] = {
        "n_layers": cfg["num_hidden_layers"], "d_model": d, "n_heads": heads, "vocab_size": cfg["vocab_size"],
        "ffn_hidden": cfg["intermediate_size"], "activation": "swiglu", "norm": "rmsnorm",
        "norm_eps": float(cfg.get("rms_norm_eps") or 1e-6), **rope,
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)), "bias": bias,
        "max_seq_len": max_pos, "seq_len": min(max_pos, 2048),
    }
    if qkv_bias:
        settings["qkv_bias"] = True
    if kv != heads:
        settings["n_kv_heads"] = kv
    if head_dim * heads != d:
        settings["kv_channels"] = head_dim
    if hf_model_type(settings) != model_type:  # named only where the other settings do not imply it (Mistral)
        settings["hf_model_type"] = model_type
    return settings

