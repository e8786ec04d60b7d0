"""What surrounds the MoE block: the parameter count and FLOPs per token (active parameters) against the built
model, a hand formula and torch's FLOP counter; the memory estimator against the engine's measured bytes (ep = 1)
and its expert-parallel arithmetic; the MoE presets; scripts/bench_moe.py's table on a tiny run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from config import load_config
from model.flops import flops_per_token, parameter_count
from model.gpt import build_chunks
from model.layers import TPContext
from parallel.comm import Group, Ledger
from parallel.layout import make_layout
from parallel.random import RNGTracker
from tests.dist_harness import run_world
from tests.parallel_utils import batch_fn, build_engine, tiny_config

ROOT = Path(__file__).resolve().parents[1]
# 3 layers: layer 0 dense (first_dense=1), layers 1-2 MoE with 4 routed experts of width 32, top-2, one shared
# expert of width 48 with Qwen2-MoE's gate
D, V, L, FFN, E, K, FE, FS = 64, 128, 3, 128, 4, 2, 32, 48
MOE = [f"model.d_model={D}", f"model.vocab_size={V}", f"model.n_layers={L}", f"model.ffn_hidden={FFN}",
       f"model.moe.num_experts={E}", f"model.moe.top_k={K}", f"model.moe.ffn_hidden={FE}",
       "model.moe.shared_experts=1", f"model.moe.shared_ffn_hidden={FS}", "model.moe.shared_gate=true",
       "model.moe.first_dense=1"]


def built(*overrides):
    cfg = tiny_config(*overrides)
    solo = Group("tp", None, [0], 0, "intra", Ledger())
    ctx = TPContext(solo, False, RNGTracker(torch.device("cpu"), 0, 0, 0, 0))
    [model] = build_chunks(cfg.model, ctx, 1, 1, 0, cfg.train.seed, torch.device("cpu"))
    return cfg, model


@pytest.mark.parametrize("overrides", [MOE, MOE + ["model.activation=gelu", "model.moe.shared_experts=0",
                                                   "model.moe.shared_ffn_hidden=null",
                                                   "model.moe.shared_gate=false", "model.moe.layer_freq=2",
                                                   "model.moe.first_dense=0", "model.tie_embeddings=true"]],
                         ids=["swiglu_shared_gate_first_dense", "gelu_every_other_tied"])
def test_parameter_count_equals_the_built_moe_model(overrides):
    cfg, model = built(*overrides)
    assert parameter_count(cfg.model)["total"] == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    counts = parameter_count(cfg.model)
    assert counts["active"] == counts["total"] - routed + routed * K // E  # a token uses top_k of E experts


def test_parameter_count_and_flops_by_hand():
    cfg = tiny_config(*MOE).model
    h = cfg.head_dim * cfg.n_heads  # = D
    attention = 4 * D * h + 2 * D  # q, k, v, o (multi-head) and the two RMSNorms
    dense_mlp = 3 * D * FFN
    moe_held = E * D + E * 3 * D * FE + 3 * D * FS + D  # router, routed experts, shared expert, shared gate
    moe_active = E * D + K * 3 * D * FE + 3 * D * FS + D
    rest = 2 * V * D + D  # embedding, untied head, final norm
    counts = parameter_count(cfg)
    assert counts["total"] == rest + L * attention + dense_mlp + 2 * moe_held
    assert counts["active"] == rest + L * attention + dense_mlp + 2 * moe_active
    assert counts["non_embedding"] == counts["total"] - 2 * V * D
    gemm = L * 4 * D * h + dense_mlp + 2 * moe_active + D * V  # active GEMM weights (no embedding lookup)
    assert flops_per_token(cfg) == 6 * gemm + 6 * L * 2 * cfg.seq_len * h


def test_dense_twin_has_the_flops_of_the_moe_model_less_its_router():
    """Same active FFN width (top_k x expert width) -> same FLOPs per token but the router's GEMM."""
    preset = str(ROOT / "configs" / "tiny_moe.yaml")
    moe = load_config(preset).model
    width = moe.moe.top_k * moe.moe.ffn_hidden
    twin = load_config(preset, ["model.moe.num_experts=0", f"model.ffn_hidden={width}"]).model
    assert flops_per_token(moe) - flops_per_token(twin) == 6 * moe.n_layers * moe.moe.num_experts * moe.d_model
    assert parameter_count(twin)["active"] == parameter_count(twin)["total"]


def math_attention(q, k, v, is_causal=True, dropout_p=0.0, enable_gqa=False):
    """Attention as explicit matmuls, so FlopCounterMode sees them (it does not count CPU SDPA kernels)."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def test_flops_per_token_matches_torch_flop_counter_on_the_loop_path(monkeypatch):
    """The loop over experts runs every token-slot through F.linear, which the counter sees: dropless, each token
    costs exactly its top_k experts, the router and the shared expert and gate."""
    from model.moe import Experts

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", math_attention)
    cfg, model = built(*MOE)
    for m in model.modules():
        if isinstance(m, Experts):
            m.grouped = False
    tokens = torch.randint(0, V, (2, cfg.model.seq_len + 1), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert counter.get_total_flops() / tokens[:, :-1].numel() == pytest.approx(flops_per_token(cfg.model), rel=1e-9)


# --- the memory estimator ---------------------------------------------------------------------------------------

MEMORY = MOE + ["train.micro_batch_size=2", "train.global_batch_size=8", "precision=bf16"]


def measure_stages(cases):
    """This rank's measured model-state bytes (after 2 steps) and the estimate, per (ep, ZeRO stage), one engine
    each; and what stays gathered between steps, measured and estimated."""
    from training.memory import held_between_steps, model_state_bytes

    out = {}
    for ep, stage in cases:
        cfg = tiny_config(*MEMORY, f"parallel.ep={ep}", f"zero.stage={stage}")
        engine = build_engine(cfg)
        for step in range(2):
            engine.train_step(batch_fn(engine, step))
        layout, rank = engine.mesh.layout, engine.mesh.rank
        out[ep, stage] = {"measured": engine.dp.memory(), "estimated": model_state_bytes(cfg, layout, rank),
                          "held": engine.dp.working.now if hasattr(engine.dp, "working") else 0,
                          "held_estimate": held_between_steps(cfg, layout, rank)}
    return out


def test_estimator_equals_measured_moe_model_states_byte_for_byte():
    """Every component, every rank, ZeRO 0-3 at dp 4 with ep 1 and ep 2 (the experts sharded over the 2 ranks
    holding them; routed experts, shared expert and gate, router, a dense layer)."""
    cases = [(ep, stage) for ep in (1, 2) for stage in range(4)]
    for rank in run_world(measure_stages, 4, cases, timeout=600):
        for case, r in rank.items():
            assert r["measured"] == r["estimated"] and r["held"] == r["held_estimate"], (case, r)
        assert rank[2, 0]["measured"]["parameters"] < rank[1, 0]["measured"]["parameters"]


def test_expert_parallel_estimate_divides_the_experts_and_shards_them_over_their_group():
    """ep in 1, 2, 4 at dp 4 (the engine is measured at ep 1 and 2 above): stage 0 holds the dense parameters plus
    num_experts / ep experts; at stages 1-3 the sharded states are the same as at ep = 1 (the experts / ep over
    dp / ep ranks are experts / dp a rank, the padding aside)."""
    from training.memory import held_parameters, model_state_bytes

    base = MOE + ["train.micro_batch_size=2", "train.global_batch_size=8", "precision=bf16"]
    counts = parameter_count(tiny_config(*base).model)
    routed = 2 * E * 3 * D * FE
    states = {}
    for ep in (1, 2, 4):
        for stage in (0, 1, 3):
            cfg = tiny_config(*base, f"parallel.ep={ep}", f"zero.stage={stage}")
            layout = make_layout(cfg, 4, 4)
            for rank in (0, 3):
                held = held_parameters(cfg, layout, rank)
                assert held == counts["total"] - routed + routed // ep
                est = model_state_bytes(cfg, layout, rank)
                if stage == 0:
                    assert est == {"parameters": 4 * held, "gradients": 4 * held, "optimizer": 8 * held,
                                   "working_peak": 0}
                states[ep, stage, rank] = est
    for stage in (1, 3):
        for rank in (0, 3):
            one = states[1, stage, rank]["optimizer"]
            for ep in (2, 4):
                assert abs(states[ep, stage, rank]["optimizer"] - one) <= 2 * 12 * 64 * 4, (stage, ep, rank)
    assert states[4, 3, 0]["working_peak"] < states[2, 3, 0]["working_peak"] < states[1, 3, 0]["working_peak"]


def test_estimate_memory_script_counts_the_experts_per_ep_rank(capsys):
    from scripts.estimate_memory import main

    assert main(["--config", str(ROOT / "configs" / "mixtral_8x7b.yaml"), "--world", "64"]) == 0
    out = capsys.readouterr().out
    assert "ep 8" in out and "stage 3" in out and "active" in out


# --- scripts/bench_moe.py ---------------------------------------------------------------------------------------

SMALL = ["model.n_layers=1", "model.seq_len=32", "train.global_batch_size=2", "train.micro_batch_size=2"]


def test_bench_moe_throughput_table_has_the_three_rows(capsys):
    from scripts.bench_moe import main

    assert main(["--steps", "1", "--warmup", "0", *SMALL]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"moe grouped", "moe loop", "dense twin"} <= set(rows), out
    assert "| 1.00x |" in rows["dense twin"] and "model.ffn_hidden=384" in out


def test_bench_moe_balance_reads_the_last_step_and_the_recent_mean(tmp_path):
    import json

    from scripts.bench_moe import read_balance

    lines = [{"step": s, "loss": 9.0 - s, "moe": {"load_max_over_mean": 1.0 + s / 100,
                                                  "layers": {"0": {"load_max_over_mean": 1.0 + s / 100},
                                                             "1": {"load_max_over_mean": 1.0}}}}
             for s in range(1, 13)] + [{"step": 12, "val_loss": 3.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    r = read_balance(tmp_path)
    assert r["step"] == 12 and r["layers"] == {"0": 1.12, "1": 1.0} and r["max"] == 1.12
    assert r["recent"] == pytest.approx(1.0 + sum(range(3, 13)) / 1000) and r["val"] == 3.5 and r["loss"] == -3.0
