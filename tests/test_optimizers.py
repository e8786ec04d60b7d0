"""train.optimizer in the trainer: each optimizer equals its reference in one process, every layout equals the
one-process run, resume is bit for bit and a checkpoint reshards, state bytes measured = estimated.

The one-process references are torch's own optimizers stepping a second copy of the model on the same
gradients (``torch.optim.Adafactor``; ``torch.optim.Muon`` on the blocks' matrices plus ``torch.optim.AdamW`` on
the rest), and for 8-bit AdamW a float64 re-implementation of its maps and arithmetic written in this file.
"""
from __future__ import annotations

import math
from typing import Dict, List

import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import batch_fn, build_engine, checkpoint_worker, tiny_config, train_worker

SETTINGS = {"adafactor": ["train.optimizer=adafactor", "train.lr=5e-2"],
            "adamw8bit": ["train.optimizer=adamw8bit", "train.adamw8bit.block_size=32"],
            "muon": ["train.optimizer=muon", "train.lr=1e-2"]}
CONSTANT_LR = ["train.warmup_steps=0", "train.min_lr_ratio=1.0"]


# -- one process: against torch's optimizers ------------------------------------------------------------------
def _decays(name: str, p: torch.Tensor) -> bool:
    return not (name.endswith("bias") or p.ndim < 2)


class _Leaves:
    """torch.optim.Muon takes 2-D leaves only: each matrix of a stacked weight (fused K/V, gate/up) as its own."""

    def __init__(self, params: Dict[str, torch.nn.Parameter]):
        self.pairs = []  # (parameter, index or None, leaf)
        for p in params.values():
            for i in range(p.shape[0]) if p.ndim == 3 else [None]:
                src = p.data if i is None else p.data[i]
                self.pairs.append((p, i, torch.nn.Parameter(src.clone())))

    def leaves(self) -> List[torch.nn.Parameter]:
        return [leaf for _, _, leaf in self.pairs]

    def grads_in(self) -> None:
        for p, i, leaf in self.pairs:
            leaf.grad = (p.grad if i is None else p.grad[i]).clone()

    def params_out(self) -> None:
        for p, i, leaf in self.pairs:
            (p.data if i is None else p.data[i]).copy_(leaf.data)


def _torch_reference(kind: str, params: Dict[str, torch.nn.Parameter], cfg):
    """(optimizers, before_step, after_step) of torch's implementation of ``kind``."""
    t = cfg.train
    def groups(items):
        items = list(items)
        return [g for g in ({"params": [p for n, p in items if _decays(n, p)], "weight_decay": t.weight_decay},
                            {"params": [p for n, p in items if not _decays(n, p)], "weight_decay": 0.0})
                if g["params"]]
    if kind == "adafactor":
        a = t.adafactor
        opt = torch.optim.Adafactor(groups(params.items()), lr=t.lr, beta2_decay=a.beta2_decay,
                                    eps=(a.eps1, a.eps2), d=a.clip_threshold, foreach=False)
        return [opt], lambda: None, lambda: None
    assert kind == "muon"
    m = t.muon
    is_matrix = {n: p.ndim >= 2 and not n.endswith("bias") and n not in ("embedding.weight", "head.weight")
                 for n, p in params.items()}
    leaves = _Leaves({n: p for n, p in params.items() if is_matrix[n]})
    muon = torch.optim.Muon(leaves.leaves(), lr=t.lr, weight_decay=t.weight_decay, momentum=m.momentum,
                            nesterov=m.nesterov, eps=m.eps, ns_steps=m.ns_steps, adjust_lr_fn=m.adjust_lr)
    adamw = torch.optim.AdamW(groups((n, p) for n, p in params.items() if not is_matrix[n]), lr=t.lr,
                              betas=(t.beta1, t.beta2), eps=t.eps, foreach=False)
    return [muon, adamw], leaves.grads_in, leaves.params_out


class Float64AdamW8bit:
    """8-bit AdamW in float64 (tests/test_optimizers_math.py's maps and rule: dequantize, torch.optim.AdamW's
    arithmetic, re-quantize with float64 ratios), blocks of each whole tensor, as an optimizer of torch's shape."""

    def __init__(self, params: Dict[str, torch.nn.Parameter], t):
        from tests import test_optimizers_math as ref
        self.ref, self.t, self.block = ref, t, t.adamw8bit.block_size
        self.param_groups = [{"lr": t.lr}]
        self.params = params
        sm, um = ref._map_float64(True).float(), ref._map_float64(False).float()
        zero = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
        self.m = {n: ref._quantize_float64(z, sm, self.block) for n, z in zero.items()}
        self.v = {n: ref._quantize_float64(z, um, self.block) for n, z in zero.items()}
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        t, lr = self.t, self.param_groups[0]["lr"]
        for n, p in self.params.items():
            state = {"exp_avg_codes": self.m[n][0], "exp_avg_scales": self.m[n][1],
                     "exp_avg_sq_codes": self.v[n][0], "exp_avg_sq_scales": self.v[n][1]}
            wd = t.weight_decay if _decays(n, p) else 0.0
            new, m, v = self.ref._adamw8bit_float64(p.data, p.grad, state, self.steps, self.block, lr, t.beta1,
                                                    t.beta2, t.eps, wd)
            p.data.copy_(new)
            self.m[n], self.v[n] = (m[0], m[1].float()), (v[0], v[1].float())


def one_process_worker(kind: str, overrides: List[str], steps: int):
    """The trainer with train.optimizer=kind, and a copy of the model stepped by the reference on the gradients
    of its own weights (the same batches): both parameter sets after ``steps`` steps."""
    cfg = tiny_config(*overrides)
    engine = build_engine(cfg)
    ref = build_engine(tiny_config(*[o for o in overrides if not o.startswith("train.optimizer")]))
    if kind == "adamw8bit":
        opt = Float64AdamW8bit(ref.params, cfg.train)
        opts, before, after = [opt], lambda: None, lambda: None
    else:
        opts, before, after = _torch_reference(kind, ref.params, cfg)
    losses = []
    for step in range(steps):
        losses.append(engine.train_step(batch_fn(engine, step))["loss"])
        ref.forward_backward(batch_fn(ref, step))
        before()
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = ref.lr_schedule(step)
            opt.step()
        after()
    return {"ours": {n: p.detach().clone() for n, p in engine.params.items()},
            "reference": {n: p.detach().clone() for n, p in ref.params.items()}, "losses": losses}


@pytest.mark.parametrize("kind", list(SETTINGS))
def test_one_process_equals_the_reference(kind):
    steps = 10
    out = run_world(one_process_worker, 1, kind, SETTINGS[kind] + CONSTANT_LR, steps)[0]
    assert out["losses"][-1] < out["losses"][0] - 0.05, "the run must learn, or equal parameters prove little"
    for name, ref in out["reference"].items():
        ours = out["ours"][name]
        if kind != "adamw8bit":
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"{kind} {name}: {m}")
            continue
        # 8-bit: a moment whose fp32 and float64 ratios straddle a code midpoint (~1e-7 apart) rounds to the
        # neighbouring code, a difference of one code gap (<= 1.4% of the block's absmax) in that element's
        # update from then on: rare, and bounded by the update size (lr per step, Adam's normalised step)
        diff = (ours - ref).abs()
        assert diff.max().item() <= 0.05 * 3e-3 * steps, f"{name}: {diff.max().item()}"
        # (an element whose second moment rounds to the zero code, v below the block's smallest code, steps by
        # m / eps: such elements amplify any difference), elsewhere only through the gradients of weights that
        # moved apart, ~1e-7; a missing weight decay alone would move most elements by lr x wd x |p| x steps ~ 6e-5
        off = (diff > 1e-5).float().mean().item()
        assert off <= 5e-2, f"{name}: {off:.2%} of the elements differ by more than 1e-5"
