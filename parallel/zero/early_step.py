"""ZeRO-3's early step (``zero.early_step``): a mixin of ``ZeroDataParallel`` (``sharded.py``).

With hpZ secondary shards and qwZ, each unit whose gradient shard is final (the last backward's reduce-scatter
arrived) steps its optimizer shard on copies, assuming no clip, and gathers the updated weights across nodes into
its secondary shards while backward goes on (``EarlyStep._early_step``); ``clip`` decides whether the optimizer
step keeps them or they are thrown away (``_discard_early``). ``ZeroDataParallel`` holds the state (``early``,
``_plan``, ``_early``, ``_landing``, ...) and calls these from its reduce (``_drain``), ``zero_grad``, ``clip``,
the stage-3 gathers (``_start_gather``) and ``after_load``.
"""
from __future__ import annotations

import torch

from parallel.optim_rules import grad_factor
from parallel.zero.adamw import adamw_step
from parallel.zero.buffers import Unit
from parallel.zero.zeropp import QuantizedGather


def early_step_applies(z) -> bool:
    """``zero.early_step`` takes effect (``ZeroDataParallel._early_step``; ``parallel/volume.py`` counts its bytes):
    stage 3 with hpZ secondary shards to gather into and qwZ (whose gather dequantizes just the node's slice), not
    qWD (whose differences are taken against the secondary copies an early gather overwrites)."""
    return z.early_step and z.stage == 3 and z.hpz_size > 1 and z.quantized_weights and not z.weight_delta


class EarlyStep:
    """Plan, run, settle and discard the early step (``zero.early_step``, see ``early_step_applies``)."""

    def plan_step(self, lr: float, loss_scale: float) -> None:
        """The engine, before a training step's forward and backward: the learning rate its optimizer step will
        use and the loss scale. With ``zero.early_step`` where it applies, and unless the last step's clip (or an
        overflow) bit or this step samples the quantization error, this step's units step early."""
        ok = self.early and not self._bites and not self.sampling and self.mesh.dp.size > 1
        self._early_units = self._early_candidates() if ok else set()
        self._plan = (lr, grad_factor(0.0, loss_scale, 0.0)) if self._early_units else None

    def _early_candidates(self) -> set:
        """Ids of the units that step early: every unit of each chunk's recorded forward but those of its first
        module (the embedding, on the first stage). That module's gradient is final last and the forward needs it
        first: an early gather of it would arrive no sooner than the one the optimizer step starts, and the step
        would wait for it."""
        firsts = {id(u) for order in self._order if order for u in order[0].units}
        return {id(u) for order in self._order for use in order or [] for u in use.units} - firsts

    @torch.no_grad()
    def _early_step(self, unit: Unit) -> None:
        """Step the unit's optimizer shard now, on copies, assuming the step's gradient factor is the unscale alone
        (no clip), and gather the updated weights across nodes into the hpZ secondary shards while backward goes
        on: the gather the next forward's first use would make from the primary shards, the same bits (``step``
        then computes the same AdamW on the same inputs in place). ``clip`` decides: the factor it finds is the
        assumed one (the clip did not bite, nothing overflowed), and ``step`` keeps the secondary copies
        (counted when a forward uses them, as the gathers the step starts); else ``_discard_early``. The unit's
        backward is over (its gradient shard is final), so nothing of this step reads its secondary shard again.
        Holds no gathered buffer: qwZ's quantized pieces of the node's slice are dequantized straight into the
        secondary shard (the quantized send and receive buffers, uncounted as every qwZ gather's)."""
        lr, factor = self._plan
        t = self.cfg.train
        master, m, v = unit.master.clone(), unit.exp_avg.clone(), unit.exp_avg_sq.clone()
        adamw_step(master, unit.grad_shard.float() * factor, m, v, unit.decay, self.optimizer_steps + 1, lr,
                   t.beta1, t.beta2, t.eps, t.weight_decay)
        del m, v
        shard = master if self.compute_dtype == torch.float32 else master.to(self.compute_dtype)
        per = self.mesh.dp.size // self.hpz.size  # this rank's hpZ slice: the whole pieces of ``per`` DP ranks
        rows = (self.hpz.rank * per, (self.hpz.rank + 1) * per)
        with self.mesh.ledger.deferred() as held:
            work = QuantizedGather(unit.secondary, shard, self.mesh.dp, self.qwz, self.gather_route, rows=rows)
        self._early[id(unit)] = [unit, work, held]
        self._poll()

    def _settle_early(self, unit: Unit) -> None:
        """Wait for the unit's early gather, if it is still in flight (its secondary shard is then whole)."""
        if not self.early:
            return
        landing = self._landing.pop(id(unit), None)
        if landing is not None:
            landing[1].wait()
        early = self._early.get(id(unit))  # (the optimizer step keeps it and starts the unit's gather)
        if early is not None and early[1] is not None:
            early[1].wait()
            early[1] = None

    def _discard_early(self) -> None:
        """The step's factor is not the assumed one: the early gathers (waited for: every rank is in them) never
        happened as far as the model is concerned; their secondary shards hold weights no step made, so the next
        forward gathers from the primary shards as after any step; their bytes are not counted (none used)."""
        self.early_discarded += bool(self._early)
        for unit, work, _ in self._early.values():
            if work is not None:
                work.wait()
            unit.secondary_valid = unit.secondary_unmeasured = False
        self._early.clear()
