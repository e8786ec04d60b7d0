"""Analytic communication volume of one training step, per rank and per group.

The same byte convention as ``parallel/comm.py`` (what a rank puts on the wire
with ring / direct algorithms). With ``a = s * b * h * e`` the bytes of one full
activation (sequence s, micro-batch b, hidden h, e bytes per element in the
compute dtype) and t the TP size, per transformer layer and micro-batch:

  TP           4 all-reduces (2 fwd: after attention and MLP; 2 bwd: into QKV and MLP)
               = 4 * 2 (t-1)/t * a
  TP + SP      2 all-gathers + 2 reduce-scatters forward, the conjugates backward
               = 8 * (t-1)/t * a      (the same bytes, half the activation memory)
  full recompute repeats the forward's collectives up to the last one whose output
  backward needs (torch's checkpoint stops early): +1 all-reduce (TP), +1.5 pairs (SP).

plus, per micro-batch, the embedding (one reduction forward, or its SP pair), the
output layer's input (one backward reduction, or its SP pair) and three fp32
all-reduces of ``s * b`` values in vocab-parallel cross entropy; per step, the
sum of sequence-parallel norm/bias gradients over TP. Grouped-query attention
with fewer KV heads than TP ranks adds, per layer and micro-batch, the all-reduce
of the replicated K/V weight gradient over its holders (group ``tp_kv``).

CP (context parallelism: each rank holds s / cp tokens of every sequence, so ``a`` above counts s / cp): per
layer and micro-batch, with n = b x local KV heads x (s / cp) x head_dim the elements of this rank's K (and of V),
e the compute dtype's bytes (bf16 under fp8: attention stays 16-bit) and fp32 gradient accumulators,
``parallel/context.py``'s exchanges over the ``cp`` group:

  p2p          forward (cp-1) hops of K and V: (cp-1) 2n e; backward the same hops with dK/dV: (cp-1) 2n (e + 4)
  all_gather   forward gather of K and V: (cp-1) 2n e; backward gathered again, (cp-1) 2n e, and dK/dV
               reduce-scattered in fp32, (cp-1) 2n 4
  a2a          (``parallel/ulysses.py``, per head of this rank's tokens, h = local heads / cp) forward q and the
               output: 2 (cp-1) h heads, K and V: 2 x the KV heads the other CP ranks need; backward the same
               pieces' gradients back, in the compute dtype: 2 (cp-1) h + 2 (cp-1) x the KV heads this rank needs
               (``ulysses.a2a_bytes``); selective recomputation repeats only q, K and V's exchange

and recomputation (full or selective) runs the forward's exchange once more.

PP: every forward that feeds a later virtual stage sends ``a / t`` (SP) or ``a``
bytes; every backward that feeds an earlier one sends the same. DP: the gradient
buckets, ``2 (d-1)/d * 4 * parameters``. Tied embeddings add one all-reduce of
the embedding shard over first+last stage. The step's scalars cross the world in
one all-reduce of float64 values (``Engine.train_step``): the loss, the strategy's
norm terms (the squared gradient norm; FP8-LM adds its two overflow counts) and the
trainer's ``STOP_FLAGS`` stop flags, in ``world``.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict

from config import Config, fp8_operands
from model.flops import parameter_count
from parallel.layout import Layout, kv_replicas
from parallel.schedule import sends, train_schedule

STOP_FLAGS = 2
"""Values the trainer adds to the step's scalar all-reduce (``training/trainer._stop_flags``: signal, time limit)."""

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}
"""Bytes of the compute dtype (fp8: activations are bf16 outside the FP8 GEMMs)."""


def _ring(n: int) -> float:
    """Per-rank share of an all-reduce over n ranks, as a multiple of the tensor's bytes."""
    return 2 * (n - 1) / n if n > 1 else 0.0


def step_bytes(cfg: Config, layout: Layout, rank: int, secondary_valid: bool = False,
               first_step: bool = False, stop_flags: int = 0, early: bool = False) -> Dict[str, float]:
    """Bytes this rank sends in one training step, by group name.

    ``stop_flags``: values the caller adds to the step's scalar all-reduce (the trainer: ``STOP_FLAGS``; a bare
    ``Engine.train_step``: none). Dense models only: a model with routed experts is refused (``ValueError``),
    its token exchanges depend on the routing (the ledger counts them).
    ``secondary_valid``: ZeRO-3 with hpZ, a validation pass ran since the last optimizer step and built the
    secondary copies, so this step gathers only from them (``zero_step_bytes``). ``first_step``: the first step
    of a run (or after a resume without qWD's reconstructed weights), where ZeRO-3's qWD gathers exactly.
    ``early``: the previous optimizer step kept its early gathers (``zero.early_step``,
    ``ZeroDataParallel.last_early``), which this step's forward uses (``zero_step_bytes``)."""
    if cfg.model.moe.num_experts:
        raise ValueError("parallel/volume.py predicts the bytes of dense models: with model.moe.num_experts > 0 the "
                         "expert exchanges and their gradient groups depend on the routing (the ledger counts them)")
    m, t = cfg.model, layout.tp
    e = DTYPE_BYTES[cfg.precision]
    cp = layout.cp
    s, b, h = m.seq_len // cp, cfg.train.micro_batch_size, m.d_model  # this rank's tokens of each sequence
    a = s * b * h * e
    mb = layout.num_microbatches
    pp_rank, _, _ = layout.coords(rank)
    vp, pp = layout.virtual_stages, layout.pp
    last_v = pp * vp - 1
    stages = [c * pp + pp_rank for c in range(vp)]
    layers = len(stages) * m.n_layers // (pp * vp)
    sp = layout.sequence_parallel
    out: Dict[str, float] = defaultdict(float)

    fp8 = cfg.precision == "fp8"
    quantized = fp8 and fp8_operands(cfg.fp8)  # FP8 linears (not with 16-bit GEMMs: fp8.gemm)
    head_fp8 = quantized and cfg.fp8.output_head
    if t > 1:
        pair = 2 * (t - 1) / t * a  # one all-reduce, or one all-gather + one reduce-scatter (SP)
        # FP8-LM: the SP all-gather in front of an FP8 linear moves E4M3 bytes, half of one gather
        fp8_saving = (t - 1) / t * a / 2 if quantized and sp and cfg.fp8.sequence_parallel_fp8 else 0.0
        per_layer = 4 * pair - 2 * fp8_saving  # the QKV and MLP-up input gathers
        if m.activation_checkpointing == "full":
            # recomputation repeats the forward's collectives up to the last tensor backward needs (torch's
            # checkpoint stops early): the attention reduction, not the MLP's; under SP also the MLP's gather
            per_layer += 1.5 * pair - 2 * fp8_saving if sp else pair
        per_mb = layers * per_layer
        if 0 in stages:
            per_mb += pair  # embedding
        if last_v in stages:
            per_mb += pair + 3 * _ring(t) * s * b * 4  # output layer input, cross entropy
            per_mb -= fp8_saving if head_fp8 else 0.0
        out["tp"] += mb * per_mb
        replicas = kv_replicas(m.kv_heads, t)
        if replicas > 1:
            # grouped-query attention, KV heads replicated over TP: each holder's K/V weight gradient is
            # all-reduced over its holders in every backward, in the parameters' dtype
            kv_local = 2 * m.head_dim * (m.d_model + (1 if m.attn_bias else 0)) * m.kv_heads * replicas // t
            e_param = 4 if cfg.zero.stage == 0 and not fp8 else e
            out["tp_kv"] += mb * layers * _ring(replicas) * e_param * kv_local
        qk = 2 * m.head_dim if m.qk_norm else 0  # each TP rank normalises its own heads: summed with SP or not
        if (sp or qk) and cfg.zero.stage == 0 and not fp8:  # (ZeRO and FP8 sum their pieces themselves: below)
            norm = h * (2 if m.norm == "layernorm" else 1)
            elems = (layers * (2 * norm + (2 * h if m.bias else 0)) + (norm if last_v in stages else 0)) if sp else 0
            out["tp"] += _ring(t) * 4 * (elems + layers * qk)

    if cp > 1:
        out["cp"] += mb * layers * _context_bytes(cfg, layout, s * b, layout.cp_rank(rank))

    act = a // t if sp else a
    for action in train_schedule(pp, vp, mb, pp_rank):
        out["pp"] += act * len(sends(action, pp, vp, pp_rank))

    if fp8:
        for group, nbytes in fp8_dp_step_bytes(cfg, layout, rank, secondary_valid).items():
            out[group] += nbytes
        linears = 4 * layers + (1 if head_fp8 and last_v in stages else 0) if quantized else 0
        for group, nbytes in fp8_amax_bytes(cfg, layout, linears, mb).items():
            out[group] += nbytes
    elif cfg.zero.stage == 0:
        local_params = _local_parameters(cfg, layout, stages)
        out["dp"] += _ring(layout.dp) * 4 * local_params
        if m.tie_embeddings and pp > 1 and (0 in stages or last_v in stages):
            out["embedding"] += _ring(2) * 4 * m.vocab_size * h / t
    else:
        for group, nbytes in zero_step_bytes(cfg, layout, rank, secondary_valid, first_step, early).items():
            out[group] += nbytes
    norm_terms = 3 if fp8 else 1
    out["world"] += _ring(layout.world_size) * 8 * (1 + norm_terms + stop_flags)
    return dict(out)


def _context_bytes(cfg: Config, layout: Layout, tokens: int, cp_rank: int) -> float:
    """One attention layer's context-parallel bytes per micro-batch of ``tokens`` local tokens (module docstring)."""
    m, cp, t = cfg.model, layout.cp, layout.tp
    kv_heads = m.kv_heads * kv_replicas(m.kv_heads, t) // t
    n = tokens * kv_heads * m.head_dim  # local K (or V) elements
    e = DTYPE_BYTES[cfg.precision]
    if cfg.parallel.cp_comm == "a2a":
        from parallel.ulysses import a2a_bytes

        inputs, output, backward = a2a_bytes(tokens * m.head_dim, e, cp, cp_rank, m.n_heads // t, kv_heads)
        forward = inputs + output
        # selective recomputation stops before the output's exchange (ulysses.a2a_bytes); full reruns the layer
        again = {"full": forward, "selective": inputs}.get(m.activation_checkpointing, 0)
    else:
        forward = (cp - 1) * 2 * n * e
        backward = (cp - 1) * 2 * n * (e + 4)  # the same bytes in both forms: K/V again, and dK/dV in fp32
        again = forward if m.activation_checkpointing in ("full", "selective") else 0
    recompute = again
    return forward + backward + recompute


def zero_step_bytes(cfg: Config, layout: Layout, rank: int, secondary_valid: bool = False,
                    first_step: bool = False, early: bool = False) -> Dict[str, float]:
    """ZeRO 1-3 traffic of one step, per unit (``parallel/zero/units.py``) with S its padded shard:

      stages 1-2  reduce-scatter (N-1) S e_r once (qgZ: below), all-gather of the updated parameters
                  (N-1) S e_c once (qwZ, with or without qWD: the quantized gather below, once)
      stage 3     per micro-batch: all-gather (N-1) S e_c once per module that uses the unit in forward and
                  once more for backward (recomputation reuses the backward gather; none where no user's
                  backward reads the weights: the untied embedding), reduce-scatter (N-1) S e_r
      ZeRO++      (``parallel/zero/zeropp.py``) qwZ: a gather from primary shards sends quantized bytes instead,
                  in two hops where DP spans Y > 1 nodes of X > 1 ranks ((Y-1) pieces on qwz_inter, (X-1) Y on
                  qwz_intra);
                  hpZ: only the step's first gather of a unit is from primary shards (on dp), every other is
                  (H-1) N S / H e_c on dp_hpz; with ``secondary_valid`` (a validation pass since the last step
                  built the secondary copies) the first one too; qWD (with hpZ): the first gather sends the
                  quantized differences (the qwZ bytes) plus one secondary gather (dp_hpz) of the previous
                  weights, except in the ``first_step``, an exact (N-1) S e_c gather on dp; ``early`` (the
                  previous step kept its early step, zero.early_step): every unit but those of each chunk's
                  first module was gathered from the primary shards into the secondary copies during the
                  previous backward (counted here, in the step whose forward uses them) and every gather of
                  them in this step, the first too, is inside the node;
                  qgZ (stages 1-3): units of at least qgz_min_numel elements reduce by the two all-to-alls
                  (dp_intra at zero.gradient_bits_intra, dp_inter at zero.gradient_bits) of ``QgzPlan`` instead
                  of the reduce-scatter
      all         sequence-parallel gradient pieces in this rank's shards all-reduced over TP; the tied
                  embedding's gradient shard over first + last stage (the norm's square sum: in the step's
                  scalar all-reduce, ``step_bytes``)
    (e_c: compute dtype bytes, e_r: reduce dtype bytes, N: DP size)."""
    from parallel.zero.partition import shard_layout
    from parallel.zero.units import chunk_units, meta_chunks
    from parallel.zero.zeropp import Quant, qwz_gather_bytes

    z, n, t = cfg.zero, layout.dp, layout.tp
    e_c = DTYPE_BYTES[cfg.precision]
    e_r = e_c if z.reduce_dtype == "compute" else 4
    pp_rank, dp_rank, _ = layout.coords(rank)
    mb = layout.num_microbatches
    tie = cfg.model.tie_embeddings and layout.pp > 1
    qwz = Quant(z.weight_bits, z.quant_block) if z.quantized_weights else None
    x, y = len(layout.dp_intra_ranks(rank)), len(layout.dp_inter_ranks(rank))
    out: Dict[str, float] = defaultdict(float)
    for chunk in meta_chunks(cfg, layout, pp_rank):
        units, uses = chunk_units(chunk)
        ahead = early_units(cfg, uses) if early else set()
        for k, unit in enumerate(units):
            shard = shard_layout([p.numel() for p in unit.params], n, z.partition)
            s = shard.shard_size
            reduces = mb if z.stage == 3 else 1
            for group, nbytes in _reduce_bytes(cfg, s, n, x, y).items():
                out[group] += reduces * nbytes
            if z.stage == 3:
                gathers = mb * _stage3_gather_count(k, uses)
                for group, nbytes in _stage3_gathers(cfg, gathers, s, n, secondary_valid, x, y, first_step,
                                                     k in ahead).items():
                    out[group] += nbytes
            elif qwz and n > 1:
                for group, nbytes in qwz_gather_bytes(s, n, qwz, x, y).items():
                    out[group] += nbytes
            else:
                out["dp"] += (n - 1) * s * e_c
            sp = sum(b - a for i, a, b, _ in shard.owned(dp_rank) if unit.params[i].spec.sequence_parallel)
            out["tp"] += _ring(t) * sp * e_r
            if tie and (unit.name == "embedding" or any(p.spec.shared_with for p in unit.params)):
                out["embedding"] += _ring(2) * s * e_r
    return dict(out)


def _reduce_bytes(cfg: Config, s: int, n: int, x: int, y: int) -> Dict[str, float]:
    """One gradient reduce-scatter of a unit with shards of ``s`` elements over ``n`` = x * y DP ranks, by group:
    qgZ's two all-to-alls (units of at least qgz_min_numel elements) or the plain reduce-scatter."""
    from parallel.zero.zeropp import QgzPlan, Quant

    z = cfg.zero
    if z.quantized_gradients and n > 1 and n * s >= z.qgz_min_numel:
        qgz = Quant(z.gradient_bits, z.quant_block)
        qgz_intra = Quant(z.gradient_bits_intra, z.quant_block) if z.gradient_bits_intra else None
        intra, inter = QgzPlan(n * s, x, y, qgz, z.qgz_stages, qgz_intra).bytes_per_rank()
        return {"dp_intra": intra, "dp_inter": inter}
    e_r = DTYPE_BYTES[cfg.precision] if z.reduce_dtype == "compute" else 4
    return {"dp": (n - 1) * s * e_r}


def spans_nodes(group: str, layout: Layout, rank: int) -> bool:
    """Whether the analytic volume's ``group`` of ``rank`` has members on more than one node (the ledger's
    ``inter`` link), for the groups of a job without pipelining (``boundary_chain_bytes``): the DP groups that
    cross nodes (``dp`` where the DP peers sit on several nodes, ``dp_inter``, ``qwz_inter``) and ``world`` where
    the job spans nodes; TP, the node's DP peers (``dp_intra``, ``qwz_intra``) and hpZ (``dp_hpz``, inside a node
    by the layout's rule) never."""
    if group in ("dp_inter", "qwz_inter"):
        return True
    if group == "dp":
        return len(layout.dp_inter_ranks(rank)) > 1
    if group == "world":
        return layout.world_size > layout.ranks_per_node
    return False


def boundary_chain_bytes(cfg: Config, layout: Layout, rank: int, early: bool = False) -> Dict[str, float]:
    """ZeRO-3 without pipelining: the bytes per step, per rank, on groups that cross nodes (``spans_nodes``) of
    ``chain`` (what must cross between the end of the backward's last block and the start of the next forward's
    first block) and of the whole ``step`` (``step_bytes``, ``early`` as there).

    The chain: the units of the forward's first two modules (the embedding and the first block) have their
    gradients final last in backward and their weights needed first in forward, so between those two points the
    link carries each one's last gradient reduce and the gather of its updated weights from the primary shards
    (an early step's gather too: it needs the reduce), while the compute has only the embedding's lookups and
    the optimizer's arithmetic to run. Whatever the schedule, a step is then at least the compute plus that
    transfer: ``step >= compute + chain / step * wire time`` (``scripts/bench_cluster.py``'s floor)."""
    from parallel.zero.partition import shard_layout
    from parallel.zero.units import chunk_units, meta_chunks

    if cfg.zero.stage != 3 or layout.pp != 1:
        raise ValueError(f"the step boundary's chain is defined for ZeRO-3 on one pipeline stage (zero.stage="
                         f"{cfg.zero.stage}, parallel.pp={layout.pp})")
    n = layout.dp
    x, y = len(layout.dp_intra_ranks(rank)), len(layout.dp_inter_ranks(rank))
    (chunk,) = meta_chunks(cfg, layout, 0)
    units, uses = chunk_units(chunk)
    chain = 0.0
    for k in sorted({k for use in uses[:2] for k in use.units}):
        s = shard_layout([p.numel() for p in units[k].params], n, cfg.zero.partition).shard_size
        one = dict(_reduce_bytes(cfg, s, n, x, y))
        for group, nbytes in _stage3_gathers(cfg, 1, s, n, False, x, y).items():
            one[group] = one.get(group, 0.0) + nbytes
        chain += sum(nbytes for group, nbytes in one.items() if spans_nodes(group, layout, rank))
    step = sum(nbytes for group, nbytes in step_bytes(cfg, layout, rank, early=early).items()
               if spans_nodes(group, layout, rank))
    return {"chain": chain, "step": step}


def early_units(cfg: Config, uses) -> set:
    """Indices of a chunk's units that ZeRO-3's early step covers (``zero.early_step``;
    ``ZeroDataParallel._early_candidates``): every unit but those of the chunk's first module."""
    from parallel.zero.sharded import early_step_applies

    if not early_step_applies(cfg.zero):
        return set()
    first = set(uses[0].units) if uses else set()
    return {k for use in uses for k in use.units if k not in first}


def _stage3_gather_count(k: int, uses) -> int:
    """Stage-3 gathers of unit ``k`` per micro-batch: one per module that uses it in forward, and one for backward
    if any of them reads its weights there (an embedding lookup's backward does not)."""
    mine = [use for use in uses if k in use.units]
    return len(mine) + any(use.backward_reads_weights for use in mine)


def _stage3_gathers(cfg: Config, gathers: int, s: int, n: int, secondary_valid: bool, x: int,
                    y: int, first_step: bool = False, early: bool = False) -> Dict[str, float]:
    """``gathers`` stage-3 gathers of a unit with shards of ``s`` elements over ``n`` = x * y DP ranks (x a node),
    by group: from the primary shards (qwZ: quantized, two hops where x > 1 and y > 1; qWD: the quantized
    differences plus the node's secondary copies of the previous weights, or exact in the ``first_step``), or
    with hpZ the first from them (none if ``secondary_valid``), the rest from the secondary copies inside the
    node; ``early``: one from the primary shards (the previous step's early gather into the secondary copies)
    and all ``gathers`` from the secondary copies."""
    from parallel.zero.zeropp import Quant, hpz_gather_bytes, qwz_gather_bytes

    z, e_c = cfg.zero, DTYPE_BYTES[cfg.precision]
    qwz = Quant(z.weight_bits, z.quant_block) if z.quantized_weights else None
    if qwz and not (z.weight_delta and first_step):
        primary = dict(qwz_gather_bytes(s, n, qwz, x, y))
        if z.weight_delta:
            primary["dp_hpz"] = hpz_gather_bytes(n * s, z.hpz_size, e_c)
    else:
        primary = {"dp": (n - 1) * s * e_c}
    first = gathers if z.hpz_size == 1 else 0 if secondary_valid else min(1, gathers)
    out = {group: first * nbytes for group, nbytes in primary.items()}
    if z.hpz_size > 1:
        inside = gathers if early and first else gathers - first
        out["dp_hpz"] = out.get("dp_hpz", 0) + inside * hpz_gather_bytes(n * s, z.hpz_size, e_c)
    return out


def _fp8_stage3_gathers(cfg: Config, unit, gathers: int, s: int, n: int, secondary_valid: bool) -> Dict[str, float]:
    """The same for FP8 (``fp8_dp_step_bytes``): E4M3 shards with their T scales."""
    T, h = len(unit.params), cfg.zero.hpz_size
    payload = (n - 1) * (s + 4 * T)
    if h == 1:
        return {"dp": gathers * payload}
    first = 0 if secondary_valid else min(1, gathers)
    total = sum(p.numel() for p in unit.params)  # hpZ slices the compact bytes, no padding
    return {"dp": first * payload, "dp_hpz": (gathers - first) * (h - 1) * (-(-total // h) + 4 * T)}


def validation_gather_bytes(cfg: Config, layout: Layout, rank: int, first_after_step: bool = True,
                            early: bool = False) -> Dict[str, float]:
    """ZeRO-3's weight gathers in one validation batch (a forward-only pass over the micro-batches: one gather
    per module use of a unit and micro-batch), by group. With hpZ, the pass that follows an optimizer step
    (``first_after_step``) gathers each unit once from the primary shards and keeps the secondary copy; every
    other gather of it, and all of a later pass before the next step, is inside the node (``early``: the step kept
    its early gathers, counted by the first pass after it, whose gathers of those units are all inside the node).
    Empty below stage 3 (the parameters stay whole between steps)."""
    from parallel.zero.partition import shard_layout
    from parallel.zero.units import chunk_units, meta_chunks

    z, n = cfg.zero, layout.dp
    x, y = len(layout.dp_intra_ranks(rank)), len(layout.dp_inter_ranks(rank))
    out: Dict[str, float] = defaultdict(float)
    if z.stage != 3:
        return {}
    fp8 = cfg.precision == "fp8"
    for chunk in meta_chunks(cfg, layout, layout.coords(rank)[0]):
        units, uses = chunk_units(chunk)
        ahead = early_units(cfg, uses) if early and not fp8 else set()
        for k, unit in enumerate(units):
            s = shard_layout([p.numel() for p in unit.params], n, "whole_tensor" if fp8 else z.partition).shard_size
            gathers = layout.num_microbatches * sum(k in use.units for use in uses)
            gathered = (_fp8_stage3_gathers(cfg, unit, gathers, s, n, not first_after_step) if fp8
                        else _stage3_gathers(cfg, gathers, s, n, not first_after_step, x, y, early=k in ahead))
            for group, nbytes in gathered.items():
                out[group] += nbytes
    return {g: v for g, v in out.items() if v}


def _local_parameters(cfg: Config, layout: Layout, stages) -> float:
    """Parameter elements held by a rank of these virtual stages (TP-split ones divided by t)."""
    m, t = cfg.model, layout.tp
    counts = parameter_count(m)
    h, v = m.d_model, m.vocab_size
    norm = h * (2 if m.norm == "layernorm" else 1)
    per_layer_total = (counts["non_embedding"] - norm) / m.n_layers
    replicated_per_layer = 2 * norm + (2 * h if m.bias else 0) + (2 * m.head_dim if m.qk_norm else 0)
    # (norms, row-parallel biases and the QK-norm weights)
    per_layer = (per_layer_total - replicated_per_layer) / t + replicated_per_layer
    layers = len(stages) * m.n_layers // (layout.pp * layout.virtual_stages)
    total = layers * per_layer
    last_v = layout.pp * layout.virtual_stages - 1
    if 0 in stages:
        total += v * h / t
    if last_v in stages:
        total += norm
        if not m.tie_embeddings or 0 not in stages:
            total += v * h / t
    return total


def fp8_dp_step_bytes(cfg: Config, layout: Layout, rank: int, secondary_valid: bool = False) -> Dict[str, float]:
    """Data-parallel traffic of one step under ``precision=fp8`` (``fp8/zero.py``), per unit with the
    ``whole_tensor`` partition (S its padded shard, T its tensors, N the DP size):

      gradients   min of the T fp32 scales (all-reduce), all-to-all of N S FP8 bytes = (N-1) S;
                  stage 0 all-gathers the reduced FP8 shards back, (N-1) S more
      weights     stages 1-2: after the step, all-gather of (S + 4 T) bytes (E4M3 shard + its scales);
                  stage 3: the same payload per gather (forward uses + 1 backward unless no user reads the weights in backward, per
                  micro-batch), or with
                  hpZ the first from primary shards (none with ``secondary_valid``: a validation pass built the
                  secondary copies) and the rest (H-1)(ceil(P / H) + 4 T) on dp_hpz (P the unit's elements: the
                  secondary slices hold the compact E4M3 bytes, no layout padding)
      always      sequence-parallel gradient pieces of the unit (fp32) all-reduced over TP (the gradient
                  norm's square and mu's overflow and element counts: in the step's scalar all-reduce,
                  ``step_bytes``)."""
    from parallel.zero.partition import shard_layout
    from parallel.zero.units import chunk_units, meta_chunks

    z, n, t = cfg.zero, layout.dp, layout.tp
    pp_rank = layout.coords(rank)[0]
    mb = layout.num_microbatches
    out: Dict[str, float] = defaultdict(float)
    for chunk in meta_chunks(cfg, layout, pp_rank):
        units, uses = chunk_units(chunk)
        for k, unit in enumerate(units):
            T = len(unit.params)
            kind = "flat" if z.stage == 0 else "whole_tensor"  # stage 0: no owner, any even split works
            s = shard_layout([p.numel() for p in unit.params], n, kind).shard_size
            out["dp"] += _ring(n) * 4 * T + (n - 1) * s * (2 if z.stage == 0 else 1)
            if z.stage in (1, 2):
                out["dp"] += (n - 1) * (s + 4 * T)
            elif z.stage == 3:
                gathers = mb * _stage3_gather_count(k, uses)
                for group, nbytes in _fp8_stage3_gathers(cfg, unit, gathers, s, n, secondary_valid).items():
                    out[group] += nbytes
            sp = sum(p.numel() for p in unit.params if p.spec.sequence_parallel)
            out["tp"] += _ring(t) * 4 * sp
    return dict(out)


def fp8_amax_bytes(cfg: Config, layout: Layout, linears: int, microbatches: int) -> Dict[str, float]:
    """The amax reductions of ``fp8/scaling.py`` for ``linears`` FP8 linear layers (3 tensor roles each: input,
    weight, output gradient). Delayed scaling: once per step, one fp32 MAX all-reduce of every role's amax
    over TP, then one over DP. Current scaling: each cast's amax over TP (input and weight per forward,
    output gradient per backward)."""
    t, d = layout.tp, layout.dp
    roles = 3 * linears
    if cfg.fp8.scaling == "delayed":
        return {"tp": _ring(t) * 4 * roles, "dp": _ring(d) * 4 * roles}
    forwards = 2 if cfg.model.activation_checkpointing == "full" else 1
    return {"tp": _ring(t) * 4 * linears * microbatches * (2 * forwards + 1)}
