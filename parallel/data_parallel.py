"""Plain data parallelism (ZeRO stage 0): bucketed gradient all-reduce, overlapped with backward.

``DataParallel`` is the strategy the engine talks to (the same five calls as
``parallel/zero/sharded.py``): zero_grad, before_last_backward, finish_grads,
clip, step. Parameters, gradients and AdamW state are fp32 and whole on every
DP rank (16 bytes a parameter); bf16/fp16 compute runs under autocast.

Every parameter's ``.grad`` is a view into a flat fp32 bucket buffer, so autograd
accumulates micro-batch gradients in place and a bucket is all-reduced as one
tensor without copies. Buckets follow reverse parameter order (roughly the order
backward produces gradients), ``bucket_mb`` each. With one DP rank there is nothing
to reduce and no buckets: autograd keeps each gradient as it comes (the first
micro-batch's tensor itself, the others added in place), as a plain PyTorch loop
does, instead of zeroing buckets and adding every micro-batch into them (16 bytes a
parameter a step less; the same sums).

Accumulation micro-steps do no communication. Before the last backward of a
step, ``start_sync`` arms the post-accumulate-grad hooks: a bucket whose
parameters have all received their final gradient is divided by the DP size and
its all-reduce launched asynchronously while backward continues. Buckets launch
strictly in index order on every rank, which collectives over one group require.
``finish`` launches any remaining buckets and waits for all of them.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from model.gpt import EMBEDDING
from parallel import comm
from parallel.comm import Group
from parallel.mesh import Mesh
from optimizers.tensor_rules import Entry, TensorRules
from parallel.optim_rules import build_optimizer, local_grad_sq, unscale_and_clip, weight_decay_exempt
from parallel.zero.dcp_view import shard_view


class GradBuckets:
    def __init__(self, params: Sequence[nn.Parameter], dp: Group, bucket_mb: float, overlap: bool = True,
                 divisor: Optional[int] = None):
        """``divisor``: what the summed gradients are divided by (default the group's size: its mean). Routed
        experts under expert parallelism reduce over their expert-data-parallel group but divide by the whole DP
        size: each EP rank's expert gradients already hold the contributions of its EP group's tokens."""
        self.dp, self.overlap = dp, overlap
        self.divisor = divisor if divisor is not None else dp.size
        self.params = [p for p in params if p.requires_grad]
        self.buckets: List[torch.Tensor] = []
        self.members: List[List[nn.Parameter]] = []
        self.bucket_of: Dict[nn.Parameter, int] = {}
        self.flat = dp.size > 1  # one DP rank: no buckets (see the module docstring)
        limit = max(int(bucket_mb * 2**20 / 4), 1)
        groups: List[List[nn.Parameter]] = []
        if self.flat:
            groups.append([])
            for p in reversed(self.params):
                if groups[-1] and sum(q.numel() for q in groups[-1]) + p.numel() > limit:
                    groups.append([])
                groups[-1].append(p)
        for i, members in enumerate(groups):
            buf = torch.zeros(sum(p.numel() for p in members), dtype=torch.float32, device=members[0].device)
            offset = 0
            for p in members:
                p.grad = buf[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                self.bucket_of[p] = i
                if overlap:
                    p.register_post_accumulate_grad_hook(self._on_grad_ready)
            self.buckets.append(buf)
            self.members.append(members)
        self._syncing = False
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._works: List[object] = []

    def zero_grad(self) -> None:
        for buf in self.buckets:
            buf.zero_()
        if not self.flat:
            for p in self.params:
                p.grad = None

    def grads(self) -> List[torch.Tensor]:
        """The gradient tensors: the bucket buffers, or (one DP rank) each parameter's own."""
        return self.buckets if self.flat else [p.grad for p in self.params if p.grad is not None]

    def start_sync(self) -> None:
        """Arm the hooks: the coming backward is the last of the step."""
        self._syncing = True
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._works = []

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._syncing:
            return
        i = self.bucket_of[p]
        self._ready[i] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.members[self._next]):
            self._launch(self._next)

    def _launch(self, i: int) -> None:
        buf = self.buckets[i]
        if self.dp.size > 1:
            buf.div_(self.divisor)
            self._works.append(comm.all_reduce(buf, self.dp, async_op=True))
        self._next = i + 1

    def finish(self) -> None:
        """Reduce whatever has not been launched yet and wait for every bucket: grads are now DP means."""
        if not self._syncing:
            self.start_sync()
        if not self.flat:  # a parameter no micro-batch reached gets zeros, as a zeroed bucket would hold
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif self.divisor > 1:  # one rank in the group, yet a mean over more (experts: edp = 1 < dp)
                    p.grad.div_(self.divisor)
        while self._next < len(self.buckets):
            self._launch(self._next)
        for work in self._works:
            work.wait()
        self._syncing = False
        self._works = []


class DataParallel:
    def __init__(self, cfg, mesh: Mesh, chunks: Sequence[nn.Module], params: Dict[str, nn.Parameter]):
        self.mesh, self.params = mesh, params
        par = cfg.parallel
        # per chunk, the dense parameters' buckets over DP and, under expert parallelism, the routed experts' over
        # their expert-data-parallel group (ParamSpec.expert), divided by the whole DP size
        self.buckets = [GradBuckets([p for p in c.parameters() if not p.spec.expert], mesh.dp, par.bucket_mb,
                                    par.overlap_grad_reduce) for c in chunks]
        self._expert_of_chunk: Dict[int, GradBuckets] = {}
        for i, c in enumerate(chunks):
            experts = [p for p in c.parameters() if p.spec.expert]
            if experts:
                self._expert_of_chunk[i] = GradBuckets(experts, mesh.edp, par.bucket_mb, par.overlap_grad_reduce,
                                                       divisor=mesh.dp.size)
        self.expert_buckets = list(self._expert_of_chunk.values())
        # train.optimizer: torch's AdamW, or the other rules tensor by tensor (optimizers/tensor_rules.py)
        self.rules: Optional[TensorRules] = None
        self.optimizer_steps = 0
        if cfg.train.optimizer == "adamw":
            self.optimizer = build_optimizer(list(params.items()), cfg.train, mesh.device)
        else:
            self.rules = TensorRules(cfg, mesh, [Entry(n, p.data, p.spec, not weight_decay_exempt(n, p))
                                                 for n, p in params.items()])
        self._sp_params = [p for p in params.values() if p.spec.sequence_parallel]
        self._tied = [p for n, p in params.items() if cfg.model.tie_embeddings and mesh.layout.pp > 1
                      and (n == EMBEDDING or p.spec.shared_with == EMBEDDING)]

    def zero_grad(self) -> None:
        for b in self.buckets + self.expert_buckets:
            b.zero_grad()

    def before_last_backward(self, chunk: int) -> None:
        self.buckets[chunk].start_sync()
        if chunk in self._expert_of_chunk:
            self._expert_of_chunk[chunk].start_sync()

    def finish_grads(self) -> None:
        """DP mean, then the reductions model parallelism needs: SP norm weights over TP, tied embeddings."""
        for b in self.buckets + self.expert_buckets:
            b.finish()
        if self._sp_params and self.mesh.tp.size > 1:
            # each TP rank normalised only its sequence slice: sum the partial norm-weight gradients
            flat = torch.cat([p.grad.flatten() for p in self._sp_params])
            comm.all_reduce(flat, self.mesh.tp)
            offset = 0
            for p in self._sp_params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        for p in self._tied:  # input embedding (first stage) and its copy, the output weight (last stage)
            comm.all_reduce(p.grad, self.mesh.embedding)

    def norm_terms(self) -> torch.Tensor:
        """This rank's addends to the step's world sum (float64, ``Engine.train_step``): the squared norm of
        the gradients it owns on DP rank 0, nothing on the others (every DP replica holds the same gradients),
        so the world's sum is the model-parallel group's."""
        mesh = self.mesh
        total = torch.zeros(1, dtype=torch.float64, device=mesh.device)
        if mesh.dp_rank == 0:
            dense = [p for p in self.params.values() if not p.spec.expert]
            total += local_grad_sq(dense, mesh.tp_rank, mesh.device).double()
        if mesh.edp_rank == 0 and self.expert_buckets:  # the first of the DP ranks holding these experts
            experts = [p for b in self.expert_buckets for p in b.params]
            total += local_grad_sq(experts, mesh.tp_rank, mesh.device).double()
        return total

    def clip(self, loss_scale: float, max_norm: float, terms: torch.Tensor) -> Tuple[float, bool]:
        """Unscale and clip, given ``norm_terms`` summed over the world."""
        buffers = [g for b in self.buckets + self.expert_buckets for g in b.grads()]
        return unscale_and_clip(buffers, terms[0].item(), loss_scale, max_norm)

    def step(self, lr: float) -> None:
        self.optimizer_steps += 1
        if self.rules is not None:
            self.rules.step([p.grad for p in self.params.values()], lr, self.optimizer_steps)
            return
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def checkpoint_state(self, with_optimizer: bool) -> Dict[str, Dict[str, torch.Tensor]]:
        """Per parameter name: the parameter (and AdamW moments) as DTensors on the stage's (dp, tp) mesh; with
        another ``train.optimizer``, its states (``TensorRules.state_views``)."""
        mesh = self.mesh.stage_mesh()
        out: Dict[str, Dict[str, torch.Tensor]] = {}
        for i, (name, p) in enumerate(self.params.items()):
            spec = p.spec
            tensors = {"model": p.data}
            if with_optimizer and self.rules is not None:
                offset = spec.local_offset(tuple(p.shape), self.mesh.tp_rank, self.mesh.ep_rank)
                views = self.rules.state_views(i, offset)
                out[name] = {k: shard_view(g, loc, off, [(0, t.numel(), t.view(-1))], t)
                             for k, (g, loc, off, t) in views.items()}
                out[name]["model"] = self._model_view(p, mesh)
                continue
            if with_optimizer:
                st = self._adam_state(p)
                tensors.update(exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"])
            if spec.tp_replicas > 1 or spec.expert:  # a piece held by several TP (or DP) ranks: no placement says it
                offset = spec.local_offset(tuple(p.shape), self.mesh.tp_rank, self.mesh.ep_rank)
                out[name] = {k: shard_view(spec.global_shape, tuple(p.shape), offset, [(0, t.numel(), t.view(-1))], t)
                             for k, t in tensors.items()}
                continue
            place = [Replicate(), Shard(spec.tp_dim) if spec.tp_dim is not None else Replicate()]
            out[name] = {k: DTensor.from_local(t, mesh, place, run_check=False) for k, t in tensors.items()}
        return out

    def _model_view(self, p: nn.Parameter, mesh) -> torch.Tensor:
        spec = p.spec
        if spec.tp_replicas > 1 or spec.expert:
            offset = spec.local_offset(tuple(p.shape), self.mesh.tp_rank, self.mesh.ep_rank)
            return shard_view(spec.global_shape, tuple(p.shape), offset, [(0, p.numel(), p.data.view(-1))], p.data)
        place = [Replicate(), Shard(spec.tp_dim) if spec.tp_dim is not None else Replicate()]
        return DTensor.from_local(p.data, mesh, place, run_check=False)

    def _adam_state(self, p: nn.Parameter) -> Dict[str, torch.Tensor]:
        """AdamW's state of p, created as a fresh optimizer would if no step has been taken yet."""
        st = self.optimizer.state[p]
        if not st:
            fused = self.optimizer.defaults.get("fused")
            st.update(step=torch.tensor(0.0, device=p.device if fused else "cpu"),
                      exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                      exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
        return st

    def set_optimizer_steps(self, steps: int) -> None:
        self.optimizer_steps = steps
        if self.rules is not None:
            return
        for p in self.params.values():
            self._adam_state(p)["step"].fill_(float(steps))

    def after_load(self) -> None:
        """Parameters (and AdamW's moments) were loaded in place; 8-bit AdamW re-quantizes its moments."""
        if self.rules is not None:
            self.rules.after_load()

    def forget_staged(self) -> None:
        """A save is done: drop the fp32 views of 8-bit moments it wrote."""
        if self.rules is not None:
            self.rules.forget_staged()

    def memory(self) -> Dict[str, int]:
        """Bytes this rank holds now, by component."""
        if self.rules is not None:
            state = list(t for e in self.rules.entries for t in e.state.values())
        else:
            state = [t for st in self.optimizer.state.values() for t in st.values()
                     if isinstance(t, torch.Tensor) and t.numel() > 1]
        return {"parameters": sum(p.numel() * p.element_size() for p in self.params.values()),
                "gradients": sum(p.numel() * p.element_size() for b in self.buckets + self.expert_buckets
                                 for p in b.params),
                "optimizer": sum(t.numel() * t.element_size() for t in state), "working_peak": 0}
