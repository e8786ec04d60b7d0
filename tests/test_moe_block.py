"""model/moe.py's MoE block, one process: the grouped-GEMM and loop paths against a per-token float64 reference
written here (routing, gates, capacity drops, shared experts, the balancing losses and every gradient), the
expert bias, and Hugging Face's Mixtral and Qwen2-MoE blocks at tiny sizes; config/moe.py's checks."""
from __future__ import annotations

import math

import pytest
import torch

from config import Config, ModelConfig
from config.moe import MoeConfig, is_moe_layer, validate_moe
from model.init import init_parameters
from model.layers import TPContext
from model.moe import MoE, grouped_gemm_runs
from parallel.comm import Group, Ledger
from parallel.random import RNGTracker

S, B, D, FFN = 4, 3, 16, 16  # 12 tokens; widths multiples of 4 so fp32 rows are 16-byte aligned
PATHS = [pytest.param(True, id="grouped"), pytest.param(False, id="loop")]


def build(activation: str = "swiglu", seed: int = 0, **moe) -> MoE:
    """A tiny MoE drawn by model/init.py (std 0.3, so outputs are O(1) and the comparisons mean something)."""
    moe = {"num_experts": 4, "top_k": 2, "ffn_hidden": FFN, **moe}
    cfg = ModelConfig(d_model=D, n_layers=1, activation=activation, init_std=0.3)
    ctx = TPContext(Group("tp", None, [0], 0, "intra", Ledger()), False, RNGTracker(torch.device("cpu"), 1, 0, 0, 0))
    m = MoE(cfg, ctx, MoeConfig(**moe))
    init_parameters(m, seed, 0, 1)
    return m


def tokens(seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(S, B, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def ffn_ref(x, up, down, swiglu: bool):
    """One expert's FFN of one token, by hand in float64."""
    h = up.flatten(0, -2) @ x
    if swiglu:
        gate, lin = h.chunk(2)
        a = gate * torch.sigmoid(gate) * lin
    else:
        a = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    return down @ a


def reference(m: MoE, x: torch.Tensor, capacity=None):
    """Token by token in float64 on float64 leaf copies of the parameters (and of x): returns
    (y [s, b, h], selected [T, k], kept [T, k], aux, z, counts, params, x64)."""
    r, swiglu = m.router, m.experts.swiglu
    p = {n: t.detach().double().requires_grad_() for n, t in m.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    s, b, h = x.shape
    T, E, k = s * b, r.num_experts, r.top_k
    flat = x64.reshape(T, h)
    logits = flat @ p["router.weight"].T
    scores = torch.softmax(logits, -1) if r.score == "softmax" else torch.sigmoid(logits)
    selected = torch.topk(scores.detach() + r.expert_bias.double(), k, dim=-1).indices
    used, kept, rows = [0] * E, torch.ones(T, k, dtype=torch.bool), []
    for t in range(T):
        y = torch.zeros(h, dtype=torch.float64)
        chosen = scores[t, selected[t]]
        for j in range(k):
            e = int(selected[t, j])
            if capacity is not None and used[e] >= capacity:
                kept[t, j] = False
                continue
            used[e] += 1
            gate = chosen[j] / chosen.sum() if r.norm_topk else chosen[j]
            y = y + r.routed_scale * gate * ffn_ref(flat[t], p["experts.w_up"][e], p["experts.w_down"][e], swiglu)
        if m.shared is not None:
            out = ffn_ref(flat[t], p["shared.up.weight"], p["shared.down.weight"], swiglu)
            if m.shared_gate is not None:
                out = torch.sigmoid(p["shared_gate"][0] @ flat[t]) * out
            y = y + out
        rows.append(y)
    counts = torch.bincount(selected.flatten(), minlength=E)
    probs = scores if r.score == "softmax" else scores / scores.sum(-1, keepdim=True)
    aux = E * sum(counts[e] / (T * k) * probs[:, e].mean() for e in range(E))
    z = (torch.log(torch.exp(logits).sum(-1)) ** 2).mean()
    return torch.stack(rows).view(s, b, h), selected, kept, aux, z, counts, p, x64


def close(a, b, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol)


CASES = {
    "mixtral": dict(score="softmax", norm_topk=True),
    "qwen2": dict(score="softmax", norm_topk=False, shared_experts=1, shared_ffn_hidden=32, shared_gate=True),
    "deepseek": dict(score="sigmoid", norm_topk=True, routed_scale=2.5, shared_experts=2),
    "gelu": dict(activation="gelu", score="softmax", norm_topk=False, top_k=1),
}


@pytest.mark.parametrize("grouped", PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_losses_and_gradients_match_a_float64_reference(case, grouped):
    m = build(**CASES[case])
    m.experts.grouped = grouped
    x = tokens().requires_grad_()
    y = m(x)
    y_ref, selected, kept, aux, z, counts, p, x64 = reference(m, x)
    close(y, y_ref)
    assert torch.equal(m.router(x.reshape(-1, D)).experts, selected) and kept.all()
    assert torch.equal(m.counts, counts) and int(m.dropped) == 0
    close(m.aux_loss, aux)
    close(m.z_loss, z)
    # gradients of output, auxiliary loss and z-loss reach router, experts, shared experts, gate and x
    g = torch.randn(S, B, D, generator=torch.Generator().manual_seed(2))
    ((y * g).sum() + 0.3 * m.aux_loss + 0.1 * m.z_loss).backward()
    ((y_ref * g.double()).sum() + 0.3 * aux + 0.1 * z).backward()
    for name, param in m.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
        close(param.grad, p[name].grad, rtol=1e-4, atol=1e-5)
    close(x.grad, x64.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("grouped", PATHS)
def test_capacity_drops_the_first_come_slots_in_token_order_and_counts_them(grouped):
    m = build(capacity_factor=0.75, shared_experts=1)
    m.experts.grouped = grouped
    x = tokens()
    capacity = m.capacity(S * B)
    assert capacity == math.ceil(0.75 * S * B * 2 / 4) == 5
    y = m(x)
    y_ref, selected, kept_ref, _, _, counts, _, _ = reference(m, x, capacity=capacity)
    flat = x.reshape(-1, D)
    routing = m.router(flat)
    _, kept = m.experts(flat, routing.experts, routing.gates, capacity)
    assert torch.equal(kept, kept_ref) and not kept.all()
    dropped = int((~kept_ref).sum())
    assert int(m.dropped) == dropped == int((counts - capacity).clamp(min=0).sum())
    close(y, y_ref)
    m(x)  # the step's second micro-batch: the stats add up
    assert int(m.dropped_slots) == 2 * dropped and torch.equal(m.load, 2 * counts)


@pytest.mark.parametrize("grouped", PATHS)
def test_a_capacity_of_the_token_count_or_more_is_dropless(grouped):
    """model.moe.capacity_factor=1e30 passed validation and the first forward died (OverflowError: int too big to
    convert, making the capacity tensor). An expert receives at most one slot per token, so a capacity of the
    token count or more drops nothing: the block is the dropless one, bit for bit, and the float64 reference's."""
    x = tokens()
    dropless = build(shared_experts=1)
    dropless.experts.grouped = grouped
    want = dropless(x)
    close(want, reference(dropless, x)[0])
    T = S * B
    for factor in (1e30, 1e308, 4 / 2, 1.99):  # 4 / 2 = E / k: exactly T slots; 1.99: ceil(11.94) = T
        m = build(shared_experts=1, capacity_factor=factor)
        m.experts.grouped = grouped
        assert torch.equal(m(x), want) and int(m.dropped) == 0, factor
    assert build(capacity_factor=1.99).capacity(T) == T and build(capacity_factor=1.8).capacity(T) == T - 1
    # the capacity path at exactly T slots keeps every one: the same output as the dropless path
    flat = x.reshape(-1, D)
    routing = dropless.router(flat)
    y_capped, kept = dropless.experts(flat, routing.experts, routing.gates, T)
    y_dropless, _ = dropless.experts(flat, routing.experts, routing.gates, None)
    assert kept.all() and torch.equal(y_capped, y_dropless)


def test_the_expert_bias_changes_selection_only_and_moves_by_the_sign_rule():
    m = build(score="sigmoid", norm_topk=True, bias_update_rate=1e-3)
    flat = tokens().reshape(-1, D)
    before = m.router(flat)
    m.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    after = m.router(flat)
    assert (after.experts[:, 0] == 3).all() and not torch.equal(after.experts, before.experts)
    torch.testing.assert_close(after.scores, before.scores, rtol=0, atol=0)
    chosen = before.scores.gather(1, after.experts)  # gates: the unbiased scores of the experts chosen
    torch.testing.assert_close(after.gates, chosen / chosen.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    y_ref = reference(m, tokens())[0]
    close(m(tokens()), y_ref)

    m.router.expert_bias.zero_()
    m.update_bias(torch.tensor([10, 0, 5, 5]))  # mean 5: the overloaded one down, the idle one up
    torch.testing.assert_close(m.router.expert_bias, torch.tensor([-1e-3, 1e-3, 0.0, 0.0]))
    m.load.zero_()
    m(tokens(1))
    m(tokens(2))
    load = m.load.clone()
    assert int(load.sum()) == 2 * S * B * 2
    bias = m.router.expert_bias.clone()
    m.update_bias()  # this rank's load of the step
    torch.testing.assert_close(m.router.expert_bias, bias + 1e-3 * torch.sign(load.double().mean() - load).float())
    assert int(m.load.sum()) == 0 and int(m.dropped_slots) == 0
    assert "router.expert_bias" in m.state_dict() and "load" not in m.state_dict()
    off = build()
    off.update_bias(torch.tensor([10, 0, 5, 5]))
    assert int((off.router.expert_bias != 0).sum()) == 0  # bias_update_rate 0: aux-loss-free balancing off


def test_the_grouped_gemm_runs_on_this_cpu_where_torch_allows_and_the_loop_elsewhere():
    cpu = torch.device("cpu")
    assert grouped_gemm_runs(torch.float32, cpu, D, FFN)
    assert not grouped_gemm_runs(torch.float32, cpu, 6, FFN)  # 24-byte rows
    assert not grouped_gemm_runs(torch.float64, cpu, D, FFN)
    assert not grouped_gemm_runs(torch.float32, torch.device("cuda"), D, FFN)  # CUDA: bf16 only
    m = build(shared_experts=1, shared_gate=True)
    assert m.experts.use_grouped(torch.float32, cpu)
    m64 = build(shared_experts=1, shared_gate=True).double()  # float64: the loop, exact to the reference
    x = tokens(dtype=torch.float64)
    close(m64(x), reference(m64, x)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("grouped", PATHS)
def test_under_bf16_autocast_the_experts_compute_in_bf16(grouped):
    m = build(shared_experts=1)
    m.experts.grouped = grouped
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(tokens().bfloat16())
    assert y.dtype == torch.bfloat16
    close(y, reference(m, tokens().bfloat16().float())[0], rtol=5e-2, atol=5e-2)


def _copy_experts(m: MoE, hf) -> None:
    hf.gate.weight.copy_(m.router.weight)
    hf.experts.gate_up_proj.copy_(m.experts.w_up.flatten(1, 2))
    hf.experts.down_proj.copy_(m.experts.w_down)


@torch.no_grad()
def test_equals_hugging_face_mixtral_sparse_moe_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf_cfg = MixtralConfig(hidden_size=D, intermediate_size=FFN, num_local_experts=4, num_experts_per_tok=2,
                           router_jitter_noise=0.0, hidden_act="silu")
    hf_cfg._experts_implementation = "eager"
    hf = MixtralSparseMoeBlock(hf_cfg).eval()
    m = build(score="softmax", norm_topk=True)
    _copy_experts(m, hf)
    for grouped in (True, False):
        m.experts.grouped = grouped
        x = tokens()
        diff = (m(x) - hf(x.transpose(0, 1).contiguous()).transpose(0, 1)).abs().max()
        assert diff <= 1e-5, diff


@pytest.mark.parametrize("norm_topk", [False, True])
@torch.no_grad()
def test_equals_hugging_face_qwen2_moe_sparse_moe_block(norm_topk):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    hf_cfg = Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=FFN, shared_expert_intermediate_size=32,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm_topk, hidden_act="silu")
    hf_cfg._experts_implementation = "eager"
    hf = Qwen2MoeSparseMoeBlock(hf_cfg).eval()
    m = build(score="softmax", norm_topk=norm_topk, shared_experts=1, shared_ffn_hidden=32, shared_gate=True)
    _copy_experts(m, hf)
    hf.shared_expert.gate_proj.weight.copy_(m.shared.up.weight[0])
    hf.shared_expert.up_proj.weight.copy_(m.shared.up.weight[1])
    hf.shared_expert.down_proj.weight.copy_(m.shared.down.weight)
    hf.shared_expert_gate.weight.copy_(m.shared_gate)
    x = tokens()
    diff = (m(x) - hf(x.transpose(0, 1).contiguous()).transpose(0, 1)).abs().max()
    assert diff <= 1e-5, diff


def test_moe_config_checks_and_layer_choice():
    def problems(**moe):
        cfg = Config()
        cfg.model.moe = MoeConfig(**moe)  # not in ModelConfig yet: attached as config/schema.py will
        found = []
        validate_moe(cfg, lambda ok, msg: found.append(msg) if not ok else None)
        return found

    assert problems() == [] and problems(num_experts=8, top_k=2, shared_experts=1, shared_gate=True) == []
    assert problems(num_experts=4, ffn_hidden=64, shared_experts=8192) == []  # 64 x 8192: the ceiling 2**19
    assert problems(num_experts=4, shared_experts=1365) == []  # 384 x 1365 = 524160
    for bad, key in [(dict(num_experts=-1), "num_experts"), (dict(num_experts=4, top_k=5), "top_k"),
                     (dict(num_experts=4, top_k=0), "top_k"), (dict(num_experts=4, capacity_factor=0.0), "capacity"),
                     (dict(num_experts=4, capacity_factor=float("nan")), "capacity"),
                     (dict(num_experts=4, aux_loss_coeff=-1.0), "aux_loss_coeff"),
                     (dict(num_experts=4, z_loss_coeff=float("inf")), "z_loss_coeff"),
                     (dict(num_experts=4, bias_update_rate=-1e-3), "bias_update_rate"),
                     (dict(num_experts=4, layer_freq=0), "layer_freq"), (dict(num_experts=4, first_dense=4), "first"),
                     (dict(num_experts=4, shared_gate=True), "shared_experts"),
                     (dict(num_experts=4, ffn_hidden=0), "ffn_hidden"),
                     (dict(num_experts=4, shared_experts=1, shared_ffn_hidden=2**19 + 1),
                      "model.moe.shared_ffn_hidden=524289"),
                     # the width derived from shared_experts has the same ceiling (the default width: 384)
                     (dict(num_experts=4, shared_experts=8192), "model.moe.shared_experts=8192"),
                     (dict(num_experts=4, shared_experts=1366), f"= {1366 * 384}, above 2**19"),
                     (dict(num_experts=4, routed_scale=0.0), "routed_scale")]:
        found = problems(**bad)
        assert len(found) == 1 and key in found[0], (bad, found)
    dense, every = MoeConfig(), MoeConfig(num_experts=8)
    qwen_step2 = MoeConfig(num_experts=8, layer_freq=2, first_dense=1)
    deepseek = MoeConfig(num_experts=8, first_dense=3)
    assert [i for i in range(6) if is_moe_layer(dense, i)] == []
    assert [i for i in range(6) if is_moe_layer(every, i)] == [0, 1, 2, 3, 4, 5]
    assert [i for i in range(6) if is_moe_layer(qwen_step2, i)] == [1, 3, 5]  # Qwen2-MoE: (i + 1) % 2 == 0
    assert [i for i in range(6) if is_moe_layer(deepseek, i)] == [3, 4, 5]
