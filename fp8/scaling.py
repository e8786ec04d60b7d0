"""Per-tensor scaling state of the FP8 GEMM operands (SPEC §4, FP8-LM; ``fp8/format.py``'s convention).

Every FP8 linear layer has three operand roles, each with its own :class:`ScaleState`:

  input   the activation x        E4M3
  weight  the weight W            E4M3
  grad    the output gradient dy  ``fp8.gradient_format`` (E5M2 by default, "hybrid" FP8)

A cast is ``q = quantize(x, scale, dtype)`` (saturating, ``x ≈ q / scale``).

Scaling modes (``fp8.scaling``):

* ``delayed``: a cast uses the scale computed at the last :meth:`Fp8Scaling.update` and only records
  ``amax(x)`` (max over the casts since that update) in ``pending``. Once per optimizer step,
  ``Fp8Scaling.update()`` reduces the pending amaxes of every role of every linear with ONE MAX
  all-reduce over the TP group and then ONE over the DP group (one stacked fp32 vector: exactly two
  collectives a step, ``4 bytes x 3 roles x linears`` on each group), pushes the result into each
  role's amax history (``amax_history[0]`` is the newest) and sets
  ``scale = scale_from_amax(max(history) | history[0], dtype, margin, power_of_two, previous=scale)``.
  The very first cast of a role (``initialized`` false) has no history: it computes its scale
  just in time from ``amax(x)`` MAX-reduced over TP and then over DP (the group given to
  :class:`Fp8Scaling`), so every TP and DP rank of a stage starts from one scale; that amax also
  goes into ``pending``.
* ``current``: each cast computes its scale from the tensor itself: ``amax(x)`` MAX-reduced over the
  TP group (one all-reduce per cast), then ``scale_from_amax``; the scale is also stored in ``scale``
  (it is the fallback when a later amax is zero or not finite). DP ranks may differ; TP ranks agree.

Why TP: under sequence parallelism each TP rank casts its own sequence slice of the activation and
the FP8 bytes are then all-gathered (FP8-LM §2.3); a gathered tensor has one scale, so every rank
must have cast with the same scale. Both modes guarantee that: delayed scales are identical on every
TP (and DP) rank because every input to them was reduced over both groups; current scales use the
TP-reduced amax. TP-sharded weights likewise get one scale for the whole logical tensor.

Bad amaxes: an amax that is zero, inf or NaN keeps the previous scale (``scale_from_amax``). Under
delayed scaling a non-finite reduced amax is entered into the history as 0 (no information), so one
bad step does not freeze the scale for ``amax_history_len`` steps; the scale of that step is the
previous one.

Checkpointing: :meth:`Fp8Scaling.state_dict` holds every state tensor (scale, amax_history, pending,
initialized) by a name that does not depend on the pipeline layout (the module's global path in the
model, ``layers.3.attn.qkv``, which is the weight's global parameter name without ``.weight``), so a
resumed run repeats the same scales bit for bit. Under delayed scaling these tensors are identical on
every TP and DP rank of a stage; under current scaling only ``scale`` matters and it is per DP rank
(it is a fallback only).

The state tensors are plain tensors, not module buffers: ``module.double()`` / ``.to(bf16)`` must not
change their dtype, and the model's own ``state_dict`` stays parameters only. They follow the device of
the tensors cast (moved on first use, and by :meth:`Fp8Scaling.attach` to the weight's device).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from config import Fp8Config
from fp8.format import E4M3, FORMATS, amax, format_max, quantize, scale_from_amax
from kernels import fp8_transpose
from parallel import comm
from parallel.comm import Group

ROLES = ("input", "weight", "grad")
FORMAT_NAMES = {dtype: name for name, dtype in FORMATS.items()}
FIELDS = ("scale", "amax_history", "pending", "initialized")
SCALINGS = ("delayed", "current")
AMAX_COMPUTES = ("max", "most_recent")


def role_dtype(cfg: Fp8Config, role: str) -> torch.dtype:
    """E4M3 for activations and weights, ``fp8.gradient_format`` for output gradients."""
    if role in ("input", "weight"):
        return E4M3
    if role == "grad":
        if cfg.gradient_format not in FORMATS:
            raise ValueError(f"fp8.gradient_format must be one of {sorted(FORMATS)}, got {cfg.gradient_format!r}")
        return FORMATS[cfg.gradient_format]
    raise ValueError(f"unknown FP8 operand role {role!r} (expected one of {ROLES})")


def _check_cfg(cfg: Fp8Config) -> None:
    if cfg.scaling not in SCALINGS:
        raise ValueError(f"fp8.scaling must be one of {SCALINGS}, got {cfg.scaling!r}")
    if cfg.amax_compute not in AMAX_COMPUTES:
        raise ValueError(f"fp8.amax_compute must be one of {AMAX_COMPUTES}, got {cfg.amax_compute!r}")
    if cfg.amax_history_len < 1:
        raise ValueError(f"fp8.amax_history_len must be >= 1, got {cfg.amax_history_len}")


def _max_reduce(a: torch.Tensor, group: Optional[Group]) -> torch.Tensor:
    """In-place MAX all-reduce of a small fp32 tensor (a group of one, or None, costs nothing)."""
    if group is not None and group.size > 1:
        comm.all_reduce(a, group, op="max")
    return a


class ScaleState:
    """Scaling state of one operand role of one FP8 linear layer (see the module docstring)."""

    def __init__(self, cfg: Fp8Config, role: str, device: Optional[torch.device] = None):
        _check_cfg(cfg)
        self.cfg, self.role = cfg, role
        self.dtype = role_dtype(cfg, role)
        self.dp: Optional[Group] = None
        """Data-parallel group of the just-in-time init (set by :meth:`Fp8Scaling.attach`)."""
        device = torch.device("cpu") if device is None else device
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(cfg.amax_history_len, dtype=torch.float32, device=device)
        self.pending = torch.zeros((), dtype=torch.float32, device=device)
        self.initialized = torch.zeros((), dtype=torch.bool, device=device)
        self._ready = False
        """Host-side copy of ``initialized`` once it is true (no device sync per cast)."""

    # -- plumbing ---------------------------------------------------------------------------------

    def tensors(self) -> Dict[str, torch.Tensor]:
        return {f: getattr(self, f) for f in FIELDS}

    def to(self, device: torch.device) -> "ScaleState":
        for f in FIELDS:
            setattr(self, f, getattr(self, f).to(device))
        return self

    def _scale_from(self, a: torch.Tensor) -> torch.Tensor:
        return scale_from_amax(a, self.dtype, self.cfg.margin, self.cfg.power_of_two_scales, previous=self.scale)

    # -- the cast ---------------------------------------------------------------------------------

    def cast(self, x: torch.Tensor, tp: Group, record: bool = True,
             transposed: bool = False) -> Tuple[torch.Tensor, ...]:
        """``(q, scale)``: ``q = quantize(x, scale, self.dtype)`` and a copy of the scale used (0-dim fp32).
        ``transposed`` (x 2-D): ``(q, qT, scale)``, qT the transpose of q (contiguous), both made in one pass by
        ``kernels/fp8_transpose.cast_transpose``.
        ``record=False`` (forward-only passes such as validation): delayed scaling does not fold this amax
        into the next update, so evaluating never changes the training run's scales.

        Collective on ``tp`` under current scaling (every cast) and on the first, just-in-time,
        cast under delayed scaling (then over ``tp`` and the DP group): every member must cast too."""
        if self.scale.device != x.device:
            self.to(x.device)
        with torch.no_grad():
            a = amax(x).reshape(1)
            if self.cfg.scaling == "current":
                _max_reduce(a, tp)
                self.scale.copy_(self._scale_from(a[0]))
                self.initialized.fill_(True)
            else:
                if not self._ready:  # a Python flag: no device sync, and nothing for a compiled graph to do
                    if not bool(self.initialized):
                        _max_reduce(a, tp)
                        _max_reduce(a, self.dp)
                        self.scale.copy_(self._scale_from(a[0]))
                        self.initialized.fill_(True)
                    self._ready = True
                # torch.maximum propagates NaN: a broken tensor is seen by the next update
                if record:
                    self.pending.copy_(torch.maximum(self.pending, a[0]))
            scale = self.scale.clone()
            if transposed:
                q, qt = fp8_transpose.cast_transpose(x.contiguous(), scale, FORMAT_NAMES[self.dtype])
                return q, qt, scale
            return quantize(x, scale, self.dtype), scale

    # -- delayed scaling --------------------------------------------------------------------------

    def _advance(self, reduced: torch.Tensor) -> None:
        """One update with the step's amax reduced over TP and DP (delayed scaling)."""
        ok = torch.isfinite(reduced)
        hist = torch.roll(self.amax_history, 1)
        hist[0] = torch.where(ok, reduced, torch.zeros_like(reduced))
        self.amax_history.copy_(hist)
        a = hist.max() if self.cfg.amax_compute == "max" else hist[0]
        self.scale.copy_(torch.where(ok, self._scale_from(a), self.scale))
        self.pending.zero_()


class Fp8States:
    """The three operand roles of one FP8 linear layer: ``.input``, ``.weight``, ``.grad``."""

    def __init__(self, cfg: Fp8Config, device: Optional[torch.device] = None):
        self.cfg = cfg
        self.input = ScaleState(cfg, "input", device)
        self.weight = ScaleState(cfg, "weight", device)
        self.grad = ScaleState(cfg, "grad", device)
        self.keep_weight = False
        """Within a training step (``Fp8Scaling.step_copies``): the weight's first cast is kept and reused."""
        self.weight_copy: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.weight_source: Optional[Callable[[Group, bool], Tuple[torch.Tensor, torch.Tensor]]] = None
        """Set where no 16-bit copy of the weight is kept (FP8-LM at ZeRO stage 0, ``fp8/zero.py``): makes the E4M3
        operand and its scale from the master weights, ``(tp, record) -> (q, scale)``, with the very roundings and
        scale rules of a cast of the 16-bit weight (``ScaleState.cast``). The layer's weight parameter then holds
        no data (its shape and gradient only)."""

    def weight_operand(self, weight: torch.Tensor, tp: Group, record: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """The weight's E4M3 cast and its scale: the step's copy when one is kept (the weights change only at the
        optimizer step, so every micro-batch's cast is the first one's, bit for bit, and so is the amax it records
        under delayed scaling), else a fresh cast (from the masters where the weight holds no data)."""
        if self.weight_copy is not None:
            return self.weight_copy
        if self.weight_source is not None:
            q, s = self.weight_source(tp, record)
        else:
            q, s = self.weight.cast(weight, tp, record=record)
        if self.keep_weight:
            self.weight_copy = (q, s)
        return q, s

    def roles(self) -> Iterator[Tuple[str, ScaleState]]:
        for r in ROLES:
            yield r, getattr(self, r)

    def to(self, device: torch.device) -> "Fp8States":
        for _, s in self.roles():
            s.to(device)
        return self

    def __repr__(self) -> str:
        return f"Fp8States(scaling={self.cfg.scaling}, grad={self.grad.dtype})"


def is_fp8_linear(module: nn.Module) -> bool:
    """True for a layer that runs its GEMMs in FP8 (it carries ``fp8_states``)."""
    return getattr(module, "fp8_states", None) is not None


def fp8_only_weights(chunks: Sequence[nn.Module]) -> Dict[nn.Parameter, Tuple[nn.Module, int]]:
    """The parameters whose values only an FP8 GEMM reads, each with its FP8 linear and its place among that
    layer's operand pieces (``fp8_weight_params``: the weight, or GroupedQKVLinear's q then kv): what FP8-LM at
    stage 0 keeps no 16-bit copy of. A weight any other module reads (an output head tied to the embedding) is not
    one of them."""
    found: Dict[nn.Parameter, Tuple[nn.Module, int]] = {}
    for chunk in chunks:
        for module in chunk.modules():
            if is_fp8_linear(module):
                for k, p in enumerate(module.fp8_weight_params()):
                    found[p] = (module, k)
    for chunk in chunks:
        for module in chunk.modules():
            if is_fp8_linear(module) or not getattr(module, "reads_parameters", True):
                continue
            for p in module._parameters.values():
                if p is not None:
                    found.pop(p, None)
    for p, (module, _) in list(found.items()):  # a layer's operand comes from the masters whole, or not at all
        if any(q not in found for q in module.fp8_weight_params()):
            found.pop(p)
    return found


def _impossible(key: str, t: torch.Tensor) -> Optional[str]:
    """What is wrong with a loaded state tensor no run can produce, or None. Scales come from
    ``scale_from_amax``, always finite and > 0 (a bad amax keeps the previous scale); histories hold amaxes, with
    0 where a step had none or a non-finite one (so zeros are valid). ``pending`` and ``initialized`` take any
    value a run can leave (a NaN pending amax is entered as 0 by the next update)."""
    field = key.rpartition(".")[2]
    t = t.detach().float().cpu()
    if field == "scale":
        bad = ~(torch.isfinite(t) & (t > 0))
        rule = "a scale must be finite and > 0"
    elif field == "amax_history":
        bad = ~(torch.isfinite(t) & (t >= 0))
        rule = "an amax history holds finite amaxes >= 0"
    else:
        return None
    if not bool(bad.any()):
        return None
    values = t.reshape(-1)[bad.reshape(-1)][:4].tolist()
    return f"{key} is {values[0] if t.dim() == 0 else values} ({rule})"


class Fp8Scaling:
    """All FP8 scaling states of this rank's model chunks: naming, the per-step update, checkpoints."""

    def __init__(self, cfg: Fp8Config, tp: Group, dp: Group):
        _check_cfg(cfg)
        self.cfg, self.tp, self.dp = cfg, tp, dp
        self.states: Dict[str, Fp8States] = {}
        """Global layer name (``layers.0.attn.qkv``, ``head``) -> its states, in a fixed (sorted) order."""
        self.make_copies: Optional[Callable[[bool], None]] = None
        """Makes the sourced weights' copies (``weight_copy`` of every state with a ``weight_source``) for
        ``step_copies``, given whether to record their amaxes: the data-parallel strategy's, which can make several
        at once (``Fp8DataParallel.make_weight_copies``); by default each from its own source."""

    def attach(self, chunks: Sequence[nn.Module]) -> "Fp8Scaling":
        """Find every FP8 linear of the model chunks; name it by its global path.

        The path of a linear in a chunk is global (``layers.17.mlp.up``; chunks hold disjoint global
        names), equal to its weight's global parameter name without ``.weight`` — except for a head
        tied to the embedding on a single stage, whose weight parameter is named ``embedding.weight``
        there and ``head.weight`` on a pipeline's last stage: the module path (``head``) is the same
        in both, which is what keeps checkpoints valid across pipeline layouts."""
        found: Dict[str, Fp8States] = {}
        for chunk in chunks:
            for name, module in chunk.named_modules():
                if not is_fp8_linear(module):
                    continue
                if name in found:
                    raise ValueError(f"FP8 linear {name!r} appears in two model chunks")
                states: Fp8States = module.fp8_states
                weight = getattr(module, "weight", None)
                if isinstance(weight, torch.Tensor):
                    states.to(weight.device)
                for _, s in states.roles():
                    if s.cfg.scaling != self.cfg.scaling:
                        raise ValueError(f"FP8 linear {name!r} was built with scaling={s.cfg.scaling}, "
                                         f"this Fp8Scaling has {self.cfg.scaling}")
                    s.dp = self.dp
                found[name] = states
        self.states = {n: found[n] for n in sorted(found)}
        return self

    @contextlib.contextmanager
    def step_copies(self, training: bool = True) -> Iterator[None]:
        """Within: each FP8 linear's weight is cast once and that E4M3 copy serves every micro-batch's forward and
        backward (Transformer Engine's weight caching; ``Engine.forward_backward`` holds it around the step's
        micro-batches). A weight with a ``weight_source`` (no 16-bit copy: FP8-LM stage 0) is cast from its masters
        on entry (``make_copies``, or each source in this object's sorted order; the same order on every rank); the
        others at their first forward. Dropped at the
        exit: the next step's weights are new. ``training=False`` (validation): only the sourced weights get a copy,
        made without recording their amaxes (as a forward without autograd casts), the others are cast per forward
        as before."""
        for st in self.states.values():
            st.keep_weight, st.weight_copy = training, None
        try:
            if self.make_copies is not None:
                self.make_copies(training)
            else:
                for st in self.states.values():
                    if st.weight_source is not None:
                        st.weight_copy = st.weight_source(self.tp, training)
            yield
        finally:
            for st in self.states.values():
                st.keep_weight, st.weight_copy = False, None

    def ready(self) -> bool:
        """Whether every scale has its first value (always under current scaling; under delayed scaling after the
        first cast of each, or a checkpoint's load): no cast will take the just-in-time path any more."""
        return self.cfg.scaling == "current" or all(s._ready for _, _, s in self._all())

    def _all(self) -> List[Tuple[str, str, ScaleState]]:
        return [(name, role, s) for name, st in self.states.items() for role, s in st.roles()]

    def _stacked(self) -> Dict[str, torch.Tensor]:
        """Every state's tensors as rows of one tensor per field (``scale`` [N], ``amax_history`` [N, H], ``pending``
        [N], ``initialized`` [N]; N = linears x 3 roles, in ``_all`` order), each ``ScaleState``'s own tensors views of
        its row: the step's update is then a handful of whole-stack operations, not ~20 per state (288 states in
        gpt_1.3b). Made on first use, and again if a state's tensors were replaced since (``ScaleState.to``)."""
        entries = self._all()
        stack = getattr(self, "_stack", None)
        if stack is not None and self._homes == [(s.scale.data_ptr(), s.amax_history.data_ptr(), s.pending.data_ptr())
                                                 for _, _, s in entries]:
            return stack
        device = entries[0][2].scale.device
        stack = {f: torch.stack([getattr(s, f).to(device) for _, _, s in entries]) for f in FIELDS}
        for i, (_, _, s) in enumerate(entries):
            for f in FIELDS:
                setattr(s, f, stack[f][i])
        stack["maximum"] = torch.tensor([format_max(s.dtype) for _, _, s in entries], dtype=torch.float32,
                                        device=device)
        self._stack = stack
        self._homes = [(s.scale.data_ptr(), s.amax_history.data_ptr(), s.pending.data_ptr()) for _, _, s in entries]
        return stack

    def update(self) -> None:
        """Delayed scaling: once per optimizer step (after the backward of every micro-batch), on every
        rank of the stage. Two collectives: MAX all-reduce of all pending amaxes over TP, then over DP.
        A no-op under current scaling."""
        if self.cfg.scaling != "delayed" or not self.states:
            return
        st = self._stacked()
        pending = st["pending"].clone()
        comm.all_reduce(pending, self.tp, op="max")
        comm.all_reduce(pending, self.dp, op="max")
        with torch.no_grad():  # ScaleState._advance for every state at once, element for element the same
            ok = torch.isfinite(pending)
            hist = torch.roll(st["amax_history"], 1, dims=1)
            hist[:, 0] = torch.where(ok, pending, torch.zeros_like(pending))
            st["amax_history"].copy_(hist)
            a = hist.max(dim=1).values if self.cfg.amax_compute == "max" else hist[:, 0]
            new = scale_from_amax(a, None, self.cfg.margin, self.cfg.power_of_two_scales, previous=st["scale"],
                                  maximum=st["maximum"])
            st["scale"].copy_(torch.where(ok, new, st["scale"]))
            st["pending"].zero_()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """``{f"{name}.{role}.{field}": tensor}`` for field in scale, amax_history, pending, initialized
        (CPU copies)."""
        return {f"{name}.{role}.{field}": t.detach().cpu().clone()
                for name, role, s in self._all() for field, t in s.tensors().items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Copy a :meth:`state_dict` back exactly; refuses missing or unexpected keys, mismatched shapes or
        dtypes, and values no run produces (a scale that is not finite and > 0, an amax history entry that is
        not finite and >= 0): nothing is changed then."""
        expected = {f"{name}.{role}.{field}": t for name, role, s in self._all() for field, t in s.tensors().items()}
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        problems = []
        if missing:
            problems.append(f"missing keys {missing}")
        if unexpected:
            problems.append(f"unexpected keys {unexpected}")
        for key in sorted(set(expected) & set(state)):
            want, got = expected[key], state[key]
            if not isinstance(got, torch.Tensor):
                problems.append(f"{key}: expected a tensor, got {type(got).__name__}")
            elif tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
                problems.append(f"{key}: expected shape {tuple(want.shape)} {want.dtype}, "
                                f"got {tuple(got.shape)} {got.dtype}")
        if problems:
            raise ValueError("FP8 scaling state_dict does not match this model ("
                             f"amax_history_len={self.cfg.amax_history_len}): " + "; ".join(problems))
        impossible = [_impossible(key, state[key]) for key in sorted(expected)]
        impossible = [p for p in impossible if p]
        if impossible:
            raise ValueError("FP8 scaling state holds impossible values: " + "; ".join(impossible))
        with torch.no_grad():
            for key, t in expected.items():
                t.copy_(state[key])
            for _, _, s in self._all():
                s._ready = bool(s.initialized)
