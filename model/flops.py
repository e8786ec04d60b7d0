"""Analytic parameter count and FLOPs per token of the GPT (for MFU), dense or mixture of experts.

Model FLOPs count the matrix multiplies of forward and backward (backward = 2x
forward) and the attention score / weighted-sum products at full (non-causal)
length, the PaLM / Megatron convention; recomputation is not counted (MFU, not
hardware FLOPs utilisation). Element-wise work, norms and softmax are ignored.

Mixture of experts (``model.moe``): an MoE layer holds the router ``[E, d]``, ``E`` routed expert FFNs, the
shared experts (one FFN of width ``shared_ffn_hidden``) and Qwen2-MoE's shared gate ``[1, d]``; a layer that
``is_moe_layer`` leaves dense keeps the dense MLP. A token uses its ``top_k`` routed experts only, so the FLOPs
per token (and MFU) count the *active* parameters -- the router's GEMM, top_k experts, the shared experts and
gate, the rest of the model -- as Megatron-Core does for MoE (``num_floating_point_operations`` with
``moe_router_topk``). The count is the dropless one: a capacity factor that drops token-slots is not subtracted.
"""
from __future__ import annotations

from typing import Dict, Tuple

from config import ModelConfig
from config.moe import is_moe_layer


def _qkv_features(cfg: ModelConfig) -> int:
    """Output features of the Q, K and V projections: n_heads * head_dim for Q, n_kv_heads * head_dim for each of
    K and V."""
    return cfg.q_size + 2 * cfg.kv_heads * cfg.head_dim


def _ffn(cfg: ModelConfig, width: int) -> int:
    """Weights of one FFN of hidden size ``width`` (SwiGLU: gate, up and down; GELU: up and down), no biases."""
    return (3 if cfg.activation == "swiglu" else 2) * cfg.d_model * width


def expert_width(cfg: ModelConfig) -> int:
    """Hidden size of each routed expert's FFN (model.moe.ffn_hidden, else the dense MLP's)."""
    return cfg.moe.ffn_hidden if cfg.moe.ffn_hidden is not None else cfg.ffn_size


def mlp_parameters(cfg: ModelConfig, layer: int) -> Tuple[int, int]:
    """(held, active) weights of layer ``layer``'s MLP: the dense MLP (biases included), or an MoE layer's
    router, routed experts, shared experts and shared gate, of which a token uses the router, top_k routed
    experts and the shared ones. All of them are GEMM weights but the dense MLP's biases."""
    if not is_moe_layer(cfg.moe, layer):
        n = _ffn(cfg, cfg.ffn_size)
        bias = (cfg.d_model + (2 if cfg.activation == "swiglu" else 1) * cfg.ffn_size) if cfg.bias else 0
        return n + bias, n + bias
    m, d = cfg.moe, cfg.d_model
    expert = _ffn(cfg, expert_width(cfg))
    shared = 0
    if m.shared_experts > 0:
        width = m.shared_ffn_hidden if m.shared_ffn_hidden is not None else expert_width(cfg) * m.shared_experts
        shared = _ffn(cfg, width) + (d if m.shared_gate else 0)
    router = m.num_experts * d
    return router + m.num_experts * expert + shared, router + m.top_k * expert + shared


def parameter_count(cfg: ModelConfig) -> Dict[str, int]:
    """Parameters of the whole model: ``total``, ``embedding`` (the token embedding), ``non_embedding`` (total
    less the embedding and an untied output head) and ``active`` (those one token uses: all but the routed experts
    it is not sent to; = total for a dense model)."""
    d, v, L = cfg.d_model, cfg.vocab_size, cfg.n_layers
    qkv = _qkv_features(cfg)
    norm = d * (2 if cfg.norm == "layernorm" else 1)
    attention = qkv * d + cfg.q_size * d + 2 * norm
    if cfg.qk_norm:  # the queries' and keys' per-head RMSNorm weights
        attention += 2 * cfg.head_dim
    if cfg.attn_bias:
        attention += qkv
    if cfg.bias:
        attention += d  # the output projection's bias
    mlps = [mlp_parameters(cfg, i) for i in range(L)]
    embedding = v * d
    head = 0 if cfg.tie_embeddings else v * d
    rest = embedding + L * attention + norm + head
    total = rest + sum(held for held, _ in mlps)
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding - head,
            "active": rest + sum(active for _, active in mlps)}


def flops_per_token(cfg: ModelConfig) -> float:
    """Training (forward + backward) model FLOPs per token at sequence length cfg.seq_len: 6 x the active GEMM
    weights (an MoE layer's router and top_k experts) plus the attention products."""
    d, v, L, s = cfg.d_model, cfg.vocab_size, cfg.n_layers, cfg.seq_len
    mlp = 0
    for i in range(L):
        active = mlp_parameters(cfg, i)[1]
        if not is_moe_layer(cfg.moe, i) and cfg.bias:  # biases are added, not multiplied
            active -= d + (2 if cfg.activation == "swiglu" else 1) * cfg.ffn_size
        mlp += active
    matmul_params = L * (_qkv_features(cfg) * d + cfg.q_size * d) + mlp + d * v
    attention = L * 2 * s * cfg.q_size  # QK^T and AV: s*heads*head_dim multiply-adds each per token per layer
    forward = 2 * matmul_params + 2 * attention
    return 3.0 * forward
