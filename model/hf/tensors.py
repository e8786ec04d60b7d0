"""The parameters: our global tensors <-> Hugging Face's, by name (``_pairs``), every name, shape and value of an
import checked first (``from_hf``)."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from config import ModelConfig
from config.moe import is_moe_layer
from model.hf.families import HFError, expert_ffn, hf_model_type, model_config, shared_ffn

Pair = Tuple[str, str, Any, Tuple[int, ...]]
"""(our name, Hugging Face name, index into our stacked tensor or None, the Hugging Face tensor's shape)."""
EXPERT_BIAS = "mlp.router.expert_bias"
"""Our MoE layers' selection bias (aux-loss-free balancing): a buffer no family here has; zero on import."""


def _mlp_pairs(m: ModelConfig, family: str, i: int, ours: str, hf: str, kinds: Tuple[str, ...]) -> List[Pair]:
    """Layer ``i``'s MLP: the dense one, or router, experts (stacked ``[E, 2, F, d]`` / ``[E, d, F]``: one HF tensor
    per expert and projection, Mixtral's w1 / w3 / w2 under block_sparse_moe, Qwen's gate / up / down_proj under
    mlp) and Qwen2-MoE's shared expert and gate."""
    d = m.d_model
    if not is_moe_layer(m.moe, i):
        f, out = m.ffn_size, []
        for kind in kinds:
            fd, df = ((f, d), (d, f)) if kind == "weight" else ((f,), (d,))
            out += [(f"{ours}mlp.up.{kind}", f"{hf}mlp.gate_proj.{kind}", 0, fd),
                    (f"{ours}mlp.up.{kind}", f"{hf}mlp.up_proj.{kind}", 1, fd),
                    (f"{ours}mlp.down.{kind}", f"{hf}mlp.down_proj.{kind}", None, df)]
        return out
    experts, f = m.moe.num_experts, expert_ffn(m)
    block = hf + ("block_sparse_moe." if family == "mixtral" else "mlp.")
    gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = [(ours + "mlp.router.weight", block + "gate.weight", None, (experts, d))]
    for e in range(experts):
        x = f"{block}experts.{e}."
        out += [(ours + "mlp.experts.w_up", f"{x}{gate}.weight", (e, 0), (f, d)),
                (ours + "mlp.experts.w_up", f"{x}{up}.weight", (e, 1), (f, d)),
                (ours + "mlp.experts.w_down", f"{x}{down}.weight", e, (d, f))]
    if m.moe.shared_experts:
        fs = shared_ffn(m)
        out += [(ours + "mlp.shared.up.weight", block + "shared_expert.gate_proj.weight", 0, (fs, d)),
                (ours + "mlp.shared.up.weight", block + "shared_expert.up_proj.weight", 1, (fs, d)),
                (ours + "mlp.shared.down.weight", block + "shared_expert.down_proj.weight", None, (d, fs))]
        if m.moe.shared_gate:
            out.append((ours + "mlp.shared_gate", block + "shared_expert_gate.weight", None, (1, d)))
    return out


def _pairs(settings: Mapping[str, Any], model_type: Optional[str] = None) -> List[Pair]:
    """Every parameter of a model of these settings exported as ``model_type`` (default ``hf_model_type``)."""
    m = model_config(settings)
    family = hf_model_type(settings, model_type)
    d, q, kv = m.d_model, m.q_size, m.kv_heads * m.head_dim
    gqa = m.kv_heads != m.n_heads
    out: List[Pair] = [("embedding.weight", "model.embed_tokens.weight", None, (m.vocab_size, d)),
                       ("final_norm.weight", "model.norm.weight", None, (d,))]
    if not m.tie_embeddings:
        out.append(("head.weight", "lm_head.weight", None, (m.vocab_size, d)))
    qkv_kinds = ("weight", "bias") if m.attn_bias else ("weight",)
    kinds = ("weight", "bias") if m.bias else ("weight",)
    for i in range(m.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        out += [(ours + "attn_norm.weight", hf + "input_layernorm.weight", None, (d,)),
                (ours + "mlp_norm.weight", hf + "post_attention_layernorm.weight", None, (d,))]
        for kind in qkv_kinds:
            qs, kvs = ((q, d), (kv, d)) if kind == "weight" else ((q,), (kv,))
            if gqa:
                out += [(f"{ours}attn.q.{kind}", f"{hf}self_attn.q_proj.{kind}", None, qs),
                        (f"{ours}attn.kv.{kind}", f"{hf}self_attn.k_proj.{kind}", 0, kvs),
                        (f"{ours}attn.kv.{kind}", f"{hf}self_attn.v_proj.{kind}", 1, kvs)]
            else:
                out += [(f"{ours}attn.qkv.{kind}", f"{hf}self_attn.{p}_proj.{kind}", j, qs)
                        for j, p in enumerate("qkv")]
        if m.qk_norm:
            out += [(f"{ours}attn.{p}_norm.weight", f"{hf}self_attn.{p}_norm.weight", None, (m.head_dim,))
                    for p in "qk"]
        for kind in kinds:
            out.append((f"{ours}attn.proj.{kind}", f"{hf}self_attn.o_proj.{kind}", None,
                        (d, q) if kind == "weight" else (d,)))
        out += _mlp_pairs(m, family, i, ours, hf, kinds)
    return out


def hf_shapes(settings: Mapping[str, Any], model_type: Optional[str] = None) -> Dict[str, Tuple[int, ...]]:
    """Every Hugging Face tensor's shape for a model of these settings (lm_head absent when tied)."""
    return {hf_name: shape for _, hf_name, _, shape in _pairs(settings, model_type)}


def to_hf(ours: Mapping[str, torch.Tensor], settings: Mapping[str, Any],
          model_type: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Hugging Face tensors (contiguous, own storage) from our global tensors; HFError naming a missing one, or an
    MoE layer's expert bias that is not zero (the families' routers have none: the export would route otherwise)."""
    for name, t in ours.items():
        if name.endswith(EXPERT_BIAS) and bool(t.ne(0).any()):
            raise HFError(f"model.{name} is not zero (aux-loss-free balancing moved it, up to "
                          f"{t.abs().max().item():.3g}): the Hugging Face routers have no selection bias, so the "
                          "export would choose other experts")
    out = {}
    for name, hf_name, index, _ in _pairs(settings, model_type):
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
    every value finite (a NaN or inf weight is refused by name: training from it could only diverge); each MoE layer's
    expert bias zero (``EXPERT_BIAS``). Experts are read in the per-expert layout ``save_pretrained`` writes and
    the Hub holds.

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
    for name, hf_name, index, _ in _pairs(settings):
        grouped.setdefault(name, {})[index] = hf[hf_name].float()
    out = {name: _stack(parts) for name, parts in grouped.items()}
    m = model_config(settings)
    for i in range(m.n_layers):
        if is_moe_layer(m.moe, i):
            out[f"layers.{i}.{EXPERT_BIAS}"] = torch.zeros(m.moe.num_experts)
    return out


def _stack(parts: Mapping[Any, torch.Tensor]) -> torch.Tensor:
    """One of our tensors from its pieces by index: None (the whole), j (``t[j]``) or a tuple (``t[e, j]``)."""
    if None in parts:
        return parts[None]
    index = {(k if isinstance(k, tuple) else (k,)): t for k, t in parts.items()}
    lead = tuple(max(k[d] for k in index) + 1 for d in range(len(next(iter(index)))))
    first = next(iter(index.values()))
    out = first.new_empty(lead + tuple(first.shape))
    for k, t in index.items():
        out[k] = t
    return out
