"""Memory per rank, estimated from the config alone: model states by ZeRO stage, and activations.

Model states follow ZeRO's accounting with this code's buffers (per unit of
``parallel/zero/units.py``, S its padded shard, N the DP size, e_c / e_r the
compute / reduce dtype bytes; Phi = the rank's parameters)::

  stage 0   parameters 4 Phi (fp32 master used under autocast), gradients 4 Phi, AdamW m and v 8 Phi  = 16 Phi
  stage 1   parameters N S e_c, gradients N S e_r, optimizer (4 + 4 + 4) S                 ~ 2 + 2 + 12/N
  stage 2   parameters N S e_c, gradients S e_r, optimizer 12 S                             ~ 2 + 14/N
  stage 3   parameters S e_c, gradients S e_r, optimizer 12 S, plus the gathered working set ~ 16/N + working

(AdamW's 8 bytes of m and v; another ``train.optimizer`` its own state bytes, ``optimizer_state_bytes``, on the
rank that owns each whole tensor.) In fp32 the master copy is the parameter buffer itself, so the optimizer holds
8 S (12 S at stages 1-2 with qwZ, whose post-step gather overwrites the parameter
shard). ZeRO++ hpZ adds its secondary shard, N S / H e_c, to the parameters, and
stage-3 qWD this rank's piece of the reconstructed weights, S e_c (the transient
quantized send/receive buffers of qwZ, qWD and qgZ are not counted). The stage-3
working set is the peak of what is gathered at once (the current module's units
and those of the ``zero.prefetch_depth`` modules prefetched ahead; a unit used by
two modules, the embedding tied to the head on one stage, stays gathered through
backward) plus the full gradients alive (the unit filling
and up to ``zero.reduce_in_flight`` being reduce-scattered), walked through one
forward and one backward of each chunk (``_working_peak``); stage 2 holds the
filling unit's and the in-flight ones' full gradients during backward, or every
unit's while gradients accumulate over several micro-batches.

Mixture of experts: the routed experts' tensors (``layers.<i>.mlp.experts.w_up`` / ``w_down``, stacked over the
experts on dim 0) are split over ``parallel.ep``: a rank holds num_experts / ep of them, and they are sharded over
the expert-data-parallel group (the dp / ep ranks holding the same experts), every other tensor over DP as
today. At ep > 1 an MoE block is two ZeRO units (``chunk_units``): its dense tensors over DP, its experts over
that group (``_parts``; at ep = 1 the block is one unit, as for a dense model). The router, shared experts and
gate are dense tensors; in backward the shared experts' gradients arrive before the routed experts' are complete,
so both units' full gradients are alive at once (``_early_gradients``). Equal byte for byte to what the engine
holds at ep 1 and 2, ZeRO 0-3 (tests/test_moe_surroundings.py).

Activations (seed 004 §memory, 16-bit): with a checkpoint every ``ci`` blocks,
the checkpoints take 2 * b * s * h * layers / ci bytes per micro-batch in flight
and recomputing one segment needs b * s * ci * (16 h + 2 heads s). Without
recomputation, Megatron's per-layer figure s b h (34 + 5 heads s / h) (divided
by t under SP, its TP form otherwise). An MoE layer's activations are counted as the dense layer's (the
top_k expert rows per token and the dispatch buffers are not modelled). At cp = 1 these are seed 004's figures
as it states them: its 5 heads s^2 b counts the s x s softmax output, its dropout mask and the dropout output of
an unfused attention; SDPA's fused kernels, which this code calls, keep none of them, so there it is an upper bound.

Context parallelism (cp > 1): each rank holds s / cp tokens of every sequence (``parallel/layout.py cp_spans``),
and every term above is that of s' = s / cp tokens. The attention (``parallel/context.py``) runs per-pair
flash-style kernels that keep no s x s scores: it saves only its local q, k, v and output (16-bit, [b, heads, s',
d]) and an fp32 log-sum-exp per query row per head, so the 5 heads s^2 b term is replaced by the output, 2 s' b h
(a buffer of its own: the output projection's input, among the 34, is a copy of it, where SDPA's output at cp = 1
is laid out so that it is a view), and the log-sum-exp, 4 heads s' b::

    per layer   s' b h (36 + 4 heads / h)            (all of it over t under SP; without SP, 10 + (26 + 4 heads
                                                       / h) / t; GQA's K/V saving as at cp = 1)
    recompute   b s' ci (16 h + 2 h + 4 heads)        (full recomputation's working segment, out and lse for the
                                                       s x s scores)

The ring's in-flight K/V blocks (the block in hand and the one arriving, GQA's expanded copies), the running
output and log-sum-exp of the forward, and the backward's fp32 dK/dV accumulators (this step's, the one passing
round the ring, the rank's own) and dQ are working memory of the one layer whose attention runs, freed when it
returns: they are not stored per layer, and are not counted here (nor ``all_gather``'s full-sequence K/V and its
fp32 dK/dV, also transient). ``SavedActivations`` measures what autograd really saves (tests/test_context_memory.py
compares it with these figures at cp 1, 2 and 4): per token it falls as 1 / cp, as the estimate does, and at bf16
it is about 1.5x the estimate, since the code keeps more than Megatron's 16-bit 34 s b h: the norms' fp32 copies
(``model/layers.py Norm``) and, outside the layers, the loss's fp32 log-probabilities.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Set, Tuple

import torch

from config import Config, grad_accumulation_precision
from optimizers.tensor_rules import rule_of
from parallel.layout import Layout
from parallel.schedule import train_schedule
from parallel.volume import DTYPE_BYTES
from parallel.zero.partition import shard_layout
from parallel.zero.units import ModuleUse, chunk_units, meta_chunks

COMPONENTS = ("parameters", "gradients", "optimizer", "working_peak")


def model_state_bytes(cfg: Config, layout: Layout, rank: int = 0) -> Dict[str, int]:
    """Estimated model-state bytes held by ``rank``, by component (see the module docstring)."""
    z = cfg.zero
    pp_rank = layout.coords(rank)[0]
    chunks = meta_chunks(cfg, layout, pp_rank)
    if cfg.precision == "fp8":
        return _fp8_state_bytes(cfg, layout, rank, chunks)
    if z.stage == 0:
        held = [(n, held_tensor(cfg, layout, n, p)) for c in chunks for n, p in c.named_parameters()]
        phi = sum(p.numel() for _, p in held)
        state = sum(optimizer_state_bytes(cfg, n, p, layout.tp) for n, p in held)
        return {"parameters": 4 * phi, "gradients": 4 * phi, "optimizer": state, "working_peak": 0}
    e_c = DTYPE_BYTES[cfg.precision]
    e_r = e_c if z.reduce_dtype == "compute" else 4
    n = layout.dp
    # fp32: the master is the parameter shard, except where a quantized post-step gather (stages 1-2 with qwZ)
    # overwrites that shard with what every rank dequantized
    master = 0 if cfg.precision == "fp32" and not (z.stage < 3 and z.quantized_weights and n > 1) else 4
    out = dict.fromkeys(COMPONENTS, 0)
    peaks, chunk_grads = [0], []
    dp_rank = layout.coords(rank)[1]
    for chunk in chunks:
        units, uses = chunk_units(chunk)
        names = {p: name for name, p in chunk.named_parameters()}
        full_p, full_g = [], []
        for u in units:
            unit_p = unit_g = 0
            for part_names, tensors, group, group_rank in _parts(cfg, layout, u.params, names, dp_rank):
                lay = shard_layout([p.numel() for p in tensors], group, z.partition)
                s = lay.shard_size
                if cfg.train.optimizer != "adamw":  # whole tensors (zero.partition=whole_tensor): owners' states
                    out["optimizer"] += sum(optimizer_state_bytes(cfg, part_names[i], tensors[i], layout.tp)
                                            for i, *_ in lay.owned(group_rank)) - 8 * s
                out["parameters"] += (group * s if z.stage < 3 else s) * e_c
                if z.stage == 3 and z.hpz_size > 1:  # ZeRO++ hpZ's secondary shard
                    out["parameters"] += group * s // z.hpz_size * e_c
                if z.stage == 3 and z.weight_delta:  # qWD: this rank's piece of the reconstructed weights
                    out["parameters"] += s * e_c
                out["gradients"] += (group * s if z.stage == 1 else s) * e_r
                out["optimizer"] += (master + 8) * s
                unit_p += group * s * e_c if z.stage == 3 else 0
                unit_g += group * s * e_r
            full_p.append(unit_p)
            full_g.append(unit_g)
        chunk_grads.append(sum(full_g))
        depth = z.prefetch_depth if z.stage == 3 and z.prefetch else 0
        peaks.append(_working_peak(uses, full_p, full_g, depth, z.reduce_in_flight,
                                   _early_gradients(units, uses, names)))
    if z.stage == 3 or (z.stage == 2 and layout.num_microbatches == 1):
        out["working_peak"] = max(peaks)
    elif z.stage == 2:  # a chunk's full gradients live from its first backward of the step to its last
        backwards = [a.chunk for a in train_schedule(layout.pp, layout.virtual_stages, layout.num_microbatches,
                                                     pp_rank) if a.kind == "B"]
        spans = [(backwards.index(c), len(backwards) - 1 - backwards[::-1].index(c)) for c in range(len(chunks))]
        out["working_peak"] = max(sum(g for g, (a, b) in zip(chunk_grads, spans) if a <= t <= b)
                                  for t in range(len(backwards)))
    return out


def is_routed_expert(name: str) -> bool:
    """Whether parameter ``name`` holds routed experts (stacked on dim 0, split over parallel.ep)."""
    return name.split(".")[-2:-1] == ["experts"]


def held_tensor(cfg: Config, layout: Layout, name: str, p):
    """What this rank holds of parameter ``p`` (a meta chunk's): a routed expert tensor's num_experts / ep experts
    (``p`` may already be this EP rank's piece, or the whole stack), any other tensor whole."""
    ep, experts = layout.ep, cfg.model.moe.num_experts
    if ep <= 1 or not is_routed_expert(name) or p.shape[0] != experts:
        return p
    piece = p.narrow(0, 0, experts // ep)
    piece.spec = p.spec
    return piece


def held_parameters(cfg: Config, layout: Layout, rank: int = 0) -> int:
    """Parameter elements ``rank`` holds (Phi): its pipeline stage's, routed experts divided by parallel.ep."""
    chunks = meta_chunks(cfg, layout, layout.coords(rank)[0])
    return sum(held_tensor(cfg, layout, n, p).numel() for c in chunks for n, p in c.named_parameters())


def _parts(cfg: Config, layout: Layout, params: Sequence, names: Dict, dp_rank: int) -> List[Tuple]:
    """A ZeRO unit's tensors as (names, held tensors, group size, this rank's index in the group) per group they
    are sharded over: all of them over DP at ep = 1 (or without experts); else the dense ones over DP and the
    routed experts (num_experts / ep of them) over the expert-data-parallel group of dp / ep ranks."""
    ep = layout.ep
    if ep <= 1 or not any(is_routed_expert(names[p]) for p in params):
        return [([names[p] for p in params], list(params), layout.dp, dp_rank)]
    dense = [p for p in params if not is_routed_expert(names[p])]
    experts = [p for p in params if is_routed_expert(names[p])]
    out = []
    if dense:
        out.append(([names[p] for p in dense], dense, layout.dp, dp_rank))
    out.append(([names[p] for p in experts], [held_tensor(cfg, layout, names[p], p) for p in experts],
                layout.dp // ep, dp_rank // ep))
    return out


def optimizer_state_bytes(cfg: Config, name: str, p, tp: int) -> int:
    """Bytes of ``train.optimizer``'s state for parameter ``name`` (this rank's piece ``p``: shape and ``spec``)
    on the rank that updates it (``optimizers/tensor_rules.py``): AdamW 8 a parameter (fp32 m and v); 8-bit AdamW
    2 (8-bit codes) plus 2 fp32 absmax scales a block; Muon 4 (its fp32 momentum) for the blocks' matrices, AdamW's
    8 for the rest; Adafactor, on the whole tensor (every TP holder keeps the same): fp32 row and column
    statistics of each matrix of the last two dimensions, or the whole second moment of a vector."""
    numel = p.numel()
    rule = rule_of(cfg.train.optimizer, name, p.ndim, p.spec)
    if rule == "adamw8bit":
        return 2 * numel + 2 * 4 * -(-numel // cfg.train.adamw8bit.block_size)
    if rule == "muon":
        return 4 * numel
    if rule == "adafactor":
        whole = tuple(p.spec.global_shape) if p.spec.tp_dim is not None and tp > 1 else tuple(p.shape)
        if len(whole) < 2:
            return 4 * math.prod(whole)
        lead = math.prod(whole[:-2])
        return 4 * lead * (whole[-2] + whole[-1])
    return 8 * numel


def checkpoint_staging_bytes(cfg: Config, layout: Layout, rank: int = 0) -> int:
    """The CPU copy an asynchronous save keeps from one save to the next (``checkpoint.async_save``,
    ``training/async_checkpoint.py``; pinned host memory under CUDA), 0 without it: what ``rank`` writes, its fp32
    master weights and its optimizer state as saved, i.e. 12 bytes an element of its shard with AdamW (stage 0: of
    every tensor it holds; 8-bit AdamW's moments are saved as fp32 views, 8; FP8-LM's master, m and v as fp32), plus
    qWD's reconstructed weights (compute dtype). The MoE expert biases and FP8 scaling states (a few numbers a
    tensor) are not counted."""
    if not cfg.checkpoint.async_save:
        return 0
    z, n = cfg.zero, layout.dp
    chunks = meta_chunks(cfg, layout, layout.coords(rank)[0])

    def saved(name: str, p) -> int:  # master + optimizer state of one whole tensor
        return 12 * p.numel() if rule_of(cfg.train.optimizer, name, p.ndim, p.spec) == "adamw8bit" else \
            4 * p.numel() + optimizer_state_bytes(cfg, name, p, layout.tp)

    if z.stage == 0:
        return sum(saved(name, held_tensor(cfg, layout, name, p)) for c in chunks for name, p in c.named_parameters())
    from fp8.zero_unit import OwnerBalance

    owners = {n: OwnerBalance(n), max(n // layout.ep, 1): OwnerBalance(max(n // layout.ep, 1))}  # as _fp8_state_bytes
    dp_rank, total = layout.coords(rank)[1], 0
    for chunk in chunks:
        units, _ = chunk_units(chunk)
        names = {p: name for name, p in chunk.named_parameters()}
        for u in units:
            for part_names, tensors, group, group_rank in _parts(cfg, layout, u.params, names, dp_rank):
                numels = [p.numel() for p in tensors]
                if cfg.precision == "fp8":  # owned whole tensors
                    total += 12 * sum(numels[i] for i, *_ in owners[group].layout(numels).owned(group_rank))
                    continue
                lay = shard_layout(numels, group, z.partition)
                if cfg.train.optimizer != "adamw":  # whole tensors: their owners'
                    total += sum(saved(part_names[i], tensors[i]) for i, *_ in lay.owned(group_rank))
                else:
                    total += 12 * lay.shard_size
                if z.weight_delta:
                    total += lay.shard_size * DTYPE_BYTES[cfg.precision]
    return total


def held_between_steps(cfg: Config, layout: Layout, rank: int = 0) -> int:
    """Working bytes ``rank`` holds between two optimizer steps (``Working.now`` after a step): ZeRO-3 with prefetch
    starts, at the end of its step, the gathers of the next forward's first ``zero.prefetch_depth`` + 1 modules of
    the first chunk (``ZeroDataParallel._next_forward_units``) and holds them; FP8-LM at stage 0 keeps the 16-bit
    working weights (bf16, or fp16 with fp8.gemm=fp16; ``fp8/zero.py``) of every tensor but the weights only FP8 GEMMs
    read. Part of ``working_peak``, never more."""
    z = cfg.zero
    chunks = meta_chunks(cfg, layout, layout.coords(rank)[0])
    if cfg.precision == "fp8":
        return 0 if z.stage else 2 * _fp8_kept_numel(cfg, layout, chunks)
    if z.stage != 3 or not z.prefetch or not chunks:
        return 0
    units, uses = chunk_units(chunks[0])
    names = {p: name for name, p in chunks[0].named_parameters()}
    ahead: List[int] = []
    for use in uses[:z.prefetch_depth + 1]:
        ahead += [u for u in use.units if u not in ahead]
    e_c = DTYPE_BYTES[cfg.precision]
    dp_rank = layout.coords(rank)[1]
    return sum(group * shard_layout([p.numel() for p in tensors], group, z.partition).shard_size * e_c
               for u in ahead for _, tensors, group, _ in _parts(cfg, layout, units[u].params, names, dp_rank))


def _fp8_kept_numel(cfg: Config, layout: Layout, chunks) -> int:
    """Elements of the 16-bit working weights FP8-LM keeps at stage 0: all but the weights only FP8 GEMMs read
    (their operands are cast from the masters: ``fp8.scaling.fp8_only_weights``)."""
    from fp8.scaling import fp8_only_weights

    sourced = fp8_only_weights(chunks)
    return sum(held_tensor(cfg, layout, n, p).numel() for c in chunks for n, p in c.named_parameters()
               if p not in sourced)


def _fp8_state_bytes(cfg: Config, layout: Layout, rank: int, chunks) -> Dict[str, int]:
    """``fp8/zero.py``'s buffers: per unit, owned tensors (whole, spread over units by
    ``fp8.zero_unit.OwnerBalance``) hold master (2 or 4 bytes), FP8 gradient (1), E4M3 m (1) and FP16 v (2) a
    parameter, packed; ``fp8_weights``: stages 1-2 keep the unit's E4M3 weights (1 a parameter), stage 3 the
    owned ones and hpZ's secondary slice; T fp32 scales per buffer. Working: 16-bit weights (the compute dtype)
    materialised per module (stages 1-3; stage 0 keeps them from one optimizer step to the next, except the weights
    only FP8 GEMMs read, whose E4M3 operands are cast from the masters) and the
    gradient accumulation (``fp8.grad_accumulation``: 2 or 4 bytes; the whole step's when micro-batches accumulate)."""
    z, n = cfg.zero, layout.dp
    dp_rank = layout.coords(rank)[1]
    master = 2 if cfg.fp8.master_dtype == "fp16" else 4
    from fp8.zero_unit import OwnerBalance

    out = dict.fromkeys(COMPONENTS + ("fp8_weights",), 0)
    peaks, weights_only, grads_all = [0], [0], 0
    owners = {n: OwnerBalance(n), max(n // layout.ep, 1): OwnerBalance(max(n // layout.ep, 1))}  # per group size
    kept = 2 * _fp8_kept_numel(cfg, layout, chunks) if z.stage == 0 else 0  # stage 0: 16-bit weights kept
    for chunk in chunks:
        units, uses = chunk_units(chunk)
        names = {p: name for name, p in chunk.named_parameters()}
        full_p, full_g = [], []
        for unit in units:
            unit_p = unit_g = 0
            for _, tensors, group, group_rank in _parts(cfg, layout, unit.params, names, dp_rank):
                numels = [p.numel() for p in tensors]
                total, t = sum(numels), len(numels)
                if z.stage == 0:
                    owned = total
                else:
                    lay = owners[group].layout(numels)
                    owned = sum(numels[i] for i, _, _, _ in lay.owned(group_rank))
                w8 = total if z.stage in (1, 2) else owned if z.stage == 3 else 0
                out["parameters"] += master * owned + 4 * t
                out["fp8_weights"] += w8 + 4 * t
                if z.stage == 3 and z.hpz_size > 1:
                    out["fp8_weights"] += -(-total // z.hpz_size) + 4 * t
                out["gradients"] += owned + 4 * t
                out["optimizer"] += 3 * owned + 8 * t
                unit_p += 2 * total if z.stage else 0
                unit_g += DTYPE_BYTES[grad_accumulation_precision(cfg)] * total
            full_p.append(unit_p)
            full_g.append(unit_g)
        depth = z.prefetch_depth if z.prefetch else 0
        peaks.append(_working_peak(uses, full_p, full_g, depth, 1, _early_gradients(units, uses, names)))
        weights_only.append(_working_peak(uses, full_p, [0] * len(full_g), depth, 1))
        grads_all += sum(full_g)
    # one micro-batch: a unit's gradient sums live from its backward to its reduction; with accumulation
    # every unit's lives from the first backward to the last micro-batch's reduction
    out["working_peak"] = kept + (max(peaks) if layout.num_microbatches == 1 else grads_all + max(weights_only))
    return out


def _early_gradients(units, uses: List[ModuleUse], names: Dict) -> Set[int]:
    """Units whose gradients start filling before the other units of their module are complete: an MoE block's
    dense unit when its routed experts are a unit of their own (``chunk_units`` at ep > 1) and the block has
    shared experts, which run after the routed ones in forward, so their gradients arrive first in backward (the
    router's, the dense unit's only other MoE weights, arrive after the experts')."""
    out: Set[int] = set()
    for use in uses:
        if len(use.units) < 2 or not any(is_routed_expert(names[p]) for u in use.units for p in units[u].params):
            continue
        out |= {u for u in use.units if any(".mlp.shared" in names[p] for p in units[u].params)}
    return out


def _working_peak(module_uses: List[ModuleUse], full_p: List[int], full_g: List[int], depth: int,
                  in_flight: int, early: Set[int] = frozenset()) -> int:
    """Peak bytes of gathered parameters plus full gradients during one forward and one backward of a chunk,
    following ``parallel/zero/sharded.py``: a module's units are gathered before it runs (and the next
    ``depth`` modules' prefetched), released after its forward; in backward the gradient of a unit fills its
    full buffer, and when the unit's first user (in forward order) has run backward the unit is released and
    reduce-scattered, after waiting for the oldest ones until fewer than ``in_flight`` are in flight; the units of
    one module complete last-first, and the ``early`` ones (``_early_gradients``) fill from the module's start. A
    module whose backward does not read its weights (an embedding lookup) is not gathered for backward."""
    uses = [u.units for u in module_uses]
    backward = [set(u.units) if u.backward_reads_weights else set() for u in module_uses]

    def ahead(i: int, step: int) -> set:
        picked = uses if step > 0 else backward
        return {u for d in range(1, depth + 1) if 0 <= i + d * step < len(uses) for u in picked[i + d * step]}

    peak, gathered = 0, set()
    for i, use in enumerate(uses):  # forward
        gathered |= set(use) | ahead(i, 1)
        peak = max(peak, sum(full_p[u] for u in gathered))
        gathered -= set(use)
    first_use = {u: min(i for i, use in enumerate(uses) if u in use) for use in uses for u in use}
    gathered, flying = set(), []
    for i in reversed(range(len(uses))):  # backward
        gathered |= backward[i] | ahead(i, -1)
        firsts = sorted((u for u in uses[i] if first_use[u] == i), reverse=True)
        filling = [u for u in firsts if u in early]
        for u in firsts:
            alive = full_g[u] + sum(full_g[v] for v in filling if v != u) + sum(full_g[v] for v in flying)
            peak = max(peak, sum(full_p[v] for v in gathered) + alive)
            gathered.discard(u)
            filling = [v for v in filling if v != u]
            flying = (flying + [u])[-in_flight:]
    return peak


def activation_bytes(cfg: Config, layout: Layout, rank: int = 0) -> Dict[str, int]:
    """Seed 004's activation estimate for this rank (16-bit activations, 1F1B in-flight micro-batches); under
    context parallelism that of the rank's s / cp tokens, with what the CP attention keeps (module docstring)."""
    m, b, cp = cfg.model, cfg.train.micro_batch_size, layout.cp
    s, h, a, t = m.seq_len // cp, m.d_model, m.n_heads, layout.tp
    pp_rank = layout.coords(rank)[0]
    layers = m.n_layers // layout.pp
    in_flight = min(layout.pp - pp_rank, layout.num_microbatches) if layout.pp > 1 else 1
    if m.activation_checkpointing == "full":
        ci = 1
        checkpoints = 2 * b * s * h * layers // ci // (t if layout.sequence_parallel else 1)
        scores = 2 * a * s if cp == 1 else 2 * h + 4 * a  # the s x s softmax; under CP the output and lse instead
        working = b * s * ci * (16 * h + scores) // t
        return {"checkpoints": checkpoints * in_flight, "recompute_working": working}
    # grouped-query attention stores K and V (2sbh each in the 34sbh) for n_kv_heads / n_heads of the heads
    kv_saving = 4 * (1 - m.kv_heads / m.n_heads)

    def attention(split: int) -> float:
        """The attention's own terms in units of s b h, split over ``split`` TP ranks: the s x s scores (cp = 1),
        or the output and the fp32 log-sum-exp (cp > 1)."""
        return 5 * a * s / (h * split) if cp == 1 else (2 + 4 * a / h) / split

    if layout.sequence_parallel:
        per_layer = s * b * h * (34 - kv_saving + attention(1)) / t
    else:
        per_layer = s * b * h * (10 + (24 - kv_saving) / t + attention(t))
    return {"stored": int(per_layer * layers * in_flight), "recompute_working": 0}


_VIEW_BACKWARDS = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0", "ReshapeAliasBackward0",
                             "AliasBackward0", "ExpandBackward0", "SliceBackward0", "SelectBackward0"})
"""The backward nodes of the views a parameter passes through before its cast (besides any ``*View*``)."""


class SavedActivations:
    """The activation bytes a rank really keeps, measured: what autograd saves for backward during one micro-batch's
    forward (``torch.autograd.graph.saved_tensors_hooks``), each distinct storage counted once, whole. Not counted:
    the storages of ``chunks``' parameters and buffers (RoPE's tables), and 16-bit casts of parameters (autocast's
    weight copies, which the linears save: 2 bytes a parameter whatever the sequence length; ``weight_casts``).

    On CPU there is no allocator peak to read, so this is the measure: the saved tensors are what stays alive from
    a micro-batch's forward to its backward, the activations an estimate like ``activation_bytes`` models; working
    buffers freed within a layer (the ring's K/V in flight, the accumulators) are not in it. Each forward of the
    first chunk starts a new micro-batch; ``peak`` is the largest micro-batch's bytes, ``last`` the last one's (one
    micro-batch at a time: pp = 1, or a pipeline's in-flight micro-batches are not added up). Without recomputation
    only: inside a ``torch.utils.checkpoint`` region torch's own hooks replace these, so what a checkpoint keeps
    (measured: nothing of the blocks at model.activation_checkpointing=full) is not seen."""

    def __init__(self, chunks: Sequence):
        self.chunks = list(chunks)
        self.excluded = {t.untyped_storage().data_ptr() for c in self.chunks
                         for t in list(c.parameters()) + list(c.buffers())}
        self.params = {id(p) for c in self.chunks for p in c.parameters()}
        self.peak = self.last = self.weight_casts = 0
        self._seen: Set[int] = set()
        self._casts = 0
        self._hooks = self._pre = None

    def _start(self, *_) -> None:
        self._seen, self.last, self._casts = set(), 0, 0

    def _is_cast(self, t) -> bool:
        """Whether ``t`` is a 16-bit cast of a parameter or a view of one. The native CPU / CUDA 16-bit linear saves
        the transposed cast (``addmm``'s ``weight.t()``: a view whose grad_fn is ``TBackward0``), the fp32-upcast
        path the cast itself, so a view is judged by its base."""
        if t._is_view():
            t = t._base
        fn = t.grad_fn
        if fn is None or type(fn).__name__ != "ToCopyBackward0":
            return False
        for _ in range(4):  # through the views of a fused weight ([3, d, d] viewed as [3d, d]) to the parameter
            fn = fn.next_functions[0][0] if fn.next_functions else None
            if fn is None or hasattr(fn, "variable"):
                return fn is not None and id(fn.variable) in self.params
            name = type(fn).__name__
            if name not in _VIEW_BACKWARDS and "View" not in name and "Reshape" not in name:
                return False
        return False

    def _pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded or key in self._seen:
            return t
        self._seen.add(key)
        if self._is_cast(t):
            self._casts += storage.nbytes()
            self.weight_casts = max(self.weight_casts, self._casts)
        else:
            self.last += storage.nbytes()
            self.peak = max(self.peak, self.last)
        return t

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        self._pre = self.chunks[0].register_forward_pre_hook(self._start)
        return self

    def __exit__(self, *exc) -> None:
        self._pre.remove()
        self._hooks.__exit__(*exc)
