"""ZeRO stages 1-3 (flat and whole-tensor shards) train exactly the single-process model, at every layout.

References: one process, and stage 0 (plain DP with torch's AdamW) at the same layout; fp32, 1e-5.
"""
import pytest
import torch

from tests.dist_harness import run_world
from tests.test_comm_volume import assert_counted_equals_analytic
from tests.parallel_utils import assert_grads_match, train_worker

STEPS = 5
RTOL = 1e-5

LAYOUTS = {
    "dp4": (4, []),
    "tp2_dp2_sp": (4, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2_dp2": (4, ["parallel.pp=2"]),
    "tp2_pp2_dp2": (8, ["parallel.tp=2", "parallel.pp=2"]),
    "dp2_accumulation_tied": (2, ["model.tie_embeddings=true", "train.global_batch_size=16"]),
}
# beyond the list: interleaved 1F1B with the tied copy on another stage, full recompute, GELU/bias/LayerNorm
EXTRA = {
    "pp2_vp2_dp2_tied_recompute": (4, ["parallel.pp=2", "parallel.virtual_stages=2", "model.tie_embeddings=true",
                                       "model.activation_checkpointing=full", "model.activation=gelu",
                                       "model.norm=layernorm", "model.bias=true", "train.global_batch_size=16"]),
}
MODEL_KEYS = ("model.", "train.global_batch_size")

_cache = {}


def run(world, overrides):
    key = (world, tuple(overrides))
    if key not in _cache:
        _cache[key] = run_world(train_worker, world, list(overrides), STEPS)
    return _cache[key]


def assert_same_training(out, ref, what):
    for r in out:
        assert r["losses"] == out[0]["losses"], "ranks disagree on the loss"
    torch.testing.assert_close(torch.tensor(out[0]["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0,
                               msg=lambda m: f"losses vs {what}: {m}")
    torch.testing.assert_close(torch.tensor(out[0]["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=RTOL,
                               atol=0, msg=lambda m: f"grad norms vs {what}: {m}")
    assert abs(out[0]["val_loss"] - ref["val_loss"]) <= RTOL * ref["val_loss"], f"validation loss vs {what}"


CASES = [(name, stage, kind) for name in LAYOUTS for stage in (1, 2, 3) for kind in ("flat", "whole_tensor")]
CASES += [(name, 3, kind) for name in EXTRA for kind in ("flat", "whole_tensor")]


@pytest.mark.parametrize("name,stage,kind", CASES)
def test_zero_matches_stage0_and_single_process(name, stage, kind):
    world, overrides = {**LAYOUTS, **EXTRA}[name]
    single = run(1, [o for o in overrides if o.startswith(MODEL_KEYS)])[0]
    stage0 = run(world, overrides)[0]
    out = run_world(train_worker, world, overrides + [f"zero.stage={stage}", f"zero.partition={kind}"], STEPS)
    assert single["losses"][-1] < single["losses"][0] - 0.05, "the reference must learn"
    assert_same_training(out, single, "one process")
    assert_same_training(out, stage0, "stage 0")

    assert_grads_match([r["grads"] for r in out], single["grads"])
    dp_kinds = {k.split("/")[0] for k, v in out[0]["comm"]["by_kind_link"].items() if v}
    assert "reduce_scatter" in dp_kinds and "all_gather" in dp_kinds, "ZeRO must reduce-scatter and gather"
    assert_counted_equals_analytic(out, overrides + [f"zero.stage={stage}", f"zero.partition={kind}"], world)


def test_clipping_on_sharded_gradients_matches_one_process():
    overrides = ["train.grad_clip=0.3"]  # below every step's norm: every step clips
    single = run(1, overrides)[0]
    out = run_world(train_worker, 2, overrides + ["zero.stage=3"], STEPS)
    assert min(single["grad_norms"]) > 0.3
    assert_same_training(out, single, "one process")


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_loss_scaling_skips_the_same_steps_as_stage0(stage):
    """A scale of 2^24 overflows fp16 gradients: the step is skipped and the scale halved until it fits."""
    overrides = ["precision=fp16", "loss_scale.initial=16777216", "zero.reduce_dtype=fp32"]
    stage0 = run(2, overrides)[0]
    out = run_world(train_worker, 2, overrides + [f"zero.stage={stage}"], STEPS)[0]
    skipped = [not torch.isfinite(torch.tensor(n)) for n in out["grad_norms"]]
    assert skipped == [not torch.isfinite(torch.tensor(n)) for n in stage0["grad_norms"]]
    assert skipped[0] and not skipped[-1], "the test must overflow first and recover later"
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(stage0["losses"]), rtol=1e-4, atol=0)


def gather_state_worker(overrides):
    from tests.parallel_utils import batch_fn, build_engine, tiny_config

    engine = build_engine(tiny_config(*overrides))
    dp = engine.dp
    engine.train_step(batch_fn(engine, 0))
    held = [u.gathered or u.gather_work is not None for u in dp.units]
    ahead = [any(u is a for a in dp._next_forward_units()) for u in dp.units]
    ahead_bytes = sum(u.full_bytes for u, a in zip(dp.units, ahead) if a)
    after_step = (dp.working.now, held, ahead, ahead_bytes)
    engine.eval_loss(batch_fn(engine, 1000))
    after_eval = (dp.working.now, [u.gathered or u.gather_work is not None for u in dp.units])
    return after_step, after_eval, dp.working.peak


@pytest.mark.parametrize("depth", [0, 2])
def test_stage3_releases_everything_after_a_step_and_after_no_grad_validation(depth):
    """After a step only the next forward's first gathers are held (in flight: prefetch depth + 1 modules,
    none without prefetch); validation (no_grad) consumes and releases them, leaking nothing."""
    prefetch = [f"zero.prefetch_depth={depth}"] if depth else ["zero.prefetch=false"]
    for r in run_world(gather_state_worker, 4, ["zero.stage=3", "parallel.pp=2", "model.tie_embeddings=true",
                                                *prefetch]):
        (step_bytes, held, ahead, ahead_bytes), (eval_bytes, eval_held), peak = r
        assert peak > 0
        assert held == ahead, "after the step, exactly the next forward's first units may be held"
        assert step_bytes == ahead_bytes and (any(ahead) == (depth > 0)), (step_bytes, ahead_bytes, ahead)
        assert eval_bytes == 0 and not any(eval_held), "validation (no_grad) leaked gathered weights"


def test_bf16_zero3_tracks_stage0():
    """Half-precision shards, gathers and reduce-scatters: the curve stays on stage 0's within bf16 noise."""
    stage0 = run(2, ["precision=bf16"])[0]
    out = run_world(train_worker, 2, ["precision=bf16", "zero.stage=3"], STEPS)[0]
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(stage0["losses"]), rtol=2e-2, atol=0)
    assert out["losses"][-1] < out["losses"][0] - 0.05
