"""train.optimizer in the trainer: each optimizer equals its reference in one process, every layout equals the
one-process run, resume is bit for bit and a checkpoint reshards, state bytes measured = estimated.

The one-process references are torch's own optimizers stepping a second copy of the model on the same
gradients (``torch.optim.Adafactor``; ``torch.optim.Muon`` on the blocks' matrices plus ``torch.optim.AdamW`` on
the rest), and for 8-bit AdamW a float64 re-implementation of its maps and arithmetic written in this file.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import batch_fn, build_engine, checkpoint_worker, tiny_config, train_worker

SETTINGS = {"adafactor": ["train.optimizer=adafactor"],  # auto: relative step train.lr / model.init_std
            "adamw8bit": ["train.optimizer=adamw8bit", "train.adamw8bit.block_size=32"],
            "muon": ["train.optimizer=muon", "train.lr=1e-2"]}
CONSTANT_LR = ["train.warmup_steps=0", "train.min_lr_ratio=1.0"]
# against torch's own optimizer: Adafactor's lr and weight decay given, so torch.optim.Adafactor takes the same two
EXPLICIT = {"adafactor": ["train.adafactor.lr=5e-2", "train.adafactor.weight_decay=0.1"]}


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
    def groups(items, decay=t.weight_decay):
        items = list(items)
        return [g for g in ({"params": [p for n, p in items if _decays(n, p)], "weight_decay": decay},
                            {"params": [p for n, p in items if not _decays(n, p)], "weight_decay": 0.0})
                if g["params"]]
    if kind == "adafactor":  # the explicit settings (EXPLICIT), under a constant schedule: lr is a.lr every step
        a = t.adafactor
        opt = torch.optim.Adafactor(groups(params.items(), a.weight_decay), lr=a.lr, beta2_decay=a.beta2_decay,
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
    from parallel.cpu_gemm import upcasts
    upcasts.cache_clear()  # GPT_CPU_GEMM (set by the test) is read again
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
            if kind != "adafactor":  # Adafactor's: its own lr, the schedule constant (asserted)
                for group in opt.param_groups:
                    group["lr"] = ref.lr_schedule(step)
            else:
                assert ref.lr_schedule(step) == cfg.train.lr
            opt.step()
        after()
    return {"ours": {n: p.detach().clone() for n, p in engine.params.items()},
            "reference": {n: p.detach().clone() for n, p in ref.params.items()}, "losses": losses}


@pytest.mark.parametrize("kind", list(SETTINGS))
def test_one_process_equals_the_reference(kind):
    steps = 10
    # Muon's Newton-Schulz in bf16 products as torch's (on a CPU without bf16 matrix instructions ours otherwise
    # multiplies the bf16 values in fp32: other sums, ~1% of an update apart, tests/test_optimizers_math.py)
    out = run_world(one_process_worker, 1, kind, SETTINGS[kind] + EXPLICIT.get(kind, []) + CONSTANT_LR, steps,
                    env={"GPT_CPU_GEMM": "native"})[0]
    assert out["losses"][-1] < out["losses"][0] - 0.05, "the run must learn, or equal parameters prove little"
    off = {}
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
        off[name] = ((diff > 1e-5).sum().item(), diff.numel())
    if kind == "adamw8bit":
        # (an element whose second moment rounds to the zero code, v below the block's smallest code, steps by
        # m / eps: such elements amplify any difference), elsewhere only through the gradients of weights that
        # moved apart, ~1e-7; a missing weight decay alone would move most elements by lr x wd x |p| x steps ~ 6e-5.
        # Counted over the whole model: in a 32-element norm weight one straddling element is already 3% (two
        # were, on a CPU with AVX-512 fp32 kernels, whose sums differ from AVX2's in the last bit)
        moved, total = map(sum, zip(*off.values()))
        assert moved <= 5e-2 * total, f"{moved} of {total} elements differ by more than 1e-5: {off}"


# -- every layout: against the one-process run of the same optimizer -------------------------------------------
WHOLE = "zero.partition=whole_tensor"
LAYOUTS = {  # world, overrides: each a DP layout, a model-parallel one and a ZeRO stage
    "dp4": (4, []),
    "tp2_sp_dp2_zero1": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "zero.stage=1", WHOLE]),
    "pp2_vp2_dp2_zero2": (4, ["parallel.pp=2", "parallel.virtual_stages=2", "zero.stage=2", WHOLE]),
    "tp2_dp2_zero3": (4, ["parallel.tp=2", "zero.stage=3", WHOLE]),
}
STEPS = 4
_references: Dict[str, dict] = {}


def _reference(kind: str) -> dict:
    if kind not in _references:
        _references[kind] = run_world(train_worker, 1, SETTINGS[kind], STEPS)[0]
    return _references[kind]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(SETTINGS))
def test_layout_equals_one_process(kind, layout):
    world, overrides = LAYOUTS[layout]
    ref = _reference(kind)
    out = run_world(train_worker, world, SETTINGS[kind] + overrides, STEPS)
    assert ref["losses"][-1] < ref["losses"][0] - 0.05, "the reference must learn"
    # Muon orthogonalises in bf16 products (torch's Newton-Schulz): the layouts' fp32 sum-order differences in the
    # gradients (~1e-7) flip bf16 roundings of its iterates, which moved step 4's loss by 1.17e-5 on a CPU with
    # native bf16 kernels (AVX512-BF16) at tp 2; a wrong gather, scale or shard moves it by 1e-3 or more
    rtol = 5e-5 if kind == "muon" else 1e-5
    torch.testing.assert_close(torch.tensor(out[0]["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=0)
    assert abs(out[0]["val_loss"] - ref["val_loss"]) <= rtol * ref["val_loss"]


# -- state bytes: measured = estimated -------------------------------------------------------------------------
def memory_worker(overrides: List[str]):
    from training.memory import model_state_bytes

    cfg = tiny_config(*overrides)
    engine = build_engine(cfg)
    for step in range(2):
        engine.train_step(batch_fn(engine, step))
    per_rule: Dict[str, List[int]] = {}  # rule -> [state bytes, elements] over the matrices (ndim >= 2)
    units = [u for u in getattr(engine.dp, "units", [])]
    rules = [engine.dp.rules] if getattr(engine.dp, "rules", None) is not None else [u.rules for u in units]
    for r in rules:
        for e in r.entries:
            if e.param.ndim >= 2 and not e.name.endswith("bias"):
                acc = per_rule.setdefault(e.rule, [0, 0])
                acc[0] += sum(t.numel() * t.element_size() for t in e.state.values())
                acc[1] += e.param.numel()
    return {"measured": engine.dp.memory(), "estimated": model_state_bytes(cfg, engine.mesh.layout, engine.mesh.rank),
            "per_rule": per_rule}


BYTES_PER_MATRIX_ELEMENT = {"adafactor": (0.0, 1.0), "adamw8bit": (2.0, 2.1), "muon": (4.0, 4.0)}


@pytest.mark.parametrize("world,layout", [(1, []), (4, ["parallel.tp=2", "zero.stage=3", WHOLE]),
                                          (2, ["zero.stage=1", WHOLE])])
@pytest.mark.parametrize("kind", list(SETTINGS))
def test_state_bytes_measured_equal_estimated(kind, world, layout):
    setting = [o for o in SETTINGS[kind] if "block_size" not in o]  # 8-bit AdamW's default blocks of 256
    out = run_world(memory_worker, world, setting + ["model.vocab_size=256"] + layout)
    for r in out:
        for key in ("parameters", "gradients", "optimizer"):
            assert r["measured"][key] == r["estimated"][key], (key, r["measured"], r["estimated"])
    if world == 1:
        lo, hi = BYTES_PER_MATRIX_ELEMENT[kind]
        state, numel = out[0]["per_rule"][kind]
        assert lo <= state / numel <= hi, state / numel


# -- resume bit for bit, and into another layout ------------------------------------------------------------
@pytest.mark.parametrize("kind", list(SETTINGS))
def test_resume_is_bit_for_bit_and_reshards(kind, tmp_path):
    saved = ["parallel.tp=2", "zero.stage=3", WHOLE]  # every optimizer's states sharded by owner and by TP
    straight = run_world(checkpoint_worker, 4, SETTINGS[kind] + saved, "none", 4, str(tmp_path / "unused"))[0]
    run_world(checkpoint_worker, 4, SETTINGS[kind] + saved, "fresh", 2, str(tmp_path))
    resumed = run_world(checkpoint_worker, 4, SETTINGS[kind] + saved, "resume", 4, str(tmp_path))[0]
    assert [resumed[s] for s in (2, 3)] == [straight[s] for s in (2, 3)]  # bit for bit
    # one process, plain DP: the whole tensors, states gathered from their owners and TP pieces
    other = run_world(checkpoint_worker, 1, SETTINGS[kind], "resume", 4, str(tmp_path))[0]
    torch.testing.assert_close(torch.tensor([other[s] for s in (2, 3)]),
                               torch.tensor([straight[s] for s in (2, 3)]), rtol=1e-5, atol=0)


def test_a_checkpoint_of_another_optimizer_is_refused_with_one_line(tmp_path):
    run_world(checkpoint_worker, 1, SETTINGS["muon"], "fresh", 1, str(tmp_path))
    with pytest.raises(Exception, match="train.optimizer=muon, this run uses train.optimizer=adafactor"):
        run_world(checkpoint_worker, 1, SETTINGS["adafactor"], "resume", 2, str(tmp_path))


# -- bad values: one line each, exit 2 ---------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,fragment", [
    (["train.optimizer=lion"], "train.optimizer='lion' is not one of ['adamw', 'adafactor', 'adamw8bit', 'muon']"),
    (["train.optimizer=adamw8bit", "train.adamw8bit.block_size=-4"], "train.adamw8bit.block_size=-4 must be in"),
    (["train.optimizer=muon", "train.muon.ns_steps=0"], "train.muon.ns_steps=0 must be in [1, 99]"),
    (["train.optimizer=muon", "train.muon.momentum=1.0"], "train.muon.momentum=1.0 must be in [0, 1)"),
    (["train.optimizer=muon", "train.muon.adjust_lr=none"], "train.muon.adjust_lr='none' is not one of"),
    (["train.optimizer=muon", "precision=fp8"], "train.optimizer=muon does not combine with precision=fp8"),
    (["train.optimizer=muon", "zero.stage=2"], "train.optimizer=muon with zero.stage=2 needs zero.partition="),
    (["train.optimizer=adafactor", "zero.stage=3", "zero.partition=whole_tensor", "zero.hpz_size=2",
      "zero.quantized_weights=true"], "zero.early_step=true (on by default) steps AdamW early"),
    (["train.optimizer=adafactor", "train.adafactor.beta2_decay=0.5"], "train.adafactor.beta2_decay=0.5 must be"),
    (["train.optimizer=adafactor", "train.adafactor.lr=0"], "train.adafactor.lr=0.0 must be a number > 0, or null"),
    (["train.optimizer=adafactor", "train.adafactor.weight_decay=-1"],
     "train.adafactor.weight_decay=-1.0 must be a number >= 0, or null"),
    (["train.optimizer=adafactor", "model.init_std=0"], "model.init_std=0.0 must be > 0 for train.adafactor.lr=null"),
])
def test_bad_values_are_one_line_and_exit_2(overrides, fragment, capsys):
    import train

    assert train.main(overrides + ["train.max_steps=1"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if fragment in line]
    assert len(lines) == 1 and "Traceback" not in err, err
