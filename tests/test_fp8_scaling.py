"""Tests for fp8/scaling.py: delayed and current per-tensor scaling of FP8 GEMM operands.

Expected scales are computed here by hand from the SPEC §4 rule ``s = max(format) / amax / 2**margin``
(rounded down to a power of two when asked; 448 for E4M3, 57344 for E5M2), with Python floats, from amaxes
the test chose; histories are written out by hand. The distributed tests run a 2 (TP) x 2 (DP) world of 4
gloo ranks where every rank feeds a different, known amax, so a reduction over the wrong group (or over
one group only) gives a visibly different scale.
"""
from __future__ import annotations

import math
from typing import Dict, List

import pytest
import torch
from torch import nn

from tests.dist_harness import run_world

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _cfg(**kw):
    from config import Fp8Config

    return Fp8Config(**kw)


def _group(name: str, rank: int = 0, ranks=(0,), pg=None):
    from parallel.comm import Group, Ledger

    return Group(name=name, pg=pg, ranks=list(ranks), rank=rank, link="intra", ledger=Ledger())


class _Lin(nn.Module):
    """The least an FP8 linear is to Fp8Scaling: a weight and ``fp8_states``."""

    def __init__(self, cfg):
        super().__init__()
        from fp8.scaling import Fp8States

        self.weight = nn.Parameter(torch.zeros(2, 2))
        self.fp8_states = Fp8States(cfg)


def _model(cfg, n: int = 2) -> nn.Module:
    m = nn.Module()
    m.blocks = nn.ModuleList([_Lin(cfg) for _ in range(n)])
    m.plain = nn.Linear(2, 2)  # not FP8: not attached
    return m


def _with_amax(a: float, n: int = 6) -> torch.Tensor:
    """A tensor whose amax is exactly ``a`` (a float32 value), reached by a negative element."""
    t = torch.linspace(-0.5, 0.5, n) * a
    t[1] = -a
    return t


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def _expected_scale(a: float, fmt_max: float, margin: int = 0, pow2: bool = False) -> float:
    s = _f32(_f32(fmt_max / _f32(a)) / 2 ** margin)
    return 2.0 ** math.floor(math.log2(s)) if pow2 else s


def _close(actual: float, expected: float) -> bool:
    """Equal up to fp32 rounding of the division (torch divides by multiplying with a rounded reciprocal)."""
    return abs(actual - expected) <= 3e-7 * abs(expected)


def _scaling(cfg, model):
    from fp8.scaling import Fp8Scaling

    return Fp8Scaling(cfg, _group("tp"), _group("dp")).attach([model])


# ---- single process --------------------------------------------------------------------------------------

def test_attach_names_every_fp8_linear_and_nothing_else() -> None:
    from fp8.scaling import is_fp8_linear

    cfg = _cfg()
    model = _model(cfg, 3)
    sc = _scaling(cfg, model)
    assert list(sc.states) == ["blocks.0", "blocks.1", "blocks.2"]
    assert is_fp8_linear(model.blocks[0]) and not is_fp8_linear(model.plain)
    keys = set(sc.state_dict())
    assert len(keys) == 3 * 3 * 4
    assert "blocks.1.grad.amax_history" in keys and "blocks.0.input.initialized" in keys


def test_role_formats() -> None:
    from fp8.scaling import Fp8States

    st = Fp8States(_cfg())
    assert st.input.dtype == st.weight.dtype == torch.float8_e4m3fn and st.grad.dtype == torch.float8_e5m2
    assert Fp8States(_cfg(gradient_format="e4m3")).grad.dtype == torch.float8_e4m3fn


def test_jit_init_then_the_scale_is_held_until_update() -> None:
    cfg = _cfg(scaling="delayed", amax_history_len=4)
    model = _model(cfg, 1)
    sc, st = _scaling(cfg, model), model.blocks[0].fp8_states
    tp = _group("tp")
    assert not bool(st.input.initialized)
    q, s = st.input.cast(_with_amax(2.0), tp)
    assert bool(st.input.initialized)
    assert float(s) == float(st.input.scale) == _expected_scale(2.0, E4M3_MAX)  # 224
    assert q.dtype == torch.float8_e4m3fn
    assert float(q.float().abs().max()) == 448.0  # amax lands on the format max
    # a larger tensor before the update: same scale (saturates), amax recorded in pending
    q, s = st.input.cast(_with_amax(8.0), tp)
    assert float(s) == 224.0 and float(q.float().abs().max()) == 448.0
    assert float(st.input.pending) == 8.0
    assert torch.equal(st.input.amax_history, torch.zeros(4))
    sc.update()
    assert st.input.amax_history.tolist() == [8.0, 0.0, 0.0, 0.0]
    assert float(st.input.scale) == _expected_scale(8.0, E4M3_MAX) == 56.0
    assert float(st.input.pending) == 0.0
    # a role that was never cast keeps scale 1 and stays uninitialized
    assert float(st.weight.scale) == 1.0 and not bool(st.weight.initialized)


@pytest.mark.parametrize("compute,margin,pow2", [("max", 0, False), ("most_recent", 0, False), ("max", 1, False),
                                                 ("most_recent", 2, True), ("max", 0, True)])
def test_delayed_history_roll_and_scale_rule(compute: str, margin: int, pow2: bool) -> None:
    L = 3
    cfg = _cfg(scaling="delayed", amax_history_len=L, amax_compute=compute, margin=margin, power_of_two_scales=pow2)
    model = _model(cfg, 1)
    sc, st = _scaling(cfg, model), model.blocks[0].fp8_states
    tp = _group("tp")
    steps = [3.0, 5.0, 1.5, 0.75, 0.375, 6.0]  # per step: amax of the input and (x10) of the gradient
    history: List[float] = [0.0] * L
    for i, a in enumerate(steps):
        st.input.cast(_with_amax(a), tp)
        st.input.cast(_with_amax(a / 2), tp)  # smaller second cast: pending keeps the max
        st.grad.cast(_with_amax(10 * a), tp)
        sc.update()
        history = [a] + history[:-1]
        assert st.input.amax_history.tolist() == history, i
        assert st.grad.amax_history.tolist() == [10 * h for h in history], i
        pick = max(history) if compute == "max" else history[0]
        want_in = _expected_scale(pick, E4M3_MAX, margin, pow2)
        want_g = _expected_scale(10 * pick, E5M2_MAX, margin, pow2)
        if pow2:  # powers of two are exact
            assert (float(st.input.scale), float(st.grad.scale)) == (want_in, want_g), (i, history)
        else:
            assert _close(float(st.input.scale), want_in) and _close(float(st.grad.scale), want_g), (i, history)
    if compute == "max":  # 6.0 entered last, 0.75 and 0.375 before it: the window max is the newest
        assert history == [6.0, 0.375, 0.75]


@pytest.mark.parametrize("compute,margin,pow2,grad_format", [("max", 0, False, "e5m2"), ("most_recent", 1, True, "e4m3")])
def test_update_of_the_stacked_states_is_each_state_advanced_alone(compute, margin, pow2, grad_format) -> None:
    """Fp8Scaling.update advances every state in a few whole-stack operations; the reference is
    ScaleState._advance run on each state alone (a copy of the same states): the same bits, every field, over
    steps that include a NaN, an inf and a zero amax, with formats of two maxima in one stack."""
    import copy

    cfg = _cfg(scaling="delayed", amax_history_len=4, amax_compute=compute, margin=margin, power_of_two_scales=pow2,
               gradient_format=grad_format)
    model = _model(cfg, 3)
    sc, tp = _scaling(cfg, model), _group("tp")
    rng = torch.Generator().manual_seed(0)
    for step, bad in enumerate([None, float("nan"), None, float("inf"), 0.0, None]):
        for k, lin in enumerate(model.blocks):
            for role in ("input", "weight", "grad"):
                a = float(torch.rand((), generator=rng)) * 10 ** (k - 1) + 1e-3
                getattr(lin.fp8_states, role).cast(_with_amax(a), tp)
        if bad is not None:
            model.blocks[1].fp8_states.grad.pending.fill_(bad)
        ref = [copy.deepcopy(lin.fp8_states) for lin in model.blocks]
        sc.update()
        for lin, want in zip(model.blocks, ref):
            for role in ("input", "weight", "grad"):
                r = getattr(want, role)
                r._advance(r.pending.clone())
                got = getattr(lin.fp8_states, role)
                for field in ("scale", "amax_history", "pending"):
                    a, b = getattr(got, field), getattr(r, field)
                    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (step, role, field, a, b)


def test_power_of_two_and_margin_by_hand() -> None:
    cfg = _cfg(scaling="current", margin=1, power_of_two_scales=True)
    st = _model(cfg, 1).blocks[0].fp8_states
    _, s = st.input.cast(_with_amax(3.0), _group("tp"))
    # 448 / 3 / 2 = 74.67 -> 64
    assert float(s) == 64.0
    _, s = st.grad.cast(_with_amax(3.0), _group("tp"))
    # 57344 / 3 / 2 = 9557.3 -> 8192
    assert float(s) == 8192.0


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_bad_amax_keeps_the_previous_scale_delayed(bad: float) -> None:
    cfg = _cfg(scaling="delayed", amax_history_len=2, amax_compute="most_recent")
    model = _model(cfg, 1)
    sc, st = _scaling(cfg, model), model.blocks[0].fp8_states
    tp = _group("tp")
    st.input.cast(_with_amax(4.0), tp)
    sc.update()
    assert float(st.input.scale) == 112.0
    x = torch.full((4,), bad)
    q, _ = st.input.cast(x, tp)
    sc.update()
    assert float(st.input.scale) == 112.0
    # the bad amax enters the history as 0 (no information), so it cannot freeze the scale
    assert st.input.amax_history.tolist() == [0.0, 4.0]
    assert float(st.input.pending) == 0.0
    st.input.cast(_with_amax(2.0), tp)
    sc.update()
    assert float(st.input.scale) == 224.0
    if bad != bad:  # NaN stays NaN through the cast: a broken tensor is still seen as broken
        assert torch.isnan(q.float()).all()


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_bad_amax_keeps_the_previous_scale_current(bad: float) -> None:
    cfg = _cfg(scaling="current")
    st = _model(cfg, 1).blocks[0].fp8_states
    tp = _group("tp")
    _, s = st.weight.cast(_with_amax(7.0), tp)
    first = float(s)
    assert _close(first, 64.0)
    _, s = st.weight.cast(torch.full((3,), bad), tp)
    assert float(s) == first == float(st.weight.scale)


def test_current_scaling_update_is_a_no_op() -> None:
    cfg = _cfg(scaling="current")
    model = _model(cfg, 1)
    sc, st = _scaling(cfg, model), model.blocks[0].fp8_states
    st.input.cast(_with_amax(2.0), _group("tp"))
    before = sc.state_dict()
    sc.update()
    after = sc.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _exercise(sc, model, seed: int, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    tp = _group("tp")
    for _ in range(steps):
        for lin in model.blocks:
            for _, s in lin.fp8_states.roles():
                s.cast(torch.randn(5, generator=g) * float(torch.rand(1, generator=g) * 10), tp)
        sc.update()


def test_state_dict_round_trip_is_bitwise_and_resumes_the_same_scales() -> None:
    cfg = _cfg(scaling="delayed", amax_history_len=5)
    model = _model(cfg)
    sc = _scaling(cfg, model)
    _exercise(sc, model, seed=0)
    # one cast after the last update: pending is part of the state
    model.blocks[1].fp8_states.input.cast(_with_amax(123.0), _group("tp"))
    saved = sc.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in saved.values())
    assert saved["blocks.1.input.pending"].item() == 123.0
    assert saved["blocks.0.grad.initialized"].dtype == torch.bool and bool(saved["blocks.0.grad.initialized"])

    fresh_model = _model(cfg)
    fresh = _scaling(cfg, fresh_model)
    fresh.load_state_dict(saved)
    loaded = fresh.state_dict()
    assert set(loaded) == set(saved)
    for k in saved:
        assert loaded[k].dtype == saved[k].dtype and torch.equal(loaded[k], saved[k]), k
    # saving copies: changing the live state does not change what was saved
    sc.update()
    assert saved["blocks.1.input.pending"].item() == 123.0
    # the restored run repeats the original one from here on
    fresh.update()
    _exercise(sc, model, seed=7)
    _exercise(fresh, fresh_model, seed=7)
    a, b = sc.state_dict(), fresh.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_load_state_dict_refuses_a_mismatch_with_a_clear_error() -> None:
    cfg = _cfg(amax_history_len=4)
    model = _model(cfg)
    sc = _scaling(cfg, model)
    good = sc.state_dict()
    missing = dict(good)
    del missing["blocks.1.weight.scale"]
    with pytest.raises(ValueError, match=r"missing keys \['blocks.1.weight.scale'\]"):
        sc.load_state_dict(missing)
    extra = dict(good, **{"blocks.9.input.scale": torch.ones(())})
    with pytest.raises(ValueError, match=r"unexpected keys \['blocks.9.input.scale'\]"):
        sc.load_state_dict(extra)
    other = _scaling(_cfg(amax_history_len=8), _model(_cfg(amax_history_len=8))).state_dict()
    with pytest.raises(ValueError, match=r"blocks.0.input.amax_history: expected shape \(4,\)"):
        sc.load_state_dict(other)
    # nothing was changed by the refused loads
    now = sc.state_dict()
    assert all(torch.equal(now[k], good[k]) for k in good)


def test_gpt_fp8_linears_are_named_by_their_global_weight_names_in_any_pipeline_layout() -> None:
    from config import load_config
    from fp8.scaling import Fp8Scaling
    from model.gpt import build_chunks, named_parameters
    from model.layers import TPContext
    from parallel.random import RNGTracker

    mcfg = load_config(None, ["model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.seq_len=8",
                              "model.vocab_size=64", "model.ffn_hidden=64"]).model
    cfg = _cfg(output_head=True)
    names = {}
    for pp in (1, 2):
        found = set()
        for pp_rank in range(pp):
            ctx = TPContext(_group("tp"), False, RNGTracker(torch.device("cpu"), 1, 0, 0, 0), fp8=cfg)
            chunks = build_chunks(mcfg, ctx, pp, 1, pp_rank, 1, torch.device("cpu"))
            sc = Fp8Scaling(cfg, _group("tp"), _group("dp")).attach(chunks)
            params = {n[: -len(".weight")] for n, _ in named_parameters(chunks) if n.endswith(".weight")}
            assert set(sc.states) <= params
            found |= set(sc.states)
        names[pp] = found
    want = {f"layers.{i}.{m}" for i in range(4) for m in ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")} | {"head"}
    assert names[1] == names[2] == want
    # without fp8.output_head the head stays bf16
    ctx = TPContext(_group("tp"), False, RNGTracker(torch.device("cpu"), 1, 0, 0, 0), fp8=_cfg())
    chunks = build_chunks(mcfg, ctx, 1, 1, 0, 1, torch.device("cpu"))
    assert set(Fp8Scaling(_cfg(), _group("tp"), _group("dp")).attach(chunks).states) == want - {"head"}


# ---- 2 (TP) x 2 (DP) world -------------------------------------------------------------------------------

# rank = dp_rank * 2 + tp_rank; TP groups {0,1} {2,3}, DP groups {0,2} {1,3}
def _amax(rank: int, lin: int, role: int, step: int) -> float:
    """Distinct per rank: the max over a TP group differs from the max over a DP group and from the global one."""
    return float([1.0, 3.0, 2.0, 0.5][rank] * (1 + lin) * (1 + role) * (step + 1) * 4)


def scaling_world_worker() -> dict:
    import torch.distributed as dist

    from fp8.scaling import ROLES, Fp8Scaling
    from parallel.comm import Group, Ledger

    rank = dist.get_rank()
    groups = {}
    for name, members in (("tp", [[0, 1], [2, 3]]), ("dp", [[0, 2], [1, 3]])):
        for ranks in members:
            pg = dist.new_group(ranks)  # every rank creates every group, in one order
            if rank in ranks:
                groups[name] = Group(name=name, pg=pg, ranks=ranks, rank=ranks.index(rank), link="intra",
                                     ledger=Ledger())
    tp, dp = groups["tp"], groups["dp"]
    out: Dict[str, object] = {}

    # delayed: JIT init over TP and DP, then update()
    cfg = _cfg(scaling="delayed", amax_history_len=3)
    model = _model(cfg, 2)
    sc = Fp8Scaling(cfg, tp, dp).attach([model])
    for step in range(2):
        for li, lin in enumerate(model.blocks):
            for ri, role in enumerate(ROLES):
                getattr(lin.fp8_states, role).cast(_with_amax(_amax(rank, li, ri, step)), tp)
        if step == 0:
            out["jit_scales"] = {(li, role): float(getattr(lin.fp8_states, role).scale)
                                 for li, lin in enumerate(model.blocks) for role in ROLES}
        before = (tp.collectives, dp.collectives)
        tp.ledger.reset()
        dp.ledger.reset()
        sc.update()
        out[f"update{step}_collectives"] = (tp.collectives - before[0], dp.collectives - before[1])
        out[f"update{step}_bytes"] = (dict(tp.ledger.bytes), dict(dp.ledger.bytes))
    out["delayed_state"] = sc.state_dict()

    # current: one scale per TP group from the TP-reduced amax; DP groups are not involved
    cfg = _cfg(scaling="current")
    model = _model(cfg, 1)
    st = model.blocks[0].fp8_states
    before = (tp.collectives, dp.collectives)
    x = _with_amax(_amax(rank, 0, 0, 0))
    q, s = st.input.cast(x, tp)
    out["current"] = (float(s), float(st.input.scale), q.float(), x, (tp.collectives - before[0],
                                                                      dp.collectives - before[1]))
    before = (tp.collectives, dp.collectives)
    Fp8Scaling(cfg, tp, dp).attach([model]).update()
    out["current_update_collectives"] = (tp.collectives - before[0], dp.collectives - before[1])
    return out


@pytest.fixture(scope="module")
def scaling_world():
    return run_world(scaling_world_worker, 4, timeout=120)


def test_jit_init_reduces_the_first_amax_over_tp_and_dp(scaling_world) -> None:
    from fp8.scaling import ROLES

    for rank, res in enumerate(scaling_world):
        for (li, role), s in res["jit_scales"].items():
            ri = ROLES.index(role)
            fmt = E5M2_MAX if role == "grad" else E4M3_MAX
            glob = max(_amax(r, li, ri, 0) for r in range(4))
            assert _close(s, _expected_scale(glob, fmt)), (rank, li, role, s)


def test_update_is_two_all_reduces_and_takes_the_max_over_tp_and_dp(scaling_world) -> None:
    from fp8.scaling import ROLES

    n_linears = 2
    for rank, res in enumerate(scaling_world):
        for step in range(2):
            assert res[f"update{step}_collectives"] == (1, 1), rank
            tp_bytes, dp_bytes = res[f"update{step}_bytes"]
            payload = 4 * len(ROLES) * n_linears  # one fp32 amax per role per linear
            assert tp_bytes == {("all_reduce", "intra", "tp"): round(2 * 1 / 2 * payload)}
            assert dp_bytes == {("all_reduce", "intra", "dp"): round(2 * 1 / 2 * payload)}
        state = res["delayed_state"]
        for li in range(n_linears):
            for ri, role in enumerate(ROLES):
                fmt = E5M2_MAX if role == "grad" else E4M3_MAX
                want = [max(_amax(r, li, ri, step) for r in range(4)) for step in (1, 0)] + [0.0]
                assert state[f"blocks.{li}.{role}.amax_history"].tolist() == want, (rank, li, role)
                assert _close(state[f"blocks.{li}.{role}.scale"].item(), _expected_scale(max(want), fmt))
                assert state[f"blocks.{li}.{role}.pending"].item() == 0.0
    # identical on every rank (what a checkpoint of the stage holds)
    for res in scaling_world[1:]:
        for k, v in scaling_world[0]["delayed_state"].items():
            assert torch.equal(res["delayed_state"][k], v), k


def test_current_scaling_shares_one_scale_per_tp_group(scaling_world) -> None:
    for rank, res in enumerate(scaling_world):
        s, stored, q, x, collectives = res["current"]
        tp_ranks = [0, 1] if rank < 2 else [2, 3]
        want = _expected_scale(max(_amax(r, 0, 0, 0) for r in tp_ranks), E4M3_MAX)
        assert s == stored and _close(s, want), rank
        assert collectives == (1, 0), rank  # one all-reduce over TP, none over DP
        # the cast used that scale (checked by hand: saturating x * s rounded to E4M3)
        assert torch.equal(q, (x * torch.tensor(s)).clamp(-448, 448).to(torch.float8_e4m3fn).float())
        assert res["current_update_collectives"] == (0, 0)
    # TP ranks 0 and 1 have different amaxes (1x and 3x) yet one scale; the other TP group differs
    assert scaling_world[0]["current"][0] == scaling_world[1]["current"][0]
    assert scaling_world[0]["current"][0] != scaling_world[2]["current"][0]


def test_forward_without_autograd_leaves_delayed_amaxes_alone():
    """Validation (no_grad) through an FP8 linear after the JIT init records nothing for the next update:
    evaluating must not change the training run's scales."""
    from config import Fp8Config
    from fp8.linear import fp8_linear
    from fp8.scaling import Fp8States
    from parallel.comm import Group, Ledger

    tp = Group(name="tp", pg=None, ranks=[0], rank=0, link="intra", ledger=Ledger())
    states = Fp8States(Fp8Config())
    for role in ("input", "weight", "grad"):
        getattr(states, role).dp = tp
    w = torch.randn(16, 16, requires_grad=True)
    fp8_linear(torch.randn(4, 2, 16), w, None, states, tp, sp_gather=False, emulate=False).sum().backward()
    before = {r: getattr(states, r).pending.clone() for r in ("input", "weight")}
    with torch.no_grad():
        fp8_linear(100 * torch.randn(4, 2, 16), 100 * w, None, states, tp, sp_gather=False, emulate=False)
    for r, p in before.items():
        assert torch.equal(getattr(states, r).pending, p), r
    fp8_linear(100 * torch.randn(4, 2, 16), w, None, states, tp, sp_gather=False, emulate=False)
    assert states.input.pending > 10 * before["input"], "a training forward does record"


def _weight_cast_worker(keep: bool, stage: int):
    """Losses of 3 steps of 4 micro-batches, and how often each step cast an FP8 linear's weight."""
    import contextlib

    from fp8.scaling import Fp8Scaling, ScaleState
    from tests.parallel_utils import batch_fn, build_engine, tiny_config

    if not keep:  # the reference: every micro-batch casts the weight afresh, as before the step's copy
        Fp8Scaling.step_copies = lambda self: contextlib.nullcontext()
    casts = {"n": 0}
    original = ScaleState.cast

    def counting(self, x, tp, record=True):
        casts["n"] += self.role == "weight"
        return original(self, x, tp, record)

    ScaleState.cast = counting
    engine = build_engine(tiny_config("precision=fp8", "train.global_batch_size=8", "train.micro_batch_size=2",
                                      f"zero.stage={stage}"))
    linears = len(engine.fp8_scaling.states)
    out = []
    for step in range(3):
        casts["n"] = 0
        loss = engine.train_step(batch_fn(engine, step))["loss"]
        out.append((loss, casts["n"] / linears))
    return out


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_each_weight_is_cast_once_a_step_and_trains_as_before(stage):
    """Within a step the weights do not change: the first micro-batch's E4M3 cast serves all four (stages 0-2; stage 3
    gathers weights per module and casts them per micro-batch, keeping no copy of the whole model), with the same
    losses, bit for bit, as casting every micro-batch."""
    kept = run_world(_weight_cast_worker, 1, True, stage)[0]
    fresh = run_world(_weight_cast_worker, 1, False, stage)[0]
    assert [loss for loss, _ in kept] == [loss for loss, _ in fresh]
    assert all(n == 4 for _, n in fresh), fresh  # one cast per micro-batch
    assert all(n == (1 if stage < 3 else 4) for _, n in kept), kept
