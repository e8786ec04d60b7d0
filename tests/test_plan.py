"""The planner's pieces against hand calculations (training/plan/, issue 54): a GEMM on its roofline, fused
attention, the pipeline bubble, a ring all-gather, a group's link and the overlap rule; and the bridges to the
project's own accounting (the estimator's memory, the volume's bytes) exactly as those modules give them."""
from __future__ import annotations

import dataclasses

import pytest

from config import load_config
from parallel.layout import make_layout
from training.plan import costs, evaluate, make_cluster
from training.plan.devices import DEVICES, LATENCY_INTER_S, LINK_EFFICIENCY, PlanInputError
from training.plan.formulas import (MEMORY_EFFICIENCY, all_gather_time, attention_time, bubble_fraction, exposed,
                                    gemm_time, memory_time, ring_time)
from training.plan.step import group_time

H100 = DEVICES["h100"]


def test_a_large_gemm_runs_at_the_ceiling_and_a_skinny_one_at_the_memory_roof():
    n = 8192
    assert gemm_time(n, n, n, H100) == pytest.approx(2 * n**3 / (989e12 * 0.77))
    # one row: 2 n^2 FLOPs over (n + n^2 + n) 2-byte elements, far below the ridge: memory-bound
    moved = (n + n * n + n) * 2
    assert gemm_time(1, n, n, H100) == pytest.approx(moved / (3350e9 * MEMORY_EFFICIENCY))
    # FP8 doubles the ceiling and halves the bytes
    assert gemm_time(n, n, n, H100, fp8=True) == pytest.approx(2 * n**3 / (1979e12 * 0.77))
    assert gemm_time(n, n, n, DEVICES["v100"], fp8=True) == gemm_time(n, n, n, DEVICES["v100"])  # no FP8 cores


def test_attention_counts_the_keys_each_query_sees_and_backward_is_2_5x():
    fwd, bwd = attention_time(2, 4096, 2048, 32, 128, H100)
    assert fwd == pytest.approx(4 * 2 * 4096 * 2048 * 32 * 128 / (989e12 * 0.77 * 0.6))
    assert bwd == pytest.approx(2.5 * fwd)


def test_bubble_of_1f1b_and_of_the_interleaved_schedule():
    assert bubble_fraction(1, 1, 8) == 0
    assert bubble_fraction(4, 1, 8) == pytest.approx(3 / 8)  # (p - 1) / m
    assert bubble_fraction(4, 2, 8) == pytest.approx(3 / 16)  # (p - 1) / (v m)


def test_a_ring_all_gather_by_hand():
    # 8 ranks, a 1 GB tensor, 100 GB/s, 10 us a step: each rank sends 7/8 GB in 7 steps
    assert all_gather_time(1e9, 8, 100e9, 1e-5) == pytest.approx(0.875e9 / 100e9 + 7e-5)
    assert all_gather_time(1e9, 1, 100e9, 1e-5) == 0
    assert ring_time(0, 1.0, 3, 1.0) == 0


def test_the_overlap_rule():
    assert exposed(3.0, 4.0, 0.5) == pytest.approx(1.0)  # 4 s of compute hide 2 s
    assert exposed(1.0, 4.0, 0.5) == 0.0
    assert exposed(1.0, 4.0, 0.0) == 1.0  # nothing overlapped
    assert exposed(2.0, -1.0, 1.0) == 2.0


def test_memory_time():
    assert memory_time(3350e9 * 0.9, H100) == pytest.approx(1.0)  # 3,350 GB/s at 90%


def _cfg(*overrides):
    return load_config(None, ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.seq_len=256",
                              "model.vocab_size=1024", "train.micro_batch_size=1", "train.global_batch_size=16",
                              "precision=bf16", *overrides])


def test_a_dp_group_across_nodes_shares_the_node_nics():
    # tp 8 fills a node of 8: each DP group has one rank per node, and all 8 of a node cross at once
    cluster = make_cluster("h100", 16)
    layout = make_layout(_cfg("parallel.tp=4", "model.n_heads=8"), 16, 8)
    assert (layout.tp, layout.dp, layout.dp_intra_size) == (4, 4, 2)
    nbytes = 1e9
    inter = nbytes * (8 // 2) / (3200e9 / 8 * LINK_EFFICIENCY)  # 4 DP groups per node cross its NICs
    assert group_time("dp", nbytes, 0, layout, cluster) == pytest.approx(max(inter, 0.0))
    assert group_time("dp", nbytes, 10, layout, cluster) == pytest.approx(inter + 10 * 3 * LATENCY_INTER_S)
    assert group_time("tp", nbytes, 0, layout, cluster) == pytest.approx(nbytes / (450e9 * LINK_EFFICIENCY))


def test_memory_is_the_estimators():
    from training.memory import activation_bytes, model_state_bytes

    cfg = _cfg("zero.stage=3", "parallel.pp=2", "model.activation_checkpointing=full")
    cluster = make_cluster("a100", 8)
    got = evaluate(cfg, cluster)
    layout = make_layout(cfg, 8, 8)
    want = max(sum(model_state_bytes(cfg, layout, r).values()) + sum(activation_bytes(cfg, layout, r).values())
               for r in (0, layout.rank_of(1, 0, 0)))
    assert got["memory_gib"] * 2**30 == pytest.approx(want)
    assert costs.memory_lower_bound(cfg, layout) <= want


@pytest.mark.parametrize("zero", [["zero.stage=3"], ["zero.stage=3", "zero.hpz_size=2", "zero.quantized_weights=true",
                                                     "zero.quantized_gradients=true"], ["zero.stage=1"]])
def test_zero_bytes_fitted_on_the_micro_batches_are_the_volumes(zero):
    from parallel.volume import zero_step_bytes
    from parallel.zero.early_step import early_step_applies

    cfg = _cfg(*zero)
    layout = dataclasses.replace(make_layout(cfg, 8, 4), num_microbatches=5)
    with costs.shared_meta():
        fitted = costs.zero_bytes(cfg, layout)
        exact = zero_step_bytes(cfg, layout, 0, early=early_step_applies(cfg.zero))
    assert set(exact) <= set(fitted)
    for group, v in exact.items():
        assert fitted[group] == pytest.approx(v)


def test_shared_meta_memoises_only_inside_and_keys_on_the_split():
    import parallel.zero.units as units
    from parallel.layout import make_layout

    cfg = _cfg()
    layout = make_layout(cfg, 8, 8)
    assert units.meta_chunks(cfg, layout, 0) is not units.meta_chunks(cfg, layout, 0)  # outside: built each time
    with costs.shared_meta():
        first = units.meta_chunks(cfg, layout, 0)
        full = _cfg("model.activation_checkpointing=full")  # recomputation changes no shape: the same entry
        assert units.meta_chunks(full, layout, 0) is first
        tp2 = make_layout(_cfg("parallel.tp=2"), 8, 8)
        assert units.meta_chunks(cfg, tp2, 0) is not first
    assert units._MEMO is None
    with costs.shared_meta():  # the planner's memo outlives one call
        assert units.meta_chunks(cfg, layout, 0) is first


def test_the_prediction_adds_up_and_counts_model_flops():
    from model.flops import flops_per_token

    cfg = _cfg("parallel.tp=2", "parallel.sequence_parallel=true", "model.activation_checkpointing=full")
    p = evaluate(cfg, make_cluster("h100", 8))
    assert p["step_time_s"] == pytest.approx(sum(p["breakdown"].values()))
    assert p["breakdown"]["recompute"] > 0 and p["breakdown"]["tp"] > 0
    tokens = 16 * 256
    assert p["tokens_per_s"] == pytest.approx(tokens / p["step_time_s"])
    assert p["tflops_per_gpu"] * 1e12 == pytest.approx(flops_per_token(cfg.model) * tokens / 8 / p["step_time_s"])
    assert p["mfu"] == pytest.approx(p["tflops_per_gpu"] / 989)


def test_a_layout_that_does_not_fit_says_by_how_much():
    p = evaluate(_cfg("model.d_model=8192", "model.n_heads=64", "model.n_layers=8"), make_cluster("v100", 16))
    assert not p["fits"] and p["over_gib"] == pytest.approx(p["memory_gib"] - 32e9 / 2**30)


def test_cluster_input_is_checked():
    with pytest.raises(PlanInputError, match="unknown GPU kind"):
        make_cluster("b200", 8)
    with pytest.raises(PlanInputError, match="not divisible by --gpus-per-node 8"):
        make_cluster("h100", 12)
    assert make_cluster("h100", 4).gpus_per_node == 4  # a job smaller than a node


def test_every_device_figure_has_its_source():
    for kind, dev in DEVICES.items():
        assert {"peak_tflops", "gemm_ceiling", "memory", "nvlink_gbps", "node", "fp32_ratio"} <= set(dev.sources), kind
        assert all(len(text) > 20 for text in dev.sources.values()), kind


def test_fp32_runs_at_the_kinds_fp32_rate():
    n = 8192
    assert gemm_time(n, n, n, H100, elem_bytes=4) == pytest.approx(2 * n**3 / (989e12 * 0.5 * 0.77))
    assert gemm_time(n, n, n, DEVICES["v100"], elem_bytes=4) == pytest.approx(2 * n**3 / (15.7e12 * 0.70))


@pytest.mark.parametrize("overrides", [["parallel.ep=2"], ["zero.stage=3", "parallel.ep=2"]])
def test_moe_bytes_match_what_a_run_counts(overrides):
    """parallel/volume.py predicts dense models only; the planner's MoE bytes (costs.moe_dp_bytes, ep_bytes: even
    routing) against the ledger of a real 4-rank step (dp 4, ep 2): the expert data-parallel group exact, the
    dispatch / combine all-to-alls and the dense data-parallel bytes within 3% (routing is uneven; ZeRO-3's
    gathers of the router and norms)."""
    from parallel.layout import make_layout
    from tests.dist_harness import run_world
    from tests.parallel_utils import tiny_config, train_worker
    from tests.test_moe_train import MOE

    out = run_world(train_worker, 4, MOE + overrides, 1)
    cfg = tiny_config(*MOE, *overrides)
    with costs.shared_meta():
        predicted = costs.step_bytes(cfg, make_layout(cfg, 4, 4))
    counted = out[0]["comm"]["by_group"]
    assert counted["edp"] == predicted["edp"]
    for group in ("ep", "dp"):
        assert counted[group] == pytest.approx(predicted[group], rel=0.03), group
