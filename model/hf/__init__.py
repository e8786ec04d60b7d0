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

    families.py  the families, HFError, the export's checks and the config.json it writes (ours -> theirs)
    settings.py  a config.json checked and read into our model.* settings (theirs -> ours), refusals by name
    tensors.py   parameter names and shapes both ways, the import's checks of every tensor
"""
from model.hf.families import (ARCHITECTURES, ROPE_SETTINGS, ROPE_TYPES, UNSUPPORTED_FAMILIES, HFError,
                               check_output_dir, export_problems, hf_config, hf_model_type, llama_config,
                               model_config)
from model.hf.settings import (HF_BOOLS, HF_INTS, HF_POSITIVE_NUMBERS, HF_ROPE_KEYS, HF_STRINGS, MOE_KEYS,
                               QK_NORM_KEYS, field_problems, model_settings)
from model.hf.tensors import first_non_finite, from_hf, hf_shapes, non_finite, to_hf

__all__ = ["ARCHITECTURES", "ROPE_SETTINGS", "ROPE_TYPES", "UNSUPPORTED_FAMILIES", "HFError", "check_output_dir",
           "export_problems", "hf_config", "hf_model_type", "llama_config", "model_config", "HF_BOOLS", "HF_INTS",
           "HF_POSITIVE_NUMBERS", "HF_ROPE_KEYS", "HF_STRINGS", "MOE_KEYS", "QK_NORM_KEYS", "field_problems",
           "model_settings", "first_non_finite", "from_hf", "hf_shapes", "non_finite", "to_hf"]
