"""What one layout costs, read from the project's own accounting, never re-derived: bytes per group from
``parallel/volume.py``, memory per rank from ``training/memory.py``, parameters from ``model/flops.py``.

Both of the first two build the rank's model chunks on the meta device (``parallel.zero.units.meta_chunks``),
~13 ms a layer on this CPU, the whole cost of a prediction. :func:`shared_meta` memoises those chunks for the
planner's calls (per model, precision, tp, sequence parallelism, ep, pp, virtual stages and pipeline rank: what
the chunks' shapes depend on), and what can be shared between layouts is cached here: the data-parallel bytes
per (model layout, ZeRO settings), affine in the micro-batches per step (measured from 1 and 2), the model
states per (layout, ZeRO settings). Mixture-of-experts models are refused by ``parallel/volume.py`` (their
exchanges depend on the routing): for them the planner counts the attention side from ``step_bytes`` on the
model with dense MLPs (the same TP/PP/CP bytes), the expert all-to-alls from the tokens routed, and the
data-parallel bytes from the parameters each group holds (ring reduce-scatter / all-gather of ``(n-1)/n`` of them).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

from config import Config
from parallel.layout import Layout

_CHUNKS: Dict[tuple, list] = {}  # meta_chunks' memo across the planner's calls
_CACHE: Dict[tuple, object] = {}
_MAX = 4096


def clear() -> None:
    _CHUNKS.clear()
    _CACHE.clear()


def rank_parameters(cfg: Config, layout: Layout) -> float:
    """Parameters a rank of the busiest stage holds (dense ones over tp x pp, routed experts over pp x ep)."""
    counts = parameters(cfg)
    experts = counts["routed"]
    dense = counts["total"] - experts
    return dense / (layout.tp * layout.pp) + experts / (layout.pp * layout.ep)


def model_key(cfg: Config) -> str:
    """The model's settings that its chunks' shapes and parameters depend on (recomputation is not one of them)."""
    return repr(dataclasses.replace(cfg.model, activation_checkpointing="off"))


def parameters(cfg: Config) -> Dict[str, int]:
    """``model.flops.parameter_count`` and ``flops_per_token`` (key ``flops``), memoised per model."""
    from model.flops import flops_per_token, parameter_count

    def make():
        out = dict(parameter_count(cfg.model))
        out["flops"] = flops_per_token(cfg.model)
        out["routed"] = routed_expert_parameters(cfg)
        return out

    return _memo(("params", model_key(cfg)), make)


def shared_meta():
    """Memoise ``meta_chunks`` for the estimator and the volume while the planner runs
    (``parallel.zero.units.memoised_meta``)."""
    from parallel.zero.units import memoised_meta

    return memoised_meta(_CHUNKS)


def _memo(key: tuple, make):
    if key not in _CACHE:
        if len(_CACHE) > _MAX:
            _CACHE.clear()
        _CACHE[key] = make()
    return _CACHE[key]


def _model_key(layout: Layout) -> tuple:
    return (layout.world_size, layout.tp, layout.pp, layout.dp, layout.virtual_stages, layout.ranks_per_node,
            layout.sequence_parallel, layout.cp, layout.ep)


def _ranks(layout: Layout):
    """The first rank of the first and of the last pipeline stage (as scripts/estimate_memory.py)."""
    return sorted({0, layout.rank_of(layout.pp - 1, 0, 0)})


def memory_lower_bound(cfg: Config, layout: Layout) -> float:
    """Bytes per GPU no lower than the estimator's would be, without building the model: the stage's model-state
    bytes per parameter (training/memory.py's docstring: 16; (e_c + e_r) + o / N; e_c + (e_r + o) / N;
    (e_c + e_r + o) / N, o = 12, 8 in fp32) on 0.95 of the busiest rank's parameters, plus the activations; 0 under fp8."""
    from training.memory import activation_bytes

    if cfg.precision == "fp8":
        return 0.0
    z, n = cfg.zero, layout.dp
    e_c = 4 if cfg.precision == "fp32" else 2
    e_r = e_c if z.reduce_dtype == "compute" else 4
    o = 8 if cfg.precision == "fp32" else 12  # fp32: the master copy is the parameter buffer itself
    per = {0: 16.0, 1: e_c + e_r + o / n, 2: e_c + (e_r + o) / n, 3: (e_c + e_r + o) / n}[z.stage]
    if cfg.train.optimizer != "adamw":
        per -= 8 / (n if z.stage else 1)  # another optimizer may keep less state than AdamW's m and v
    acts = max(sum(activation_bytes(cfg, layout, r).values()) for r in _ranks(layout))
    return 0.95 * rank_parameters(cfg, layout) * per + acts


def memory_bytes(cfg: Config, layout: Layout) -> Tuple[float, Dict[str, float]]:
    """The estimator's peak bytes per GPU (model states + activations, ``training/memory.py``) over the first
    rank of the first and of the last stage, and that rank's components."""
    from training.memory import activation_bytes, model_state_bytes

    mb = layout.num_microbatches if cfg.zero.stage == 2 or cfg.precision == "fp8" else 0
    best: Tuple[float, Dict[str, float]] = (-1.0, {})
    for rank in _ranks(layout):
        key = ("states", _model_key(layout), mb, rank, repr(cfg.zero), cfg.precision, repr(cfg.fp8),
               cfg.train.optimizer, model_key(cfg))
        states = _memo(key, lambda: model_state_bytes(cfg, layout, rank))
        parts = dict(states)
        for k, v in activation_bytes(cfg, layout, rank).items():
            parts[f"activations_{k}"] = v
        total = float(sum(parts.values()))
        if total > best[0]:
            best = (total, parts)
    return best


def dense_twin(cfg: Config) -> Config:
    """The model with its MoE layers' MLPs dense (for the bytes ``step_bytes`` counts outside the experts)."""
    if not cfg.model.moe.num_experts:
        return cfg
    moe = dataclasses.replace(cfg.model.moe, num_experts=0)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe))


def _plain(cfg: Config) -> Config:
    z = dataclasses.replace(cfg.zero, stage=0, quantized_weights=False, quantized_gradients=False, hpz_size=1,
                            weight_delta=False)
    return dataclasses.replace(cfg, zero=z)


ACTIVATION_GROUPS = ("tp", "tp_kv", "cp", "pp", "world")


def step_bytes(cfg: Config, layout: Layout, activations_only: bool = False) -> Dict[str, float]:
    """Bytes rank 0 sends in one step, by ``parallel/volume.py``'s group names (plus ``ep`` for MoE).
    ``activations_only``: the groups that move activations (TP, CP, PP, EP) and none of the data-parallel ones,
    without building the model (the search's lower bound; under fp8 half the bf16 bytes, a lower bound)."""
    from parallel.volume import step_bytes as volume_step_bytes

    if activations_only:
        twin = dense_twin(cfg)
        scale = 0.5 if cfg.precision == "fp8" else 1.0
        if cfg.precision == "fp8":
            twin = dataclasses.replace(twin, precision="bf16")
        base = volume_step_bytes(_plain(twin), layout, 0)
        out = {g: scale * v for g, v in base.items() if g in ACTIVATION_GROUPS}
        if cfg.model.moe.num_experts:
            out["ep"] = ep_bytes(cfg, layout)
        return out
    if cfg.precision == "fp8" and not cfg.model.moe.num_experts:  # FP8-LM's own DP path: the whole step at once
        key = ("fp8", _model_key(layout), layout.num_microbatches, repr(cfg.zero), repr(cfg.fp8), repr(cfg.model),
               cfg.train.micro_batch_size)
        return _memo(key, lambda: volume_step_bytes(cfg, layout, 0))
    twin = dense_twin(cfg)
    base = volume_step_bytes(_plain(twin) if cfg.precision != "fp8" else twin, layout, 0)
    out = {g: v for g, v in base.items() if g in ACTIVATION_GROUPS}
    if cfg.model.moe.num_experts:
        out.update(moe_dp_bytes(cfg, layout))
        out["ep"] = ep_bytes(cfg, layout)
        return out
    if cfg.zero.stage == 0:
        out["dp"] = base.get("dp", 0.0)
        out["embedding"] = base.get("embedding", 0.0)
        return out
    for group, v in zero_bytes(cfg, layout).items():
        out[group] = out.get(group, 0.0) + v
    return out


def zero_bytes(cfg: Config, layout: Layout) -> Dict[str, float]:
    """``parallel/volume.zero_step_bytes`` (steady state: ``early`` where the early step applies), affine in the
    micro-batches per step: measured at 1 and 2 once per (model layout, ZeRO settings)."""
    from parallel.volume import zero_step_bytes
    from parallel.zero.early_step import early_step_applies

    early = early_step_applies(cfg.zero)
    key = ("zero", _model_key(layout), repr(cfg.zero), cfg.precision, model_key(cfg))

    def fit():
        one = zero_step_bytes(cfg, dataclasses.replace(layout, num_microbatches=1), 0, early=early)
        two = zero_step_bytes(cfg, dataclasses.replace(layout, num_microbatches=2), 0, early=early)
        return {g: (one.get(g, 0.0), two.get(g, 0.0) - one.get(g, 0.0)) for g in set(one) | set(two)}

    lines = _memo(key, fit)
    return {g: a + b * (layout.num_microbatches - 1) for g, (a, b) in lines.items()}


def routed_expert_parameters(cfg: Config) -> int:
    """Weights of every routed expert of every MoE layer (``model/flops.py``'s expert width and FFN shape)."""
    from config.moe import is_moe_layer
    from model.flops import expert_width

    m = cfg.model
    if not m.moe.num_experts:
        return 0
    per_expert = (3 if m.activation == "swiglu" else 2) * m.d_model * expert_width(m)
    return sum(m.moe.num_experts * per_expert for i in range(m.n_layers) if is_moe_layer(m.moe, i))


def moe_dp_bytes(cfg: Config, layout: Layout) -> Dict[str, float]:
    """Data-parallel bytes of an MoE model: dense tensors over dp, routed experts over dp / ep, as ZeRO moves
    them (stage 0: fp32 all-reduce; 1-2: reduce-scatter + all-gather; 3: per micro-batch two gathers and one
    reduce-scatter) at the compute dtype (reduce_dtype=compute)."""
    from model.flops import parameter_count

    experts = routed_expert_parameters(cfg)
    dense = parameter_count(cfg.model)["total"] - experts
    per_stage = 1.0 / layout.pp
    e = 2 if cfg.precision != "fp32" else 4
    z = cfg.zero
    out: Dict[str, float] = {}
    for group, n, params in (("dp", layout.dp, dense * per_stage / layout.tp),
                             ("edp", layout.dp // layout.ep, experts * per_stage / layout.ep)):
        share = (n - 1) / n if n > 1 else 0.0
        if z.stage == 0:
            out[group] = 2 * share * 4 * params
        elif z.stage in (1, 2):
            out[group] = 2 * share * e * params
        else:
            out[group] = 3 * share * e * params * layout.num_microbatches
    return out


def ep_bytes(cfg: Config, layout: Layout) -> float:
    """Expert parallelism's all-to-alls per step: each MoE layer sends top_k copies of its tokens' hidden states
    out and back (dispatch, combine) in forward and their gradients in backward; recomputation repeats forward's."""
    from config.moe import is_moe_layer

    m, ep = cfg.model, layout.ep
    if ep <= 1:
        return 0.0
    tokens = cfg.train.micro_batch_size * m.seq_len // layout.cp
    e = 2 if cfg.precision != "fp32" else 4
    layers = sum(is_moe_layer(m.moe, i) for i in range(m.n_layers)) / layout.pp
    passes = 4 + (2 if m.activation_checkpointing == "full" else 0)
    return passes * layers * tokens * m.moe.top_k * m.d_model * e * (ep - 1) / ep * layout.num_microbatches
