"""The parameters: our global tensors <-> Hugging Face's, by name (``_pairs``), every name, shape and value of an
import checked first (``from_hf``)."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from model.hf.families import HFError, model_config

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
