"""FP8-LM in the mixture-of-experts layers (``fp8/experts.py``, the expert units of ``fp8/zero.py``).

* The experts' FP8 GEMMs, one process: output, input and weight gradients of both stacked projections (``w_up``
  with SwiGLU's two matrices, ``w_down``) against a float64 reference computed here from the same hand-quantized
  operands, every expert on its own rows (one with none), the scales those of the whole stacked tensors
  (``max / amax``); the tolerance is ``tests/test_fp8_linear.py``'s GEMM bound. Also bit for bit against
  ``fp8/linear.py``'s FP8 linear applied to each expert with those scales, the CUDA row padding of the weight
  gradient forced on CPU, both CPU routes of the product, emulation, E4M3 gradients.
* Training under ``precision=fp8`` (delayed scaling with 4-step histories, mu moving every step) at ep 2 and 4 and
  with ZeRO-1 and ZeRO-3 over the expert-data-parallel groups, against the one-process fp8 run: every step's loss
  within ``TRACK_RTOL`` (the 3% of the dense FP8 layouts, ``tests/test_fp8_e2e.py``; measured <= 1e-3 here), and
  each expert tensor's step-0 gradient norm within 5% (measured <= 3.4%: FP8 casts of differently split tensors;
  a mean over the expert group instead of DP would be off by the factor ep); the expert units' FP8 bytes on the
  expert-data-parallel group, 1 a parameter (+ 4 a tensor); at stage 0 no 16-bit copy of the expert weights; the
  model-state bytes and what stays between steps as the memory estimator says, byte for byte.
* An fp8 MoE checkpoint at ep 2 (ZeRO-1) resumes bit for bit, and at one process on the same curve.
* FP8 tracks bf16 on the MoE model (one process and every layout above) within ``TRACK_RTOL``; with 16-bit GEMMs
  (``fp8.gemm=bf16``) the experts are 16-bit (no FP8 scaling state) and ep 2 is the one-process run too.

Two-layer model (``model.n_layers=2``) to keep the distributed runs short.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import assemble, batch_fn, build_engine, local_grads, tiny_config
from tests.test_fp8_e2e import TRACK_RTOL
from tests.test_fp8_linear import _deq, _gemm_tol, _group, _rand
from tests.test_moe_train import MOE

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMT_MAX = {E4M3: 448.0, E5M2: 57344.0}

# ---- the FP8 GEMMs of the experts, one process --------------------------------------------------------------

E, D, F = 4, 32, 16
COUNTS = [5, 0, 9, 2]  # expert 1 gets no rows


def _experts(scaling: str, emulate: bool, dtype: torch.dtype, grad_format: str):
    from config import Fp8Config, ModelConfig
    from config.moe import MoeConfig
    from model.moe import Experts

    fp8 = Fp8Config(scaling=scaling, emulate=emulate, gradient_format=grad_format)
    m = Experts(ModelConfig(d_model=D, n_layers=1), MoeConfig(num_experts=E, ffn_hidden=F), tp=_group(), fp8=fp8)
    with torch.no_grad():
        m.w_up.copy_(_rand(11, E, 2, F, D, dtype=dtype))
        m.w_down.copy_(_rand(12, E, D, F, dtype=dtype))
    return m.to(dtype)


def _projection_case(m, which: str, dtype: torch.dtype, grad_format: str, emulate: bool) -> Dict[str, tuple]:
    """One stacked projection forward and backward; name -> (actual, reference, tolerance), and the scales used
    against ``max / amax`` of the whole tensors."""
    proj, W = (m.up, m.w_up) if which == "up" else (m.down, m.w_down)
    G = E5M2 if grad_format == "e5m2" else E4M3
    W3 = W.detach().double().reshape(E, -1, W.shape[-1])  # [E, out, in]
    n_in, n_out, N = W3.shape[2], W3.shape[1], sum(COUNTS)
    x = _rand(13, N, n_in, dtype=dtype)
    R = (_rand(14, N, n_out, dtype=dtype) * 1e-3).to(dtype).double()  # the output gradient the layer sees
    xl = x.to(dtype).clone().requires_grad_()
    W.grad = None
    y = proj(xl, COUNTS)
    y.backward(R.to(dtype))
    st = proj.fp8_states
    sx, sw, sg = st.input.scale, st.weight.scale, st.grad.scale
    xq, wq, gq = _deq(x, sx, E4M3), _deq(W3, sw, E4M3), _deq(R, sg, G)
    y_ref, dx_ref, dw_ref = torch.zeros_like(y, dtype=torch.float64), torch.zeros_like(x), torch.zeros_like(W3)
    p_y, p_dx, p_dw = torch.zeros_like(y_ref), torch.zeros_like(dx_ref), torch.zeros_like(dw_ref)
    at = 0
    for e, n in enumerate(COUNTS):  # each expert on its rows, by hand
        rows = slice(at, at + n)
        y_ref[rows], p_y[rows] = xq[rows] @ wq[e].t(), xq[rows].abs() @ wq[e].abs().t()
        dx_ref[rows], p_dx[rows] = gq[rows] @ wq[e], gq[rows].abs() @ wq[e].abs()
        dw_ref[e], p_dw[e] = gq[rows].t() @ xq[rows], gq[rows].abs().t() @ xq[rows].abs()
        at += n
    dw = W.grad.double().reshape(E, n_out, n_in)
    assert y.dtype == xl.grad.dtype == W.grad.dtype == dtype
    assert not dw[1].any(), "an expert without rows has a zero weight gradient"
    checks = {f"{which}/out": (y.double(), y_ref, _gemm_tol(p_y, y_ref, n_in, dtype, emulate)),
              f"{which}/dx": (xl.grad.double(), dx_ref, _gemm_tol(p_dx, dx_ref, n_out, dtype, emulate)),
              f"{which}/dW": (dw, dw_ref, _gemm_tol(p_dw, dw_ref, max(COUNTS), dtype, emulate))}
    scales = {f"{which}/input": (float(sx), FMT_MAX[E4M3] / float(x.abs().max())),
              f"{which}/weight": (float(sw), FMT_MAX[E4M3] / float(W3.abs().max())),
              f"{which}/grad": (float(sg), FMT_MAX[G] / float(R.abs().max()))}
    return {"checks": checks, "scales": scales, "x": x, "R": R, "y": y.detach(), "dx": xl.grad, "dW": W.grad}


def _assert_checks(res: Dict[str, Any], where: str) -> None:
    for name, (actual, expected, tol) in res["checks"].items():
        err = (actual - expected).abs()
        assert not (err > tol).any(), f"{where} {name}: worst error {float(err.max()):.3g}"
    for name, (used, hand) in res["scales"].items():
        assert abs(used - hand) <= 3e-7 * hand, f"{where} {name}: scale {used} != max/amax = {hand}"


def _per_expert_fp8_linear(m, which: str, res: Dict[str, Any], emulate: bool, dtype: torch.dtype, grad_format):
    """``fp8/linear.py``'s FP8 linear on each expert's rows and matrix, with the projection's scales set (delayed
    scaling, initialised): the same operands, so the same bits."""
    from config import Fp8Config
    from fp8.linear import fp8_linear
    from fp8.scaling import Fp8States

    proj, W = (m.up, m.w_up) if which == "up" else (m.down, m.w_down)
    W3 = W.detach().reshape(E, -1, W.shape[-1])
    ys, dxs, dws, at = [], [], [], 0
    for e, n in enumerate(COUNTS):
        st = Fp8States(Fp8Config(scaling="delayed", emulate=emulate, gradient_format=grad_format))
        for role, s in st.roles():
            s.scale.copy_(getattr(proj.fp8_states, role).scale)
            s.initialized.fill_(True)
        x = res["x"][at:at + n].to(dtype).clone().requires_grad_()
        w = W3[e].clone().requires_grad_()
        y = fp8_linear(x, w, None, st, _group(), sp_gather=False, emulate=emulate)
        y.backward(res["R"][at:at + n].to(dtype))
        ys.append(y.detach())
        dxs.append(x.grad)
        dws.append(w.grad)
        at += n
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws).view(W.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("route", ["auto", "native", "padded"])
def test_expert_fp8_gemms_match_the_dequantized_float64_reference(dtype, route, monkeypatch):
    """``route``: the CPU product as the fp32 GEMM of the widened FP8 operands (``auto``), torch's CPU
    ``_scaled_mm`` (``native``), or ``auto`` with CUDA's padding of each expert's rows to 16 in the weight-gradient
    GEMM forced on CPU (``padded``)."""
    import fp8.experts as fx
    import fp8.linear as fl

    monkeypatch.setenv("GPT_CPU_FP8_GEMM", "native" if route == "native" else "auto")
    fl.cpu_fp32.cache_clear()
    if route == "padded":
        monkeypatch.setitem(fx.ROW_MULTIPLE, "cpu", 16)
    try:
        for scaling in ("current", "delayed"):
            for emulate in (False, True):
                for grad_format in ("e5m2", "e4m3") if scaling == "current" else ("e5m2",):
                    m = _experts(scaling, emulate, dtype, grad_format)
                    for which in ("up", "down"):
                        where = f"{route}/{scaling}/emulate={emulate}/{grad_format}/{str(dtype)[6:]}"
                        res = _projection_case(m, which, dtype, grad_format, emulate)
                        _assert_checks(res, where)
                        if scaling == "delayed":  # the per-expert FP8 linear with these scales: the same bits
                            y, dx, dw = _per_expert_fp8_linear(m, which, res, emulate, dtype, grad_format)
                            assert torch.equal(y, res["y"]) and torch.equal(dx, res["dx"]), where
                            assert torch.equal(dw, res["dW"]), where
    finally:
        fl.cpu_fp32.cache_clear()


def test_experts_are_fp8_linears_named_by_their_projection_and_read_only_through_them():
    """Fp8Scaling names the experts' two states by module path; at FP8-LM's stage 0 the expert weights are among
    the weights only FP8 GEMMs read (no 16-bit copy); bad shapes are refused."""
    from config import Fp8Config
    from fp8.experts import fp8_experts
    from fp8.scaling import Fp8Scaling, Fp8States, fp8_only_weights

    m = _experts("delayed", False, torch.float32, "e5m2")
    scaling = Fp8Scaling(Fp8Config(), _group(), _group()).attach([m])
    assert sorted(scaling.states) == ["down", "up"]
    assert set(fp8_only_weights([m])) == {m.w_up, m.w_down}
    assert [n for n, _ in m.named_parameters()] == ["w_up", "w_down"]
    with pytest.raises(ValueError, match="counts sum to 15"):
        fp8_experts(torch.zeros(16, F), m.w_down, [5, 0, 8, 2], Fp8States(Fp8Config()), _group(), emulate=False)
    with pytest.raises(ValueError, match="do not match the stacked weight"):
        fp8_experts(torch.zeros(16, D), m.w_down, COUNTS, Fp8States(Fp8Config()), _group(), emulate=False)


# ---- training -------------------------------------------------------------------------------------------------

FP8 = ["precision=fp8", "fp8.amax_history_len=4", "fp8.mu_growth_interval=1"]
COMMON = MOE + ["model.n_layers=2"]
STEPS = 6
LAYOUTS = {
    "ep2": (2, ["parallel.ep=2"]),
    "ep4": (4, ["parallel.ep=4"]),
    "zero1_ep2": (2, ["zero.stage=1", "parallel.ep=2"]),
    "zero3_ep2_dp4": (4, ["zero.stage=3", "parallel.ep=2"]),
}
_cache: Dict[tuple, List[Dict[str, Any]]] = {}


def fp8_worker(overrides: List[str], steps: int, mode: str = "none", ckpt_dir: str = "",
               save_at: int = -1) -> Dict[str, Any]:
    """Train to ``steps`` (resuming from ``ckpt_dir`` when mode is 'resume'; saving there after step ``save_at``
    and going on): losses by step, the step-0 gradients, the last step's bytes by kind/group, which expert
    weights hold no data (FP8-LM's stage 0) and the names of the FP8 scaling states."""
    from training.checkpoint import Checkpointer

    cfg = tiny_config(*COMMON, *overrides)
    engine = build_engine(cfg)
    ckpt = Checkpointer(cfg, ckpt_dir, engine) if ckpt_dir else None
    if mode == "resume":
        ckpt.load(ckpt.find_resumable())
    losses, grads = {}, None
    while engine.step < steps:
        step = engine.step
        engine.mesh.ledger.reset()
        losses[step] = engine.train_step(batch_fn(engine, step))["loss"]
        if step == 0:
            grads = local_grads(engine)
        if engine.step == save_at:
            ckpt.save(engine.step, engine.step * cfg.train.global_batch_size)
    from training.memory import held_between_steps, model_state_bytes

    experts = [p for n, p in engine.params.items() if ".experts." in n]
    scaling = engine.fp8_scaling
    layout, rank = engine.mesh.layout, engine.mesh.rank
    fp8 = scaling is not None  # (the estimator's FP8 bytes, against the strategy's)
    return {"losses": losses, "grads": grads, "memory": engine.dp.memory() if fp8 else None,
            "held": engine.dp.working.now if fp8 else None, "estimated": model_state_bytes(cfg, layout, rank),
            "held_estimate": held_between_steps(cfg, layout, rank),
            "raw": {f"{kind}/{group}": n for (kind, _, group), n in engine.mesh.ledger.bytes.items()},
            "no_data": [p.untyped_storage().nbytes() <= p.element_size() for p in experts],
            "states": sorted(scaling.states) if scaling is not None else None}


def run(world: int, overrides: List[str], steps: int = STEPS) -> List[Dict[str, Any]]:
    key = (world, tuple(overrides), steps)
    if key not in _cache:
        _cache[key] = run_world(fp8_worker, world, list(overrides), steps, timeout=300)
    return _cache[key]


@pytest.fixture(scope="module")
def ep2_checkpoint(tmp_path_factory):
    """The zero1_ep2 layout's run, which saves a checkpoint after step 3 and goes on to the end (it is that
    layout's run for the other tests too)."""
    world, overrides = LAYOUTS["zero1_ep2"]
    ckpt = tmp_path_factory.mktemp("fp8_moe_ckpt")
    _cache[(world, tuple(FP8 + overrides), STEPS)] = run_world(fp8_worker, world, FP8 + overrides, STEPS, "none",
                                                               str(ckpt), 3, timeout=300)
    return ckpt


def _curve(result: Dict[str, Any]) -> List[float]:
    return [result["losses"][s] for s in sorted(result["losses"])]


def test_fp8_tracks_bf16_on_the_moe_model_and_the_experts_are_fp8():
    fp8, bf16 = run(1, FP8)[0], run(1, ["precision=bf16"])[0]
    assert _curve(fp8) == pytest.approx(_curve(bf16), rel=TRACK_RTOL)
    assert _curve(fp8)[-1] < _curve(fp8)[0] - 0.1, "fp8 must learn"
    assert _curve(fp8) != _curve(bf16)  # (the experts' FP8 casts change the numbers)
    assert [s for s in fp8["states"] if ".experts." in s] == [f"layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                                              for p in ("down", "up")]
    assert fp8["no_data"] and all(fp8["no_data"]), "stage 0 keeps no 16-bit copy of the expert weights"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_layout_equals_one_process(request, layout):
    world, overrides = LAYOUTS[layout]
    if layout == "zero1_ep2":
        request.getfixturevalue("ep2_checkpoint")
    ref, bf16 = run(1, FP8)[0], run(1, ["precision=bf16"])[0]
    results = run(world, FP8 + overrides)
    last = results[-1]
    assert all(_curve(r) == _curve(last) for r in results), "every rank reports the same global loss"
    assert _curve(last) == pytest.approx(_curve(ref), rel=TRACK_RTOL), (_curve(last), _curve(ref))
    assert _curve(last) == pytest.approx(_curve(bf16), rel=TRACK_RTOL)
    grads, want = assemble([r["grads"] for r in results]), assemble([ref["grads"]])
    assert grads.keys() == want.keys()
    for name in [n for n in want if ".experts." in n]:  # the whole stacked tensor, from the EP ranks' pieces
        ratio = float(grads[name].norm() / want[name].norm())
        assert abs(ratio - 1) <= 0.05, f"{name}: gradient norm {ratio:.3f} x the one-process run's"
    if "zero" not in layout:
        assert all(all(r["no_data"]) for r in results)
    for r in results:  # the estimator knows where every FP8 state byte of the expert units lives
        for k in ("parameters", "gradients", "optimizer", "fp8_weights"):
            assert r["memory"][k] == r["estimated"][k], (k, r["memory"], r["estimated"])
        assert r["held"] == r["held_estimate"], r


def test_expert_fp8_bytes_move_over_the_expert_data_parallel_group():
    """ZeRO-3, ep 2 x dp 4: each MoE layer's expert unit (this rank's 2 experts' w_up and w_down, whole tensors
    owned within the group of 2 DP ranks holding the same experts) reduces its FP8 gradients by an all-to-all of
    1 byte an element and gathers its E4M3 weights with their fp32 scales, forward and backward, on that group;
    the scales' MIN all-reduce too. Nothing of the experts crosses the whole DP group."""
    from parallel.zero.partition import shard_layout

    world, overrides = LAYOUTS["zero3_ep2_dp4"]
    raw = run(world, FP8 + overrides)[0]["raw"]
    n, layers, local = 2, 2, E // 2  # expert-data-parallel ranks, MoE layers, experts on this rank
    numels = [local * 2 * 32 * 64, local * 64 * 32]  # w_up [2, 2, F, d], w_down [2, d, F] (ffn 32, d_model 64)
    s = shard_layout(numels, n, "whole_tensor").shard_size
    microbatches = 1  # global batch 8 = 4 DP ranks x micro-batch 2
    assert raw["all_to_all/edp"] == layers * (n - 1) * s
    assert raw["all_gather/edp"] == layers * 2 * microbatches * (n - 1) * (s + 4 * len(numels))
    assert raw["all_reduce/edp"] == layers * 4 * len(numels)


def test_fp8_checkpoint_at_ep2_resumes_bit_for_bit_and_at_one_process(ep2_checkpoint):
    """ZeRO-1 at ep 2, saved after step 3 by a run that went on: resumed in the same layout the losses are that
    run's, bit for bit (masters, moments, mu, the experts' scales and amax histories); resumed at one process
    (every expert on one rank) on the same curve within FP8's tolerance. The experts' scaling states are in the
    checkpoint."""
    import pickle

    _, overrides = LAYOUTS["zero1_ep2"]
    straight = run(2, FP8 + overrides)[0]["losses"]
    resumed = run_world(fp8_worker, 2, FP8 + overrides, STEPS, "resume", str(ep2_checkpoint), timeout=300)
    assert sorted(resumed[0]["losses"]) == [3, 4, 5]
    for step in (3, 4, 5):
        assert resumed[0]["losses"][step] == straight[step], (step, resumed[0]["losses"], straight)
    one = run_world(fp8_worker, 1, FP8, STEPS, "resume", str(ep2_checkpoint), timeout=300)[0]["losses"]
    assert [one[s] for s in (3, 4, 5)] == pytest.approx([straight[s] for s in (3, 4, 5)], rel=TRACK_RTOL)
    with open(ep2_checkpoint / "step_00000003" / ".metadata", "rb") as f:
        keys = set(pickle.load(f).state_dict_metadata)  # written by this test's own run
    assert {f"fp8.layers.1.mlp.experts.{p}.{r}.amax_history" for p in ("up", "down")
            for r in ("input", "weight", "grad")} <= keys


def test_with_16bit_gemms_the_experts_are_16bit_and_ep2_is_the_one_process_run():
    """fp8.gemm=bf16 (an A100's path): no FP8 scaling state at all, the experts' weights kept as 16-bit working
    weights; FP8-LM's gradients, communication and optimizer over the expert groups as with FP8 GEMMs."""
    over = FP8 + ["fp8.gemm=bf16"]
    one = run(1, over, 3)[0]
    split = run(2, over + ["parallel.ep=2"], 3)
    assert one["states"] == [] and not any(one["no_data"])
    assert _curve(split[0]) == pytest.approx(_curve(one), rel=TRACK_RTOL)


def test_a_checkpoint_without_the_experts_scaling_states_is_refused_naming_them(ep2_checkpoint, tmp_path):
    """What an fp8 MoE checkpoint written before the experts' GEMMs were FP8 holds (every tensor but the
    ``fp8.layers.<i>.mlp.experts.*`` scaling states): its resume stops with one line naming the first missing one."""
    import pickle
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp

    from tests.test_fp8_e2e import _rehash_all, resume_worker

    step_dir = tmp_path / "step_00000003"
    shutil.copytree(ep2_checkpoint / "step_00000003", step_dir)
    (tmp_path / "latest").write_text("step_00000003\n")
    with open(step_dir / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # written by this module's own run
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if ".experts." not in k or not k.startswith("fp8.")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
        for p in list(step_dir.glob("__*.distcp")) + [step_dir / ".metadata"]:
            p.unlink()
        dcp.save(state, checkpoint_id=str(step_dir), no_dist=True)
    _rehash_all(step_dir)
    error = run_world(resume_worker, 1, COMMON + FP8, str(tmp_path), 5)[0].get("error")
    assert error is not None and "\n" not in error, error
    assert "tensor fp8.layers.0.mlp.experts." in error and "is not there" in error, error
