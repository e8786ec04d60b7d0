"""Hugging Face Llama, Qwen2, Mistral, Qwen3, Mixtral, Qwen2-MoE and Qwen3-MoE <-> this GPT: settings and
parameter names, shared by scripts/export_hf.py and import_hf.py.

Our model with ``activation=swiglu`` and ``norm=rmsnorm`` is a Llama decoder: pre-norm blocks, RMSNorm
(``x * rsqrt(mean(x^2) + eps) * w``), rotary embeddings in the rotate-half form that transformers'
rotary classes use (so q/k need no permutation), SwiGLU ``down(silu(gate(x)) * up(x))``, an untied or tied
output head without bias. Qwen2 is the same decoder with biases on q/k/v only (``model.qkv_bias``), Mistral
the same without biases (its sliding window refused), Qwen3 Mistral's with each head's queries and keys
RMS-normalised before RoPE (``model.qk_norm``). Mixtral is Mistral with routed experts in every layer
(``model.moe``: softmax router, top-k renormalised), Qwen2-MoE Qwen2 with routed experts in the layers
``decoder_sparse_step`` and ``mlp_only_layers`` choose plus one shared expert behind a sigmoid gate, Qwen3-MoE
Qwen3 with routed experts and no shared one. Fused tensors are stacked on leading dims (Q = n_heads * head_dim,
KV = n_kv_heads * head_dim; head_dim = ``model.kv_channels``, default d / n_heads; E experts, each F_e wide,
the shared one F_s):

    ours (global name, global shape)                    Hugging Face (every family)
    embedding.weight            (V, d)                  model.embed_tokens.weight
    head.weight                 (V, d)                  lm_head.weight (absent when tied)
    final_norm.weight           (d,)                    model.norm.weight
    layers.i.attn_norm.weight   (d,)                    model.layers.i.input_layernorm.weight
    layers.i.mlp_norm.weight    (d,)                    model.layers.i.post_attention_layernorm.weight
    layers.i.attn.qkv.weight    (3, Q, d)  [0] [1] [2]  ...self_attn.q_proj / k_proj / v_proj.weight
    layers.i.attn.q.weight      (Q, d)                  ...self_attn.q_proj.weight      } grouped-query
    layers.i.attn.kv.weight     (2, KV, d) [0] [1]      ...self_attn.k_proj / v_proj    } (n_kv_heads < n_heads)
    layers.i.attn.q_norm.weight (head_dim,)             ...self_attn.q_norm.weight      } Qwen3, Qwen3-MoE
    layers.i.attn.k_norm.weight (head_dim,)             ...self_attn.k_norm.weight      }
    layers.i.attn.proj.weight   (d, Q)                  ...self_attn.o_proj.weight
    layers.i.mlp.up.weight      (2, F, d)  [0] [1]      ...mlp.gate_proj / up_proj.weight   (a dense layer)
    layers.i.mlp.down.weight    (d, F)                  ...mlp.down_proj.weight

    an MoE layer (B = model.layers.i.block_sparse_moe for Mixtral, model.layers.i.mlp for Qwen)
    layers.i.mlp.router.weight  (E, d)                  B.gate.weight
    layers.i.mlp.experts.w_up   (E, 2, F_e, d) [e, 0]   B.experts.e.w1 / gate_proj.weight (Mixtral / Qwen)
                                               [e, 1]   B.experts.e.w3 / up_proj.weight
    layers.i.mlp.experts.w_down (E, d, F_e)    [e]      B.experts.e.w2 / down_proj.weight
    layers.i.mlp.shared.up.weight (2, F_s, d) [0] [1]   B.shared_expert.gate_proj / up_proj.weight  } Qwen2-MoE
    layers.i.mlp.shared.down.weight (d, F_s)            B.shared_expert.down_proj.weight            }
    layers.i.mlp.shared_gate    (1, d)                  B.shared_expert_gate.weight                 }
    layers.i.mlp.router.expert_bias (E,), a buffer      none: zero on import, refused on export unless zero

Biases follow their weights: q/k/v ones with ``model.qkv_bias`` or ``model.bias`` (Qwen2, Qwen2-MoE; Llama's
``attention_bias``), o_proj and the MLP's with ``model.bias`` (Llama's ``attention_bias`` and ``mlp_bias``
together). RoPE: ``rope_type`` default, ``linear`` and ``llama3`` (``model.rope_scaling``). Everything that
these families cannot express, or that we cannot (other RoPE types, sliding windows, router jitter, QK-norm of
other families, Qwen3's attention_bias, MoE layer sets ``model.moe.layer_freq`` / ``first_dense`` cannot
describe, quantized weights), is refused by name (``HFError``); so is an export of settings the family lacks.

    families.py  the families, HFError, the export's checks and the config.json it writes (ours -> theirs)
    settings.py  a config.json checked and read into our model.* settings (theirs -> ours), refusals by name
    tensors.py   parameter names and shapes both ways, the import's checks of every tensor
"""
from model.hf.families import (ARCHITECTURES, MOE_FAMILIES, QK_NORM_FAMILIES, ROPE_SETTINGS, ROPE_TYPES,
                               UNSUPPORTED_FAMILIES, HFError, check_output_dir, export_problems, hf_config,
                               hf_model_type, llama_config, model_config, sparse_layers)
from model.hf.settings import (HF_BOOLS, HF_INTS, HF_MOE_INTS, HF_POSITIVE_NUMBERS, HF_ROPE_KEYS, HF_STRINGS,
                               MOE_KEYS, QK_NORM_KEYS, field_problems, model_settings, moe_layer_choice)
from model.hf.tensors import EXPERT_BIAS, first_non_finite, from_hf, hf_shapes, non_finite, to_hf

__all__ = ["ARCHITECTURES", "MOE_FAMILIES", "QK_NORM_FAMILIES", "ROPE_SETTINGS", "ROPE_TYPES", "UNSUPPORTED_FAMILIES",
           "HFError", "check_output_dir", "export_problems", "hf_config", "hf_model_type", "llama_config",
           "model_config", "sparse_layers", "HF_BOOLS", "HF_INTS", "HF_MOE_INTS", "HF_POSITIVE_NUMBERS",
           "HF_ROPE_KEYS", "HF_STRINGS", "MOE_KEYS", "QK_NORM_KEYS", "field_problems", "model_settings",
           "moe_layer_choice", "EXPERT_BIAS", "first_non_finite", "from_hf", "hf_shapes", "non_finite", "to_hf"]
