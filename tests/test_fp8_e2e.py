"""FP8-LM end to end: the real engine under ``precision=fp8`` on CPU (gloo), against bf16 references.

* tracking: every step's loss within ``TRACK_RTOL`` of the bf16 run of the same layout (measured: see
  the test), over single process, plain DP, ZeRO-1 with TP + SP, ZeRO-3 with hpZ, and PP;
* resume: a run stopped and resumed repeats the uninterrupted per-step losses (1e-6), with mu moving
  every step and delayed-scaling histories in use, so forgetting any of them would show;
* bytes: counted = analytic (``parallel/volume.py``) per group; FP8 gradient reduction = half of bf16's,
  FP8 SP all-gathers = half, FP8 stage-3 weight gathers = half (+ the per-tensor scales);
* memory: measured model-state bytes per parameter, 6 (+ scales) on one rank against 16;
* GEMM paths (``fp8.gemm``): every test here runs with FP8 GEMMs and with the 16-bit GEMMs of GPUs without FP8
  tensor cores where it applies: all three (fp8, bf16, fp16) where the GEMM's dtype changes what is measured
  (tracking, TP bytes), fp8 and fp16 where only the data-parallel strategy is (fp16 is the 16-bit path that differs
  there: fp16 working weights, the loss scaler, no FP8 scaling state; bf16 GEMMs leave the strategy as fp8's).
  The device rule and the fp16 loss scaler: ``tests/test_fp8_gemm.py``.
"""
import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import batch_fn, build_engine, checkpoint_worker, tiny_config
from tests.test_comm_volume import assert_counted_equals_analytic

FP8 = "precision=fp8"
GEMMS = ["fp8", "bf16", "fp16"]
"""fp8.gemm settings of the tests where the GEMM's dtype matters."""
DP_GEMMS = ["fp8", "fp16"]
"""... and of those where only the data-parallel strategy does."""
TRACK_RTOL = 0.03
STEPS = 6
LAYOUTS = {
    "single": (1, []),
    "dp2_stage0": (2, []),
    "tp2_sp_dp2_zero1": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "zero.stage=1"]),
    "dp4_zero3_hpz2": (4, ["zero.stage=3", "zero.hpz_size=2", "parallel.ranks_per_node=4"]),
    "pp2_dp2_zero2": (4, ["parallel.pp=2", "zero.stage=2"]),
}
_cache = {}


def worker(overrides, steps):
    cfg = tiny_config(*overrides)
    engine = build_engine(cfg)
    losses, records = [], []
    for step in range(steps):
        engine.mesh.ledger.reset()
        losses.append(engine.train_step(batch_fn(engine, step))["loss"])
        if engine.fp8_scaling is not None:
            records.append(engine.dp.fp8_record())
    comm = engine.mesh.ledger.snapshot()
    raw = {f"{kind}/{group}": n for (kind, _, group), n in engine.mesh.ledger.bytes.items()}
    from training.memory import held_between_steps, model_state_bytes

    return {"losses": losses, "fp8": records, "comm": comm, "raw": raw, "memory": engine.dp.memory(),
            "estimated": model_state_bytes(cfg, engine.mesh.layout, engine.mesh.rank),
            "held": engine.dp.working.now if hasattr(engine.dp, "working") else 0, "held_estimate": held_between_steps(cfg, engine.mesh.layout, engine.mesh.rank),
            "phi": sum(p.numel() for p in engine.params.values())}


def run(world, overrides, steps=STEPS):
    key = (world, tuple(overrides), steps)
    if key not in _cache:
        _cache[key] = run_world(worker, world, list(overrides), steps, timeout=300)
    return _cache[key]


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_tracks_bf16_and_counts_its_bytes(name, gemm):
    world, overrides = LAYOUTS[name]
    ref = run(world, overrides + ["precision=bf16"])
    out = run(world, overrides + [FP8, f"fp8.gemm={gemm}"])
    worst = max(abs(a - b) / b for a, b in zip(out[0]["losses"], ref[0]["losses"]))
    assert worst <= TRACK_RTOL, (out[0]["losses"], ref[0]["losses"])
    assert out[0]["losses"][-1] < out[0]["losses"][0] - 0.1, "fp8 must learn"
    assert all(r["losses"] == out[0]["losses"] for r in out), "every rank reports the same global loss"
    assert_counted_equals_analytic(out, overrides + [FP8, f"fp8.gemm={gemm}"], world)
    for r in out:  # the estimator knows where every FP8 state byte lives (whole-tensor owners included)
        for k in ("parameters", "gradients", "optimizer", "fp8_weights"):
            assert r["memory"][k] == r["estimated"][k], (k, r["memory"], r["estimated"])
        # and what stays between steps: stage 0 its bf16 working weights (materialised once a step), else nothing
        assert r["held"] == r["held_estimate"], r


@pytest.mark.parametrize("gemm", DP_GEMMS)
@pytest.mark.parametrize("accumulation", ["compute", "fp32"])
def test_gradient_accumulation_dtype_sets_the_working_bytes_the_estimator_counts(accumulation, gemm):
    """fp8.grad_accumulation: micro-batch weight gradients add up in the compute dtype's 16 bits (the default: bf16,
    fp16 with fp16 GEMMs) or fp32 buffers; the working peak (every unit's sums live from the first backward to the
    last micro-batch's reduction) is what the estimator says, byte for byte, and it is 2 bytes a parameter less in
    16 bits. Both train."""
    over = [FP8, "train.global_batch_size=16", "train.micro_batch_size=4", f"fp8.gemm={gemm}"]
    r = run(1, over + [f"fp8.grad_accumulation={accumulation}"])[0]
    other = run(1, over + [f"fp8.grad_accumulation={'fp32' if accumulation == 'compute' else 'compute'}"])[0]
    assert r["memory"]["working_peak"] == r["estimated"]["working_peak"], (r["memory"], r["estimated"])
    saved = (1 if accumulation == "fp32" else -1) * (r["memory"]["working_peak"] - other["memory"]["working_peak"])
    assert saved == 2 * r["phi"], (saved, r["phi"])
    assert r["losses"][-1] < r["losses"][0] - 0.1, r["losses"]
    # the sums differ by a 16-bit rounding only: the same run within a hair
    worst = max(abs(a - b) / b for a, b in zip(r["losses"], other["losses"]))
    assert worst <= 2e-3, (r["losses"], other["losses"])


@pytest.mark.parametrize("gemm", DP_GEMMS)
def test_fp8_gradient_reduction_is_half_of_bf16(gemm):
    """ZeRO-1 over 2 ranks, whole tensors in both: the FP8 all-to-all moves half the bf16 reduce-scatter's bytes,
    and the shared-scale agreement adds one fp32 min per tensor."""
    over = ["zero.stage=1", "zero.partition=whole_tensor"]
    bf16 = run(2, over + ["precision=bf16"])[0]["raw"]
    fp8 = run(2, over + [FP8, f"fp8.gemm={gemm}"])[0]["raw"]
    assert fp8["all_to_all/dp"] * 2 == bf16["reduce_scatter/dp"]
    assert "reduce_scatter/dp" not in fp8


@pytest.mark.parametrize("gemm", GEMMS)
def test_fp8_sequence_parallel_gathers_are_half(gemm):
    """tp2 + SP: the all-gathers in front of the FP8 linears (QKV and MLP-up inputs, forward) move E4M3 bytes:
    bf16 all-gather bytes minus fp8's = exactly half of those gathers' bf16 bytes. With 16-bit GEMMs the
    activations are not quantized: the gathers move the 16-bit bytes of bf16's."""
    world, overrides = LAYOUTS["tp2_sp_dp2_zero1"]
    cfg = tiny_config(*overrides)
    bf16 = run(world, overrides + ["precision=bf16"])[0]["raw"]["all_gather/tp"]
    fp8 = run(world, overrides + [FP8, f"fp8.gemm={gemm}"])[0]["raw"]["all_gather/tp"]
    if gemm != "fp8":
        assert fp8 == bf16
        return
    m, t = cfg.model, 2
    slice_bf16 = m.seq_len // t * cfg.train.micro_batch_size * m.d_model * 2  # one rank's piece, bf16 bytes
    microbatches = cfg.train.global_batch_size // cfg.train.micro_batch_size // 2
    fp8_gathers = 2 * m.n_layers * microbatches
    assert bf16 - fp8 == fp8_gathers * (t - 1) * slice_bf16 // 2


@pytest.mark.parametrize("gemm", DP_GEMMS)
def test_fp8_stage3_weight_gathers_are_half(gemm):
    over = ["zero.stage=3", "zero.partition=whole_tensor"]
    bf16 = run(2, over + ["precision=bf16"])[0]["raw"]["all_gather/dp"]
    fp8 = run(2, over + [FP8, f"fp8.gemm={gemm}"])[0]["raw"]["all_gather/dp"]
    cfg = tiny_config(*over)
    tensors_per_layer = 6  # qkv, proj, up, down, two norms
    microbatches = cfg.train.global_batch_size // cfg.train.micro_batch_size // 2
    tensors = cfg.model.n_layers * tensors_per_layer + 3  # blocks, embedding, final norm, head
    # one fp32 scale per tensor and gather: forward and backward per micro-batch, except the embedding's backward
    # (a lookup's backward does not read its weights: not gathered)
    scales = 4 * (2 * tensors - 1) * microbatches
    assert fp8 == bf16 // 2 + scales


@pytest.mark.parametrize("gemm", DP_GEMMS)
def test_fp8_model_state_is_6_bytes_a_parameter(gemm):
    """One rank: master FP16 (2) + FP8 gradient (1) + E4M3 m (1) + FP16 v (2), scales on top, vs bf16's 16.
    ZeRO-1 on 4 ranks: each rank holds the E4M3 weights (1) and its whole tensors' 6; summed over ranks the
    sharded part is 6 a parameter again."""
    fp8 = run(1, [FP8, f"fp8.gemm={gemm}"])[0]
    bf16 = run(1, ["precision=bf16"])[0]

    def state(r):
        return sum(r["memory"][k] for k in ("parameters", "gradients", "optimizer")) / r["phi"]

    assert state(bf16) == 16
    assert 6.0 <= state(fp8) <= 6.2
    assert fp8["memory"]["fp8_weights"] <= 4 * 64, "stage 0 keeps no E4M3 weight copy (only unused scales)"
    out = run_world(worker, 4, ["zero.stage=1", FP8, f"fp8.gemm={gemm}", "train.global_batch_size=8"], 1)
    phi = out[0]["phi"]
    assert 6.0 <= sum(state(r) for r in out) <= 6.2  # each rank its whole tensors' share: 6 a parameter in all
    assert all(state(r) < 6.2 / 4 * 1.3 for r in out), [state(r) for r in out]  # and roughly a quarter each
    assert all(phi <= r["memory"]["fp8_weights"] <= phi * 1.01 for r in out)  # + the E4M3 weights, 1 a parameter


@pytest.mark.parametrize("gemm", DP_GEMMS)
@pytest.mark.parametrize("world,overrides", [(1, []), (2, ["zero.stage=3"])])
def test_fp8_resume_repeats_the_uninterrupted_losses(tmp_path, world, overrides, gemm):
    """mu doubles after every clean step (interval 1) and halves on overflow, delayed scaling keeps 4 steps of
    history: a resume that lost mu, the histories, the scales or the FP8 optimizer state would differ. fp16 GEMMs
    (no FP8 scaling state at all): the loss scale starts where the tiny model's fp16 gradients overflow and grows
    every clean step, so steps are skipped and S and mu both move inside the window (a resume that lost the
    scaler's state would differ too)."""
    over = [FP8, f"fp8.gemm={gemm}", "fp8.mu_growth_interval=1", "fp8.amax_history_len=4", *overrides]
    if gemm == "fp16":
        over += ["loss_scale.initial=16777216", "loss_scale.growth_interval=1"]
    straight = run_world(checkpoint_worker, world, over, "none", 6, str(tmp_path / "a"))
    run_world(checkpoint_worker, world, over, "fresh", 3, str(tmp_path / "b"))
    resumed = run_world(checkpoint_worker, world, over, "resume", 6, str(tmp_path / "b"))
    for step in (3, 4, 5):
        assert abs(resumed[0][step] - straight[0][step]) <= 1e-6, (step, resumed[0], straight[0])
    mus = [r["mu"] for r in run(world, over, 6)[0]["fp8"]]
    assert len(set(mus)) > 1, f"mu never moved: {mus}"


@pytest.mark.parametrize("gemm", DP_GEMMS)
def test_mu_halves_while_the_reduced_gradient_overflows(gemm):
    """mu starting at 2**20 on 2 ranks: the reduced FP8 gradient saturates, so mu halves every step, and the
    metrics record says so."""
    recs = run(2, [FP8, f"fp8.gemm={gemm}", "fp8.mu_initial=1048576"], 4)[0]["fp8"]
    assert [r["mu"] for r in recs] == [2.0 ** (20 - k) for k in range(4)]
    assert all(r["overflow_fraction"] > 1e-5 for r in recs)
    assert recs[-1]["mu_changes"] == 4


# -- hand-edited checkpoints and precision changes on resume (issue 17) ---------------------------------------------

def resume_worker(overrides, ckpt_dir, steps):
    """Resume from ckpt_dir to ``steps``: (losses, console output) or the CheckpointError's message."""
    import contextlib
    import io

    from training.checkpoint import CheckpointError

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            losses = checkpoint_worker(overrides, "resume", steps, ckpt_dir)
    except CheckpointError as e:
        return {"error": str(e)}
    return {"losses": losses, "stdout": out.getvalue()}


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """An fp8 run (delayed scaling, 4-step histories) saved at step 3, single process."""
    ckpt = tmp_path_factory.mktemp("fp8_ckpt")
    run_world(checkpoint_worker, 1, [FP8, "fp8.amax_history_len=4"], "fresh", 3, str(ckpt))
    return ckpt


def _rehash_all(step_dir):
    """The manifest of every file now in the directory (hashlib, as whoever edited it would)."""
    import hashlib
    import json

    files = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in step_dir.iterdir() if p.name != "manifest.json"}
    manifest = json.loads((step_dir / "manifest.json").read_text())
    (step_dir / "manifest.json").write_text(json.dumps({**manifest, "files": files}))


def _edit_tensor(step_dir, key, edit):
    """Rewrite the checkpoint's tensors with stock DCP (no process group) after ``edit(tensors[key])``."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    with open(step_dir / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # written by this test's own run
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
        if key is not None:
            edit(state[key])
        for p in list(step_dir.glob("__*.distcp")) + [step_dir / ".metadata"]:
            p.unlink()
        dcp.save(state, checkpoint_id=str(step_dir), no_dist=True)
    _rehash_all(step_dir)


def _first(step_dir, suffix):
    import pickle

    with open(step_dir / ".metadata", "rb") as f:
        return sorted(k for k in pickle.load(f).state_dict_metadata if k.startswith("fp8.") and k.endswith(suffix))[0]


@pytest.mark.parametrize("case,world,layout", [
    ("untouched", 1, []), ("scale_nan", 1, []), ("scale_zero", 1, []), ("history_nan", 1, []), ("mu_nan", 1, []),
    ("scale_nan", 2, ["parallel.pp=2"])], ids=["untouched", "scale_nan", "scale_zero", "history_nan", "mu_nan",
                                               "scale_nan_on_one_stage_of_pp2"])
def test_fp8_scaling_state_no_run_produces_is_refused_naming_it(fp8_checkpoint, tmp_path, case, world, layout):
    """A hand-edited checkpoint (manifest re-hashed) whose FP8 scale is NaN or 0, whose amax history holds a NaN
    or whose mu is NaN stops the resume with one line naming the tensor, on every rank (under pp=2 only the
    first stage holds the edited layer: the other must stop too, not wait in a collective). 'untouched' is the
    same rewrite without an edit: it resumes."""
    import json
    import math
    import shutil

    step_dir = tmp_path / "step_00000003"
    shutil.copytree(fp8_checkpoint / "step_00000003", step_dir)
    (tmp_path / "latest").write_text("step_00000003\n")
    key, expected = None, None
    if case.startswith("scale"):
        key = _first(step_dir, ".input.scale" if case == "scale_nan" else ".weight.scale")
        value = float("nan") if case == "scale_nan" else 0.0
        _edit_tensor(step_dir, key, lambda t: t.fill_(value))
        expected = f"{key[len('fp8.'):]} is {value}"
    elif case == "history_nan":
        key = _first(step_dir, ".grad.amax_history")
        _edit_tensor(step_dir, key, lambda t: t.__setitem__(1, float("nan")))
        expected = f"{key[len('fp8.'):]} is [nan]"
    elif case == "mu_nan":
        meta = json.loads((step_dir / "meta.json").read_text())
        meta["fp8"]["mu"] = float("nan")
        (step_dir / "meta.json").write_text(json.dumps(meta))
        _rehash_all(step_dir)
        expected = "mu is nan"
    else:
        _edit_tensor(step_dir, None, None)
    out = run_world(resume_worker, world, [FP8, "fp8.amax_history_len=4", *layout], str(tmp_path), 5)
    if expected is None:
        assert all("error" not in r for r in out), out[0]
        assert sorted(out[0]["losses"]) == [3, 4] and all(math.isfinite(v) for v in out[0]["losses"].values())
        return
    assert all(r == out[0] for r in out), out  # every rank stops with the same line
    error = out[0].get("error")
    assert error is not None and expected in error and "\n" not in error, error
    assert str(step_dir) in error


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("bf16_ckpt")
    run_world(checkpoint_worker, 1, ["precision=bf16"], "fresh", 3, str(ckpt))
    return ckpt


@pytest.fixture(scope="module")
def fp8_bf16_gemm_checkpoint(tmp_path_factory):
    """An fp8 run with bf16 GEMMs (an A100's path: no FP8 scaling state) saved at step 3."""
    ckpt = tmp_path_factory.mktemp("fp8_bf16_gemm_ckpt")
    run_world(checkpoint_worker, 1, [FP8, "fp8.gemm=bf16"], "fresh", 3, str(ckpt))
    return ckpt


GEMM_CHANGE = "resuming a precision=fp8 checkpoint with fp8.gemm={} as fp8.gemm={}: {}; mu and the FP8 optimizer "\
              "state carry on"


@pytest.mark.parametrize("saved,resumed,line", [
    ("fp8", ["precision=bf16"], "resuming a precision=fp8 checkpoint as precision=bf16: its FP8 scaling state "
                                "(scales, amax histories, mu) is dropped"),
    ("bf16", [FP8], "resuming a precision=bf16 checkpoint as precision=fp8: FP8 scales, amax histories and mu start "
                    "fresh"),
    ("fp8", [FP8], None),
    ("fp8", [FP8, "fp8.gemm=bf16"], GEMM_CHANGE.format("fp8", "bf16", "its FP8 scales and amax histories are dropped")),
    ("fp8_bf16_gemm", [FP8], GEMM_CHANGE.format("bf16", "fp8", "FP8 scales and amax histories start fresh")),
    ("fp8_bf16_gemm", [FP8, "fp8.gemm=fp16"], GEMM_CHANGE.format("bf16", "fp16", "the fp16 loss scale starts fresh at "
                                                                              "loss_scale.initial=65536"))],
    ids=["fp8_as_bf16", "bf16_as_fp8", "fp8_as_fp8", "fp8_gemm_as_bf16_gemm", "bf16_gemm_as_fp8_gemm",
         "bf16_gemm_as_fp16_gemm"])
def test_resuming_in_another_precision_says_so_and_continues(request, tmp_path, saved, resumed, line):
    """A resume into another precision or GEMM path (an A100 job moved to an H100 or a V100) continues, saying on
    one line what happens to the FP8 scaling state and the fp16 loss scale; mu and the FP8 optimizer state carry
    over between GEMM paths."""
    import math
    import shutil

    shutil.copytree(request.getfixturevalue(f"{saved}_checkpoint"), tmp_path / "ckpt")
    out = run_world(resume_worker, 1, [*resumed, "fp8.amax_history_len=4"], str(tmp_path / "ckpt"), 5)[0]
    assert "error" not in out, out
    said = [s for s in out["stdout"].splitlines() if "resuming a precision=" in s]
    assert said == ([f"[checkpoint] {line} (step_00000003)"] if line else []), out["stdout"]
    assert sorted(out["losses"]) == [3, 4] and all(math.isfinite(v) for v in out["losses"].values())


@pytest.mark.parametrize("gemm", DP_GEMMS)
@pytest.mark.parametrize("world,overrides", [(1, []), (2, ["zero.stage=1"]),
                                             (4, ["zero.stage=3", "zero.hpz_size=2", "parallel.ranks_per_node=4"])],
                         ids=["single_stage0", "dp2_stage1", "dp4_stage3_hpz2"])
def test_packed_unit_updates_give_the_per_tensor_bits(world, overrides, gemm):
    """FP8-LM's whole-unit updates (AdamW, norm, weight dequantization: what CUDA runs, FP8_PACKED=1) give the
    per-tensor loops' losses bit for bit (gradient clipping off: the norm's summation order differs)."""
    over = [FP8, f"fp8.gemm={gemm}", *overrides]
    per_tensor = run_world(worker, world, over, 4, timeout=300, env={"FP8_PACKED": "0"})
    packed = run_world(worker, world, over, 4, timeout=300, env={"FP8_PACKED": "1"})
    for a, b in zip(per_tensor, packed):
        assert a["losses"] == b["losses"], (a["losses"], b["losses"])
        assert a["fp8"] == b["fp8"]
        assert a["memory"] == b["memory"]
    assert per_tensor[0]["losses"][-1] < per_tensor[0]["losses"][0]
