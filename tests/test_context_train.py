"""Context parallelism in the trainer: every layout with cp > 1 trains the one-process model (cp = 1, one rank):
the same losses, validation loss, gradient norms and gradients, for both attention forms (ring and all-gather),
MHA and GQA, at seq 120 (cp = 4: chunks of 15 tokens, a multiple of nothing convenient); the data each rank reads;
checkpoints that resume and reshard between cp sizes; bad settings.

The attention itself is checked against float64 SDPA in ``tests/test_context_attention.py``; here the reference
is a one-process run, outside the code under test (no CP code runs at cp = 1).
"""
from __future__ import annotations

from typing import List

import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import assert_grads_match, checkpoint_worker, train_worker

STEPS = 4
RTOL = 1e-5
NORM_RTOL = 5e-5
"""Gradient norms after Adam steps: the attention's sums run in another order (keys split by chunk, merged by
their log-sum-exp; GQA's dK/dV summed per pair), and Adam's first steps magnify fp32 rounding in the near-zero
gradients (measured: step-0 gradients within 6e-7 of the reference, losses 3e-7, norms up to 2.1e-5 at step 2
for cp 4 with GQA; the dense layouts of tests/test_layouts.py hold 1e-5)."""
SEQ = ["model.seq_len=120"]
GQA = ["model.n_kv_heads=2"]

LAYOUTS = {
    # name: (world, overrides); every case at seq 120
    "cp4_p2p_gqa": (4, ["parallel.cp=4", *GQA]),
    "cp4_all_gather": (4, ["parallel.cp=4", "parallel.cp_comm=all_gather"]),
    "cp2_tp2_sp_gqa": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", *GQA]),
    "cp2_pp2_vp2_full_recompute": (4, ["parallel.cp=2", "parallel.pp=2", "parallel.virtual_stages=2",
                                       "model.activation_checkpointing=full"]),
    "cp2_dp2_zero1_selective": (4, ["parallel.cp=2", "zero.stage=1", "model.activation_checkpointing=selective",
                                    "parallel.cp_comm=all_gather"]),
    "cp2_pp2_zero2": (4, ["parallel.cp=2", "parallel.pp=2", "zero.stage=2", *GQA]),
    "cp4_zero3": (4, ["parallel.cp=4", "zero.stage=3"]),
    "cp2_dp2_zero3_hpz2": (4, ["parallel.cp=2", "zero.stage=3", "zero.hpz_size=2", "parallel.ranks_per_node=2"]),
}
MODEL_KEYS = ("model.", "precision")

_references: dict = {}


def reference(overrides: List[str], steps: int = STEPS) -> dict:
    """The one-process run of the same model (only the model and precision overrides kept), cached."""
    model = tuple(o for o in SEQ + overrides if o.startswith(MODEL_KEYS))
    if (model, steps) not in _references:
        _references[model, steps] = run_world(train_worker, 1, list(model), steps)[0]
    return _references[model, steps]


def assert_same_curve(out: List[dict], ref: dict, rtol: float = RTOL) -> None:
    for r in out:  # every rank reports the same losses
        assert r["losses"] == out[0]["losses"] and r["val_loss"] == out[0]["val_loss"]
    torch.testing.assert_close(torch.tensor(out[0]["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(out[0]["grad_norms"]), torch.tensor(ref["grad_norms"]),
                               rtol=max(rtol, NORM_RTOL), atol=0)
    assert abs(out[0]["val_loss"] - ref["val_loss"]) <= rtol * ref["val_loss"]
    assert ref["losses"][-1] < ref["losses"][0] - 0.05, "the reference must learn, or equal curves prove little"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_layout_matches_one_process(name):
    world, overrides = LAYOUTS[name]
    ref = reference(overrides)
    out = run_world(train_worker, world, SEQ + overrides, STEPS)
    assert_same_curve(out, ref)
    assert_grads_match([r["grads"] for r in out], ref["grads"])
    assert out[0]["comm"]["by_group"].get("cp", 0) > 0, "the attention must exchange K/V over the CP group"


def test_fp8_with_context_parallelism_tracks_one_process():
    """precision=fp8 at cp 2 (attention bf16, the linears FP8): the scales' amaxes are reduced over dp x cp, so
    every rank casts activations with the one-process run's scales; the gradients cross the dp x cp group in FP8
    (FP8-LM's auto-scaled all-reduce), as at dp 2. Losses within 1e-3 (measured 3.3e-4, as dp 2's 3.2e-4); the
    gradient norms carry that FP8 communication (4% at cp 2, 5% at dp 2) and are not compared."""
    overrides = ["parallel.cp=2", "precision=fp8", "fp8.emulate=true"]
    ref = reference(overrides)
    out = run_world(train_worker, 2, SEQ + overrides, STEPS)
    for r in out:
        assert r["losses"] == out[0]["losses"]
    assert out[0]["losses"] == pytest.approx(ref["losses"], rel=1e-3)
    assert out[0]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-3)
    assert out[0]["comm"]["by_group"].get("cp", 0) > 0


def test_zeropp_with_context_parallelism_tracks_zero3():
    """qwZ + qgZ over the dp x cp group (2 nodes x 2): within ZeRO++'s tolerance of the exact ZeRO-3 curve, as
    tests/test_zeropp.py holds it at cp 1."""
    from tests.test_zeropp import QUANT_RTOL

    overrides = ["parallel.cp=2", "zero.stage=3", "zero.hpz_size=2", "parallel.ranks_per_node=2",
                 "zero.quantized_weights=true", "zero.quantized_gradients=true"]
    ref = reference(overrides)
    out = run_world(train_worker, 4, SEQ + overrides, STEPS)
    diffs = [abs(a - b) / b for a, b in zip(out[0]["losses"], ref["losses"])]
    assert max(diffs) <= QUANT_RTOL, diffs


def _compile_worker(compiled: bool) -> dict:
    from torch._dynamo.utils import counters

    from tests.parallel_utils import batch_fn, build_engine, tiny_config

    engine = build_engine(tiny_config(*SEQ, "parallel.cp=2", "precision=bf16", f"train.compile={compiled}",
                                      "model.n_layers=1"))
    counters.clear()
    losses = [engine.train_step(batch_fn(engine, step))["loss"] for step in range(2)]
    return {"losses": losses, "breaks": [str(k) for k in counters["graph_break"]]}


def test_compiled_blocks_break_only_at_the_ring():
    """train.compile at cp 2: the ring's exchanges run eagerly between compiled regions (the disabled
    ``context_attention``); nothing else breaks the graph, and the curve is eager's."""
    compiled = run_world(_compile_worker, 2, True, timeout=600, env={"GPT_COMPILE_BACKEND": "aot_eager"})[0]
    eager = run_world(_compile_worker, 2, False)[0]
    assert compiled["breaks"] and all("context_attention" in b or "disable" in b for b in compiled["breaks"]), \
        compiled["breaks"]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-3)


def test_checkpoint_at_cp4_resumes_at_cp2_and_cp1_on_the_same_curve(tmp_path):
    """Written at cp 4 (ZeRO-3 over the dp x cp group), resumed at cp 2 x dp 2 (ZeRO-1) and at one process."""
    full = run_world(checkpoint_worker, 1, SEQ, "none", 6, str(tmp_path / "straight"))[0]
    run_world(checkpoint_worker, 4, SEQ + ["parallel.cp=4", "zero.stage=3"], "fresh", 3, str(tmp_path / "ckpt"))
    for world, layout in ((4, ["parallel.cp=2", "zero.stage=1"]), (1, [])):
        resumed = run_world(checkpoint_worker, world, SEQ + layout, "resume", 6, str(tmp_path / "ckpt"))[-1]
        assert [resumed[s] for s in (3, 4, 5)] == pytest.approx([full[s] for s in (3, 4, 5)], rel=1e-5), layout


def _batch_worker(overrides: List[str]):
    from tests.parallel_utils import batch_fn, build_engine, tiny_config

    engine = build_engine(tiny_config(*overrides))
    tokens, labels = batch_fn(engine, 3)(1)
    return engine.mesh.layout.cp_rank(engine.mesh.rank), engine.mesh.batch_rank, tokens, labels


def test_each_rank_reads_its_two_chunks_of_its_samples():
    """cp 2 x dp 2 at seq 120: rank (batch b, cp c) holds chunks c and 3 - c (30 tokens each) of batch b's samples,
    tokens and their next tokens, read as such (the synthetic sample's own positions)."""
    from tests.parallel_utils import synthetic_sample

    out = run_world(_batch_worker, 4, SEQ + ["parallel.cp=2"], timeout=120)
    for cp_rank, batch_rank, tokens, labels in out:
        assert tokens.shape == labels.shape == (2, 60)
        first = 3 * 8 + batch_rank * 4 + 1 * 2  # step 3, 8 samples a step, 4 per batch shard, micro-batch 1 of 2
        for row in range(2):
            whole = synthetic_sample(first + row, 120, 128)
            keep = torch.cat([torch.arange(30 * cp_rank, 30 * cp_rank + 30),
                              torch.arange(30 * (3 - cp_rank), 30 * (3 - cp_rank) + 30)])
            assert torch.equal(tokens[row], whole[keep]) and torch.equal(labels[row], whole[keep + 1])


@pytest.mark.parametrize("overrides,fragment", [
    (["parallel.cp=4", "model.seq_len=36"], "model.seq_len=36 is not divisible by 2 x parallel.cp = 8"),
    (["parallel.cp=3", "model.seq_len=120"],
     "world size 1 is not divisible by parallel.tp=1 x parallel.pp=1 x parallel.cp=3"),
    (["parallel.cp=0"], "parallel.cp=0 must be >= 1"),
    (["parallel.cp=2", "parallel.cp_comm=ring"], "parallel.cp_comm='ring' is not one of ['p2p', 'all_gather', 'a2a']"),
    (["parallel.cp=4", "parallel.cp_comm=a2a", "model.n_heads=6", "model.d_model=96", "model.seq_len=120"],
     "6 heads per TP rank do not divide into 4 CP ranks"),
    (["parallel.cp=2", "model.attention_dropout=0.1"], "model.attention_dropout=0.1 with parallel.cp=2"),
    (["parallel.cp=2", "model.moe.num_experts=4", "model.moe.capacity_factor=1.25"],
     "model.moe.capacity_factor=1.25 with parallel.cp=2 is not built"),
])
def test_bad_settings_are_one_line_and_exit_2(overrides, fragment, capsys):
    import train

    assert train.main(overrides + ["train.max_steps=1"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if fragment in line]
    assert len(lines) == 1 and "Traceback" not in err, err


def test_sequence_parallel_split_of_each_ranks_chunks_is_checked():
    from config import ConfigError
    from parallel.layout import make_layout
    from tests.parallel_utils import tiny_config

    cfg = tiny_config("model.seq_len=36", "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true")
    with pytest.raises(ConfigError, match=r"each rank's 18 tokens .* not divisible by parallel.tp=4"):
        make_layout(tiny_config("model.seq_len=36", "parallel.cp=2", "parallel.tp=4",
                                "parallel.sequence_parallel=true", "model.n_heads=4"), 8, 8)
    layout = make_layout(cfg, 8, 8)
    assert (layout.cp, layout.dp, layout.batch_shards) == (2, 4, 2)
    assert layout.cp_ranks(0) == [0, 2] and layout.cp_ranks(5) == [5, 7] and layout.dp_ranks(1) == [1, 3, 5, 7]


def test_kill_9_mid_ring_resumes_exactly_and_continues_at_one_process(tmp_path):
    """train.main on two forked ranks at cp 2 (bundled corpus, seq 64: chunks of 16): SIGKILL to one rank mid-run
    (the step is mostly ring attention) ends the job; the resumed run logs the uninterrupted run's losses, and its
    step-6 checkpoint continued at one process (cp 1) stays on the same curve."""
    from tests.test_train_e2e import FAST, assert_kill_9_resumes_exactly

    assert_kill_9_resumes_exactly(tmp_path, FAST + ["train.max_steps=9", "checkpoint.interval=3"], ["parallel.cp=2"])


def _rope_phase_worker(ckpt_dir: str):
    from training.checkpoint import Checkpointer, CheckpointError
    from tests.parallel_utils import batch_fn, build_engine, tiny_config

    cfg = tiny_config()
    engine = build_engine(cfg)
    engine.train_step(batch_fn(engine, 0))
    path = Checkpointer(cfg, ckpt_dir, engine).save(1, 8)
    outcomes = {}
    for name, overrides in (("rope", ["model.seq_len=128", "model.rope_scaling=linear", "model.rope_scaling_factor=4",
                                      "model.rope_theta=20000"]), ("width", ["model.ffn_hidden=64"])):
        longer = tiny_config(*overrides)
        ckpt = Checkpointer(longer, ckpt_dir + "-" + name, build_engine(longer))
        try:
            meta = ckpt.load_weights(path)
            outcomes[name] = ("loaded", meta["rope_changes"])
        except CheckpointError as e:
            outcomes[name] = ("refused", str(e))
        try:
            ckpt.load(path)
            outcomes[name + " resume"] = ("loaded", None)
        except CheckpointError as e:
            outcomes[name + " resume"] = ("refused", str(e))
    return outcomes


def test_a_long_context_phase_starts_from_weights_with_other_rope_settings(tmp_path):
    """checkpoint.init_from takes the weights under new rotary settings (no weight depends on them) and names the
    changes; a full resume refuses them, and init_from still refuses a model of another shape."""
    out = run_world(_rope_phase_worker, 1, str(tmp_path / "c"))[0]
    kind, changes = out["rope"]
    assert kind == "loaded" and any("model.rope_scaling: checkpoint 'none' vs config 'linear'" in c for c in changes)
    assert any("model.rope_theta" in c for c in changes), changes
    assert out["rope resume"][0] == "refused" and "model.rope_scaling" in out["rope resume"][1]
    assert out["width"][0] == "refused" and "model.ffn_size" in out["width"][1]
