"""Adafactor, 8-bit AdamW and Muon as the data-parallel strategies run them: tensor by tensor.

``TensorRules`` steps a list of tensors this rank updates: at stage 0 every parameter (``parallel/data_parallel.py``),
with ZeRO the whole tensors of its shards (``zero.partition=whole_tensor``, ``parallel/zero/sharded.py``). Each
tensor is a parameter's fp32 master, or its tensor-parallel piece (``ParamSpec``: split along ``tp_dim``).

Which rule a tensor gets (``rule_of``): Adafactor and 8-bit AdamW every tensor; Muon the weight matrices of the
transformer blocks (2-D, or stacks of 2-D matrices such as the fused K/V and gate/up weights, each matrix
orthogonalised on its own), AdamW (fp32 moments) the embedding, the output head, norms and biases — the split of
every published Muon recipe.

Tensor parallelism. Elementwise rules (AdamW, 8-bit AdamW, Muon's momentum) run on the piece. What needs the
whole matrix is computed on the whole matrix: Muon all-gathers its momentum update's pieces over TP, every TP
rank runs Newton-Schulz on the same whole matrix and keeps its own rows or columns; Adafactor all-gathers the
piece's gradient and parameter, every TP rank runs the update of the whole tensor (its row and column statistics
are those of the whole matrix, so each TP rank holds the same small factored state, or the whole second moment of
a split vector) and keeps its piece. Both are exactly the one-process arithmetic (the gathered tensor is the
one-process tensor, bit for bit), at the cost of each TP rank repeating the whole matrix's update. 8-bit blocks
are ``train.adamw8bit.block_size`` consecutive elements of the piece this rank holds: they never straddle two
tensors or two ranks' pieces, and a TP size other than 1 groups different elements into blocks than one process.

Adafactor's relative step and weight decay are ``config.optimizer.adafactor_settings``'s (``train.adafactor.lr`` and
``weight_decay``, or for null what they derive from ``train.lr``, ``train.weight_decay`` and ``model.init_std``),
computed from the config alone, so every rank and ZeRO unit steps with the same numbers; a step's relative step is
that lr times the schedule's fraction (lr / ``train.lr``).

Checkpoints hold every state as a global tensor (``state_views``): Muon's momentum and 8-bit AdamW's moments
shaped and split like the parameter (8-bit moments dequantized to fp32, re-quantized exactly on load: a block's
absmax maps to a code of its own), Adafactor's factored statistics whole (every holder has the same).

8-bit AdamW under ``train.compile`` (``model.compile.enabled``): ``optimizers.adamw8bit.adamw8bit_update`` goes
through ``torch.compile`` once a process (``model.compile.backend()``, whole graph, static shapes), so each 8-bit
tensor is dequantized, updated and re-quantized by one compiled graph, one graph per distinct tensor shape; the
step's scalars are two fp32 device tensors filled once a step (decayed and exempt tensors), not graph constants, so
no step recompiles. Eager otherwise (the CPU default), through the same function: the bits of ``adamw8bit_step``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from config.optimizer import adafactor_settings
from model.compile import backend as compile_backend
from model.compile import enabled as compile_enabled
from model.gpt import EMBEDDING
from parallel import comm
from parallel.zero.adamw import adamw_step

HEAD = "head.weight"

StateView = Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...], torch.Tensor]
"""(global shape, local shape, local offset, tensor): a state as a global tensor of which this rank holds a part."""


def rule_of(optimizer: str, name: str, ndim: int, spec) -> str:
    """The update rule ``train.optimizer`` gives parameter ``name`` (``ndim`` dimensions, its ``ParamSpec``)."""
    if optimizer != "muon":
        return optimizer
    matrix = ndim >= 2 and not name.endswith("bias") and name not in (EMBEDDING, HEAD)
    return "muon" if matrix and spec.shared_with is None else "adamw"


@dataclass
class Entry:
    name: str
    param: torch.Tensor
    """fp32, this rank's piece, updated in place."""
    spec: object
    """The parameter's ``ParamSpec`` (tensor-parallel split)."""
    decay: bool
    rule: str = ""
    state: Dict[str, torch.Tensor] = field(default_factory=dict)


def _compiled_without_grad(fn):
    """``fn`` through torch.compile with the project's backend (``GPT_COMPILE_BACKEND``), the whole function one
    graph (``fullgraph``: a graph break is an error, not a silent eager fallback) and shapes static (one graph a
    shape), always entered with autograd off. ``fp8.zero_unit._compiled_without_grad``'s pattern; not imported from
    there: fp8.zero_unit imports parallel.zero.sharded, which imports this module."""
    compiled = torch.compile(fn, backend=compile_backend(), fullgraph=True, dynamic=False)

    def run(*args, **kwargs):
        with torch.no_grad():
            return compiled(*args, **kwargs)

    return run


_COMPILED_8BIT: Dict[str, object] = {}  # backend -> the compiled 8-bit update, one a process (every TensorRules)
_SHAPES_8BIT: Set[Tuple[Tuple[int, ...], str]] = set()  # the (shape, device) the compiled 8-bit update meets


def _compiled_update8(shapes: Set[Tuple[Tuple[int, ...], str]]):
    """The compiled ``adamw8bit_update``, made once a process and shared by every ``TensorRules`` (ZeRO builds one
    a unit), with room in dynamo's cache of the function for one graph each distinct ``shapes`` entry."""
    from optimizers.adamw8bit import adamw8bit_update
    name = compile_backend()
    if name not in _COMPILED_8BIT:
        _COMPILED_8BIT[name] = _compiled_without_grad(adamw8bit_update)
    _SHAPES_8BIT.update(shapes)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, len(_SHAPES_8BIT))
    return _COMPILED_8BIT[name]


class TensorRules:
    def __init__(self, cfg, mesh, entries: Sequence[Entry]):
        self.t, self.mesh = cfg.train, mesh
        self.tp = mesh.tp
        self.entries = list(entries)
        self.block = self.t.adamw8bit.block_size
        self._staged: Optional[List[Dict[str, torch.Tensor]]] = None  # 8-bit moments as fp32, for a load
        for e in self.entries:
            e.rule = rule_of(self.t.optimizer, e.name, e.param.ndim, e.spec)
            e.state = self._new_state(e)
        # Adafactor's peak relative step and weight decay, from the config (the same on every rank and resume)
        self.adafactor_lr, self.adafactor_decay = adafactor_settings(cfg)
        shapes = {(tuple(e.param.shape), str(e.param.device)) for e in self.entries if e.rule == "adamw8bit"}
        self.compiled = bool(shapes) and compile_enabled(cfg, mesh.device)
        self._update8 = None
        if shapes:
            from optimizers.adamw8bit import adamw8bit_update
            # the step's scalars (keep, step size, sqrt of bc2), filled once a step: decayed tensors, exempt ones
            self._scalars = {d: torch.zeros(3, dtype=torch.float32, device=mesh.device) for d in (True, False)}
            self._update8 = _compiled_update8(shapes) if self.compiled else adamw8bit_update

    # -- the pieces and the whole --------------------------------------------------------------------
    def _split(self, e: Entry) -> bool:
        return e.spec.tp_dim is not None and self.tp.size > 1

    def _whole_shape(self, e: Entry) -> Tuple[int, ...]:
        return tuple(e.spec.global_shape) if self._split(e) else tuple(e.param.shape)

    def _whole(self, e: Entry, piece: torch.Tensor) -> torch.Tensor:
        """The one-process tensor from every TP rank's piece (ranks holding the same piece counted once)."""
        if not self._split(e):
            return piece
        piece = piece.contiguous()
        out = torch.empty((self.tp.size,) + tuple(piece.shape), dtype=piece.dtype, device=piece.device)
        comm.all_gather(out.view(-1), piece.view(-1), self.tp)
        return torch.cat(list(out[::e.spec.tp_replicas]), dim=e.spec.tp_dim)

    def _own(self, e: Entry, whole: torch.Tensor) -> torch.Tensor:
        if not self._split(e):
            return whole
        n = e.param.shape[e.spec.tp_dim]
        return whole.narrow(e.spec.tp_dim, e.spec.tp_piece(self.tp.rank) * n, n)

    # -- state --------------------------------------------------------------------------------------
    def _new_state(self, e: Entry) -> Dict[str, torch.Tensor]:
        dev = e.param.device
        if e.rule == "adafactor":
            from optimizers.adafactor import adafactor_state
            return adafactor_state(self._whole_shape(e), dev)
        if e.rule == "adamw8bit":
            from optimizers.adamw8bit import adamw8bit_state
            return adamw8bit_state(tuple(e.param.shape), dev, self.block)
        if e.rule == "muon":
            return {"momentum_buffer": torch.zeros_like(e.param)}
        return {"exp_avg": torch.zeros_like(e.param), "exp_avg_sq": torch.zeros_like(e.param)}

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for e in self.entries for t in e.state.values())

    def state_views(self, i: int, local_offset: Sequence[int], owned: bool = True) -> Dict[str, StateView]:
        """Entry ``i``'s states as global tensors (``parallel/zero/dcp_view.shard_view``'s terms); ``owned``: this
        rank updates the tensor (ZeRO: its owner). Call ``after_load`` once a load has written into them."""
        e = self.entries[i]
        local, glob = tuple(e.param.shape), tuple(e.spec.global_shape)
        if e.rule == "adamw8bit":
            from optimizers.adamw8bit import dequantized_moments
            if self._staged is None:
                self._staged = [{} for _ in self.entries]
            m, v = dequantized_moments(e.state, local, self.block)
            self._staged[i] = {"exp_avg": m, "exp_avg_sq": v}
            return {k: (glob, local, tuple(local_offset), t) for k, t in self._staged[i].items()}
        if e.rule == "adafactor":  # whole on every holder
            return {k: (tuple(t.shape), tuple(t.shape), (0,) * t.ndim, t) for k, t in e.state.items()}
        return {k: (glob, local, tuple(local_offset), t) for k, t in e.state.items()}

    @torch.no_grad()
    def after_load(self) -> None:
        """A checkpoint was loaded into the views of ``state_views``: re-quantize the 8-bit moments."""
        if self._staged is None:
            return
        from optimizers.adamw8bit import load_moments
        for e, staged in zip(self.entries, self._staged):
            if staged:
                load_moments(e.state, staged["exp_avg"], staged["exp_avg_sq"], self.block)
        self._staged = None

    def forget_staged(self) -> None:
        """A save is done with the fp32 views of the 8-bit moments."""
        self._staged = None

    # -- the step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, grads: Sequence[torch.Tensor], lr: float, step: int) -> None:
        """One update of every entry; ``grads`` fp32 (unscaled and clipped), entry by entry; ``step`` >= 1."""
        t = self.t
        if self._update8 is not None:
            from optimizers.adamw8bit import fill_step_scalars, moment_maps
            for decay, out in self._scalars.items():
                fill_step_scalars(out, step, lr, t.beta1, t.beta2, t.weight_decay if decay else 0.0)
        for e, g in zip(self.entries, grads):
            wd = t.weight_decay if e.decay else 0.0
            if e.rule == "adamw":
                adamw_step(e.param.view(-1), g.reshape(-1), e.state["exp_avg"].view(-1),
                           e.state["exp_avg_sq"].view(-1), [(0, e.param.numel())] if wd else [], step, lr,
                           t.beta1, t.beta2, t.eps, wd)
            elif e.rule == "adamw8bit":
                self._update8(e.param, g, e.state, self._scalars[bool(e.decay)], moment_maps(e.param.device), t.beta1,
                              t.beta2, t.eps, self.block)
            elif e.rule == "adafactor":
                self._adafactor(e, g, lr, step, e.decay)
            else:
                self._muon(e, g, lr, wd)

    def _adafactor(self, e: Entry, g: torch.Tensor, lr: float, step: int, decay: bool) -> None:
        """torch.optim.Adafactor's step at the relative step train.adafactor.lr x (lr / train.lr): the schedule's
        fraction (exactly 1.0 at the peak, so a constant schedule steps at exactly train.adafactor.lr)."""
        from optimizers.adafactor import adafactor_step
        a = self.t.adafactor
        relative = self.adafactor_lr * (lr / self.t.lr)
        whole, grad = self._whole(e, e.param), self._whole(e, g)
        adafactor_step(whole, grad, e.state, step, relative, self.adafactor_decay if decay else 0.0, a.beta2_decay,
                       a.eps1, a.eps2, a.clip_threshold)
        if whole is not e.param:
            e.param.copy_(self._own(e, whole))

    def _muon(self, e: Entry, g: torch.Tensor, lr: float, wd: float) -> None:
        from optimizers.muon import adjusted_lr, momentum_update, newton_schulz
        m = self.t.muon
        update = self._whole(e, momentum_update(g, e.state["momentum_buffer"], m.momentum, m.nesterov))
        shape = update.shape[-2:]
        ortho = torch.stack([newton_schulz(x, steps=m.ns_steps, eps=m.eps)
                             for x in update.reshape((-1,) + tuple(shape))]).view(update.shape)
        e.param.mul_(1.0 - lr * wd)
        e.param.add_(self._own(e, ortho).to(e.param.dtype), alpha=-adjusted_lr(lr, tuple(shape), m.adjust_lr))
