"""train.optimizer=adafactor at its defaults steps like AdamW on this project's initialisation, and explicit settings
are torch.optim.Adafactor's arithmetic bit for bit.

The strategies' per-tensor rules (``optimizers/tensor_rules.TensorRules``, what plain DP and every ZeRO unit step
Adafactor through) are driven from a config, one process, no process group (TP size 1). References: torch.optim's
Adafactor and AdamW stepping a copy of the same tensors on the same gradients, in float64 for AdamW.

Why the first step: AdamW's first update of every element is lr x g / (|g| + eps), a step of lr whatever the
gradient; Adafactor's is its relative step x RMS(parameter) x the clipped update (RMS <= 1, ~1 for a Gaussian
gradient). On weights of RMS model.init_std (0.02) the two match only when the relative step is lr / init_std:
torch's lr at AdamW's 2e-3 makes it a fiftieth of AdamW's (the run that looked broken: issue 53, item 11).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from config import load_config
from optimizers.tensor_rules import Entry, TensorRules

SHAPE = (96, 160)


def _rules(cfg, tensors):
    """A TensorRules over (name, fp32 tensor, decayed) as one process steps them."""
    mesh = SimpleNamespace(tp=SimpleNamespace(size=1, rank=0), device=torch.device("cpu"))
    spec = SimpleNamespace(tp_dim=None, shared_with=None, global_shape=None)
    return TensorRules(cfg, mesh, [Entry(name, t, spec, decay) for name, t, decay in tensors])


def _weight_and_grad(std: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(SHAPE, generator=gen) * std
    g = torch.randn(SHAPE, generator=gen) * 1e-3  # any scale: both rules normalise it
    return w, g


def _rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


def _adamw_float64(w: torch.Tensor, g: torch.Tensor, t, lr: float) -> torch.Tensor:
    """torch.optim.AdamW's first step in float64 at train.lr, betas, eps and weight decay."""
    p = torch.nn.Parameter(w.double().clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay,
                            foreach=False)
    p.grad = g.double().clone()
    opt.step()
    return p.detach()


@pytest.mark.parametrize("lr_point", [1.0, 0.05])  # the schedule's peak, and a warm-up step (lr x 1/20)
def test_defaults_first_step_is_adamws_on_a_weight_of_the_initial_rms(lr_point):
    cfg = load_config(None, ["train.optimizer=adafactor"])
    t = cfg.train
    lr = t.lr * lr_point
    w, g = _weight_and_grad(cfg.model.init_std)
    ours = w.clone()
    _rules(cfg, [("blocks.0.mlp.up.weight", ours, True)]).step([g], lr, 1)
    adamw = _adamw_float64(w, g, t, lr)
    step_ours, step_adamw = _rms(ours.double() - w.double()), _rms(adamw - w.double())
    assert step_adamw == pytest.approx(lr, rel=1e-3)  # AdamW's first step: lr on every element
    # Adafactor: RMS(w) / init_std (~1, sampling) x the clipped update's RMS (a Gaussian gradient: ~1)
    ratio = step_ours / step_adamw
    assert 0.95 <= ratio <= 1.05, f"Adafactor's first step {step_ours:.3g} vs AdamW's {step_adamw:.3g}"


def test_defaults_decay_a_step_is_adamws():
    """With no gradient, each rule only decays: the weight times 1 - lr x decay, AdamW's factor (float64)."""
    cfg = load_config(None, ["train.optimizer=adafactor"])
    t = cfg.train
    w, _ = _weight_and_grad(cfg.model.init_std)
    zero = torch.zeros(SHAPE)
    ours = w.clone()
    _rules(cfg, [("blocks.0.mlp.up.weight", ours, True)]).step([zero], t.lr, 1)
    adamw = _adamw_float64(w, zero, t, t.lr)
    torch.testing.assert_close(ours.double() / w.double(), adamw / w.double(), rtol=1e-7, atol=0)
    assert (1 - ours.double() / w.double()).mean().item() == pytest.approx(t.lr * t.weight_decay, rel=1e-3)


def test_explicit_settings_are_torchs_adafactor_bit_for_bit():
    """train.adafactor.lr and weight_decay given: torch.optim.Adafactor(lr, weight_decay) on a decayed matrix and an
    exempt vector, 8 steps, at the schedule's peak (where the relative step is exactly the value given)."""
    rel, wd = 0.03, 0.05
    cfg = load_config(None, ["train.optimizer=adafactor", f"train.adafactor.lr={rel}",
                             f"train.adafactor.weight_decay={wd}"])
    gen = torch.Generator().manual_seed(1)
    w, v = torch.randn(SHAPE, generator=gen) * 0.02, 1.0 + 0.1 * torch.randn(SHAPE[1], generator=gen)
    ours = [w.clone(), v.clone()]
    rules = _rules(cfg, [("blocks.0.mlp.up.weight", ours[0], True), ("blocks.0.norm1.weight", ours[1], False)])
    ref = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(v.clone())]
    opt = torch.optim.Adafactor([{"params": [ref[0]], "weight_decay": wd}, {"params": [ref[1]], "weight_decay": 0.0}],
                                lr=rel, foreach=False)
    for step in range(1, 9):
        grads = [torch.randn(SHAPE, generator=gen), torch.randn(SHAPE[1], generator=gen)]
        grads[0] *= 10.0 if step == 3 else 1.0  # one step gets clipped
        for p, gr in zip(ref, grads):
            p.grad = gr.clone()
        opt.step()
        rules.step(grads, cfg.train.lr, step)
        for o, r in zip(ours, ref):
            assert torch.equal(o, r.detach()), step


def test_the_schedule_scales_the_relative_step():
    """Under warm-up / decay (lr below train.lr) the relative step is train.adafactor.lr x lr / train.lr: torch's
    Adafactor at that lr, bit for bit."""
    rel = 0.03
    cfg = load_config(None, ["train.optimizer=adafactor", f"train.adafactor.lr={rel}",
                             "train.adafactor.weight_decay=0.1"])
    w, g = _weight_and_grad(0.02, seed=2)
    lr = cfg.train.lr * 0.25  # 0.25 and the lr's scale are powers of two: rel x 0.25 is exact
    ours = w.clone()
    _rules(cfg, [("blocks.0.mlp.up.weight", ours, True)]).step([g], lr, 1)
    ref = torch.nn.Parameter(w.clone())
    opt = torch.optim.Adafactor([ref], lr=rel * 0.25, weight_decay=0.1, foreach=False)
    ref.grad = g.clone()
    opt.step()
    assert torch.equal(ours, ref.detach())


def test_auto_follows_train_lr_and_init_std():
    """auto = train.lr / model.init_std, decay train.weight_decay x train.lr / that: the first step on a weight of
    RMS init_std is lr whatever the two are (here lr 1e-3, init_std 0.05, decay 0.2)."""
    cfg = load_config(None, ["train.optimizer=adafactor", "train.lr=1e-3", "model.init_std=0.05",
                             "train.weight_decay=0.2"])
    w, g = _weight_and_grad(0.05, seed=3)
    ours = w.clone()
    _rules(cfg, [("blocks.0.attn.qkv.weight", ours, True)]).step([g], 1e-3, 1)
    assert _rms(ours.double() - w.double()) / 1e-3 == pytest.approx(1.0, abs=0.1)
    zero_w = w.clone()
    _rules(cfg, [("blocks.0.attn.qkv.weight", zero_w, True)]).step([torch.zeros(SHAPE)], 1e-3, 1)
    assert (1 - zero_w.double() / w.double()).mean().item() == pytest.approx(1e-3 * 0.2, rel=1e-3)


def test_the_startup_line_says_what_was_chosen_and_why():
    from config.optimizer import adafactor_line
    auto = adafactor_line(load_config(None, ["train.optimizer=adafactor"]))
    assert "\n" not in auto
    assert "train.adafactor.lr=auto: 0.1 = train.lr 0.002 / model.init_std 0.02" in auto
    assert "weight_decay=auto: 0.002" in auto
    given = adafactor_line(load_config(None, ["train.optimizer=adafactor", "train.adafactor.lr=0.01",
                                              "train.adafactor.weight_decay=0"]))
    assert "train.adafactor.lr=0.01 (given)" in given and "weight_decay=0 (given)" in given
