"""QK-norm (``model.qk_norm``, Qwen3's per-head RMSNorm of queries and keys before RoPE) under tensor parallelism.

Each TP rank normalises only its own heads, so the two ``[head_dim]`` weights of each layer get partial gradients
on every TP rank, with or without sequence parallelism: the layouts below must sum them over TP to train as one
process does (losses, gradient norms and every gradient, assembled from the ranks). Numerics against transformers'
Qwen3 are in tests/test_hf_moe.py; here also the checkpoint's record of the setting.
"""

import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import assert_grads_match, tiny_config, train_worker

STEPS = 3
RTOL = 1e-5
QK = ["model.qk_norm=true", "model.rope_theta=500.0"]
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    # one KV head replicated on both TP ranks: k_norm's gradient on each is its own query heads' share
    "tp2_sp_mqa": (2, ["model.n_kv_heads=1", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    # ZeRO-1 over dp2 sums the partial pieces over TP in its own reduce path
    "tp2_zero1_dp2": (4, ["parallel.tp=2", "zero.stage=1"]),
}
_references = {}


def _reference(model_overrides):
    key = tuple(model_overrides)
    if key not in _references:
        _references[key] = run_world(train_worker, 1, QK + list(model_overrides), STEPS)[0]
    return _references[key]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qk_norm_trains_at_tp2_as_one_process(name):
    world, layout = LAYOUTS[name]
    ref = _reference([o for o in layout if o.startswith("model.")])
    assert "layers.0.attn.q_norm.weight" in ref["grads"] and "layers.3.attn.k_norm.weight" in ref["grads"]
    out = run_world(train_worker, world, QK + layout, STEPS)
    torch.testing.assert_close(torch.tensor(out[0]["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(out[0]["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=RTOL, atol=0)
    assert ref["losses"][-1] < ref["losses"][0]
    assert_grads_match([r["grads"] for r in out], ref["grads"])


def test_the_checkpoint_records_qk_norm_and_older_ones_had_none():
    """meta.json records model.qk_norm (MODEL_KEYS); a checkpoint from before it (no such key) is a model without
    QK-norm: it loads into qk_norm=false and is refused, naming the setting, by qk_norm=true."""
    from training.checkpoint_rules import model_differences, model_record

    on, off = tiny_config("model.qk_norm=true").model, tiny_config().model
    assert model_record(on)["qk_norm"] is True and model_record(off)["qk_norm"] is False
    older = {k: v for k, v in model_record(off).items() if k != "qk_norm"}

    def mismatch(model, saved):
        return [phrase for _, phrase in model_differences({"model": saved}, model)]

    assert mismatch(off, older) == [] and mismatch(on, model_record(on)) == []
    assert mismatch(on, older) == ["model.qk_norm: checkpoint False vs config True"]
    assert mismatch(off, model_record(on)) == ["model.qk_norm: checkpoint True vs config False"]


@pytest.mark.parametrize("overrides", [[], ["model.activation_checkpointing=selective"]], ids=["plain", "selective"])
def test_a_qk_norm_block_traces_into_one_graph(overrides):
    """train.compile: the per-head norms (fp32 inside bf16 autocast) break no graph; both weights learn."""
    from tests.test_compile import _block

    cfg, block = _block("bf16", "model.qk_norm=true", *overrides)
    x = torch.randn(cfg.model.seq_len, 2, cfg.model.d_model, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        block(x).float().sum().backward()
        explained = torch._dynamo.explain(block.forward)(x)
    assert block.attn.q_norm.weight.grad is not None and block.attn.k_norm.weight.grad.abs().sum() > 0
    assert explained.graph_break_count == 0, [str(b.reason)[:300] for b in explained.break_reasons]
    assert explained.graph_count == 1
