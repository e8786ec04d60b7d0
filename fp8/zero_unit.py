"""One unit's FP8-LM state on one rank (``Fp8Unit``: masters, moments, FP8 gradients and weights, the working
buffers), the owners of its whole tensors (``OwnerBalance``), and the whole-unit (packed) operations the strategy
of ``fp8/zero.py`` runs on it: the FP8 AdamW update read from the FP8 gradients, the norm's sum of squares, the
working weights from the masters, each compiled under ``train.compile``."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fp8 import adam
from fp8.format import E4M3, amax, dequantize, quantize
from fp8.segments import Segments
from model.compile import backend as compile_backend
from parallel.mesh import Mesh
from parallel.optim_rules import owns_gradient, weight_decay_exempt
from parallel.zero.partition import shard_layout
from parallel.zero.sharded import Working
from parallel.zero.units import UnitSpec

MASTER_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}


class OwnerBalance:
    """Owners of whole tensors across a stage's units: each unit's ``whole_tensor`` layout (largest tensor
    first, to the least-loaded rank) starts its ties at the rank that owns the fewest elements so far, so
    one-tensor units (embedding, head) land on different ranks. Deterministic from the shapes: every rank,
    and the estimator (``training/memory.py``), computes the same owners."""

    def __init__(self, world: int):
        self.load = [0] * world

    def layout(self, numels: Sequence[int]):
        world = len(self.load)
        first = min(range(world), key=lambda r: (self.load[r], r))
        lay = shard_layout(numels, world, "whole_tensor", first=first)
        for r in range(world):
            self.load[r] += sum(b - a for _, a, b, _ in lay.owned(r))
        return lay


class Fp8Unit:
    """One unit's FP8-LM state on this rank (see the module docstring for what lives where).

    Three coordinate systems: ``bounds`` place tensors in the reduction/gather layout (N shards of S,
    padded; N the size of ``group``), ``where`` in this rank's packed state buffers (owned tensors back to
    back, no padding), and ``compact`` in the unit's working buffers (all tensors back to back)."""

    def __init__(self, spec: UnitSpec, owners: Dict[int, "OwnerBalance"], names: Dict[nn.Parameter, str],
                 mesh: Mesh, stage: int, master_dtype: torch.dtype, working: Working, hpz: int, packed: bool = False,
                 acc_dtype: torch.dtype = torch.bfloat16, work_dtype: torch.dtype = torch.bfloat16,
                 sourced: Sequence[nn.Parameter] = ()):
        self.name, self.params, self.stage, self.working = spec.name, spec.params, stage, working
        self.packed = packed  # whole-unit operations (see packed_updates)
        self.names = [names[p] for p in self.params]
        device = mesh.device
        # the ranks it is reduced and sharded over, as ZeRO's Unit.group: DP, or for routed experts split over EP
        # (a unit of their own, parallel/zero/units.py) their expert-data-parallel group, the DP ranks holding the
        # same experts; their gradients are still the mean over the whole DP group (Fp8DataParallel._reduce)
        self.expert = any(p.spec.expert for p in self.params)
        self.group = group = mesh.edp if self.expert else mesh.dp
        numels = [p.numel() for p in self.params]
        # stage 0 reduces over a flat layout (the shared scale makes any split valid); stages 1-3 own whole
        # tensors, spread over the group's ranks across the units of that group size (OwnerBalance)
        if stage == 0:
            self.layout = shard_layout(numels, group.size, "flat")
        else:
            self.layout = owners.setdefault(group.size, OwnerBalance(group.size)).layout(numels)
        self.S, self.T, self.N, self.rank = self.layout.shard_size, len(self.params), group.size, group.rank
        self.bounds = [(off, off + n) for n, off in zip(numels, self.layout.offsets)]
        at = [0]
        for n in numels:
            at.append(at[-1] + n)
        self.compact = [(at[i], at[i + 1]) for i in range(self.T)]
        self.numel = at[-1]
        self.owned = list(range(self.T)) if stage == 0 else [i for i, _, _, _ in self.layout.owned(self.rank)]
        self.where: Dict[int, Tuple[int, int]] = {}
        k = 0
        for i in self.owned:
            self.where[i] = (k, k + numels[i])
            k += numels[i]
        self.extent = k
        self.decay = {i: not weight_decay_exempt(self.names[i], self.params[i]) for i in self.owned}
        self.in_norm = {i: owns_gradient(self.params[i], mesh.tp_rank) for i in self.owned}
        self.sp = [i for i, p in enumerate(self.params) if p.spec.sequence_parallel]
        # optimizer state of the owned tensors, masters from the initial values
        self.master = torch.zeros(self.extent, dtype=master_dtype, device=device)
        self.m = torch.zeros(self.extent, dtype=E4M3, device=device)
        self.v = torch.zeros(self.extent, dtype=torch.float16, device=device)
        self.master_scale = torch.ones(self.T, dtype=torch.float32, device=device)
        self.m_scale = torch.ones_like(self.master_scale)
        self.v_scale = torch.ones_like(self.master_scale)
        with torch.no_grad():
            for i in self.owned:
                a, b = self.where[i]
                adam.set_master(self.master[a:b], self.master_scale[i], self.params[i].detach().flatten().float())
        # reduced FP8 gradients of the owned tensors (raw bytes), their scales N * s'_g
        self.grad8 = torch.zeros(self.extent, dtype=torch.uint8, device=device)
        self.grad_scale = torch.ones_like(self.master_scale)
        self.grad_acc: Optional[torch.Tensor] = None  # working accumulation during backward (fp8.grad_accumulation)
        self.acc_dtype = acc_dtype
        self.grad_views: Optional[List[torch.Tensor]] = None  # each parameter's view of it
        # E4M3 weights: stages 1-2 every tensor (compact), stage 3 the owned ones (packed)
        self.w8 = torch.zeros(self.numel if stage in (1, 2) else self.extent if stage == 3 else 0, dtype=E4M3,
                              device=device)
        self.w8_scale = torch.ones_like(self.master_scale)
        # hpZ (stage 3): slice h of the unit's gathered E4M3 bytes (compact), and every tensor's scale
        self.hpz = hpz
        self.secondary = (torch.zeros(-(-self.numel // hpz), dtype=torch.uint8, device=device) if hpz > 1 else None)
        self.secondary_scale = torch.ones_like(self.master_scale) if hpz > 1 else None
        self.secondary_valid = False
        self.gathered8: Optional[torch.Tensor] = None  # the E4M3 bytes of the last gather, until release
        # the compute working weights (bf16, or fp16 with fp16 GEMMs), materialised on demand: every tensor's, except
        # at stage 0 the weights only FP8 GEMMs read (``sourced``: their E4M3 operands come from the masters, see
        # Fp8DataParallel._weight_source), which keep their shape and gradient but hold one NaN, expanded (reading
        # one gives NaN, writing fails; ``Fp8DataParallel.full_weights`` gives them their values on demand)
        sourced = {id(p) for p in sourced}
        self.kept = [i for i, p in enumerate(self.params) if id(p) not in sourced]
        self.full_at: Dict[int, Tuple[int, int]] = {}
        k = 0
        for i in self.kept:
            self.full_at[i] = (k, k + numels[i])
            k += numels[i]
        self.full = torch.zeros(k, dtype=work_dtype, device=device)
        self.placeholder = torch.full((1,), float("nan"), dtype=work_dtype, device=device)
        for i, p in enumerate(self.params):
            if i in self.full_at:
                p.data = self.full[self.full_at[i][0]:self.full_at[i][1]].view(p.shape)
            else:
                p.data = self.placeholder.expand(p.shape)
        self.full.untyped_storage().resize_(0)
        self.gathered, self.gather_work = False, None
        self.ledger_held = None  # (parallel/zero/sharded.py: records of a gather an optimizer step started)
        self.arrived, self.reduced, self.tied = 0, False, False

    @property
    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()

    def packing(self) -> Dict[str, object]:
        """What the whole-unit (packed) operations need, built once (``fp8/segments.py``): the owned tensors as
        segments (their ``where`` ranges lie back to back from 0), their indices among the unit's T, whether
        each takes weight decay and whether it counts in the norm (device tensors); every tensor as segments
        in compact order (``full``, ``w8`` at stages 1-2)."""
        if getattr(self, "_packing", None) is None:
            device = self.master.device
            as_tensor = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
            self._packing = {
                "owned": Segments([self.where[i][1] - self.where[i][0] for i in self.owned], device),
                "index": as_tensor(self.owned, torch.int64),
                "decay": as_tensor([bool(self.decay[i]) for i in self.owned], torch.bool),
                "in_norm": as_tensor([bool(self.in_norm[i]) for i in self.owned], torch.bool),
                "all_owned": list(self.owned) == list(range(len(self.params))),
                "compact": Segments([b - a for a, b in self.compact], device)}
            if len(self.kept) < len(self.params):  # stage 0 without the sourced weights: where their masters lie
                where = [torch.arange(*self.where[i], device=device) for i in self.kept]
                self._packing["kept_elements"] = torch.cat(where) if where else torch.zeros(0, dtype=torch.int64,
                                                                                           device=device)
                self._packing["kept_index"] = as_tensor(self.kept, torch.int64)
                self._packing["kept"] = Segments([b - a for a, b in self.full_at.values()], device)
        return self._packing

    def master_value(self, i: int) -> torch.Tensor:
        a, b = self.where[i]
        return adam.master_value(self.master[a:b], self.master_scale[i])

    def grad_view(self, i: int) -> torch.Tensor:
        """Tensor i's piece of the gradient accumulation buffer (``fp8.grad_accumulation``'s dtype; allocated, with
        every tensor's view, at the first gradient of a step)."""
        if self.grad_acc is None:
            self.grad_acc = torch.zeros(self.numel, dtype=self.acc_dtype, device=self.full.device)
            self.working.add(self.grad_acc.numel() * self.grad_acc.element_size())
            self.grad_views = [self.grad_acc[a:b].view(p.shape) for p, (a, b) in zip(self.params, self.compact)]
        return self.grad_views[i]

    def set_weights(self, data: torch.Tensor, scales: torch.Tensor) -> None:
        """Dequantize every tensor's E4M3 bytes (compact order) into the 16-bit working buffer (packed: one pass,
        each element divided by its tensor's scale)."""
        if not self.packed:
            for i, (a, b) in enumerate(self.compact):
                self.full[a:b] = dequantize(data[a:b].view(E4M3), scales[i], self.full.dtype)
            return
        per_element = self.packing()["compact"].spread(scales)
        self.full.copy_(dequantize(data[:self.numel].view(E4M3), per_element, self.full.dtype))


class _Gather:
    """An FP8 weight all-gather in flight; ``wait`` unpacks the gathered rows into compact E4M3 bytes and
    their scales (``unpack``) and dequantizes them into the working weights."""

    def __init__(self, unit: Fp8Unit, work, out: torch.Tensor, unpack):
        self.unit, self.work, self.out, self.unpack = unit, work, out, unpack

    def wait(self) -> None:
        self.work.wait()
        data, scales = self.unpack(self.out)
        u = self.unit
        u.set_weights(data, scales)
        if u.secondary is not None and not u.secondary_valid:
            u.gathered8 = data
            u.secondary_scale.copy_(scales)


def dequantize_segments(q: torch.Tensor, scales: torch.Tensor, segments: Segments) -> torch.Tensor:
    """fp32 values of T tensors stored back to back in ``q``, each read with its scale: ``q / scale``."""
    return dequantize(q, segments.spread(scales))


def unit_update(grad8: torch.Tensor, grad_scales: torch.Tensor, factor: torch.Tensor, master: torch.Tensor,
                master_scales: Optional[torch.Tensor], m: torch.Tensor, m_scales: torch.Tensor, v: torch.Tensor,
                v_scales: torch.Tensor, segments: Segments, decays: torch.Tensor, scalars: torch.Tensor,
                **hyper) -> None:
    """One unit's AdamW step from its reduced FP8 gradients: ``grad = dequantize(grad8) * factor`` (the clipping
    and mu factor), then ``adam.adamw_update_segments``. One function, so that compiled (``train.compile``) the
    gradient is read as FP8 inside the update's kernel instead of written in fp32 and read back.

    The step's scalars come made (``Fp8DataParallel.step``), as fp32 device tensors (a Python float would be a
    constant of a compiled graph): ``factor`` 0-dim; ``scalars`` [3]: the step size, ``sqrt(bc2)`` and the
    decoupled decay factor ``1 - lr * wd`` of the tensors that take decay (``decays`` bool [T]; the others keep
    exactly 1)."""
    grad = dequantize_segments(grad8, grad_scales, segments) * factor
    keep = torch.where(decays, scalars[2], torch.ones_like(scalars[2]))
    adam.adamw_update_segments(master, master_scales, m, m_scales, v, v_scales, grad, segments, keep,
                               step_size=scalars[0], bc2_sqrt=scalars[1], **hyper)


def unit_square_sum(grad8: torch.Tensor, grad_scales: torch.Tensor, segments: Segments,
                    in_norm: torch.Tensor) -> torch.Tensor:
    """The sum of squares of a unit's reduced gradients over the tensors that count in the norm (per tensor first,
    as the per-tensor loop adds them up)."""
    per_tensor = segments.sum(dequantize_segments(grad8, grad_scales, segments).square())
    return torch.where(in_norm, per_tensor, torch.zeros_like(per_tensor)).sum()


def materialize_packed(full: torch.Tensor, master: torch.Tensor, master_scales: torch.Tensor,
                       segments: Segments) -> None:
    """Stage 0's working weights (``full``, 16-bit) from a unit's scaled FP16 masters, written in place."""
    full.copy_(dequantize(master, segments.spread(master_scales), full.dtype))


def cast_from_master(master: torch.Tensor, master_scale: Optional[torch.Tensor], scale: torch.Tensor,
                     pending: torch.Tensor, record: bool, work_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """An FP8 linear's E4M3 weight operand straight from its master (stage 0, delayed scaling with its scale set): the
    16-bit value the working weight would have held (``q / master_scale`` rounded to ``work_dtype``), its amax into
    ``pending`` (where ``record``), and its cast with a copy of ``scale``: ``ScaleState.cast`` of that weight, the
    same operations, so the same bits, without a 16-bit copy in memory (compiled: one pass over the master)."""
    x = (master if master_scale is None else dequantize(master, master_scale, torch.float32)).to(work_dtype)
    if record:
        pending.copy_(torch.maximum(pending, amax(x)))
    s = scale.clone()
    return quantize(x, s, E4M3), s


def cast_unit_from_masters(masters: List[torch.Tensor], master_scales: List[Optional[torch.Tensor]],
                           scales: List[torch.Tensor], pendings: List[torch.Tensor], record: bool,
                           work_dtype: torch.dtype) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``cast_from_master`` of each of a unit's FP8 linear weights: one function, so that compiled it is one call."""
    return [cast_from_master(m, ms, s, p, record, work_dtype) for m, ms, s, p in zip(masters, master_scales, scales,
                                                                                      pendings)]


def _compiled_without_grad(fn, exact_casts: bool = False):
    """``fn`` through torch.compile, always entered with autograd off: these whole-unit operations are called
    from autograd hooks and from the step alike, and a compiled function is guarded on the grad mode it was
    entered with (each mode was a recompilation of each kind of unit: dequantize_segments reached torch's limit
    of 8 on gpt_1.3b and ran eager from then on).

    ``exact_casts``: inductor keeps a value cast to a 16-bit dtype inside a fused kernel at fp32 unless told to
    round it (``emulate_precision_casts``): ``cast_from_master``'s bf16 rounding before the E4M3 cast was dropped
    (on CPU 2,035 of 65,536 E4M3 bytes of a weight differed from eager's), so it compiles with the rounding kept."""
    name = compile_backend()
    options = {"emulate_precision_casts": True} if exact_casts and name == "inductor" else None
    compiled = torch.compile(fn, backend=name, options=options)

    def run(*args, **kwargs):
        with torch.no_grad():
            return compiled(*args, **kwargs)

    return run


def packed_updates(device: torch.device) -> bool:
    """Whether a unit's tensors are updated together (packed) or one by one; the same bits either way (tested).

    Packed on CUDA, where the per-tensor loops' hundreds of small kernels are what an FP8 step spends its
    time on; one by one on CPU, where they are cheap and the packed form's buffer-sized temporaries (each
    tensor's scale spread over its elements) cost more than they save. ``FP8_PACKED=1`` / ``=0`` forces
    either (tests run the packed path on CPU with it)."""
    forced = os.environ.get("FP8_PACKED")
    if forced not in (None, "", "0", "1"):
        raise ValueError(f"FP8_PACKED must be 0 or 1, got {forced!r}")
    return forced == "1" if forced else torch.device(device).type == "cuda"
