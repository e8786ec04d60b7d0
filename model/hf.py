"""Hugging Face Llama <-> this GPT: settings and parameter names, shared by scripts/export_hf.py and import_hf.py.

Our model with ``activation=swiglu`` and ``norm=rmsnorm`` is a Llama decoder: pre-norm blocks, RMSNorm
(``x * rsqrt(mean(x^2) + eps) * w``), rotary embeddings in the rotate-half form that transformers'
``LlamaRotaryEmbedding`` uses (so q/k need no permutation), SwiGLU ``down(silu(gate(x)) * up(x))``, an
untied or tied output head without bias. Fused tensors are stacked on a leading dim:

    ours (global name, global shape)                    Llama
    embedding.weight            (V, d)                  model.embed_tokens.weight
    head.weight                 (V, d)                  lm_head.weight (absent when tied)
    final_norm.weight           (d,)                    model.norm.weight
    layers.i.attn_norm.weight   (d,)                    model.layers.i.input_layernorm.weight
    layers.i.mlp_norm.weight    (d,)                    model.layers.i.post_attention_layernorm.weight
    layers.i.attn.qkv.weight    (3, d, d)  [0] [1] [2]  ...self_attn.q_proj / k_proj / v_proj.weight
    layers.i.attn.q.weight      (H*hd, d)               ...self_attn.q_proj.weight      } grouped-query
    layers.i.attn.kv.weight     (2, KV*hd, d) [0] [1]   ...self_attn.k_proj / v_proj    } (n_kv_heads < n_heads)
    layers.i.attn.proj.weight   (d, d)                  ...self_attn.o_proj.weight
    layers.i.mlp.up.weight      (2, F, d)  [0] [1]      ...mlp.gate_proj / up_proj.weight
    layers.i.mlp.down.weight    (d, F)                  ...mlp.down_proj.weight

Biases (``model.bias``; Llama's ``attention_bias`` and ``mlp_bias`` together) follow their weights.
Everything that Llama cannot express, or that we cannot, is refused by name (``HFError``).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict, List, Mapping, Tuple

import torch

from config import MAX_D_MODEL, MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB_SIZE, ModelConfig

HF_ROPE_KEYS = ("rope_parameters", "rope_scaling")
HF_INTS = {  # config.json key: (required, the setting it becomes, its largest value: config.py's bound of it)
    "vocab_size": (True, "model.vocab_size", MAX_VOCAB_SIZE), "hidden_size": (True, "model.d_model", MAX_D_MODEL),
    "intermediate_size": (True, "model.ffn_hidden", 4 * MAX_D_MODEL),
    "num_hidden_layers": (True, "model.n_layers", MAX_LAYERS),
    "num_attention_heads": (True, "model.n_heads", MAX_D_MODEL),
    "num_key_value_heads": (False, "model.n_kv_heads", MAX_D_MODEL), "head_dim": (False, "head dim", MAX_D_MODEL),
    "max_position_embeddings": (False, "model.max_seq_len", MAX_SEQ_LEN),
}
HF_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
HF_POSITIVE_NUMBERS = {"rms_norm_eps": 1.0, "rope_theta": math.inf}  # key: exclusive upper bound


class HFError(ValueError):
    """A model, checkpoint or file that cannot be converted; the message is one line naming why."""


# ---- our model settings -----------------------------------------------------------------------------------

def model_config(settings: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig from a ``model`` section (e.g. a checkpoint's meta.json); keys it does not know are ignored."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in settings.items() if k in known})


def export_problems(settings: Mapping[str, Any]) -> List[str]:
    """Why a model of these settings is not a Llama (empty when it is), one reason per setting."""
    problems = []
    if settings.get("activation", "swiglu") != "swiglu":
        problems.append(f"model.activation={settings['activation']} (Llama's MLP is SwiGLU: model.activation=swiglu)")
    if settings.get("norm", "rmsnorm") != "rmsnorm":
        problems.append(f"model.norm={settings['norm']} (Llama normalises with RMSNorm: model.norm=rmsnorm)")
    m = model_config(settings)
    if m.n_heads % m.kv_heads:
        problems.append(f"model.n_kv_heads={m.kv_heads} does not divide model.n_heads={m.n_heads}")
    return problems


# ---- config.json ------------------------------------------------------------------------------------------

def llama_config(settings: Mapping[str, Any], *, dtype: str, bos_id: int, eos_id: int) -> Dict[str, Any]:
    """config.json of a LlamaForCausalLM equal to our model of these settings.

    Written as plain JSON so that exporting needs no transformers; the rotary base is given both as
    ``rope_parameters`` (transformers 5) and ``rope_theta`` (transformers 4)."""
    m = model_config(settings)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "rope_theta": m.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": m.bias,
        "mlp_bias": m.bias,
        "attention_dropout": m.attention_dropout,
        "initializer_range": m.init_std,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def _rope_theta(cfg: Mapping[str, Any]) -> Tuple[float, List[str]]:
    """The rotary base of a Llama config.json (transformers 4 or 5 style) and what we cannot express."""
    problems = []
    theta = cfg.get("rope_theta")
    for key in HF_ROPE_KEYS:
        rope = cfg.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            problems.append(f"{key}={rope!r} is not a mapping")
            continue
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default" or set(rope) - {"rope_type", "type", "rope_theta"}:
            problems.append(f"{key}={rope} (RoPE scaling is not supported; only plain rotary embeddings are)")
        theta = rope.get("rope_theta", theta)
    return float(theta if theta is not None else 10000.0), problems


def _json(value: Any) -> str:
    """A config.json value as JSON spells it (true, "false", 1e-05)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


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


def model_settings(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """Our ``model.*`` settings equal to a Llama config.json: HFError naming every field of a wrong type or out of
    range (by key and value), else every setting we cannot express."""
    bad = field_problems(cfg)
    if bad:
        raise HFError("config.json: " + "; ".join(bad))
    problems = []
    model_type = cfg.get("model_type")
    if model_type != "llama":
        problems.append(f"model_type={model_type!r} (only 'llama' is supported)")
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        problems.append(f"hidden_act={act!r} (only silu, i.e. SwiGLU, is supported)")
    if d % heads:
        problems.append(f"hidden_size={d} is not divisible by num_attention_heads={heads}")
    head_dim = cfg.get("head_dim") or (d // heads)
    if head_dim * heads != d:
        problems.append(f"head_dim={head_dim} != hidden_size/num_attention_heads={d}/{heads} (not supported)")
    if head_dim % 2:
        problems.append(f"head_dim={head_dim} is odd (rotary embeddings need an even head dim)")
    if heads % kv:
        problems.append(f"num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    attn_bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
    if attn_bias != mlp_bias:
        problems.append(f"attention_bias={attn_bias} with mlp_bias={mlp_bias} (one model.bias covers both: "
                        "they must be equal)")
    theta, rope_problems = _rope_theta(cfg)
    problems += rope_problems
    if cfg.get("quantization_config"):
        problems.append("quantization_config is set (quantized checkpoints are not supported)")
    if problems:
        raise HFError("cannot import this model: " + "; ".join(problems))
    max_pos = int(cfg.get("max_position_embeddings") or 2048)
    settings: Dict[str, Any] = {
        "n_layers": cfg["num_hidden_layers"], "d_model": d, "n_heads": heads, "vocab_size": cfg["vocab_size"],
        "ffn_hidden": cfg["intermediate_size"], "activation": "swiglu", "norm": "rmsnorm",
        "norm_eps": float(cfg.get("rms_norm_eps") or 1e-6), "rope_theta": theta,
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)), "bias": attn_bias,
        "max_seq_len": max_pos, "seq_len": min(max_pos, 2048),
    }
    if kv != heads:
        settings["n_kv_heads"] = kv
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
    kinds = ("weight", "bias") if m.bias else ("weight",)
    for i in range(m.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        out += [(ours + "attn_norm.weight", hf + "input_layernorm.weight", None),
                (ours + "mlp_norm.weight", hf + "post_attention_layernorm.weight", None)]
        for kind in kinds:
            if gqa:
                out += [(f"{ours}attn.q.{kind}", f"{hf}self_attn.q_proj.{kind}", None),
                        (f"{ours}attn.kv.{kind}", f"{hf}self_attn.k_proj.{kind}", 0),
                        (f"{ours}attn.kv.{kind}", f"{hf}self_attn.v_proj.{kind}", 1)]
            else:
                out += [(f"{ours}attn.qkv.{kind}", f"{hf}self_attn.{p}_proj.{kind}", j) for j, p in enumerate("qkv")]
            out += [(f"{ours}attn.proj.{kind}", f"{hf}self_attn.o_proj.{kind}", None),
                    (f"{ours}mlp.up.{kind}", f"{hf}mlp.gate_proj.{kind}", 0),
                    (f"{ours}mlp.up.{kind}", f"{hf}mlp.up_proj.{kind}", 1),
                    (f"{ours}mlp.down.{kind}", f"{hf}mlp.down_proj.{kind}", None)]
    return out


def hf_shapes(settings: Mapping[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """Every Llama tensor's shape for a model of these settings (lm_head absent when tied)."""
    m = model_config(settings)
    d, f, hd = m.d_model, m.ffn_size, m.head_dim
    kv = m.kv_heads * hd
    per_layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
                 "self_attn.q_proj.weight": (d, d), "self_attn.k_proj.weight": (kv, d),
                 "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, d),
                 "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f)}
    if m.bias:
        per_layer.update({"self_attn.q_proj.bias": (d,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (d,),
                          "mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (d,)})
    shapes = {"model.embed_tokens.weight": (m.vocab_size, d), "model.norm.weight": (d,)}
    if not m.tie_embeddings:
        shapes["lm_head.weight"] = (m.vocab_size, d)
    for i in range(m.n_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def to_hf(ours: Mapping[str, torch.Tensor], settings: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """Llama tensors (contiguous, own storage) from our global tensors; HFError naming a missing one."""
    out = {}
    for name, hf_name, index in _pairs(settings):
        if name not in ours:
            raise HFError(f"the checkpoint has no tensor model.{name}")
        t = ours[name] if index is None else ours[name][index]
        out[hf_name] = t.detach().clone().contiguous()
    return out


def from_hf(hf: Mapping[str, torch.Tensor], settings: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """Our global fp32 tensors from Llama tensors, every name and shape checked against the settings first, and
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
        raise HFError(f"the weights hold {len(extra)} tensor(s) a Llama of this config.json has not, e.g. {extra[0]}")
    for k, shape in shapes.items():
        if tuple(hf[k].shape) != shape:
            raise HFError(f"{k} has shape {tuple(hf[k].shape)}, config.json implies {shape}")
    for k in [*shapes, *(["lm_head.weight"] if tied and "lm_head.weight" in hf else [])]:
        t = hf[k]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            nan = int(torch.isnan(t).sum())
            inf = int(torch.isinf(t).sum())
            raise HFError(f"{k} holds non-finite values ({nan} NaN, {inf} inf of {t.numel()}): the weights are "
                          "broken, nothing to train from")
    if tied and "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
        raise HFError("tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
    grouped: Dict[str, Dict[Any, torch.Tensor]] = {}
    for name, hf_name, index in _pairs(settings):
        grouped.setdefault(name, {})[index] = hf[hf_name].float()
    return {name: parts[None] if None in parts else torch.stack([parts[j] for j in sorted(parts)])
            for name, parts in grouped.items()}
