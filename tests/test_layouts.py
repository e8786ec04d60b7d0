"""Every parallel layout trains the single-process model: same losses, grad norms and gradients (fp32)."""
import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import assert_grads_match, train_worker

STEPS = 5
RTOL = 1e-5

LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "pp4_vp2": (4, ["parallel.pp=4", "parallel.virtual_stages=2", "model.n_layers=8"]),
    "tp2_pp2_sp": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]),
    "tp2_pp2_dp2": (8, ["parallel.tp=2", "parallel.pp=2"]),
    "pp2_dp2": (4, ["parallel.pp=2"]),
    "dp2_small_buckets": (2, ["parallel.bucket_mb=0.01"]),
    "tp2_pp2_tied_gelu_bias": (4, ["parallel.tp=2", "parallel.pp=2", "model.tie_embeddings=true",
                                   "model.activation=gelu", "model.norm=layernorm", "model.bias=true",
                                   "parallel.sequence_parallel=true"]),
}
MODEL_KEYS = ("model.n_layers", "model.tie_embeddings", "model.activation", "model.norm", "model.bias")

_references = {}


def reference(overrides, steps=STEPS, keys=MODEL_KEYS):
    """Single-process run of the same model (only the overrides starting with ``keys`` kept), cached per model
    shape and step count."""
    model = tuple(o for o in overrides if o.startswith(keys))
    if (model, steps) not in _references:
        _references[model, steps] = run_world(train_worker, 1, list(model), steps)[0]
    return _references[model, steps]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name):
    world, overrides = LAYOUTS[name]
    ref = reference(overrides)
    out = run_world(train_worker, world, overrides, STEPS)

    for r in out:  # every rank reports the same loss, whatever its stage
        assert r["losses"] == out[0]["losses"] and r["val_loss"] == out[0]["val_loss"]
    assert abs(out[0]["val_loss"] - ref["val_loss"]) <= RTOL * ref["val_loss"]
    torch.testing.assert_close(torch.tensor(out[0]["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(out[0]["grad_norms"]), torch.tensor(ref["grad_norms"]),
                               rtol=RTOL, atol=0)
    assert ref["losses"][-1] < ref["losses"][0] - 0.05, "the reference must learn, or equal curves prove little"

    assert_grads_match([r["grads"] for r in out], ref["grads"])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_activations_cross_stages(precision):
    """Stage outputs travel in the compute dtype; pipelining must not change the numbers."""
    overrides = [f"precision={precision}", "loss_scale.initial=1024"]
    ref = run_world(train_worker, 1, overrides, 3)[0]
    out = run_world(train_worker, 4, overrides + ["parallel.pp=4", "parallel.virtual_stages=1"], 3)
    torch.testing.assert_close(torch.tensor(out[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-3, atol=0)
    assert abs(out[0]["val_loss"] - ref["val_loss"]) <= 1e-3 * ref["val_loss"]
    assert out[1]["comm"]["by_group"]["pp"] == 2 * 4 * 32 * 2 * 64 * 2  # 4 mb x (fwd + bwd) x s*b*h x 2 bytes


def test_one_f_one_b_bounds_activations_in_flight_and_frees_what_it_sent():
    out = run_world(train_worker, 4, ["parallel.pp=4", "train.global_batch_size=16"], 1)
    for rank, r in enumerate(out):  # 8 micro-batches, but at most pp - rank in flight
        assert r["max_in_flight"] == 4 - rank
        # every activation / input gradient sent was freed right after (one step; the ledger counts sends)
        assert r["released_bytes"] == r["comm"]["by_group"]["pp"] > 0


def test_backward_through_an_output_whose_storage_was_freed():
    """What the pipeline relies on: a sent output keeps only its shape and autograd node."""
    x = torch.randn(6, 2, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    out = x + torch.nn.functional.gelu(x @ w)  # a residual-stream output, as a stage returns
    grad = torch.randn_like(out)
    expected = torch.autograd.grad(out, (x, w), grad, retain_graph=True)
    out.detach().untyped_storage().resize_(0)
    assert out.untyped_storage().nbytes() == 0
    got = torch.autograd.grad(out, (x, w), grad)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
