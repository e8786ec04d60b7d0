"""The read direction of the settings: a Hugging Face config.json checked field by field (``field_problems``) and
turned into our ``model.*`` settings (``model_settings``), every feature we cannot compute refused by name.

Experts (Mixtral, Qwen2-MoE, Qwen3-MoE) become ``model.moe``: a softmax router, the top-k renormalised where the
family does (Mixtral always, Qwen's ``norm_topk_prob``), Qwen's ``decoder_sparse_step`` and ``mlp_only_layers``
as the layer set ``model.moe.layer_freq`` / ``first_dense`` describe (a set they cannot describe is refused by
name), Qwen2-MoE's shared expert and its sigmoid gate. ``router_aux_loss_coef`` becomes
``model.moe.aux_loss_coeff`` as it is: the number people carry between Hugging Face and Megatron-style trainers
(Megatron's Mixtral recipes), although the two losses are normalised differently (transformers' is pooled over
the layers and top_k when balanced, added only with ``output_router_logits``; ours is 1 per layer when balanced,
summed over the MoE layers, always added when the coefficient is above 0); set ``model.moe.aux_loss_coeff`` in
the import's model.yaml to train with another, or 0 to drop it. What the families have that we cannot compute
(router jitter, sliding windows, biases on q/k/v/o together) is refused by name.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

from config import MAX_D_MODEL, MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB_SIZE
from config.moe import MAX_EXPERT_FFN, MAX_EXPERTS
from model.hf.families import (ARCHITECTURES, MOE_FAMILIES, QK_NORM_FAMILIES, ROPE_SETTINGS, ROPE_TYPES,
                               UNSUPPORTED_FAMILIES, HFError, hf_model_type)

HF_ROPE_KEYS = ("rope_parameters", "rope_scaling")
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
"""Keys that give a model experts: refused in the dense families (and n_routed_experts, DeepSeek's, in every one)."""
QK_NORM_KEYS = ("qk_norm", "use_qk_norm", "qk_layernorm")
"""Other families' QK-norm switches (Qwen3's is its model_type): refused by name."""
SLIDING_FLAG_FAMILIES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
"""Families whose sliding window is switched by use_sliding_window (sliding_window alone is only its width)."""
HF_INTS = {  # config.json key: (required, the setting it becomes, its largest value: config/schema.py's bound of it)
    "vocab_size": (True, "model.vocab_size", MAX_VOCAB_SIZE), "hidden_size": (True, "model.d_model", MAX_D_MODEL),
    "intermediate_size": (True, "model.ffn_hidden", 4 * MAX_D_MODEL),
    "num_hidden_layers": (True, "model.n_layers", MAX_LAYERS),
    "num_attention_heads": (True, "model.n_heads", MAX_D_MODEL),
    "num_key_value_heads": (False, "model.n_kv_heads", MAX_D_MODEL),
    "head_dim": (False, "model.kv_channels", MAX_D_MODEL),
    "max_position_embeddings": (False, "model.max_seq_len", MAX_SEQ_LEN),
}
HF_MOE_INTS = {  # the same, read in the MoE families only
    "num_local_experts": (False, "model.moe.num_experts", MAX_EXPERTS),
    "num_experts": (False, "model.moe.num_experts", MAX_EXPERTS),
    "num_experts_per_tok": (True, "model.moe.top_k", MAX_EXPERTS),
    "moe_intermediate_size": (False, "model.moe.ffn_hidden", MAX_EXPERT_FFN),
    "shared_expert_intermediate_size": (False, "model.moe.shared_ffn_hidden", MAX_EXPERT_FFN),
    "decoder_sparse_step": (False, "model.moe.layer_freq", MAX_LAYERS),
}
HF_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "qkv_bias", "norm_topk_prob")
HF_STRINGS = ("model_type", "hidden_act")  # names looked up in tables: a list or mapping there is refused by key
HF_POSITIVE_NUMBERS = {"rms_norm_eps": 1.0, "rope_theta": math.inf}  # key: exclusive upper bound
HF_NONNEGATIVE_NUMBERS = ("router_aux_loss_coef", "router_jitter_noise")


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
        found.append((key, rope.get("rope_type", rope.get("type", "default")), rope))  # as transformers reads it
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
    if kind not in ROPE_TYPES:  # named as the file spells it: transformers 4's configs may say "type"
        name = "rope_type" if "rope_type" in rope else "type"
        problems.append(f"{key}.{name}={_json(kind)} (only default, linear and llama3 RoPE are supported)")
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
    ints = {**HF_INTS, **(HF_MOE_INTS if cfg.get("model_type") in MOE_FAMILIES else {})}
    missing = [k for k, (required, _, _) in ints.items() if required and cfg.get(k) is None]
    if missing:
        problems.append(f"lacks a positive integer {', '.join(missing)}")
    for key, (_, ours, most) in ints.items():
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
    for key in HF_NONNEGATIVE_NUMBERS:
        value = cfg.get(key)
        if value is not None and not (_is_number(value) and value >= 0):
            problems.append(f"{key}={_json(value)} is not a finite number >= 0")
    layers, n = cfg.get("mlp_only_layers"), cfg.get("num_hidden_layers")
    if layers is not None and (not isinstance(layers, list) or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < (n if isinstance(n, int) else 0)
            for i in layers)):
        problems.append(f"mlp_only_layers={_json(layers)} is not a list of layer indices (0 to num_hidden_layers - 1)")
    return problems


def _unsupported(cfg: Mapping[str, Any], model_type: Any) -> List[str]:
    """Architectural features of config.json we do not compute (sliding windows, other families' QK-norm, experts
    outside the MoE families, router jitter), by key."""
    problems = []
    if model_type not in ARCHITECTURES:
        why = UNSUPPORTED_FAMILIES.get(model_type) if isinstance(model_type, str) else None
        problems.append(f"model_type={model_type!r} (" + (f"{why}; " if why else "") + "only "
                        + ", ".join(list(ARCHITECTURES)[:-1]) + f" and {list(ARCHITECTURES)[-1]} are supported)")
    for key in MOE_KEYS:
        if cfg.get(key) and (model_type not in MOE_FAMILIES or key == "n_routed_experts"):
            problems.append(f"{key}={_json(cfg[key])} (mixture-of-experts in a {model_type} model: experts import "
                            "as mixtral, qwen2_moe or qwen3_moe)")
    for key in QK_NORM_KEYS:
        if cfg.get(key):
            problems.append(f"{key}={_json(cfg[key])} (QK-norm is not supported)")
    if cfg.get("router_jitter_noise"):
        problems.append(f"router_jitter_noise={_json(cfg['router_jitter_noise'])} (routing with multiplicative "
                        "input noise is not supported: 0)")
    if model_type in ("qwen3", "qwen3_moe") and cfg.get("attention_bias"):
        problems.append("attention_bias=true (biases on q, k, v and o_proj together, none in the MLP: ours are on "
                        "q/k/v only, or on every linear layer)")
    # Qwen's families (qwen2, qwen2_moe, qwen3, ...) switch their window with use_sliding_window: sliding_window is
    # then only the width it would have (Qwen2-MoE's config even writes 0), not a window in use. Mistral's,
    # Mixtral's and Llama's configs have no such flag: a sliding_window there is one.
    flag = cfg.get("use_sliding_window")
    if model_type in SLIDING_FLAG_FAMILIES or (model_type not in ARCHITECTURES and isinstance(flag, bool)):
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


def moe_layer_choice(moe_layers: List[int], n_layers: int, step: int) -> Optional[Tuple[int, int]]:
    """``(layer_freq, first_dense)`` whose MoE layers (``config.moe.is_moe_layer``) are exactly ``moe_layers``
    (sorted, not empty), or None when no pair is: every layer_freq-th layer from first_dense on."""
    first = moe_layers[0]
    freq = moe_layers[1] - first if len(moe_layers) > 1 else max(step, n_layers - first)
    return (freq, first) if moe_layers == list(range(first, n_layers, freq)) else None


def _moe_settings(cfg: Mapping[str, Any], model_type: str, problems: List[str]) -> Dict[str, Any]:
    """``model.moe`` of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json (its fields already checked by type); what
    cannot be expressed is appended to ``problems``."""
    n = cfg["num_hidden_layers"]
    given = {k: cfg[k] for k in ("num_local_experts", "num_experts") if cfg.get(k) is not None}
    if len(set(given.values())) > 1:
        problems.append(f"num_local_experts={given['num_local_experts']} and num_experts={given['num_experts']} "
                        "disagree")
    experts = next(iter(given.values()), None)
    if experts is None:
        key = "num_local_experts" if model_type == "mixtral" else "num_experts"
        problems.append(f"lacks a positive integer {key} (the number of experts)")
        return {}
    top_k = cfg["num_experts_per_tok"]
    if top_k > experts:
        problems.append(f"num_experts_per_tok={top_k} exceeds the {experts} experts")
    moe: Dict[str, Any] = {"num_experts": experts, "top_k": top_k, "score": "softmax",
                           "aux_loss_coeff": float(cfg.get("router_aux_loss_coef") or 0.0)}
    if model_type == "mixtral":  # every layer, renormalised top-k, experts as wide as intermediate_size
        return {**moe, "ffn_hidden": cfg["intermediate_size"], "norm_topk": True}
    for key in ("moe_intermediate_size",) + (("shared_expert_intermediate_size",) if model_type == "qwen2_moe" else ()):
        if cfg.get(key) is None:
            problems.append(f"lacks a positive integer {key}")
    moe.update({"ffn_hidden": cfg.get("moe_intermediate_size"), "norm_topk": bool(cfg.get("norm_topk_prob", False))})
    if model_type == "qwen2_moe":  # one shared expert behind a sigmoid gate
        moe.update({"shared_experts": 1, "shared_ffn_hidden": cfg.get("shared_expert_intermediate_size"),
                    "shared_gate": True})
    step, dense = cfg.get("decoder_sparse_step") or 1, cfg.get("mlp_only_layers") or []
    sparse = [i for i in range(n) if (i + 1) % step == 0 and i not in dense]
    choice = moe_layer_choice(sparse, n, step) if sparse else None
    if choice is None:
        problems.append(f"decoder_sparse_step={step} with mlp_only_layers={_json(dense)} makes layers {sparse} MoE "
                        f"of {n} (model.moe.layer_freq and first_dense express every layer_freq-th layer from "
                        "first_dense on" + (")" if sparse else "; here none)"))
    else:
        moe.update({"layer_freq": choice[0], "first_dense": choice[1]})
    return moe


def model_settings(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """Our ``model.*`` settings equal to a config.json of one of ``ARCHITECTURES``' families: HFError naming every
    field of a wrong type or out of range (by key and value), else every setting we cannot express."""
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
    # Qwen2's q/k/v projections always have biases (Qwen2-MoE's unless transformers 5's qkv_bias says not), o_proj none
    bias, qkv_bias = False, model_type == "qwen2" or (model_type == "qwen2_moe" and cfg.get("qkv_bias", True))
    if model_type == "llama":
        attn_bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
        if attn_bias != mlp_bias:
            problems.append(f"attention_bias={attn_bias} with mlp_bias={mlp_bias} (one model.bias "
                            "covers both: they must be equal)")
        bias = attn_bias
    rope, rope_problems = _rope(cfg)
    problems += rope_problems
    moe = _moe_settings(cfg, model_type, problems) if model_type in MOE_FAMILIES else None
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
    if model_type in QK_NORM_FAMILIES:
        settings["qk_norm"] = True
    if moe is not None:
        settings["moe"] = moe
    if model_type not in ("llama", "qwen2") or hf_model_type(settings) != model_type:  # where not implied
        settings["hf_model_type"] = model_type
    return settings

