"""FP8-LM's checkpoints (``Fp8DataParallel``'s part, a mixin of ``fp8/zero.py``'s strategy): fp32 values of the master
weights and Adam moments under the global names every precision uses, written from and read into staging buffers, and
the gradient factor mu's state."""
from __future__ import annotations

import math
from typing import Dict

import torch

from fp8 import adam
from fp8.format import dequantize
from fp8.grad_comm import AutoScale
from parallel.zero.dcp_view import shard_view


class Fp8Checkpointing:
    """Checkpoint calls of ``Fp8DataParallel`` (its units, stage and mesh; ``_refresh_weights`` after a load)."""

    # -- checkpoints ------------------------------------------------------------------------------
    def checkpoint_state(self, with_optimizer: bool) -> Dict[str, Dict[str, torch.Tensor]]:
        """Per parameter name: fp32 values of its master weights (and Adam moments) as global tensors of which
        this rank holds its owned tensors; loading writes into the same staging buffers (``after_load``)."""
        out: Dict[str, Dict[str, torch.Tensor]] = {}
        self._staging = []
        for u in self.units:
            stage = {"model": torch.zeros(u.extent, dtype=torch.float32, device=u.master.device)}
            if with_optimizer:
                stage["exp_avg"] = torch.zeros_like(stage["model"])
                stage["exp_avg_sq"] = torch.zeros_like(stage["model"])
            for i in u.owned:
                a, b = u.where[i]
                stage["model"][a:b] = u.master_value(i)
                if with_optimizer:
                    stage["exp_avg"][a:b] = dequantize(u.m[a:b], u.m_scale[i])
                    stage["exp_avg_sq"][a:b] = dequantize(u.v[a:b], u.v_scale[i])
            self._staging.append(stage)
            for i, (name, p) in enumerate(zip(u.names, u.params)):
                spec, local = p.spec, tuple(p.shape)
                offset = spec.local_offset(local, self.mesh.tp_rank, self.mesh.ep_rank)  # (an expert's EP piece)
                pieces = {k: [(0, p.numel(), buf[u.where[i][0]:u.where[i][1]])] if i in u.where else []
                          for k, buf in stage.items()}
                out[name] = {k: shard_view(spec.global_shape, local, offset, pieces[k], buf)
                             for k, buf in stage.items()}
        return out

    def after_save(self) -> None:
        self._staging = None

    @torch.no_grad()
    def after_load(self) -> None:
        """The staging buffers were loaded: requantize masters and moments (same scale rules as the optimizer,
        so a checkpoint of this run gives back the same bits), then refresh the E4M3 weights."""
        staging, self._staging = self._staging, None
        if staging is not None:
            for u, stage in zip(self.units, staging):
                for i in u.owned:
                    a, b = u.where[i]
                    adam.set_master(u.master[a:b], u.master_scale[i], stage["model"][a:b])
                    if "exp_avg" in stage:
                        adam.set_moments(u.m[a:b], u.m_scale[i], u.v[a:b], u.v_scale[i], stage["exp_avg"][a:b],
                                         stage["exp_avg_sq"][a:b])
        self._refresh_weights()

    def fp8_state(self) -> Dict[str, float]:
        return self.autoscale.state_dict()

    def load_fp8_state(self, state: Dict[str, float]) -> None:
        """mu and its counters from a checkpoint; a mu no run produces (not finite, outside AutoScale's
        [MIN, MAX]) is refused, naming it."""
        mu = state.get("mu") if isinstance(state, dict) else None
        if not isinstance(mu, (int, float)) or isinstance(mu, bool) or not math.isfinite(mu) \
                or not AutoScale.MIN <= mu <= AutoScale.MAX:
            raise ValueError(f"FP8 gradient factor mu is {mu!r} (it is finite, in [2**-64, 2**64])")
        self.autoscale.load_state_dict(state)
