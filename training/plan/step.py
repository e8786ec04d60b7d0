"""One layout's predicted step: compute from the GEMM shapes, the bubble, each group's communication with the
overlap the code really has, the optimizer; memory from the estimator.

What overlaps what (as the code does it):
  TP / SP      collectives inside a layer, waited on at once (parallel/tensor_parallel.py): all exposed
  CP           the ring posts the next K/V block before attending to the one in hand (parallel/context.py):
               hides behind the attention's compute; all_gather and a2a (parallel/ulysses.py): all exposed
  PP           sends never block and receives are posted ahead (parallel/pipeline.py): the fill and drain hops
               (2 (p - 1) of them) are on the critical path, the rest hides behind the compute
  EP           the dispatch and combine all-to-alls are waited on: all exposed
  DP, ZeRO 0-2 the bucketed gradient reduction runs behind the last micro-batch's backward
               (parallel.overlap_grad_reduce); stages 1-2's gather of the updated parameters after the step: exposed
  ZeRO-3       gathers prefetched and reduce-scatters in flight behind the whole step's compute, except the step
               boundary's chain (parallel/volume.boundary_chain_bytes: the first modules' last reduce and next
               gather, which nothing can hide): exposed
Each hiding is bounded by the kind's ``overlap`` share of its window (devices.py).
"""
from __future__ import annotations

from typing import Dict, Optional

from config import Config
from parallel.layout import Layout, kv_replicas
from training.plan import costs
from training.plan.devices import LATENCY_INTER_S, LATENCY_INTRA_S, Cluster
from training.plan.formulas import (BACKWARD_FACTOR, attention_time, bubble_fraction, exposed, gemm_time,
                                    memory_time)

INTRA_GROUPS = ("tp", "tp_kv", "dp_intra", "qwz_intra", "dp_hpz")
ONE_PER_NODE = ("dp_inter", "qwz_inter")
PARAMETER_GROUPS = ("dp", "edp", "dp_intra", "qwz_intra", "dp_hpz", "embedding")


def layer_compute(cfg: Config, layout: Layout, cluster: Cluster) -> Dict[str, float]:
    """Seconds of one micro-batch through one transformer layer on one rank: ``gemm``, ``attention`` (forward)
    and ``attention_bwd``, ``elementwise`` (forward; backward counted as 2x), ``fp8_cast``."""
    m, t, dev = cfg.model, layout.tp, cluster.device
    fp8 = cfg.precision == "fp8"
    e = 4 if cfg.precision == "fp32" else 2
    tokens = cfg.train.micro_batch_size * m.seq_len // layout.cp
    h, hd = m.d_model, m.head_dim
    kv = m.kv_heads * hd * kv_replicas(m.kv_heads, t) // t
    shapes = [(tokens, m.q_size // t + 2 * kv, h), (tokens, h, m.q_size // t)]
    glu = 2 if m.activation == "swiglu" else 1
    moe = m.moe
    if moe.num_experts:  # routed experts whole on every TP rank (config/moe.py); rows: top_k copies of each token
        from model.flops import expert_width

        w = expert_width(m)
        rows = tokens * moe.top_k
        local = moe.num_experts // layout.ep
        per = max(rows // local, 1) if local else rows
        shapes += [(per, glu * w, h)] * local + [(per, h, w)] * local + [(tokens, moe.num_experts, h)]
        if moe.shared_experts:
            sw = moe.shared_ffn_hidden or w * moe.shared_experts
            shapes += [(tokens, glu * sw // t, h), (tokens, h, sw // t)]
        f_local = moe.top_k * w
    else:
        shapes += [(tokens, glu * m.ffn_size // t, h), (tokens, h, m.ffn_size // t)]
        f_local = m.ffn_size // t
    gemm = sum(gemm_time(a, b, c, dev, fp8, e) for a, b, c in shapes)
    fwd, bwd = attention_time(cfg.train.micro_batch_size, m.seq_len // layout.cp, m.seq_len / 2, m.n_heads // t,
                              hd, dev, e == 4)
    norm_tokens = tokens // t if layout.sequence_parallel else tokens
    elementwise = memory_time(e * (10 * h * norm_tokens + (4 * m.q_size // t) * tokens
                                   + (glu + 1) * f_local * tokens), dev)
    cast = 0.0
    if fp8:  # FP8-LM casts each GEMM's operands (read 16-bit, write 8-bit) forward and the gradients backward
        cast = memory_time(3 * 3 * sum(a * c + b * c for a, b, c in shapes), dev)
    return {"gemm": gemm, "attention": fwd, "attention_bwd": bwd, "elementwise": elementwise, "fp8_cast": cast}


def group_span(group: str, layout: Layout, g: int):
    """(members, members per node) of ``group`` for the time model."""
    dp, tp = layout.dp, layout.tp
    per_node_dp = layout.dp_intra_size
    if group == "dp":
        return dp, per_node_dp
    if group == "edp":
        n = max(dp // layout.ep, 1)
        return n, max(min(n, per_node_dp // layout.ep), 1)
    if group in ("cp", "ep"):
        n = layout.cp if group == "cp" else layout.ep
        return n, max(min(n, g // tp), 1)
    if group == "pp":
        return layout.pp, 1 if tp * dp >= g else g
    if group == "embedding":
        return 2, 1 if layout.pp > 1 and tp * dp >= g else 2
    if group == "world":
        return layout.world_size, min(g, layout.world_size)
    return dp, per_node_dp


def group_parts(group: str, nbytes: float, calls: float, layout: Layout, cluster: Cluster):
    """(NVLink seconds, NIC seconds, latency seconds) of this rank's ``nbytes`` on ``group`` in ``calls``
    collectives (formulas.ring_time's model): inside a node over NVLink; across nodes over the node's NICs, shared
    by the node's ranks that send at once (one ring per group crosses each node boundary; groups with one member
    per node all cross), with the NVLink hop of the members that share a node."""
    if nbytes <= 0:
        return 0.0, 0.0, 0.0
    g = cluster.gpus_per_node
    intra_Bps = cluster.intra_node_Bps * (cluster.device.zero_intra_efficiency if group in PARAMETER_GROUPS else 1.0)
    if group in INTRA_GROUPS:
        n = {"tp": layout.tp, "tp_kv": layout.tp, "dp_intra": layout.dp_intra_size,
             "qwz_intra": layout.dp_intra_size, "dp_hpz": layout.dp_intra_size}[group]
        return nbytes / intra_Bps, 0.0, calls * max(n - 1, 1) * LATENCY_INTRA_S
    if group in ONE_PER_NODE:
        n = layout.dp_inter_size
        return 0.0, nbytes * g / cluster.inter_node_Bps, calls * max(n - 1, 1) * LATENCY_INTER_S
    n, x = group_span(group, layout, g)
    if n <= x or layout.world_size <= g:  # the whole group on one node
        return nbytes / intra_Bps, 0.0, calls * max(n - 1, 1) * LATENCY_INTRA_S
    intra = nbytes / intra_Bps if x > 1 else 0.0
    return intra, nbytes * max(g // x, 1) / cluster.inter_node_Bps, calls * (n - 1) * LATENCY_INTER_S


def group_time(group: str, nbytes: float, calls: float, layout: Layout, cluster: Cluster) -> float:
    """Seconds of one group's traffic: its NVLink and NIC hops pipelined (the slower one), plus the latency."""
    intra, inter, latency = group_parts(group, nbytes, calls, layout, cluster)
    return max(intra, inter) + latency


def micro_batch_compute(cfg: Config, layout: Layout, cluster: Cluster) -> float:
    """Seconds of one micro-batch's forward and backward on one rank as ``predict`` counts them (no recompute)."""
    return predict(cfg, layout, cluster, lower_bound=True, parts=True)["per_mb"]


def _calls(cfg: Config, layout: Layout, layers: float) -> Dict[str, float]:
    """Collectives per step by group (for the latency term): a rough count of what the code issues."""
    mb, z = layout.num_microbatches, cfg.zero
    units = layers + 2
    full = cfg.model.activation_checkpointing == "full"
    tp = mb * layers * (8 if layout.sequence_parallel else 4) * (1.5 if full else 1.0)
    if z.stage == 3:
        dp = 3 * mb * units
    else:
        buckets = max(costs.rank_parameters(cfg, layout) * 4 / (cfg.parallel.bucket_mb * 2**20), 1.0)
        dp = buckets + (units if z.stage else 0)
    return {"tp": tp, "tp_kv": mb * layers, "cp": 3 * mb * layers * max(layout.cp - 1, 0), "ep": 4 * mb * layers,
            "pp": 2 * mb * layout.virtual_stages, "dp": dp, "edp": dp, "dp_intra": mb * units if z.stage == 3
            else units, "dp_inter": mb * units if z.stage == 3 else units, "qwz_intra": units, "qwz_inter": units,
            "dp_hpz": 2 * mb * units, "embedding": 1, "world": 1}


def predict(cfg: Config, layout: Layout, cluster: Cluster, lower_bound: bool = False,
            dp_bytes: Optional[Dict[str, float]] = None, parts: bool = False) -> dict:
    """The prediction for one layout: the fields of ``plan.py --json`` (module docstring of training/plan).
    ``lower_bound``: only ``step_time_s``, with no data-parallel communication and no model built (the search
    ranks layouts by it before predicting them whole). ``dp_bytes``: the data-parallel groups' bytes of another
    system (scripts/plan_check.py's FSDP2 hybrid shard) in place of this code's, with ZeRO-3's overlap rule."""
    m, dev, mb = cfg.model, cluster.device, layout.num_microbatches
    layers = m.n_layers / layout.pp
    lc = layer_compute(cfg, layout, cluster)
    t = layout.tp
    tokens = cfg.train.micro_batch_size * m.seq_len // layout.cp
    fp8 = cfg.precision == "fp8"
    e = 4 if cfg.precision == "fp32" else 2
    head = gemm_time(tokens, m.vocab_size // t, m.d_model, dev, fp8 and cfg.fp8.output_head, e)
    fwd_layer = lc["gemm"] + lc["attention"] + lc["elementwise"] + lc["fp8_cast"] / 3
    bwd_layer = BACKWARD_FACTOR * lc["gemm"] + lc["attention_bwd"] + 2 * lc["elementwise"] + 2 * lc["fp8_cast"] / 3
    recompute_layer = {"full": fwd_layer, "selective": lc["attention"]}.get(m.activation_checkpointing, 0.0)
    per_mb = layers * (fwd_layer + bwd_layer) + (1 + BACKWARD_FACTOR) * head
    if parts:
        return {"per_mb": per_mb}
    compute = mb * per_mb
    recompute = mb * layers * recompute_layer
    bubble = bubble_fraction(layout.pp, layout.virtual_stages, mb) * (compute + recompute)

    nbytes = costs.step_bytes(cfg, layout, activations_only=lower_bound or dp_bytes is not None)
    if dp_bytes is not None:
        nbytes.update(dp_bytes)
    calls = _calls(cfg, layout, layers)
    times = {g: group_time(g, v, calls.get(g, 1), layout, cluster) for g, v in nbytes.items()}
    busy = compute + recompute
    window_attention = mb * layers * (lc["attention"] + lc["attention_bwd"])
    out = {"tp": times.get("tp", 0.0) + times.get("tp_kv", 0.0), "ep": times.get("ep", 0.0)}
    if cfg.parallel.cp_comm == "p2p":  # the ring posts the next block's transfer before attending to this one
        out["cp"] = exposed(times.get("cp", 0.0), window_attention, cluster.overlap)
    else:  # the all-gather and the all-to-alls are waited on where they are issued
        out["cp"] = times.get("cp", 0.0)
    pp_time = times.get("pp", 0.0)
    hop = pp_time / max(calls["pp"], 1)
    fill = min(2 * (layout.pp - 1) * hop, pp_time)
    out["pp"] = fill + exposed(pp_time - fill, busy, cluster.overlap)
    dp_groups = [g for g in times if g not in ("tp", "tp_kv", "ep", "cp", "pp")]
    dp_time = sum(times[g] for g in dp_groups)  # distinct collectives, one after another
    z = cfg.zero
    if lower_bound:
        out["dp"] = _dp_lower_bound(cfg, layout, cluster, busy, layers * bwd_layer, e)
    elif z.stage == 3:
        chain = _chain_time(cfg, layout, cluster, nbytes, times) if dp_bytes is None else 0.0
        out["dp"] = chain + exposed(dp_time - chain, busy, cluster.overlap)
    else:
        window = layers * bwd_layer if cfg.parallel.overlap_grad_reduce else 0.0
        e_r = e if z.reduce_dtype == "compute" else 4
        reduce_share = 1.0 if z.stage == 0 else e_r / (e_r + e)
        out["dp"] = exposed(dp_time * reduce_share, window, cluster.overlap) + dp_time * (1 - reduce_share)
    params = costs.rank_parameters(cfg, layout)
    shard = params / layout.dp if z.stage else params
    per_element = 12 if fp8 else (32 if z.stage == 0 else 28)  # AdamW: read/written bytes per element
    quant = 0.0
    if z.quantized_weights:
        quant += memory_time(3 * params * (mb if z.stage == 3 and z.hpz_size == 1 else 1), dev)
    if z.quantized_gradients:
        quant += memory_time(6 * params * (mb if z.stage == 3 else 1), dev)
    optimizer = memory_time(per_element * shard, dev)
    breakdown = {"compute": compute + quant, "recompute": recompute, "bubble": bubble, "tp": out["tp"],
                 "cp": out["cp"], "ep": out["ep"], "pp": out["pp"], "dp": out["dp"], "optimizer": optimizer}
    step = sum(breakdown.values())
    if lower_bound:
        return {"step_time_s": step}
    step_tokens = cfg.train.global_batch_size * m.seq_len
    flops = costs.parameters(cfg)["flops"] * step_tokens / layout.world_size / step
    mem, parts = costs.memory_bytes(cfg, layout)
    gib = mem / 2**30
    capacity = dev.memory_bytes / 2**30
    return {"layout": describe(cfg, layout), "step_time_s": step, "tokens_per_s": step_tokens / step,
            "tflops_per_gpu": flops / 1e12, "mfu": flops / dev.peak(False), "memory_gib": gib,
            "fits": gib <= capacity, "over_gib": max(gib - capacity, 0.0), "breakdown": breakdown,
            "bytes": {g: v for g, v in nbytes.items() if v}, "memory": {k: v / 2**30 for k, v in parts.items()}}


def _dp_lower_bound(cfg: Config, layout: Layout, cluster: Cluster, busy: float, backward: float, e: int) -> float:
    """No more than ``predict`` finds for the data-parallel groups, without building the model: 0.9 of the bytes
    ZeRO's accounting gives the rank's parameters ((n-1)/n of them: stage 0 an fp32 all-reduce, 1-2 a reduce-scatter
    and an all-gather, 3 two gathers and a reduce-scatter per micro-batch) on the ``dp`` group, with the same
    overlap rule; with ZeRO++ or hpZ only the gradients' quantized bytes over the node's links; 0 for MoE."""
    z, n = cfg.zero, layout.dp
    if n <= 1 or cfg.model.moe.num_experts or cfg.precision == "fp8":
        return 0.0
    share = 0.9 * (n - 1) / n * costs.rank_parameters(cfg, layout)
    e_r = e if z.reduce_dtype == "compute" else 4
    mb = layout.num_microbatches if z.stage == 3 else 1
    if z.quantized_weights or z.quantized_gradients or z.hpz_size > 1:
        bits = z.gradient_bits if z.quantized_gradients else 8 * e_r
        return share * bits / 8 * mb / (cluster.intra_node_Bps * 2)
    if z.stage == 0:
        return exposed(group_time("dp", 2 * 4 * share, 0, layout, cluster), backward if
                       cfg.parallel.overlap_grad_reduce else 0.0, cluster.overlap)
    if z.stage in (1, 2):
        reduce = group_time("dp", share * e_r, 0, layout, cluster)
        return exposed(reduce, backward if cfg.parallel.overlap_grad_reduce else 0.0, cluster.overlap) + \
            group_time("dp", share * e, 0, layout, cluster)
    return exposed(group_time("dp", share * (2 * e + e_r) * mb, 0, layout, cluster), busy, cluster.overlap)


def _chain_time(cfg: Config, layout: Layout, cluster: Cluster, nbytes, times) -> float:
    """ZeRO-3 on one stage across nodes: the step boundary's chain share of the cross-node time (exposed)."""
    if layout.pp != 1 or layout.dp_inter_size <= 1 or cfg.model.moe.num_experts or cfg.precision == "fp8":
        return 0.0
    from parallel.volume import boundary_chain_bytes
    from parallel.zero.early_step import early_step_applies

    key = ("chain", costs._model_key(layout), repr(cfg.zero), costs.model_key(cfg))
    got = costs._memo(key, lambda: boundary_chain_bytes(cfg, layout, 0, early=early_step_applies(cfg.zero)))
    share = got["chain"] / got["step"] if got["step"] else 0.0
    cross = sum(times[g] for g in ("dp", "dp_inter", "qwz_inter", "world") if g in times)
    return share * cross


def describe(cfg: Config, layout: Layout) -> Dict[str, object]:
    """The layout's keys as train.py takes them (``key=value`` overrides)."""
    z, m = cfg.zero, cfg.model
    keys = {"parallel.tp": layout.tp, "parallel.pp": layout.pp, "parallel.virtual_stages": layout.virtual_stages,
            "parallel.cp": layout.cp, "parallel.ep": layout.ep, "parallel.sequence_parallel": layout.sequence_parallel,
            "train.micro_batch_size": cfg.train.micro_batch_size,
            "model.activation_checkpointing": m.activation_checkpointing, "zero.stage": z.stage}
    if layout.cp > 1:
        keys["parallel.cp_comm"] = cfg.parallel.cp_comm
    if z.quantized_weights:
        keys["zero.quantized_weights"] = True
    if z.quantized_gradients:
        keys["zero.quantized_gradients"] = True
    if z.hpz_size > 1:
        keys["zero.hpz_size"] = z.hpz_size
    keys["dp"] = layout.dp // layout.cp
    return keys
