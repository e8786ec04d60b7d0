"""Optimizer pieces, precision, accumulation, FLOPs and parameter counts against independent references."""
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from model.flops import flops_per_token, parameter_count
from model.gpt import build_chunks
from model.layers import TPContext
from parallel.comm import Group, Ledger
from parallel.random import RNGTracker
from tests.dist_harness import run_world
from tests.parallel_utils import batch_fn, build_engine, tiny_config, train_worker
from config import LossScaleConfig, TrainConfig
from parallel.optim_rules import build_optimizer, local_grad_sq, unscale_and_clip
from training.metrics import peak_tflops
from training.optim import LossScaler, LRSchedule


def single_model(*overrides):
    cfg = tiny_config(*overrides)
    solo = Group("tp", None, [0], 0, "intra", Ledger())
    ctx = TPContext(solo, False, RNGTracker(torch.device("cpu"), 0, 0, 0, 0))
    [model] = build_chunks(cfg.model, ctx, 1, 1, 0, cfg.train.seed, torch.device("cpu"))
    return cfg, model


def test_lr_schedule_warmup_cosine_floor():
    s = LRSchedule(TrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, max_steps=110))
    assert [s(i) for i in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.55)  # cosine half-way between peak and floor
    assert s(10 + 25) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert s(110) == s(500) == pytest.approx(0.1)


def test_loss_scaler_halves_on_overflow_and_grows_after_a_clean_window():
    s = LossScaler(LossScaleConfig(initial=1024.0, growth_interval=3, min_scale=1.0), enabled=True)
    for found_inf, expected in [(True, 512), (False, 512), (False, 512), (False, 1024), (True, 512), (False, 512)]:
        s.update(found_inf)
        assert s.scale == expected
    low = LossScaler(LossScaleConfig(initial=1.0, min_scale=1.0), enabled=True)
    with pytest.raises(FloatingPointError, match="minimum loss scale"):
        low.update(True)


def test_weight_decay_skips_norms_and_biases():
    cfg, model = single_model("model.bias=true", "model.norm=layernorm")
    opt = build_optimizer(list(model.named_parameters()), cfg.train, torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert plain == {n for n in names.values() if n.endswith("bias") or "norm" in n}
    assert decayed == set(names.values()) - plain


def test_unscale_and_clip_matches_torch_clip_grad_norm():
    _, model = single_model()
    params = list(model.parameters())
    buf = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.grad = buf[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    buf.normal_(0, 3.0, generator=torch.Generator().manual_seed(0))
    scale = 256.0
    reference = []  # the same gradients, unscaled, clipped by torch
    for p in params:
        q = torch.nn.Parameter(torch.zeros_like(p))
        q.grad = p.grad.clone() / scale
        reference.append(q)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm=1.0)
    sq = local_grad_sq(params, 0, buf.device).item()
    norm, finite = unscale_and_clip([buf], sq, scale, 1.0)
    assert finite and norm == pytest.approx(ref_norm.item(), rel=1e-5)
    for p, q in zip(params, reference):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8)
    buf[3] = float("inf")
    assert unscale_and_clip([buf], local_grad_sq(params, 0, buf.device).item(), 1.0, 1.0)[1] is False


@pytest.mark.parametrize("overrides", [[], ["model.tie_embeddings=true"],
                                       ["model.bias=true", "model.norm=layernorm", "model.activation=gelu"],
                                       ["model.n_heads=8", "model.n_kv_heads=2", "model.bias=true"]])
def test_parameter_count_equals_the_model(overrides):
    cfg, model = single_model(*overrides)
    assert parameter_count(cfg.model)["total"] == sum(p.numel() for p in model.parameters())


def math_attention(q, k, v, is_causal=True, dropout_p=0.0, enable_gqa=False):
    """Attention as explicit matmuls, so FlopCounterMode sees them (it does not count CPU SDPA kernels)."""
    if enable_gqa:  # grouped-query: every query head attends with its group's K/V head
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("overrides", [["model.activation=swiglu"], ["model.activation=gelu"],
                                       ["model.n_heads=8", "model.n_kv_heads=2"]], ids=["swiglu", "gelu", "gqa"])
def test_flops_per_token_matches_torch_flop_counter(overrides, monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", math_attention)
    cfg, model = single_model(*overrides)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1))
    with FlopCounterMode(display=False) as counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    counted = counter.get_total_flops() / tokens[:, :-1].numel()
    # the counter sees matmuls and SDPA exactly; our formula is the same convention (x3 for backward)
    assert counted == pytest.approx(flops_per_token(cfg.model), rel=1e-6)


def test_peak_table_by_device_name(monkeypatch):
    cuda = torch.device("cuda", 0)
    for name, precision, peak in [("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA H100 PCIe", "bf16", 756.0),
                                  ("NVIDIA H200", "fp8", 1979.0), ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
                                  ("Tesla V100-SXM2-32GB", "fp16", 125.0), ("Tesla V100-SXM2-32GB", "bf16", None),
                                  ("NVIDIA GeForce RTX 4090", "bf16", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert peak_tflops(cuda, precision) == peak, name
    assert peak_tflops(torch.device("cpu"), "bf16") is None


def test_gradient_accumulation_equals_one_big_micro_batch():
    many = run_world(train_worker, 1, ["train.micro_batch_size=1"], 3)[0]["losses"]
    one = run_world(train_worker, 1, ["train.micro_batch_size=8"], 3)[0]["losses"]
    torch.testing.assert_close(torch.tensor(many), torch.tensor(one), rtol=1e-5, atol=0)


def test_one_dp_rank_keeps_autograd_gradients_instead_of_buckets():
    """parallel/data_parallel.py with one DP rank: no bucket buffers; each gradient is autograd's own (the first
    micro-batch's tensor kept, the next ones added in place), equal to the float64 sum of the micro-batches'
    gradients; a parameter no micro-batch reached gets zeros at finish (as a zeroed bucket held), and zero_grad
    drops them all for the next step."""
    from parallel.data_parallel import GradBuckets

    torch.manual_seed(0)
    used, unused = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    params = list(used.parameters()) + list(unused.parameters())
    one = Group("dp", None, [0], 0, "intra", Ledger())
    b = GradBuckets(params, one, bucket_mb=25.0)
    assert b.buckets == [] and not b.flat
    xs = [torch.randn(3, 8) for _ in range(4)]
    want = sum(torch.autograd.functional.jacobian(lambda w: (x.double() @ w.t()).sum(), used.weight.detach().double())
               for x in xs)
    b.zero_grad()
    used(xs[0]).sum().backward()
    first = used.weight.grad
    for x in xs[1:]:
        used(x).sum().backward()
    b.finish()
    assert used.weight.grad is first, "the first micro-batch's gradient tensor is kept and added into"
    torch.testing.assert_close(used.weight.grad.double(), want, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in unused.parameters())
    assert len(b.grads()) == 4
    b.zero_grad()
    assert all(p.grad is None for p in params) and b.grads() == []


def fp16_worker():
    cfg = tiny_config("precision=fp16", "loss_scale.initial=4294967296", "loss_scale.growth_interval=2")
    engine = build_engine(cfg)
    before = {n: p.detach().clone() for n, p in engine.params.items()}
    first = engine.train_step(batch_fn(engine, 0))
    unchanged = all(torch.equal(before[n], p) for n, p in engine.params.items())
    history = [first]
    for step in range(1, 40):
        history.append(engine.train_step(batch_fn(engine, step)))
    return {"first": first, "unchanged": unchanged, "history": history, "skipped": engine.skipped_steps}


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    out = run_world(fp16_worker, 1)[0]
    assert out["first"]["skipped"] and out["unchanged"], "an overflowing step must not touch the weights"
    scales = [h["loss_scale"] for h in out["history"]]
    skipped = [h["skipped"] for h in out["history"]]
    for i in range(1, len(scales)):  # halved after each skip; doubled after two clean steps
        if skipped[i - 1]:
            assert scales[i] == scales[i - 1] / 2
    assert not all(skipped) and out["skipped"] == sum(skipped)
    assert any(scales[i] == 2 * scales[i - 1] for i in range(1, len(scales))), "the scale never grew back"
    trained = [h["loss"] for h, s in zip(out["history"], skipped) if not s]
    assert trained[-1] < trained[0]


def test_bf16_tracks_fp32():
    fp32 = run_world(train_worker, 1, [], 8)[0]["losses"]
    bf16 = run_world(train_worker, 1, ["precision=bf16"], 8)[0]["losses"]
    assert all(abs(a - b) < 0.03 * a for a, b in zip(fp32, bf16)), (fp32, bf16)
    assert bf16[-1] < bf16[0] - 0.05
