"""The Hugging Face families we map to (``ARCHITECTURES``), the errors of a conversion, and the write direction of
the settings: which family a model of our settings exports as, why it cannot (``export_problems``), and the
config.json that describes it (``hf_config``). The whole mapping: ``model/hf/__init__.py``."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from config import ModelConfig
from config.moe import MoeConfig, is_moe_layer

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
"""config.json's model_type -> its architectures entry, for the families we import and export."""
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Families whose MLPs are (some of them) routed experts: model.moe.num_experts > 0."""
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
"""Families that RMS-normalise each head's queries and keys: model.qk_norm."""
UNSUPPORTED_FAMILIES = {
    "olmo2": "QK-norm over all heads at once and norms after each sublayer",
    "gemma3": "GeGLU, scaled embeddings and sliding windows",
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
    """A ModelConfig from a ``model`` section (e.g. a checkpoint's meta.json, its ``moe`` a mapping); keys it does
    not know are ignored."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    values = {k: v for k, v in settings.items() if k in known}
    if isinstance(values.get("moe"), Mapping):
        moe_known = {f.name for f in dataclasses.fields(MoeConfig)}
        values["moe"] = MoeConfig(**{k: v for k, v in values["moe"].items() if k in moe_known})
    return ModelConfig(**values)


def hf_model_type(settings: Mapping[str, Any], override: Optional[str] = None) -> str:
    """The family a model of these settings exports as: ``override``, else ``model.hf_model_type``, else by what
    it has: routed experts make qwen3_moe with QK-norm, qwen2_moe with shared experts, mixtral otherwise; a dense
    model with QK-norm is qwen3, one with biases on q/k/v only qwen2, anything else llama."""
    m = model_config(settings)
    chosen = override or m.hf_model_type
    if chosen is not None:
        if chosen not in ARCHITECTURES:
            raise HFError(f"model type {chosen!r} is not one of {sorted(ARCHITECTURES)}")
        return chosen
    if m.moe.num_experts > 0:
        return "qwen3_moe" if m.qk_norm else "qwen2_moe" if m.moe.shared_experts else "mixtral"
    if m.qk_norm:
        return "qwen3"
    return "qwen2" if m.qkv_bias and not m.bias else "llama"


def expert_ffn(m: ModelConfig) -> int:
    """Hidden size of each routed expert (model.moe.ffn_hidden, else the dense MLP's)."""
    return m.moe.ffn_hidden if m.moe.ffn_hidden is not None else m.ffn_size


def shared_ffn(m: ModelConfig) -> int:
    """Hidden size of the shared experts' one FFN (Qwen2-MoE's shared_expert_intermediate_size)."""
    return m.moe.shared_ffn_hidden if m.moe.shared_ffn_hidden is not None else expert_ffn(m) * m.moe.shared_experts


def sparse_layers(m: ModelConfig) -> Tuple[int, List[int]]:
    """Qwen's ``(decoder_sparse_step, mlp_only_layers)`` naming exactly our MoE layers (``config.moe.is_moe_layer``):
    layer i is sparse there when (i + 1) % step == 0 and i is not listed. The step is model.moe.layer_freq where
    that pattern holds every MoE layer of ours (first_dense + 1 a multiple of it: Qwen2-MoE's own layouts), listing
    the pattern's layers below first_dense; else 1, listing every dense layer."""
    f, k = m.moe.layer_freq, m.moe.first_dense
    ours = {i for i in range(m.n_layers) if is_moe_layer(m.moe, i)}
    step = f if (k + 1) % f == 0 else 1
    return step, [i for i in range(m.n_layers) if (i + 1) % step == 0 and i not in ours]


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
    if family in ("qwen2", "qwen2_moe") and m.bias:
        problems.append(f"model.bias=true ({name} has biases on q/k/v only: model.qkv_bias)")
    if family == "qwen2" and not m.attn_bias:
        problems.append("model.qkv_bias=false (Qwen2 always has q/k/v biases)")
    if family in ("mistral", "mixtral", "qwen3", "qwen3_moe") and m.attn_bias:
        problems.append(f"model.{'bias' if m.bias else 'qkv_bias'}=true ({name} has no biases)")
    if m.qk_norm != (family in QK_NORM_FAMILIES):
        problems.append(f"model.qk_norm=true ({name} has no QK-norm; export as qwen3 or qwen3_moe)" if m.qk_norm else
                        f"model.qk_norm=false ({name} RMS-normalises each head's queries and keys: model.qk_norm=true)")
    e = m.moe
    if (e.num_experts > 0) != (family in MOE_FAMILIES):
        problems.append(f"model.moe.num_experts={e.num_experts} " + (
            f"({name} has no experts; export as mixtral, qwen2_moe or qwen3_moe)" if e.num_experts else
            f"({name} is a mixture of experts)"))
    if e.num_experts > 0 and family in MOE_FAMILIES:
        problems += _moe_problems(m, family, name)
    return problems


def _moe_problems(m: ModelConfig, family: str, name: str) -> List[str]:
    """What the experts of ``m`` have that ``family``'s have not (its router is a softmax, its gates unscaled;
    Mixtral's top-k renormalised in every layer; Qwen2-MoE's one sigmoid-gated shared expert; Qwen3-MoE's none)."""
    e, problems = m.moe, []
    if e.score != "softmax":
        problems.append(f"model.moe.score={e.score} ({name}'s router is a softmax)")
    if e.routed_scale != 1.0:
        problems.append(f"model.moe.routed_scale={e.routed_scale} ({name} does not scale the routed gates)")
    if family == "mixtral":
        if not e.norm_topk:
            problems.append("model.moe.norm_topk=false (Mixtral renormalises the top-k probabilities)")
        if e.layer_freq != 1 or e.first_dense != 0:
            problems.append(f"model.moe.layer_freq={e.layer_freq}, first_dense={e.first_dense} (every Mixtral "
                            "layer is MoE: 1 and 0)")
    if family == "qwen2_moe" and (e.shared_experts == 0 or not e.shared_gate):
        problems.append(f"model.moe.shared_experts={e.shared_experts}, shared_gate={str(e.shared_gate).lower()} "
                        "(Qwen2-MoE has a shared expert behind a sigmoid gate: >= 1 and true)")
    if family in ("mixtral", "qwen3_moe") and e.shared_experts:
        problems.append(f"model.moe.shared_experts={e.shared_experts} ({name} has no shared experts)")
    return problems


# ---- config.json ------------------------------------------------------------------------------------------

def _rope_parameters(m: ModelConfig) -> Dict[str, Any]:
    """The RoPE of our model as transformers 5's ``rope_parameters``."""
    kind = "default" if m.rope_scaling == "none" else m.rope_scaling
    return {"rope_type": kind, "rope_theta": m.rope_theta,
            **{key: getattr(m, ROPE_SETTINGS[key]) for key in ROPE_TYPES[kind]}}


def hf_config(settings: Mapping[str, Any], *, dtype: str, bos_id: Optional[int], eos_id: Optional[int],
              model_type: Optional[str] = None) -> Dict[str, Any]:
    """config.json of the model of family ``hf_model_type`` equal to our model of these settings.

    Written as plain JSON so that exporting needs no transformers; the RoPE is given both as
    ``rope_parameters`` (transformers 5) and ``rope_theta`` + ``rope_scaling`` (transformers 4). Experts: the
    router's settings, model.moe.aux_loss_coeff as router_aux_loss_coef (import's mapping, reversed), Qwen's MoE
    layers as ``sparse_layers``."""
    family = hf_model_type(settings, model_type)
    m = model_config(settings)
    rope = _rope_parameters(m)
    legacy_scaling = None if m.rope_scaling == "none" else {k: v for k, v in rope.items() if k != "rope_theta"}
    out = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": expert_ffn(m) if family == "mixtral" else m.ffn_size,
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
    full = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": m.n_layers}
    layer_types = {"layer_types": ["full_attention"] * m.n_layers}
    e = m.moe
    router = {"num_experts_per_tok": e.top_k, "router_aux_loss_coef": e.aux_loss_coeff, "output_router_logits": False}
    if family in ("qwen2_moe", "qwen3_moe"):
        step, mlp_only = sparse_layers(m)
        router.update({"num_experts": e.num_experts, "moe_intermediate_size": expert_ffn(m),
                       "norm_topk_prob": e.norm_topk, "decoder_sparse_step": step, "mlp_only_layers": mlp_only})
    if family == "llama":
        out.update({"attention_bias": m.bias, "mlp_bias": m.bias, "pretraining_tp": 1})
    elif family == "qwen2":
        out.update({**full, **layer_types})
    elif family == "qwen3":
        out.update({"attention_bias": False, **full, **layer_types})
    elif family == "mixtral":
        out.update({"num_local_experts": e.num_experts, **router, "router_jitter_noise": 0.0, "sliding_window": None})
    elif family == "qwen2_moe":
        out.update({"qkv_bias": m.attn_bias, **full, **layer_types, **router,
                    "shared_expert_intermediate_size": shared_ffn(m)})
    elif family == "qwen3_moe":
        out.update({"attention_bias": False, **full, **router})
    else:
        out["sliding_window"] = None
    return out


def llama_config(settings: Mapping[str, Any], *, dtype: str, bos_id: Optional[int],
                 eos_id: Optional[int]) -> Dict[str, Any]:
    """config.json of the LlamaForCausalLM equal to our model (``hf_config`` with model_type llama)."""
    return hf_config(settings, dtype=dtype, bos_id=bos_id, eos_id=eos_id, model_type="llama")

