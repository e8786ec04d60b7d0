"""Model-state bytes each rank really holds match the estimator, and the estimator follows ZeRO's accounting."""
import pytest

from tests.dist_harness import run_world
from tests.parallel_utils import batch_fn, build_engine, tiny_config

MODEL = ["model.d_model=128", "model.vocab_size=512", "model.n_layers=4"]


def measure_worker(overrides):
    from model.flops import parameter_count
    from training.memory import held_between_steps, model_state_bytes

    cfg = tiny_config(*MODEL, *overrides)
    engine = build_engine(cfg)
    for step in range(2):
        engine.train_step(batch_fn(engine, step))
    layout, rank = engine.mesh.layout, engine.mesh.rank
    return {"measured": engine.dp.memory(), "estimated": model_state_bytes(cfg, layout, rank),
            "phi": parameter_count(cfg.model)["total"], "held": engine.dp.working.now if hasattr(engine.dp, "working") else 0,
            "held_estimate": held_between_steps(cfg, layout, rank)}


# bytes per parameter in ZeRO's accounting (paper: K = 12 for mixed-precision Adam), N = 4, padding aside
ZERO_ACCOUNTING = {
    ("fp32", 0): 16, ("fp32", 1): 4 + 4 + 8 / 4, ("fp32", 2): 4 + 12 / 4, ("fp32", 3): 16 / 4,
    ("bf16", 0): 16, ("bf16", 1): 2 + 2 + 12 / 4, ("bf16", 2): 2 + 14 / 4, ("bf16", 3): 16 / 4,
}


@pytest.mark.parametrize("precision,stage", list(ZERO_ACCOUNTING))
def test_measured_model_states_match_estimator_at_dp4(precision, stage):
    out = run_world(measure_worker, 4, [f"precision={precision}", f"zero.stage={stage}"])
    for r in out:
        measured, estimated = sum(r["measured"].values()), sum(r["estimated"].values())
        assert abs(measured - estimated) <= 0.05 * estimated, (r["measured"], r["estimated"])
        assert r["measured"]["parameters"] > 0 and r["measured"]["optimizer"] > 0
    persistent = sum(v for k, v in out[0]["measured"].items() if k != "working_peak")
    per_param = persistent / out[0]["phi"]
    assert per_param == pytest.approx(ZERO_ACCOUNTING[precision, stage], rel=0.03), per_param
    if stage == 3:
        assert out[0]["measured"]["working_peak"] > 0, "stage 3 must gather (and count) working buffers"
    for r in out:  # what stays gathered between steps (stage 3: the next forward's first modules) is known too
        assert r["held"] == r["held_estimate"], r
        assert (r["held"] > 0) == (stage == 3), r


def test_whole_tensor_shards_pad_to_the_largest_load_and_the_estimator_knows():
    out = run_world(measure_worker, 4, ["precision=bf16", "zero.stage=3", "zero.partition=whole_tensor"])
    flat = run_world(measure_worker, 4, ["precision=bf16", "zero.stage=3"])
    for r in out:
        measured, estimated = sum(r["measured"].values()), sum(r["estimated"].values())
        assert abs(measured - estimated) <= 0.05 * estimated, (r["measured"], r["estimated"])
    assert out[0]["measured"]["optimizer"] > flat[0]["measured"]["optimizer"]  # whole tensors cannot balance exactly


def test_estimate_memory_script_prints_every_stage():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "scripts/estimate_memory.py", "--config", "configs/gpt_7b.yaml",
                          "--world", "64", "parallel.tp=8", "precision=bf16"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for stage in range(4):
        assert f"stage {stage}" in res.stdout
    assert "activation" in res.stdout


def test_config_errors_name_the_zero_key(capsys, tmp_path):
    import train

    for args, expected in [(["zero.stage=4"], "zero.stage=4"), (["zero.partition=striped"], "zero.partition"),
                           (["zero.stage=1", "zero.hpz_size=2"], "zero.hpz_size=2 needs zero.stage=3"),
                           (["zero.stage=0", "zero.quantized_weights=true"], "zero.quantized_weights=true needs"),
                           (["zero.stage=3", "zero.quantized_weights=true", "zero.weight_delta=true"],
                            "zero.weight_delta=true at zero.stage=3 needs zero.hpz_size > 1"),
                           (["zero.reduce_dtype=fp8"], "zero.reduce_dtype")]:
        assert train.main([f"logging.run_dir={tmp_path}", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and expected in err, err
        assert len(err.strip().splitlines()) <= 2, err


@pytest.mark.parametrize("world,overrides", [
    (4, ["zero.stage=3", "model.tie_embeddings=true"]),  # the tied embedding stays gathered through backward
    (8, ["zero.stage=3", "parallel.pp=2", "parallel.virtual_stages=2", "train.global_batch_size=16"]),
    (8, ["zero.stage=2", "parallel.pp=2", "parallel.virtual_stages=2", "train.global_batch_size=16"]),
    (4, ["zero.stage=3", "zero.hpz_size=2", "parallel.ranks_per_node=2", "zero.quantized_weights=true",
         "zero.quantized_gradients=true"]),
], ids=["stage3_tied", "stage3_pp2_vp2_dp2", "stage2_pp2_vp2_dp2_accumulating", "zeropp_hpz2_2x2"])
def test_estimator_follows_composed_layouts(world, overrides):
    for r in run_world(measure_worker, world, ["precision=bf16"] + overrides):
        measured, estimated = sum(r["measured"].values()), sum(r["estimated"].values())
        assert abs(measured - estimated) <= 0.05 * estimated, (r["measured"], r["estimated"])
        assert r["measured"]["working_peak"] > 0


def test_working_peak_follows_prefetch_depth_and_reduces_in_flight():
    """The gathered modules ahead (zero.prefetch_depth) and the full gradients in flight (zero.reduce_in_flight)
    are what the estimator walks: measured working peak == estimated, byte for byte, and deeper costs more."""
    peaks = {}
    for depth, flying in ((1, 1), (3, 3)):
        out = run_world(measure_worker, 4, ["precision=bf16", "zero.stage=3", "model.tie_embeddings=true",
                                            f"zero.prefetch_depth={depth}", f"zero.reduce_in_flight={flying}"])
        for r in out:
            assert r["measured"]["working_peak"] == r["estimated"]["working_peak"], (depth, flying, r)
            assert 0 < r["held"] == r["held_estimate"] <= r["measured"]["working_peak"], (depth, r)
        peaks[depth] = out[0]["measured"]["working_peak"]
    assert peaks[3] > peaks[1]
