"""Context parallelism's all-to-all form (parallel.cp_comm=a2a, parallel/ulysses.py) in the trainer: each layout
trains the one-process model (cp = 1: no CP code runs) with the same losses, validation loss, gradient norms and
gradients, at the tolerances of tests/test_context_train.py; the ledger's CP bytes equal parallel/volume.py's."""
from __future__ import annotations

import pytest

from parallel.layout import make_layout
from parallel.volume import step_bytes
from tests.dist_harness import run_world
from tests.parallel_utils import assert_grads_match, tiny_config, train_worker
from tests.test_context_train import GQA, SEQ, STEPS, assert_same_curve, reference

A2A = ["parallel.cp_comm=a2a"]
LAYOUTS = {
    # name: (world, overrides); the tiny model has 4 heads: 2 per TP rank at tp 2
    "cp4_a2a": (4, ["parallel.cp=4", *A2A]),
    "cp2_a2a_gqa_zero3": (4, ["parallel.cp=2", "zero.stage=3", *GQA, *A2A]),
    "cp2_a2a_tp2_sp_gqa_selective": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                         "model.activation_checkpointing=selective", *GQA, *A2A]),
    "cp4_a2a_mqa_pp1_full_recompute": (4, ["parallel.cp=4", "model.n_kv_heads=1",
                                           "model.activation_checkpointing=full", *A2A]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_all_to_all_layout_matches_one_process(name):
    world, overrides = LAYOUTS[name]
    ref = reference(overrides)
    out = run_world(train_worker, world, SEQ + overrides, STEPS)
    assert_same_curve(out, ref)
    assert_grads_match([r["grads"] for r in out], ref["grads"])
    cfg = tiny_config(*SEQ, *overrides)
    layout = make_layout(cfg, world, world)
    for rank, r in enumerate(out):
        counted = r["comm"]["by_group"].get("cp", 0)
        assert counted > 0 and abs(counted - step_bytes(cfg, layout, rank)["cp"]) <= 16, (rank, counted)
