"""The mixture-of-experts settings (``model.moe``) and their checks.

``model.moe.num_experts = 0`` (the default) is today's dense model: every other key here is then ignored. With
routed experts, the MLP of the chosen layers (``is_moe_layer``) is ``model/moe.py``'s ``MoE``: a top-k
token-choice router computed in fp32, the routed experts (each a SwiGLU or GELU FFN as ``model.activation``
says), optional shared experts every token passes through, and the balancing terms (the Switch/GShard auxiliary
loss, the router z-loss, DeepSeek-V3's aux-loss-free expert bias).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

MOE_SCORES = ("softmax", "sigmoid")
"""``model.moe.score``'s values: the router's probabilities over the experts."""

MAX_EXPERTS = 2**13
"""model.moe.num_experts and model.moe.shared_experts: 21x the most routed experts published (Kimi K2's 384)."""
MAX_EXPERT_FFN = 2**19
"""model.moe.ffn_hidden and model.moe.shared_ffn_hidden: 4 x config.MAX_D_MODEL, model.ffn_hidden's ceiling."""


@dataclass
class MoeConfig:
    """Routed (and shared) experts in place of the dense MLP of some layers; 0 experts = the dense model."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 = dense (no MoE layer; the other keys are ignored)."""
    top_k: int = 2
    """Experts each token is sent to (1 to num_experts): Mixtral 2, Qwen2-MoE 4, DeepSeek-V3 8."""
    ffn_hidden: Optional[int] = None
    """Hidden size of each routed expert's FFN; null = model.ffn_hidden (the dense MLP's width)."""
    shared_experts: int = 0
    """Shared experts every token passes through, added to the routed output (DeepSeek's plain ones; Qwen2-MoE's
    one, gated by model.moe.shared_gate); computed as one FFN of width model.moe.shared_ffn_hidden. 0 = none."""
    shared_ffn_hidden: Optional[int] = None
    """Hidden size of the shared experts' one FFN; null = the routed experts' width x model.moe.shared_experts.
    Either way at most 2**19 (config.MAX_EXPERT_FFN)."""
    shared_gate: bool = False
    """Multiply the shared experts' output by sigmoid(x . w), w a learned [d_model] vector (Qwen2-MoE)."""
    layer_freq: int = 1
    """Which layers are MoE, with first_dense: layer i (from 0) is MoE when i >= first_dense and (i - first_dense)
    is a multiple of layer_freq. 1 = every layer from first_dense on (Mixtral, DeepSeek-V3 with first_dense=3);
    Qwen2-MoE's decoder_sparse_step s is layer_freq=s with first_dense=s-1."""
    first_dense: int = 0
    """Layers at the bottom that keep the dense MLP (DeepSeek's first_k_dense_replace); below model.n_layers."""
    score: str = "softmax"
    """Router probabilities, in fp32: softmax (over the experts: Mixtral, Qwen2-MoE) | sigmoid (each expert on its
    own: DeepSeek-V3)."""
    norm_topk: bool = True
    """Renormalise the chosen experts' probabilities to sum to 1 (Mixtral; Qwen's norm_topk_prob; DeepSeek-V3);
    false keeps the raw probabilities as gates (Qwen2-MoE's default, Switch)."""
    routed_scale: float = 1.0
    """Factor on the routed experts' gates (DeepSeek-V3's routed_scaling_factor, 2.5); > 0."""
    capacity_factor: Optional[float] = None
    """null = dropless (every token reaches its top_k experts). A number c caps each expert at
    ceil(c x tokens x top_k / num_experts) token-slots per forward, the first ones in token order; a dropped slot
    contributes nothing (its token keeps the residual and its other experts) and is counted. An expert receives at
    most one slot per token, so a capacity of the token count or more (c >= num_experts / top_k, 1e30 included)
    drops nothing: it is dropless."""
    aux_loss_coeff: float = 0.0
    """Weight of the Switch/GShard load-balancing loss num_experts x sum_e f_e P_e (f_e: fraction of token-slots
    routed to e, P_e: mean router probability of e; 1 when balanced); 0 = off (Mixtral used 0.02, Megatron 1e-2)."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss, the mean over tokens of logsumexp(router logits)^2 (ST-MoE: 1e-3); 0 = off."""
    bias_update_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the top-k selection only,
    moved by this much once per optimizer step towards the mean load (bias_e += rate x sign(mean - load_e), from
    the load over all data-parallel ranks); saved in checkpoints. 0 = off (DeepSeek-V3: 1e-3)."""


def is_moe_layer(moe: MoeConfig, layer: int) -> bool:
    """Whether transformer layer ``layer`` (from 0) has routed experts instead of the dense MLP."""
    return moe.num_experts > 0 and layer >= moe.first_dense and (layer - moe.first_dense) % moe.layer_freq == 0


def validate_moe(cfg, need: Callable[[bool, str], None]) -> None:
    """``model.moe``'s checks, one line each, reported with the rest of ``validate_config`` (the name of
    model.moe.score is checked with every string setting, ``schema.CHOICES``)."""
    m, e = cfg.model, cfg.model.moe
    need(0 <= e.num_experts <= MAX_EXPERTS,
         f"model.moe.num_experts={e.num_experts} must be in [0, {MAX_EXPERTS}] (0 = dense; config.MAX_EXPERTS)")
    if e.num_experts <= 0:
        return
    need(1 <= e.top_k <= e.num_experts,
         f"model.moe.top_k={e.top_k} must be in [1, model.moe.num_experts={e.num_experts}]")
    for key in ("ffn_hidden", "shared_ffn_hidden"):
        value = getattr(e, key)
        need(value is None or 1 <= value <= MAX_EXPERT_FFN,
             f"model.moe.{key}={value} must be null or in [1, 2**19] (config.MAX_EXPERT_FFN)")
    need(0 <= e.shared_experts <= MAX_EXPERTS,
         f"model.moe.shared_experts={e.shared_experts} must be in [0, {MAX_EXPERTS}] (config.MAX_EXPERTS)")
    need(e.shared_experts > 0 or (e.shared_ffn_hidden is None and not e.shared_gate),
         "model.moe.shared_ffn_hidden and model.moe.shared_gate need model.moe.shared_experts >= 1")
    need(e.layer_freq >= 1, f"model.moe.layer_freq={e.layer_freq} must be >= 1")
    need(0 <= e.first_dense < m.n_layers,
         f"model.moe.first_dense={e.first_dense} must be in [0, model.n_layers={m.n_layers}) (else no layer is MoE)")
    need(e.capacity_factor is None or (math.isfinite(e.capacity_factor) and e.capacity_factor > 0),
         f"model.moe.capacity_factor={e.capacity_factor} must be null (dropless) or a number > 0")
    need(math.isfinite(e.routed_scale) and e.routed_scale > 0,
         f"model.moe.routed_scale={e.routed_scale} must be a number > 0")
    for key in ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
        value = getattr(e, key)
        need(math.isfinite(value) and value >= 0, f"model.moe.{key}={value} must be a number >= 0 (0 = off)")
    need(not m.bias, "model.bias=true with model.moe.num_experts > 0: the router and the experts have no biases")
    ep = cfg.parallel.ep
    z = cfg.zero
    zeropp = [k for k, on in (("zero.quantized_weights", z.quantized_weights), ("zero.quantized_gradients",
                                                                             z.quantized_gradients),
                              ("zero.hpz_size", z.hpz_size > 1)) if on]
    need(ep == 1 or not zeropp,
         f"parallel.ep={ep} with ZeRO++ ({', '.join(zeropp)}) is not built: its node-local groups and quantized "
         f"collectives span the whole data-parallel group, the routed experts shard over dp / ep ranks")
    tp = cfg.parallel.tp
    routed = e.ffn_hidden if e.ffn_hidden is not None else m.ffn_size
    shared = e.shared_ffn_hidden if e.shared_ffn_hidden is not None else routed * e.shared_experts
    # the derived width has the ceiling of one given as model.moe.shared_ffn_hidden (checked above; a routed width
    # or an expert count out of range is named above too)
    need(e.shared_ffn_hidden is not None or not (0 < e.shared_experts <= MAX_EXPERTS and 1 <= routed <= MAX_EXPERT_FFN)
         or shared <= MAX_EXPERT_FFN,
         f"model.moe.shared_experts={e.shared_experts} makes the shared experts' width {e.shared_experts} x {routed} "
         f"(the routed experts' width) = {shared}, above 2**19 (config.MAX_EXPERT_FFN; or set "
         f"model.moe.shared_ffn_hidden)")
    need(e.shared_experts == 0 or shared % tp == 0,
         f"the shared experts' width {shared} (model.moe.shared_ffn_hidden) is not divisible by parallel.tp={tp}")
