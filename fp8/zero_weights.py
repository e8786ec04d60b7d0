"""FP8-LM's weights (``Fp8DataParallel``'s part, a mixin of ``fp8/zero.py``'s strategy): the E4M3 weights refreshed
from the masters after each step (stages 1-2 all-gather them with their scales), the 16-bit working weights
materialised before a module runs and released after (stage 0 from the masters, kept from one step to the next;
stages 1-2 from the persistent E4M3 copy; stage 3 by the FP8 all-gather, inside the node with hpZ), and at stage 0
the FP8 linears' E4M3 operands cast straight from the masters (no 16-bit copy of those weights)."""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterator, List, Tuple

import torch

from fp8.format import E4M3, amax, quantize, scale_from_amax
from fp8.scaling import Fp8States
from fp8.zero_unit import Fp8Unit, _Gather
from parallel import comm


class Fp8Weights:
    """Weight calls of ``Fp8DataParallel`` (its units, stage, mesh, hpZ group and working-bytes count)."""

    @torch.no_grad()
    def _refresh_weights(self) -> None:
        """Stage 0: the 16-bit working weights from the masters (kept until the next step). Stages 1-3: E4M3 weights
        from the masters; stages 1-2 all-gather them with their scales."""
        for u in self.units:
            u.secondary_valid = False
            if self.stage == 0:
                self._materialize(u)
                continue
            for i in u.owned:
                value = u.master_value(i)
                s = scale_from_amax(amax(value), E4M3)
                a, b = u.compact[i] if self.stage in (1, 2) else u.where[i]
                u.w8[a:b] = quantize(value, s, E4M3)
                u.w8_scale[i] = s
            if self.stage in (1, 2):
                data, scales = self._all_gather_weights(u)
                u.w8.view(torch.uint8).copy_(data)
                u.w8_scale.copy_(scales)

    def _payload(self, u: Fp8Unit) -> torch.Tensor:
        """This rank's shard of E4M3 bytes (layout positions, zero padding) with the unit's fp32 scales appended
        (its own tensors' entries are the ones read): what a weight gather moves."""
        out = torch.zeros(u.S + 4 * u.T, dtype=torch.uint8, device=u.master.device)
        base = u.rank * u.S
        for i in u.owned:
            lo, hi = u.bounds[i]
            a, b = u.compact[i] if self.stage in (1, 2) else u.where[i]
            out[lo - base:hi - base] = u.w8[a:b].view(torch.uint8)
        out[u.S:] = u.w8_scale.view(torch.uint8)
        return out

    def _unpack(self, u: Fp8Unit, out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Compact E4M3 bytes and per-tensor scales (each from its owner's row) of a gathered payload."""
        rows = out.view(u.N, u.S + 4 * u.T)
        flat = rows[:, :u.S].reshape(-1)
        data = torch.cat([flat[a:b] for a, b in u.bounds]) if u.T > 1 else flat[u.bounds[0][0]:u.bounds[0][1]]
        table = rows[:, u.S:].contiguous().view(torch.float32)  # [N, T]
        owners = torch.tensor([u.layout.owner(i) for i in range(u.T)], device=out.device)
        return data, table[owners, torch.arange(u.T, device=out.device)]

    def _all_gather_weights(self, u: Fp8Unit, async_op: bool = False):
        payload = self._payload(u)
        out = torch.empty(u.N * payload.numel(), dtype=torch.uint8, device=payload.device)
        work = comm.all_gather(out, payload, u.group, async_op=async_op)
        if async_op:
            return _Gather(u, work, out, partial(self._unpack, u))
        return self._unpack(u, out)

    # -- working weights: materialise before use, release after ----------------------------------------
    def _materialize(self, unit: Fp8Unit) -> None:
        """Stage 0: the unit's 16-bit working weights from its masters (every rank holds every master). Done once per
        optimizer step (``_refresh_weights``) and kept until the next: every forward and backward of the step's
        micro-batches reads the same values, so dequantizing them per module use (twice per micro-batch) would
        only repeat the same work."""
        if not unit.gathered:
            unit.full.untyped_storage().resize_(unit.full_bytes)
            self.working.add(unit.full_bytes)
            unit.gathered = True
        if not unit.packed:
            for i, (a, b) in unit.full_at.items():
                unit.full[a:b] = unit.master_value(i).to(unit.full.dtype)
        elif len(unit.kept) < unit.T:  # the tensors that keep a working copy (norms, biases, embedding): gathered
            pk = unit.packing()
            master = unit.master[pk["kept_elements"]]
            if unit.master.dtype == torch.float32:
                unit.full.copy_(master)
            else:
                self._materialize_packed(unit.full, master, unit.master_scale[pk["kept_index"]], pk["kept"])
        elif unit.master.dtype == torch.float32:  # packed: owned = all, where = compact (back to back)
            unit.full.copy_(unit.master)
        else:
            self._materialize_packed(unit.full, unit.master, unit.master_scale, unit.packing()["owned"])

    @contextlib.contextmanager
    @torch.no_grad()
    def full_weights(self) -> Iterator[None]:
        """Within: every parameter holds its 16-bit value, also the stage-0 weights that keep no working copy (given
        theirs from the masters, the values ``_materialize`` would write; released at the exit). For code that
        reads ``param.data`` outside the forward (inspection, export, tests); the forward needs none of it."""
        given = []
        for u in self.units:
            for i in range(u.T):
                if i not in u.full_at:
                    p = u.params[i]
                    p.data = u.master_value(i).to(u.full.dtype).view(p.shape)
                    given.append((u, p))
        try:
            yield
        finally:
            for u, p in given:
                p.data = u.placeholder.expand(p.shape)

    def _weight_source(self, states: Fp8States, pieces: List[Tuple[Fp8Unit, int]]):
        """Stage 0: an FP8 linear's E4M3 weight operand from its masters (``Fp8States.weight_source``): the 16-bit
        weight ``_materialize`` would have written (the layer's operand rows, GroupedQKVLinear's pieces concatenated),
        made for the cast and dropped after it, cast by ``ScaleState.cast``."""
        dtype = self.compute_dtype
        cols = pieces[0][0].params[pieces[0][1]].shape[-1]

        @torch.no_grad()
        def source(tp, record: bool) -> Tuple[torch.Tensor, torch.Tensor]:
            parts = [unit.master_value(i).to(dtype).view(-1, cols) for unit, i in pieces]
            return states.weight.cast(parts[0] if len(parts) == 1 else torch.cat(parts), tp, record=record)

        return source

    def make_weight_copies(self, record: bool) -> None:
        """``Fp8Scaling.step_copies``' work at stage 0: every sourced FP8 linear's E4M3 operand for the step (or the
        validation), in a fixed order on every rank. Under train.compile a unit's one-piece layers whose delayed
        scales are set are cast together, one compiled call a unit (``cast_unit_from_masters``: each the operations
        of ``ScaleState.cast`` of its 16-bit weight, so the same bits; 24 calls a step at gpt_1.3b instead of 96, each
        of which costs host time while the device waits at the step's start); the others by their
        ``weight_source`` (the first step's just-in-time scales reduce over TP and DP: eager)."""
        tp = self.mesh.tp
        for unit, entries in self._copy_groups:
            fast, slow = [], []
            for st, i in entries:
                ready = st.weight.cfg.scaling == "delayed" and st.weight._ready
                on_device = st.weight.scale.device == unit.master.device
                (fast if self._cast_unit is not None and ready and on_device else slow).append((st, i))
            if fast:
                fp16 = unit.master.dtype != torch.float32
                outs = self._cast_unit([unit.master[unit.where[i][0]:unit.where[i][1]] for _, i in fast],
                                       [unit.master_scale[i] if fp16 else None for _, i in fast],
                                       [st.weight.scale for st, _ in fast], [st.weight.pending for st, _ in fast],
                                       record, self.compute_dtype)
                for (st, i), (q, s) in zip(fast, outs):
                    p = unit.params[i]
                    st.weight_copy = (q.view(-1, p.shape[-1]), s)
            for st, _ in slow:
                st.weight_copy = st.weight_source(tp, record)
        for st in self._copy_others:
            st.weight_copy = st.weight_source(tp, record)

    def _start_gather(self, unit: Fp8Unit) -> None:
        if unit.gathered or unit.gather_work is not None:
            return
        unit.full.untyped_storage().resize_(unit.full_bytes)
        self.working.add(unit.full_bytes)
        with torch.no_grad():
            if self.stage in (1, 2):  # the persistent E4M3 copy
                unit.set_weights(unit.w8, unit.w8_scale)
                unit.gathered = True
            elif unit.secondary_valid:  # hpZ: inside the node
                group, n = self.hpz, unit.secondary.numel()
                payload = torch.cat([unit.secondary, unit.secondary_scale.view(torch.uint8)])
                out = torch.empty(group.size * payload.numel(), dtype=torch.uint8, device=payload.device)
                work = comm.all_gather(out, payload, group, async_op=True)

                def unpack(out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
                    rows = out.view(group.size, -1)
                    return rows[:, :n].reshape(-1)[:unit.numel], rows[0, n:].contiguous().view(torch.float32)

                unit.gather_work = _Gather(unit, work, out, unpack)
            else:  # stage 3: every rank's E4M3 shard with its scales
                unit.gather_work = self._all_gather_weights(unit, async_op=True)

    def _keep_secondary(self, unit: Fp8Unit) -> None:
        """hpZ: keep this rank's slice of the gathered E4M3 bytes (the bytes, not bf16 values dequantized from
        them, so every later gather inside the node gives exactly what the first one gave)."""
        if unit.gathered8 is None:
            raise RuntimeError(f"hpZ: unit {unit.name} has no gathered FP8 weights to keep")
        n = unit.secondary.numel()
        piece = unit.gathered8[self.hpz.rank * n:(self.hpz.rank + 1) * n]
        unit.secondary.zero_()
        unit.secondary[:piece.numel()] = piece

    def _release(self, unit: Fp8Unit) -> None:
        if self.stage == 0:  # kept from one optimizer step to the next (_materialize)
            return
        super()._release(unit)
        unit.gathered8 = None
