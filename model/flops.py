"""Analytic parameter count and FLOPs per token of the GPT (for MFU).

Model FLOPs count the matrix multiplies of forward and backward (backward = 2x
forward) and the attention score / weighted-sum products at full (non-causal)
length, the PaLM / Megatron convention; recomputation is not counted (MFU, not
hardware FLOPs utilisation). Element-wise work, norms and softmax are ignored.
"""
from __future__ import annotations

from typing import Dict

from config import ModelConfig


def _qkv_features(cfg: ModelConfig) -> int:
    """Output features of the Q, K and V projections: n_heads * head_dim for Q, n_kv_heads * head_dim for each of
    K and V."""
    return cfg.q_size + 2 * cfg.kv_heads * cfg.head_dim


def parameter_count(cfg: ModelConfig) -> Dict[str, int]:
    d, f, v, L = cfg.d_model, cfg.ffn_size, cfg.vocab_size, cfg.n_layers
    qkv = _qkv_features(cfg)
    up = (2 if cfg.activation == "swiglu" else 1) * d * f
    norm = d * (2 if cfg.norm == "layernorm" else 1)
    per_layer = qkv * d + cfg.q_size * d + up + f * d + 2 * norm
    if cfg.attn_bias:
        per_layer += qkv
    if cfg.bias:
        per_layer += d + (2 if cfg.activation == "swiglu" else 1) * f + d
    embedding = v * d
    head = 0 if cfg.tie_embeddings else v * d
    total = embedding + L * per_layer + norm + head
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding - head}


def flops_per_token(cfg: ModelConfig) -> float:
    """Training (forward + backward) model FLOPs per token at sequence length cfg.seq_len."""
    d, f, v, L, s = cfg.d_model, cfg.ffn_size, cfg.vocab_size, cfg.n_layers, cfg.seq_len
    up = (2 if cfg.activation == "swiglu" else 1) * d * f
    matmul_params = L * (_qkv_features(cfg) * d + cfg.q_size * d + up + f * d) + d * v
    attention = L * 2 * s * cfg.q_size  # QK^T and AV: s*heads*head_dim multiply-adds each per token per layer
    forward = 2 * matmul_params + 2 * attention
    return 3.0 * forward
