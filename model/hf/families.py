"""The Hugging Face families we map to (``ARCHITECTURES``), the errors of a conversion, and the write direction of
the settings: which family a model of our settings exports as, why it cannot (``export_problems``), and the
config.json that describes it (``hf_config``). The whole mapping: ``model/hf/__init__.py``."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from config import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
"""config.json's model_type -> its architectures entry, for the families we import and export."""
UNSUPPORTED_FAMILIES = {
    "qwen3": "QK-norm: q and k are RMS-normalised per head", "olmo2": "QK-norm", "gemma3": "QK-norm",
    "qwen2_moe": "mixture-of-experts", "qwen3_moe": "QK-norm and mixture-of-experts", "mixtral": "mixture-of-experts",
    "deepseek_v3": "mixture-of-experts and latent attention", "gemma": "GeGLU and scaled embeddings",
    "gemma2": "soft-capped logits and sliding windows", "phi3": "fused qkv and partial rotary", "gpt2": "GELU, "
    "learned positions, LayerNorm"}
"""Families people ask for that we cannot express, with the reason named in the refusal."""
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
"""rope_type -> its parameters (config.json spelling), for the RoPE types we compute."""
ROPE_SETTINGS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                 "high_freq_factor": "rope_high_freq_factor",
                 "original_max_position_embeddings": "rope_original_max_positions"}


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

