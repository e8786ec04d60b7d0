"""Every valid layout of a model on a cluster, ranked by predicted tokens/s among those that fit.

The space: tp over the divisors of the node size, pp over the divisors of the layers, virtual stages (1, 2, 3, 4,
6, 8 where they divide the layers per stage), cp (1, and powers of two up to 32 from 8K tokens a sequence; for cp > 1
each form: p2p, all_gather, a2a), ep
over the divisors of the experts (MoE), micro-batch 1, 2, 4, 8, recomputation off / selective / full, sequence
parallelism whenever tp > 1 (the same bytes, less memory), and ZeRO stage 0, 1, 2, 3, 3 with hpZ over the
node's DP ranks, and ZeRO++ (int8 qwZ + hpZ + int4 qgZ); dp is what is left of the world. Every candidate is
checked as train.py checks it (``validate_config``, ``make_layout``): an invalid one is not a layout.

Predicting a layout whole builds its pipeline ranks' chunks on the meta device for the memory estimator and the
volume (costs.py), tens of milliseconds to seconds per new (tp, pp, virtual stages); the search avoids most of it
with bounds that need no model: a memory lower bound (``costs.memory_lower_bound``) drops the layouts that
cannot fit, a step-time lower bound (the prediction without data-parallel communication) orders the rest, and
layouts are predicted whole in that order until the top N that fit are known: the next lower bound is no
faster than the N-th prediction. The result is the exact top N of the whole space under the model.
"""
from __future__ import annotations

import dataclasses
import heapq
import time
from typing import Iterator, List, Optional, Tuple

from config import Config, ConfigError, validate_config
from parallel.layout import Layout, make_layout
from training.plan import costs
from training.plan.devices import Cluster
from training.plan.step import predict

MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = ("off", "selective", "full")
VIRTUAL = (1, 2, 3, 4, 6, 8)
CP_FROM_TOKENS = 8192


def zero_variants(hpz: int) -> List[dict]:
    """ZeRO settings the search tries (hpz: the node's DP ranks, the hpZ group)."""
    off = dict(quantized_weights=False, quantized_gradients=False, hpz_size=1, weight_delta=False)
    out = [dict(off, stage=s) for s in (0, 1, 2, 3)]
    if hpz > 1:
        out.append(dict(off, stage=3, hpz_size=hpz))
        out.append(dict(stage=3, quantized_weights=True, quantized_gradients=True, hpz_size=hpz, weight_delta=False))
    return out


CP_FORMS = ("p2p", "all_gather", "a2a")
"""parallel.cp_comm's forms, each searched where cp > 1 (a2a only where a TP rank's heads divide by cp)."""


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: Config, cluster: Cluster) -> Iterator[Tuple[Config, Layout]]:
    """Every valid (config, layout) of the space (module docstring)."""
    m, world, g = cfg.model, cluster.gpus, cluster.gpus_per_node
    cps = [1] + ([c for c in (2, 4, 8, 16, 32) if m.seq_len % (2 * c) == 0] if m.seq_len >= CP_FROM_TOKENS else [])
    eps = _divisors(m.moe.num_experts) if m.moe.num_experts else [1]
    for tp in [t for t in _divisors(min(g, world))]:
        for pp in [p for p in _divisors(m.n_layers) if world % (tp * p) == 0]:
            for vp in [v for v in VIRTUAL if v == 1 or (pp > 1 and m.n_layers % (pp * v) == 0)]:
                for cp in [c for c in cps if world % (tp * pp * c) == 0]:
                    for ep in eps:
                        for form in CP_FORMS if cp > 1 else (cfg.parallel.cp_comm,):
                            base = dataclasses.replace(cfg, parallel=dataclasses.replace(
                                cfg.parallel, tp=tp, pp=pp, virtual_stages=vp, cp=cp, ep=ep,
                                sequence_parallel=tp > 1, ranks_per_node=None, cp_comm=form))
                            for b in MICRO_BATCHES:
                                yield from _variants(base, b, cluster)


def _variants(base: Config, b: int, cluster: Cluster) -> Iterator[Tuple[Config, Layout]]:
    try:
        c = dataclasses.replace(base, train=dataclasses.replace(base.train, micro_batch_size=b),
                                zero=dataclasses.replace(base.zero, hpz_size=1, quantized_weights=False,
                                                         quantized_gradients=False, weight_delta=False))
        validate_config(c)
        layout = make_layout(c, cluster.gpus, cluster.gpus_per_node)
    except ConfigError:
        return
    for rc in RECOMPUTE:
        for zero in zero_variants(layout.dp_intra_size):
            if zero["stage"] and layout.dp == 1:
                continue
            z = dataclasses.replace(c.zero, **zero)
            one = dataclasses.replace(c, zero=z, model=dataclasses.replace(c.model, activation_checkpointing=rc))
            try:
                validate_config(one)
                lay = make_layout(one, cluster.gpus, cluster.gpus_per_node) if zero["hpz_size"] > 1 else layout
            except ConfigError:
                continue
            yield one, lay


def search(cfg: Config, cluster: Cluster, top: int = 10, stats: Optional[dict] = None) -> List[dict]:
    """The ``top`` layouts that fit, fastest first (exact under the model: module docstring). ``stats`` (a dict)
    receives the counts and timings. Empty when nothing fits."""
    started = time.perf_counter()
    capacity = cluster.device.memory_bytes
    bounded = []
    n = dropped = 0
    least = float("inf")
    with costs.shared_meta():
        for i, (one, layout) in enumerate(candidates(cfg, cluster)):
            n += 1
            need = costs.memory_lower_bound(one, layout)
            if need > capacity:
                dropped += 1
                least = min(least, need)
                continue
            bounded.append((predict(one, layout, cluster, lower_bound=True)["step_time_s"], i, one, layout))
        enumerated = time.perf_counter()
        heapq.heapify(bounded)
        best: List[Tuple[float, int, dict]] = []  # max-heap of the top fitting ones, by -step
        whole = 0
        while bounded:
            bound, i, one, layout = heapq.heappop(bounded)
            if len(best) >= top and bound >= -best[0][0]:
                break
            got = predict(one, layout, cluster)
            whole += 1
            if not got["fits"]:
                least = min(least, got["memory_gib"] * 2**30)
                continue
            heapq.heappush(best, (-got["step_time_s"], -i, got))
            if len(best) > top:
                heapq.heappop(best)
    if stats is not None:
        stats.update(candidates=n, cannot_fit=dropped, predicted_whole=whole, least_gib=least / 2**30,
                     enumerate_s=enumerated - started, total_s=time.perf_counter() - started)
    return [got for _, _, got in sorted(best, key=lambda x: (-x[0], -x[1]))]
