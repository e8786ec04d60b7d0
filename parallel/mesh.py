"""The one mesh object: every process group of the job, built once, passed explicitly.

Groups (each a ``comm.Group`` sharing one byte ledger):

  world      all ranks
  tp         tensor-parallel peers (adjacent ranks, one node)
  pp         pipeline stages of this (dp, tp) coordinate
  dp         data-parallel replicas of this (pp, tp) coordinate: dp x cp ranks (context-parallel ranks hold the
             same parameters: parallel/layout.py)
  cp         context-parallel peers: the cp consecutive DP members splitting the same sequences
  dp_intra   DP peers on this node (size X)             -- ZeRO++ hpZ / qgZ step 2
  dp_inter   DP peers with the same intra index (size Y) -- ZeRO++ qgZ step 4
  embedding  first + last pipeline stage (tied embeddings)
  mp         the model-parallel replica (all of pp x tp at this dp index)
  dp_hpz     ZeRO++ hpZ: consecutive dp_intra peers (``hpz_group(size)``, built on request)
  qwz_inter, qwz_intra   ZeRO++ qwZ's two-hop weight gather: dp_inter's and dp_intra's members as groups of
             their own (``gather_groups()``, built on request)
  tp_kv      grouped-query attention with fewer KV heads than TP ranks: the consecutive TP peers that
             hold the same KV heads (``tp_kv_group(size)``, built on request)

The tp/pp/dp groups come from torch's DeviceMesh, which also serves DTensor-based
checkpointing; the others are created with ``new_group`` in a fixed order on
every rank (a requirement of torch.distributed).

Every group carries the collective timeout of the default process group
(``parallel.timeout_s``, given to ``init_process_group``): torch gives a group
created without one its own default (30 minutes), so a stuck rank would leave its
peers waiting that long in any collective outside ``world``.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel.comm import Group, Ledger
from parallel.layout import Layout


def default_timeout(device: torch.device) -> timedelta:
    """The collective timeout of the default process group (what ``init_process_group`` was given)."""
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device(device.type))
    return backend.options._timeout


def _pg_options(device: torch.device, timeout: timedelta):
    """Backend options that carry ``timeout``, for DeviceMesh's ``backend_override``."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False  # torch's default for NCCL groups
    else:
        options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


class Mesh:
    def __init__(self, layout: Layout, device: torch.device):
        if dist.get_world_size() != layout.world_size:
            raise RuntimeError(f"layout expects {layout.world_size} ranks, the process group has "
                               f"{dist.get_world_size()}")
        self.layout = layout
        self.device = device
        self.rank = dist.get_rank()
        self.ledger = Ledger()
        self.timeout = default_timeout(device)  # of every group, as of world (parallel.timeout_s)
        self.pp_rank, self.dp_rank, self.tp_rank = layout.coords(self.rank)
        self.ep_rank, self.edp_rank = self.dp_rank % layout.ep, self.dp_rank // layout.ep
        self.cp_rank, self.batch_rank = self.dp_rank % layout.cp, self.dp_rank // layout.cp
        options = {dim: _pg_options(device, self.timeout) for dim in ("pp", "dp", "tp")}
        self.device_mesh: DeviceMesh = init_device_mesh(
            device.type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"),
            backend_override=options)
        self.world = self._group("world", list(range(layout.world_size)), dist.group.WORLD)
        self.tp = self._group("tp", layout.tp_ranks(self.rank), self.device_mesh.get_group("tp"))
        self.pp = self._group("pp", layout.pp_ranks(self.rank), self.device_mesh.get_group("pp"))
        self.dp = self._group("dp", layout.dp_ranks(self.rank), self.device_mesh.get_group("dp"))
        # on gloo a DP group across nodes reduce-scatters directly over one-way connections (comm.Group.reverse);
        # every rank creates the twins (collective), a rank whose DP group stays in a node does not use its own
        nodes = {layout.node_of(r) for r in range(layout.world_size)}
        if dist.get_backend() == "gloo" and len(nodes) > 1:
            twin = self._new_groups("dp_reverse", layout.dp_ranks).pg
            self.dp.reverse = twin if self.dp.link == "inter" else None
        self.dp_intra = self._new_groups("dp_intra", layout.dp_intra_ranks)
        self.dp_inter = self._new_groups("dp_inter", layout.dp_inter_ranks, twin=True)
        # expert parallelism: the runs of ep DP peers that split the experts, and the peers holding the same ones
        # (with ep = 1: this rank alone, and the DP group itself)
        self.ep = self._new_groups("ep", layout.ep_ranks) if layout.ep > 1 else self._group("ep", [self.rank], None)
        self.edp = self._new_groups("edp", layout.edp_ranks) if layout.ep > 1 else self.dp
        self.cp = self._new_groups("cp", layout.cp_ranks) if layout.cp > 1 else self._group("cp", [self.rank], None)
        self.embedding = self._new_groups("embedding", layout.embedding_ranks)
        self.mp = self._new_groups("mp", layout.model_parallel_ranks)
        self._hpz: Dict[int, Group] = {}
        self._tp_kv: Dict[int, Group] = {}
        self._gather: Optional[Tuple[Group, Group]] = None

    # -- construction -------------------------------------------------------------------------
    def _group(self, name: str, ranks: List[int], pg) -> Group:
        nodes = {self.layout.node_of(r) for r in ranks}
        return Group(name=name, pg=pg if len(ranks) > 1 else None, ranks=ranks, rank=ranks.index(self.rank),
                     link="intra" if len(nodes) == 1 else "inter", ledger=self.ledger)

    def _new_groups(self, name: str, members_of: Callable[[int], List[int]], twin: bool = False) -> Group:
        """Create every distinct group of this family (all ranks, same order) and keep ours. ``twin``: on gloo, a
        group that crosses nodes gets a second process group over the same members (``Group.reverse``: its
        exchanges send each direction over a connection of its own)."""
        mine = members_of(self.rank)
        distinct = sorted({tuple(members_of(r)) for r in range(self.layout.world_size)})
        twin = twin and dist.get_backend() == "gloo"
        pg = reverse = None
        for ranks in distinct:
            if len(ranks) == 1:
                continue
            created = dist.new_group(list(ranks), timeout=self.timeout)
            second = (dist.new_group(list(ranks), timeout=self.timeout)
                      if twin and len({self.layout.node_of(r) for r in ranks}) > 1 else None)
            if list(ranks) == mine:
                pg, reverse = created, second
        group = self._group(name, mine, pg)
        group.reverse = reverse
        group.pairwise_gather = reverse is not None
        return group

    def _consecutive_groups(self, name: str, family: Callable[[int], List[int]], size: int) -> Group:
        """Cut each group of ``family`` into runs of ``size`` consecutive members; this rank's run."""
        def members(rank: int) -> List[int]:
            ranks = family(rank)
            at = ranks.index(rank) // size * size
            return ranks[at:at + size]

        return self._new_groups(name, members)

    def hpz_group(self, size: int) -> Group:
        """ZeRO++ hpZ's secondary-partition group: ``size`` consecutive DP peers of this rank's node.

        Collective (every rank must call it, with the same size); built once per size."""
        if size not in self._hpz:
            if self.dp_intra.size % size:
                raise ValueError(f"hpZ group size {size} does not divide the {self.dp_intra.size} DP ranks per node")
            self._hpz[size] = self._consecutive_groups("dp_hpz", self.layout.dp_intra_ranks, size)
        return self._hpz[size]

    def gather_groups(self) -> Tuple[Group, Group]:
        """(inter, intra): the dp_inter and dp_intra memberships as groups of their own, for ZeRO++'s two-hop
        weight gather (``parallel/zero/zeropp.py``: its second hop is launched when the first arrives, an order
        that must not interleave with other collectives on a shared group). Collective; built once."""
        if self._gather is None:
            self._gather = (self._new_groups("qwz_inter", self.layout.dp_inter_ranks, twin=True),
                            self._new_groups("qwz_intra", self.layout.dp_intra_ranks))
        return self._gather

    def tp_kv_group(self, size: int) -> Group:
        """The ``size`` consecutive TP peers of this rank that hold the same (replicated) KV heads.

        Collective (every rank must call it, with the same size); built once per size."""
        if size not in self._tp_kv:
            if self.tp.size % size:
                raise ValueError(f"KV replica group size {size} does not divide the TP size {self.tp.size}")
            self._tp_kv[size] = self._consecutive_groups("tp_kv", self.layout.tp_ranks, size)
        return self._tp_kv[size]

    # -- queries ------------------------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sequence_parallel

    def stage_mesh(self) -> DeviceMesh:
        """The (dp, tp) sub-mesh of this pipeline stage: where this rank's parameters live as DTensors."""
        return self.device_mesh["dp", "tp"]

    def groups(self) -> Dict[str, Group]:
        return {g.name: g for g in (self.world, self.tp, self.pp, self.dp, self.dp_intra, self.dp_inter, self.cp,
                                    self.ep, self.edp, self.embedding, self.mp, *self._hpz.values(),
                                    *(self._gather or ()), *self._tp_kv.values())}

    def __repr__(self) -> str:
        return (f"Mesh(rank={self.rank}, pp={self.pp_rank}/{self.layout.pp}, dp={self.dp_rank}/{self.layout.dp}, "
                f"tp={self.tp_rank}/{self.layout.tp}, node={self.layout.node_of(self.rank)})")
