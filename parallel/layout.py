"""The parallel layout as plain arithmetic: world = PP x DP x CP x TP, with node topology.

Rank order (SPEC §1; Megatron-Core's tp-cp-dp-pp): TP innermost (adjacent ranks, same node), then CP, then DP, PP
outermost::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank,    dp_rank = batch_rank * cp + cp_rank

Context-parallel ranks hold the same parameters as data-parallel ones, so for everything about parameters they
*are* data-parallel ranks: ``dp`` / ``dp_rank`` / ``dp_ranks`` count the dp x cp ranks of a replica group
(Megatron's "data-parallel group with context parallelism"): gradients are summed, ZeRO shards cut and FP8 scales
reduced over them. Only the data and attention tell them apart: the ``cp`` consecutive members of a DP group
(``cp_ranks``) read the same samples (``batch_rank``) and split each sequence between them.

``make_layout`` checks every number against every other before a process group
exists, so an impossible layout stops identically on all ranks with a message
that names the numbers, instead of hanging or failing deep inside a shape error.
It is pure, so it is unit-tested without launching processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from config import Config, ConfigError


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int
    pp: int
    dp: int
    virtual_stages: int
    ranks_per_node: int
    sequence_parallel: bool
    num_microbatches: int
    """Micro-batches per optimizer step on each data-parallel rank."""
    cp: int = 1
    """Context-parallel size: runs of cp consecutive DP ranks (``cp_ranks``) split each sequence; ``dp`` counts them
    (dp = batch shards x cp)."""
    ep: int = 1
    """Expert-parallel size: runs of ep consecutive DP ranks split the routed experts (``ep_ranks``); the DP ranks
    holding the same experts, one per run, are the expert-data-parallel group (``edp_ranks``)."""

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def tp_ranks(self, rank: int) -> List[int]:
        p, d, _ = self.coords(rank)
        return [self.rank_of(p, d, t) for t in range(self.tp)]

    def dp_ranks(self, rank: int) -> List[int]:
        p, _, t = self.coords(rank)
        return [self.rank_of(p, d, t) for d in range(self.dp)]

    def pp_ranks(self, rank: int) -> List[int]:
        _, d, t = self.coords(rank)
        return [self.rank_of(p, d, t) for p in range(self.pp)]

    @property
    def batch_shards(self) -> int:
        """Ranks of a DP group reading distinct samples (dp / cp): the data-parallel size of the batch arithmetic."""
        return self.dp // self.cp

    def batch_rank(self, rank: int) -> int:
        """Which of the batch_shards sample slices this rank reads."""
        return self.coords(rank)[1] // self.cp

    def cp_rank(self, rank: int) -> int:
        return self.coords(rank)[1] % self.cp

    def cp_ranks(self, rank: int) -> List[int]:
        """The cp consecutive DP peers (this rank among them) that split the same sequences."""
        peers = self.dp_ranks(rank)
        at = peers.index(rank) // self.cp * self.cp
        return peers[at:at + self.cp]

    def ep_ranks(self, rank: int) -> List[int]:
        """The ep consecutive DP peers (this rank among them) that split the routed experts."""
        peers = self.dp_ranks(rank)
        at = peers.index(rank) // self.ep * self.ep
        return peers[at:at + self.ep]

    def edp_ranks(self, rank: int) -> List[int]:
        """The DP peers holding the same experts as this rank (one per EP group; dp / ep of them)."""
        peers = self.dp_ranks(rank)
        return peers[peers.index(rank) % self.ep::self.ep]

    def dp_intra_ranks(self, rank: int) -> List[int]:
        """DP peers on this rank's node (size X)."""
        return [r for r in self.dp_ranks(rank) if self.node_of(r) == self.node_of(rank)]

    def dp_inter_ranks(self, rank: int) -> List[int]:
        """DP peers with this rank's intra-node index, one per node (size Y)."""
        peers = self.dp_ranks(rank)
        index = self.dp_intra_ranks(rank).index(rank)
        by_node: dict = {}
        for r in peers:
            by_node.setdefault(self.node_of(r), []).append(r)
        return [members[index] for _, members in sorted(by_node.items())]

    def embedding_ranks(self, rank: int) -> List[int]:
        """First and last pipeline stage at this rank's (dp, tp) coordinate; just this rank on a middle stage."""
        stages = self.pp_ranks(rank)
        if rank not in (stages[0], stages[-1]):
            return [rank]
        return sorted({stages[0], stages[-1]})

    def model_parallel_ranks(self, rank: int) -> List[int]:
        """All ranks holding a piece of the same model replica (same dp_rank)."""
        _, d, _ = self.coords(rank)
        return [self.rank_of(p, d, t) for p in range(self.pp) for t in range(self.tp)]

    @property
    def dp_intra_size(self) -> int:
        return len(self.dp_intra_ranks(0))

    @property
    def dp_inter_size(self) -> int:
        return self.dp // self.dp_intra_size

    def describe(self) -> str:
        dp = f"dp {self.batch_shards} x cp {self.cp}" if self.cp > 1 else f"dp {self.dp}"
        return (f"world={self.world_size} = pp {self.pp} x {dp} x tp {self.tp}"
                + (f" (ep {self.ep} of the dp ranks)" if self.ep > 1 else "")
                + f" (virtual_stages={self.virtual_stages}, sequence_parallel={self.sequence_parallel},"
                f" ranks_per_node={self.ranks_per_node}, dp_intra={self.dp_intra_size},"
                f" dp_inter={self.dp_inter_size}, microbatches={self.num_microbatches})")


def cp_chunks(cp: int, cp_rank: int) -> Tuple[int, int]:
    """Which two of a sequence's 2 x cp chunks context-parallel rank ``cp_rank`` holds, in its local order: chunks
    cp_rank and 2 cp - 1 - cp_rank (Megatron-Core's get_batch_on_this_cp_rank), so that under the causal mask every
    rank does the same attention work."""
    return cp_rank, 2 * cp - 1 - cp_rank


def cp_spans(seq_len: int, cp: int, cp_rank: int) -> List[Tuple[int, int]]:
    """The token ranges ``[lo, hi)`` of a sequence that context-parallel rank ``cp_rank`` holds (``cp_chunks``), in
    its local order."""
    size = seq_len // (2 * cp)
    return [(c * size, (c + 1) * size) for c in cp_chunks(cp, cp_rank)]


def kv_replicas(kv_heads: int, tp: int) -> int:
    """TP ranks holding each KV head: 1 when the KV heads split over TP, else tp / n_kv_heads."""
    return tp // kv_heads if kv_heads < tp else 1


def make_layout(cfg: Config, world_size: int, launcher_ranks_per_node: int) -> Layout:
    """Validate cfg.parallel against the model, the batch and the launch; return the layout."""
    par, m, t = cfg.parallel, cfg.model, cfg.train
    errors: List[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            errors.append(msg)

    tp, pp, vp, cp = par.tp, par.pp, par.virtual_stages, max(par.cp, 1)
    rpn = par.ranks_per_node if par.ranks_per_node is not None else launcher_ranks_per_node
    factors = f"parallel.tp={tp} x parallel.pp={pp}" + (f" x parallel.cp={cp}" if cp > 1 else "")
    need(world_size % (tp * pp * cp) == 0, f"world size {world_size} is not divisible by {factors} = {tp * pp * cp}")
    dp = max(world_size // (tp * pp * cp), 1) * cp  # the replica group: batch shards x cp
    need(m.n_heads % tp == 0, f"model.n_heads={m.n_heads} is not divisible by parallel.tp={tp}")
    kv = m.kv_heads
    need(kv < 1 or kv % tp == 0 or tp % kv == 0,
         f"model.n_kv_heads={kv} cannot be laid out over parallel.tp={tp}: KV heads are split over TP when "
         f"n_kv_heads is a multiple of tp, and replicated when tp is a multiple of n_kv_heads")
    need(m.vocab_size % tp == 0, f"model.vocab_size={m.vocab_size} is not divisible by parallel.tp={tp}")
    need(m.ffn_size % tp == 0, f"MLP hidden size {m.ffn_size} (model.ffn_hidden) is not divisible by parallel.tp={tp}")
    need(vp == 1 or pp > 1, f"parallel.virtual_stages={vp} needs parallel.pp > 1 (got pp={pp})")
    need(m.n_layers % (pp * vp) == 0,
         f"model.n_layers={m.n_layers} is not divisible by parallel.pp={pp} x parallel.virtual_stages={vp}"
         f" = {pp * vp} (every model chunk must hold the same number of layers)")
    if par.sequence_parallel and cp == 1:
        need(m.seq_len % tp == 0,
             f"model.seq_len={m.seq_len} is not divisible by parallel.tp={tp} (sequence parallelism splits it)")
    elif par.sequence_parallel and tp > 1:
        need(m.seq_len % (2 * cp) == 0 and m.seq_len // cp % tp == 0,
             f"each rank's {m.seq_len / cp:g} tokens (model.seq_len={m.seq_len} / parallel.cp={cp}) are not "
             f"divisible by parallel.tp={tp} (sequence parallelism splits them)")
    shards = dp // cp
    per_step = t.micro_batch_size * shards
    need(t.global_batch_size % per_step == 0,
         f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size="
         f"{t.micro_batch_size} x data-parallel size {shards} = {per_step}")
    num_mb = max(t.global_batch_size // per_step, 1)
    if pp > 1:
        need(num_mb >= pp, f"{num_mb} micro-batches per step (global_batch_size={t.global_batch_size} / "
                           f"(micro_batch_size={t.micro_batch_size} x dp={shards})) is fewer than parallel.pp={pp} "
                           "pipeline stages")
    if vp > 1:
        need(num_mb % pp == 0, f"the interleaved schedule needs micro-batches per step ({num_mb}) divisible by "
                               f"parallel.pp={pp}")
    need(rpn >= 1 and (world_size <= rpn or world_size % rpn == 0),
         f"parallel.ranks_per_node={rpn} does not divide the world size {world_size}")
    rpn = min(rpn, world_size)  # a job smaller than a node sits on one node
    need(rpn < 1 or rpn % tp == 0,
         f"tensor parallelism would span nodes: parallel.tp={tp} does not divide parallel.ranks_per_node={rpn}")
    ep, experts = par.ep, m.moe.num_experts
    need(ep >= 1, f"parallel.ep={ep} must be >= 1")
    if ep > 1 and experts <= 0:  # (the sizes below would only repeat it)
        need(False, f"parallel.ep={ep} needs routed experts (model.moe.num_experts > 0)")
    elif ep > 1:
        need(dp % ep == 0, f"parallel.ep={ep} does not divide the data-parallel size {dp} (world {world_size} / "
                           f"(tp={tp} x pp={pp}))")
        need(experts % ep == 0,
             f"model.moe.num_experts={experts} is not divisible by parallel.ep={ep} (each EP rank holds "
             f"num_experts / ep experts)")
    if errors:
        raise ConfigError.listing("impossible parallel layout", errors)
    layout = Layout(world_size=world_size, tp=tp, pp=pp, dp=dp, virtual_stages=vp, ranks_per_node=rpn,
                    sequence_parallel=par.sequence_parallel and tp > 1, num_microbatches=num_mb, ep=ep, cp=cp)
    sizes = dp_intra_sizes(layout)
    if len(sizes) != 1:
        raise ConfigError(f"impossible parallel layout: data-parallel peers are spread unevenly over nodes "
                          f"(ranks_per_node={rpn}, {layout.describe()}); dp_intra sizes {sorted(sizes)}")
    hpz, intra = cfg.zero.hpz_size, sizes.pop()
    if hpz > 1 and intra % hpz:
        raise ConfigError(f"impossible parallel layout: zero.hpz_size={hpz} does not divide the {intra} data-parallel "
                          f"ranks per node (parallel.ranks_per_node={rpn}, parallel.tp={tp}, parallel.pp={pp})")
    return layout


def dp_intra_sizes(layout: Layout) -> set:
    """The sizes of every rank's ``dp_intra_ranks`` (its DP peers on its node), counted once per DP group: O(world)
    where asking each rank costs O(world x dp), which at thousands of ranks is seconds of start-up."""
    sizes = set()
    for p in range(layout.pp):
        for t in range(layout.tp):
            per_node: dict = {}
            for d in range(layout.dp):
                node = layout.node_of(layout.rank_of(p, d, t))
                per_node[node] = per_node.get(node, 0) + 1
            sizes.update(per_node.values())
    return sizes
