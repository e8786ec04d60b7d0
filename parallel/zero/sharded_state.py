"""ZeRO's checkpoints, load and memory accounting: a mixin of ``ZeroDataParallel`` (``sharded.py``).

Checkpoints hold every parameter's master weights and AdamW moments (with qWD, the reconstructed weights too) as
global tensors of which each rank holds its shard's pieces (``dcp_view.py``, for torch.distributed.checkpoint).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from parallel import comm
from parallel.zero.dcp_view import shard_view


class ZeroState:
    """Checkpoint state, the step count, qWD's reference kind, the load, unsharded gradients and memory."""

    # -- checkpoints ------------------------------------------------------------------------------
    def checkpoint_state(self, with_optimizer: bool) -> Dict[str, Dict[str, torch.Tensor]]:
        """Per parameter name: its master weights (and AdamW moments) as global tensors of which this rank
        holds its shard's pieces (views: loading writes straight into the shards). With qWD and the optimizer,
        also ``weight_reference``: the weights every rank reconstructed (compute dtype), what the next
        differences are taken against, so a resume continues bit for bit (``after_load``)."""
        out: Dict[str, Dict[str, torch.Tensor]] = {}
        adam = self.cfg.train.optimizer == "adamw"
        buffers = ("model", "exp_avg", "exp_avg_sq") if with_optimizer and adam else ("model",)
        if with_optimizer and self.weight_delta:
            buffers += ("weight_reference",)
        for u in self.units:
            pieces: Dict[int, list] = {i: [] for i in range(len(u.params))}
            for i, a, b, at in u.layout.owned(u.group.rank):
                pieces[i].append((a, b, at))
            for i, (name, p) in enumerate(zip(u.names, u.params)):
                spec, local = p.spec, tuple(p.shape)
                offset = spec.local_offset(local, self.mesh.tp_rank, self.mesh.ep_rank)
                sources = {"model": u.master, "exp_avg": u.exp_avg, "exp_avg_sq": u.exp_avg_sq,
                           "weight_reference": u.reference if self.stage == 3 else u.shard}
                out[name] = {key: shard_view(spec.global_shape, local, offset,
                                             [(a, b, sources[key][at:at + b - a]) for a, b, at in pieces[i]],
                                             sources[key])
                             for key in buffers}
            if with_optimizer and getattr(u, "rules", None) is not None:  # another optimizer's states: their owner's
                for j, (i, _) in enumerate(u.rule_at):
                    p = u.params[i]
                    views = u.rules.state_views(j, p.spec.local_offset(tuple(p.shape), self.mesh.tp_rank,
                                                                       self.mesh.ep_rank))
                    out[u.names[i]].update({k: shard_view(g, loc, off, [(0, t.numel(), t.view(-1))], t)
                                            for k, (g, loc, off, t) in views.items()})
        return out

    def forget_staged(self) -> None:
        """A save is done: drop the fp32 views of 8-bit moments it wrote."""
        for u in self.units:
            if getattr(u, "rules", None) is not None:  # (FP8-LM's units have none)
                u.rules.forget_staged()

    def set_optimizer_steps(self, steps: int) -> None:
        self.optimizer_steps = steps

    def reference_kind(self) -> Optional[str]:
        """qWD: what this rank's ``weight_reference`` (``checkpoint_state``) holds now, recorded in a checkpoint's
        meta.json so that any stage resumes it: ``"applied"``, the weights the next forward runs on (stages 1-2:
        the post-step gather added the step's differences; stage 3 once a forward since the step, a validation
        pass for one, gathered them and kept the secondary shards), or ``"pending"`` (stage 3 right after a step:
        the weights the last forward ran on, the step's differences not yet sent). None without qWD."""
        if not self.weight_delta:
            return None
        if self.stage < 3:
            return "applied"
        kept = {u.secondary_valid for u in self.units}
        if len(kept) > 1:  # a forward is all or none of a rank's units between two steps
            raise RuntimeError("qWD: some units were gathered since the optimizer step and others not")
        return "applied" if kept == {True} else "pending"

    @torch.no_grad()
    def after_load(self, reference_loaded: bool = False, reference_kind: str = "applied") -> None:
        """Master shards were loaded: refresh the compute-dtype parameters from them.

        qWD: with the reconstructed weights loaded too (``reference_loaded``: a checkpoint of a qWD run, of any stage),
        every rank's copy of them is rebuilt exactly, so the run continues as if never stopped; without them the next
        gather is exact, as at the start. ``reference_kind`` (``reference_kind`` of the saving run): ``"applied"``,
        they are the weights the next forward runs on (stages 1-2: the full parameters; stage 3: the secondary
        shards, marked valid so that forward gathers them inside the node and sends no differences); ``"pending"``,
        the step's differences are still to be added (stage 3: the next forward's gather adds them, as after any
        step; stages 1-2: the post-step gather of the differences runs now). Stages 1-2 with qwZ (no qWD): the
        parameters are the quantized gather of the master, as after every step."""
        if reference_kind not in ("applied", "pending"):
            raise ValueError(f"qWD reference kind must be applied or pending, got {reference_kind!r}")
        self._discard_early()
        for u in self.units:  # 8-bit AdamW: the loaded fp32 moments, re-quantized
            if getattr(u, "rules", None) is not None:  # (FP8-LM's units have none)
                u.rules.after_load()
        for _, work in self._landing.values():
            work.wait()
        self._landing.clear()
        quantized = self._quantized_step_gather()
        for u in self.units:  # (stages 1-2 qWD with the reference loaded: the shard holds that reference)
            if u.shard is not u.master and not (quantized and self.weight_delta and reference_loaded):
                u.shard.copy_(u.master)
        if quantized and not self.weight_delta:
            for work in [self._step_gather(u) for u in self.units]:
                work.wait()
            return
        for u in self.units:
            if self.stage < 3:
                comm.all_gather(u.full, u.shard.clone(), u.group)
            u.secondary_valid = u.secondary_unmeasured = False
            if u.reference is not None:
                u.reference_valid = reference_loaded
                if not reference_loaded:
                    u.reference.copy_(u.shard)
                else:  # the secondary shards: this rank's hpZ slice of everyone's references
                    full = torch.empty_like(u.full)
                    comm.all_gather(full, u.reference.clone(), self.mesh.dp)
                    n = u.secondary.numel()
                    u.secondary.copy_(full[self.hpz.rank * n:(self.hpz.rank + 1) * n])
                    u.secondary_valid = reference_kind == "applied"
        if quantized and self.weight_delta and reference_loaded and reference_kind == "pending":
            for work in [self._step_gather(u) for u in self.units]:  # a stage-3 checkpoint: its step's differences
                work.wait()

    def unsharded_grads(self) -> Dict[str, torch.Tensor]:
        """Every parameter's (DP-mean) gradient, gathered from the shards: a collective over DP, for tests."""
        out = {}
        for u in self.units:
            full = torch.empty(u.layout.padded_size, dtype=u.grad_shard.dtype, device=u.grad_shard.device)
            comm.all_gather(full, u.grad_shard.clone(), u.group)
            for name, p, off in zip(u.names, u.params, u.layout.offsets):
                out[name] = full[off:off + p.numel()].view(p.shape).float()
        return out

    # -- accounting ---------------------------------------------------------------------------------
    def memory(self) -> Dict[str, int]:
        """Bytes this rank holds now, by component (views of one storage counted once)."""
        seen = set()

        def size(*tensors: Optional[torch.Tensor]) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                st = t.untyped_storage()
                if st.data_ptr() in seen or st.nbytes() == 0:
                    continue
                seen.add(st.data_ptr())
                total += st.nbytes()
            return total

        params = sum(size(u.full if self.stage < 3 else u.shard, u.secondary, u.reference) for u in self.units)
        grads = sum(size(u.grad_full if self.stage == 1 else u.grad_shard) for u in self.units)
        optim = sum(size(u.master, u.exp_avg, u.exp_avg_sq) for u in self.units)
        optim += sum(u.rules.state_bytes() for u in self.units if getattr(u, "rules", None) is not None)
        return {"parameters": params, "gradients": grads, "optimizer": optim, "working_peak": self.working.peak}
