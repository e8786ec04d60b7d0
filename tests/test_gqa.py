"""Grouped-query attention (``model.n_kv_heads``).

The single-process model is checked against Hugging Face's ``LlamaForCausalLM`` with
``num_key_value_heads < num_attention_heads`` (logits, loss and every gradient); each
parallel layout, KV heads split over TP or replicated on several TP ranks, is checked
against the single-process run like every other layout; checkpoints move between them;
counted bytes equal the analytic volume; impossible layouts are refused.
"""
import json

import pytest
import torch

from model.flops import parameter_count
from parallel.layout import make_layout
from tests.dist_harness import run_world
from tests.parallel_utils import assert_grads_match, checkpoint_worker, tiny_config, train_worker
from tests.test_comm_volume import assert_counted_equals_analytic
from tests.test_layouts import reference
from config import ConfigError, validate_config

STEPS = 4
RTOL = 1e-5
GQA = ["model.n_heads=8", "model.n_kv_heads=2"]  # head_dim 8, each KV head serves 4 query heads


def _single_process_model(cfg):
    from model.gpt import build_chunks
    from model.layers import TPContext
    from parallel.comm import Group, Ledger
    from parallel.random import RNGTracker

    tp = Group(name="tp", pg=None, ranks=[0], rank=0, link="intra", ledger=Ledger())
    ctx = TPContext(tp, False, RNGTracker(torch.device("cpu"), 1, 0, 0, 0))
    return build_chunks(cfg.model, ctx, 1, 1, 0, cfg.train.seed, torch.device("cpu"))[0]


@pytest.mark.parametrize("bias", [False, True])
def test_single_process_gqa_equals_hugging_face_llama(bias):
    import transformers
    cfg = tiny_config(*GQA, "model.n_layers=2", f"model.bias={str(bias).lower()}", "model.rope_theta=500.0")
    m = cfg.model
    ours = _single_process_model(cfg)
    params = dict(ours.named_parameters())
    assert params["layers.0.attn.q.weight"].shape == (64, 64)
    assert params["layers.0.attn.kv.weight"].shape == (2, 16, 64)
    assert sum(p.numel() for p in params.values()) == parameter_count(m)["total"]

    hf_cfg = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_size, num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads, max_position_embeddings=m.max_positions,
        rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=False, attention_bias=bias,
        mlp_bias=bias, hidden_act="silu", attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():  # our weights into HF's names: q, kv[0] = k, kv[1] = v, up[0] = gate, up[1] = up
        def put(name, value):
            assert hf_params[name].shape == value.shape, name
            hf_params[name].copy_(value)

        put("model.embed_tokens.weight", params["embedding.weight"])
        put("lm_head.weight", params["head.weight"])
        put("model.norm.weight", params["final_norm.weight"])
        for i in range(m.n_layers):
            ours_l, hf_l = f"layers.{i}.", f"model.layers.{i}."
            put(hf_l + "input_layernorm.weight", params[ours_l + "attn_norm.weight"])
            put(hf_l + "post_attention_layernorm.weight", params[ours_l + "mlp_norm.weight"])
            for kind in ("weight",) + (("bias",) if bias else ()):
                put(hf_l + f"self_attn.q_proj.{kind}", params[ours_l + f"attn.q.{kind}"])
                put(hf_l + f"self_attn.k_proj.{kind}", params[ours_l + f"attn.kv.{kind}"][0])
                put(hf_l + f"self_attn.v_proj.{kind}", params[ours_l + f"attn.kv.{kind}"][1])
                put(hf_l + f"self_attn.o_proj.{kind}", params[ours_l + f"attn.proj.{kind}"])
                put(hf_l + f"mlp.gate_proj.{kind}", params[ours_l + f"mlp.up.{kind}"][0])
                put(hf_l + f"mlp.up_proj.{kind}", params[ours_l + f"mlp.up.{kind}"][1])
                put(hf_l + f"mlp.down_proj.{kind}", params[ours_l + f"mlp.down.{kind}"])
            if bias:  # zero-initialised: make them matter
                for t in (params[ours_l + "attn.q.bias"], params[ours_l + "attn.kv.bias"]):
                    t.normal_(0, 0.1)
                put(hf_l + "self_attn.q_proj.bias", params[ours_l + "attn.q.bias"])
                put(hf_l + "self_attn.k_proj.bias", params[ours_l + "attn.kv.bias"][0])
                put(hf_l + "self_attn.v_proj.bias", params[ours_l + "attn.kv.bias"][1])

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m.vocab_size, (2, m.seq_len + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = hf(input_ids=x, labels=None)
    ref_logits = out.logits
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), y.flatten())
    ref_loss.backward()

    logits = ours.logits(x)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5 * ref_logits.abs().max().item())
    loss = ours(x, y)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    loss.backward()
    grads = {"model.layers.0.self_attn.k_proj.weight": params["layers.0.attn.kv.weight"].grad[0],
             "model.layers.0.self_attn.v_proj.weight": params["layers.0.attn.kv.weight"].grad[1],
             "model.layers.1.self_attn.q_proj.weight": params["layers.1.attn.q.weight"].grad,
             "model.embed_tokens.weight": params["embedding.weight"].grad}
    if bias:
        grads["model.layers.1.self_attn.k_proj.bias"] = params["layers.1.attn.kv.bias"].grad[0]
    for name, grad in grads.items():
        ref = hf_params[name].grad
        err = (grad - ref).abs().max() / ref.abs().max()
        assert err < 1e-4, f"{name}: gradient differs from LlamaForCausalLM by {err:.2e} (relative to max)"


LAYOUTS = {
    # KV heads split over TP (1 per rank)
    "tp2_kv2": (2, GQA + ["parallel.tp=2"]),
    # fewer KV heads than TP ranks: each replicated on 2 TP ranks, under sequence parallelism
    "tp4_kv2_replicated_sp": (4, GQA + ["parallel.tp=4", "parallel.sequence_parallel=true"]),
    # one KV head (multi-query) on tp2 x pp2, with biases
    "tp2_pp2_mqa_bias": (4, ["model.n_heads=8", "model.n_kv_heads=1", "model.bias=true", "parallel.tp=2",
                             "parallel.pp=2"]),
    # ZeRO-3 shards the replicated pieces like any parameter
    "tp4_kv2_zero3_dp2": (8, GQA + ["parallel.tp=4", "zero.stage=3"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gqa_layout_matches_single_process(name):
    world, overrides = LAYOUTS[name]
    ref = reference(overrides, STEPS, ("model.",))  # cached per model
    out = run_world(train_worker, world, overrides, STEPS)
    torch.testing.assert_close(torch.tensor(out[0]["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(out[0]["grad_norms"]), torch.tensor(ref["grad_norms"]),
                               rtol=RTOL, atol=0)
    assert abs(out[0]["val_loss"] - ref["val_loss"]) <= RTOL * ref["val_loss"]
    assert ref["losses"][-1] < ref["losses"][0] - 0.05
    assert_grads_match([r["grads"] for r in out], ref["grads"])
    assert_counted_equals_analytic(out, overrides, world)
    replicated = "parallel.tp=4" in overrides or "model.n_kv_heads=1" in overrides
    assert ("tp_kv" in out[0]["comm"]["by_group"]) == replicated


def test_gqa_checkpoint_moves_between_replicated_and_split_layouts(tmp_path):
    """Saved at tp4 with replicated KV heads (stage 0), resumed at tp2 (split) under ZeRO-1 and on one process:
    every resume continues the uninterrupted single-process curve."""
    steps, ckpt = 4, str(tmp_path / "ckpt")
    straight = run_world(checkpoint_worker, 1, GQA, "none", steps, str(tmp_path / "unused"))[0]
    run_world(checkpoint_worker, 4, GQA + ["parallel.tp=4"], "fresh", 2, ckpt)
    meta = json.loads((tmp_path / "ckpt" / "step_00000002" / "meta.json").read_text())
    assert meta["model"]["kv_heads"] == 2
    for world, layout in ((2, ["parallel.tp=2", "zero.stage=1", "parallel.pp=1"]), (1, [])):
        resumed = run_world(checkpoint_worker, world, GQA + layout, "resume", steps, ckpt)[0]
        assert sorted(resumed) == [2, 3]
        for step in (2, 3):
            assert abs(resumed[step] - straight[step]) <= RTOL * straight[step], (layout, step)


def test_gqa_checkpoint_refuses_a_different_kv_head_count(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_world(checkpoint_worker, 1, GQA, "fresh", 1, ckpt)
    with pytest.raises(AssertionError, match=r"model.n_kv_heads: checkpoint 2 vs config 4"):
        run_world(checkpoint_worker, 1, ["model.n_heads=8", "model.n_kv_heads=4"], "resume", 2, ckpt)


@pytest.mark.parametrize("overrides, message", [
    (["model.n_heads=8", "model.n_kv_heads=3"], "model.n_kv_heads=3 must divide model.n_heads=8"),
    (["model.n_heads=8", "model.n_kv_heads=0"], "model.n_kv_heads=0 must divide model.n_heads=8"),
])
def test_bad_kv_head_counts_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(tiny_config(*overrides))


def test_kv_heads_that_neither_split_nor_replicate_over_tp_are_refused():
    cfg = tiny_config("model.n_heads=12", "model.d_model=96", "model.n_kv_heads=6", "parallel.tp=4")
    with pytest.raises(ConfigError, match="model.n_kv_heads=6 cannot be laid out over parallel.tp=4"):
        make_layout(cfg, 4, 4)


def test_parameter_count_and_flops_shrink_with_fewer_kv_heads():
    from model.flops import flops_per_token

    mha, gqa = tiny_config("model.n_heads=8").model, tiny_config(*GQA).model
    d, hd = 64, 8
    saved = 4 * 2 * (8 - 2) * hd * d  # 4 layers, K and V, 6 fewer heads
    assert parameter_count(mha)["total"] - parameter_count(gqa)["total"] == saved
    assert flops_per_token(mha) - flops_per_token(gqa) == 6 * saved


def test_gqa_under_fp8_tracks_one_process_and_counts_its_bytes():
    """FP8-LM with one KV head (replicated on both TP ranks), sequence parallel, FP8 ZeRO-1: the FP8 GEMM of
    the fused Q/K/V projection and the replicated gradient's all-reduce; FP8 rounding differs per layout,
    so the curve is compared at FP8's tolerance."""
    base = ["model.n_heads=8", "model.n_kv_heads=1", "precision=fp8", "fp8.emulate=true"]
    overrides = base + ["parallel.tp=2", "parallel.sequence_parallel=true", "zero.stage=1"]
    ref = run_world(train_worker, 1, base, 3)[0]
    out = run_world(train_worker, 4, overrides, 3)
    torch.testing.assert_close(torch.tensor(out[0]["losses"]), torch.tensor(ref["losses"]), rtol=5e-3, atol=0)
    assert_counted_equals_analytic(out, overrides, 4)
    assert out[0]["comm"]["by_group"]["tp_kv"] > 0
