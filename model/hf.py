"""Hugging Face Llama, Qwen2 and Mistral <-> this GPT: settings and parameter names, shared by
scripts/export_hf.py and import_hf.py.

Our model with ``activation=swiglu`` and ``norm=rmsnorm`` is a Llama decoder: pre-norm blocks, RMSNorm
(``x * rsqrt(mean(x^2) + eps) * w``), rotary embeddings in the rotate-half form that transformers'
rotary classes use (so q/k need no permutation), SwiGLU ``down(silu(gate(x)) * up(x))``, an untied or tied
output head without bias. Qwen2 is the same decoder with biases on q/k/v only (``model.qkv_bias``), Mistral
the same without biases (its sliding window refused). Fused tensors are stacked on a leading dim
(Q = n_heads * head_dim, KV = n_kv_heads * head_dim; head_dim = ``model.kv_channels``, default d / n_heads):

    ours (global name, global shape)                    Hugging Face (all three families)
    embedding.weight            (V, d)                  model.embed_tokens.weight
    head.weight                 (V, d)                  lm_head.weight (absent when tied)
    final_norm.weight           (d,)                    model.norm.weight
    layers.i.attn_norm.weight   (d,)                    model.layers.i.input_layernorm.weight
    layers.i.mlp_norm.weight    (d,)                    model.layers.i.post_attention_layernorm.weight
    layers.i.attn.qkv.weight    (3, Q, d)  [0] [1] [2]  ...self_attn.q_proj / k_proj / v_proj.weight
    layers.i.attn.q.weight      (Q, d)                  ...self_attn.q_proj.weight      } grouped-query
    layers.i.attn.kv.weight     (2, KV, d) [0] [1]      ...self_attn.k_proj / v_proj    } (n_kv_heads < n_heads)
    layers.i.attn.proj.weight   (d, Q)                  ...self_attn.o_proj.weight
    layers.i.mlp.up.weight      (2, F, d)  [0] [1]      ...mlp.gate_proj / up_proj.weight
    layers.i.mlp.down.weight    (d, F)                  ...mlp.down_proj.weight

Biases follow their weights: q/k/v ones with ``model.qkv_bias`` or ``model.bias`` (Qwen2; Llama's
``attention_bias``), o_proj and the MLP's with ``model.bias`` (Llama's ``attention_bias`` and ``mlp_bias``
together). RoPE: ``rope_type`` default, ``linear`` and ``llama3`` (``model.rope_scaling``). Everything that
these families cannot express, or that we cannot (other RoPE types, sliding windows, QK-norm, mixtures of
experts, quantized weights), is refused by name (``HFError``).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from config import MAX_D_MODEL, MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB_SIZE, ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
"""config.json's model_type -> its architectures entry, for the families we import and export."""
UNSUPPORTED_FAMILIES = {
    "qwen3": "QK-norm: q and k are RMS-normalised per head", "olmo2": "QK-norm", "gemma3": "QK-norm",
    "qwen2_moe": "mixture-of-experts", "qwen3_moe": "QK-norm and mixture-of-experts", "mixtral": "mixture-of-experts",
    "deepseek_v3": "mixture-of-experts and latent attention", "gemma": "GeGLU and scaled embeddings",
    "gemma2": "soft-capped logits and sliding windows", "phi3": "fused qkv and partial rotary", "gpt2": "GELU, "
    "learned positions, LayerNorm"}
"""Families people ask for that we cannot express, with the reason named in the refusal."""
HF_ROPE_KEYS = ("rope_parameters", "rope_scaling")
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
"""rope_type -> its parameters (config.json spelling), for the RoPE types we compute."""
ROPE_SETTINGS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                 "high_freq_factor": "rope_high_freq_factor",
                 "original_max_position_embeddings": "rope_original_max_positions"}
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


class HFError(ValueError):
    """A model, checkpoint or file that cannot be converted; the message is one line naming why."""


# ---- our model settings -----------------------------------------------------------------------------------

def check_output_dir(out: Path) -> None:
    """``--output`` of an export or import: a directory, or a path where one can be made (the nearest existing
    ancestor is a directory); HFError naming what is in the way."""
    for parent in out.absolute().parents:  # the nearest one that exists must be a directory
        if parent.exists():
            if not parent.is_dir():
                raise HFError(f"--output {out}: {parent} is not a directory")
            break
    if out.exists() and not out.is_dir():
        raise HFError(f"--output {out} exists and is not a directory")


def model_config(settings: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig from a ``model`` section (e.g. a checkpoint's meta.json); keys it does not know are ignored."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in settings.items() if k in known})


def hf_model_type(settings: Mapping[str, Any], override: Optional[str] = None) -> str:
    """The family a model of these settings exports as: ``override``, else ``model.hf_model_type``, else qwen2
    when it has biases on q/k/v only, else llama."""
    m = model_config(settings)
    chosen = override or m.hf_model_type
    if chosen is not None:
        if chosen not in ARCHITECTURES:
            raise HFError(f"model type {chosen!r} is not one of {sorted(ARCHITECTURES)}")
        return chosen
    return "qwen2" if m.qkv_bias and not m.bias else "llama"


def export_problems(settings: Mapping[str, Any], model_type: Optional[str] = None) -> List[str]:
    """Why a model of these settings is not of its Hugging Face family (empty when it is), one reason per
    setting."""
    problems = []
    family = hf_model_type(settings, model_type)
    name = ARCHITECTURES[family][:-len("ForCausalLM")]
    if settings.get("activation", "swiglu") != "swiglu":
        problems.append(f"model.activation={settings['activation']} ({name}'s MLP is SwiGLU: model.activation=swiglu)")
    if settings.get("norm", "rmsnorm") != "rmsnorm":
        problems.append(f"model.norm={settings['norm']} ({name} normalises with RMSNorm: model.norm=rmsnorm)")
    m = model_config(settings)
    if m.n_heads % m.kv_heads:
        problems.append(f"model.n_kv_heads={m.kv_heads} does not divide model.n_heads={m.n_heads}")
    if family == "llama" and m.qkv_bias and not m.bias:
        problems.append("model.qkv_bias=true without model.bias (Llama's attention_bias also biases o_proj; "
                        "export as qwen2)")
    if family == "qwen2" and m.bias:
        problems.append("model.bias=true (Qwen2 has biases on q/k/v only: model.qkv_bias)")
    if family == "qwen2" and not m.attn_bias:
        problems.append("model.qkv_bias=false (Qwen2 always has q/k/v biases)")
    if family == "mistral" and m.attn_bias:
        problems.append(f"model.{'bias' if m.bias else 'qkv_bias'}=true (Mistral has no biases)")
    return problems


# ---- config.json ------------------------------------------------------------------------------------------

def _rope_parameters(m: ModelConfig) -> Dict[str, Any]:
    """The RoPE of our model as transformers 5's ``rope_parameters``."""
    kind = "default" if m.rope_scaling == "none" else m.rope_scaling
    return {"rope_type": kind, "rope_theta": m.rope_theta,
            **{key: getattr(m, ROPE_SETTINGS[key]) for key in ROPE_TYPES[kind]}}


def hf_config(settings: Mapping[str, Any], *, dtype: str, bos_id: Optional[int], eos_id: Optional[int],
              model_type: Optional[str] = None) -> Dict[str, Any]:
    """config.json of the Llama / Qwen2 / Mistral model (``hf_model_type``) equal to our model of these settings.

    Written as plain JSON so that exporting needs no transformers; the RoPE is given both as
    ``rope_parameters`` (transformers 5) and ``rope_theta`` + ``rope_scaling`` (transformers 4)."""
    family = hf_model_type(settings, model_type)
    m = model_config(settings)
    rope = _rope_parameters(m)
    legacy_scaling = None if m.rope_scaling == "none" else {k: v for k, v in rope.items() if k != "rope_theta"}
    out = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_positions,
        "rms_norm_eps": m.norm_eps,
        "rope_parameters": rope,
        "rope_theta": m.rope_theta,
        "rope_scaling": legacy_scaling,
        "tie_word_embeddings": m.tie_embeddings,
        "attention_dropout": m.attention_dropout,
        "initializer_range": m.init_std,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if family == "llama":
        out.update({"attention_bias": m.bias, "mlp_bias": m.bias, "pretraining_tp": 1})
    elif family == "qwen2":
        out.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": m.n_layers,
                    "layer_types": ["full_attention"] * m.n_layers})
    else:
        out["sliding_window"] = None
    return out


def llama_config(settings: Mapping[str, Any], *, dtype: str, bos_id: Optional[int],
                 eos_id: Optional[int]) -> Dict[str, Any]:
    """config.json of the LlamaForCausalLM equal to our model (``hf_config`` with model_type llama)."""
    return hf_config(settings, dtype=dtype, bos_id=bos_id, eos_id=eos_id, model_type="llama")


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


# ---- parameters -------------------------------------------------------------------------------------------

def _pairs(settings: Mapping[str, Any]) -> List[Tuple[str, str, Any]]:
    """(our name, HF name, index into our stacked tensor or None) of every parameter."""
    m = model_config(settings)
    gqa = m.kv_heads != m.n_heads
    out: List[Tuple[str, str, Any]] = [("embedding.weight", "model.embed_tokens.weight", None),
                                       ("final_norm.weight", "model.norm.weight", None)]
    if not m.tie_embeddings:
        out.append(("head.weight", "lm_head.weight", None))
    qkv_kinds = ("weight", "bias") if m.attn_bias else ("weight",)
    kinds = ("weight", "bias") if m.bias else ("weight",)
    for i in range(m.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        out += [(ours + "attn_norm.weight", hf + "input_layernorm.weight", None),
                (ours + "mlp_norm.weight", hf + "post_attention_layernorm.weight", None)]
        for kind in qkv_kinds:
            if gqa:
                out += [(f"{ours}attn.q.{kind}", f"{hf}self_attn.q_proj.{kind}", None),
                        (f"{ours}attn.kv.{kind}", f"{hf}self_attn.k_proj.{kind}", 0),
                        (f"{ours}attn.kv.{kind}", f"{hf}self_attn.v_proj.{kind}", 1)]
            else:
                out += [(f"{ours}attn.qkv.{kind}", f"{hf}self_attn.{p}_proj.{kind}", j) for j, p in enumerate("qkv")]
        for kind in kinds:
            out += [(f"{ours}attn.proj.{kind}", f"{hf}self_attn.o_proj.{kind}", None),
                    (f"{ours}mlp.up.{kind}", f"{hf}mlp.gate_proj.{kind}", 0),
                    (f"{ours}mlp.up.{kind}", f"{hf}mlp.up_proj.{kind}", 1),
                    (f"{ours}mlp.down.{kind}", f"{hf}mlp.down_proj.{kind}", None)]
    return out


def hf_shapes(settings: Mapping[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """Every Hugging Face tensor's shape for a model of these settings (lm_head absent when tied)."""
    m = model_config(settings)
    d, f, q = m.d_model, m.ffn_size, m.q_size
    kv = m.kv_heads * m.head_dim
    per_layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
                 "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
                 "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
                 "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
    if m.attn_bias:
        per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
    if m.bias:
        per_layer.update({"self_attn.o_proj.bias": (d,), "mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,),
                          "mlp.down_proj.bias": (d,)})
    shapes = {"model.embed_tokens.weight": (m.vocab_size, d), "model.norm.weight": (d,)}
    if not m.tie_embeddings:
        shapes["lm_head.weight"] = (m.vocab_size, d)
    for i in range(m.n_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def to_hf(ours: Mapping[str, torch.Tensor], settings: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """Hugging Face tensors (contiguous, own storage) from our global tensors; HFError naming a missing one."""
    out = {}
    for name, hf_name, index in _pairs(settings):
        if name not in ours:
            raise HFError(f"the checkpoint has no tensor model.{name}")
        t = ours[name] if index is None else ours[name][index]
        out[hf_name] = t.detach().clone().contiguous()
    return out


def non_finite(t: torch.Tensor) -> Optional[str]:
    """``"non-finite values (n NaN, m inf of N)"`` when a floating-point tensor holds NaN or inf, else None."""
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return None
    return f"non-finite values ({int(torch.isnan(t).sum())} NaN, {int(torch.isinf(t).sum())} inf of {t.numel()})"


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> Optional[Tuple[str, str]]:
    """(name, what) of the first tensor, in order, holding NaN or inf (:func:`non_finite`); None when all are
    finite."""
    for name, t in tensors.items():
        bad = non_finite(t)
        if bad:
            return name, bad
    return None


def from_hf(hf: Mapping[str, torch.Tensor], settings: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """Our global fp32 tensors from Hugging Face tensors, every name and shape checked against the settings first, and
    every value finite (a NaN or inf weight is refused by name: training from it could only diverge).

    A tied model's ``lm_head.weight`` may be present (it must then equal the embedding) or not."""
    shapes = hf_shapes(settings)
    missing = [k for k in shapes if k not in hf]
    if missing:
        raise HFError(f"the weights lack {len(missing)} tensor(s) config.json implies, e.g. {missing[0]}")
    tied = model_config(settings).tie_embeddings
    extra = [k for k in hf if k not in shapes and not (tied and k == "lm_head.weight")
             and not k.endswith("rotary_emb.inv_freq")]
    if extra:
        raise HFError(f"the weights hold {len(extra)} tensor(s) a model of this config.json has not, e.g. {extra[0]}")
    for k, shape in shapes.items():
        if tuple(hf[k].shape) != shape:
            raise HFError(f"{k} has shape {tuple(hf[k].shape)}, config.json implies {shape}")
    for k in [*shapes, *(["lm_head.weight"] if tied and "lm_head.weight" in hf else [])]:
        bad = non_finite(hf[k])
        if bad:
            raise HFError(f"{k} holds {bad}: the weights are broken, nothing to train from")
    if tied and "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
        raise HFError("tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
    grouped: Dict[str, Dict[Any, torch.Tensor]] = {}
    for name, hf_name, index in _pairs(settings):
        grouped.setdefault(name, {})[index] = hf[hf_name].float()
    return {name: parts[None] if None in parts else torch.stack([parts[j] for j in sorted(parts)])
            for name, parts in grouped.items()}
