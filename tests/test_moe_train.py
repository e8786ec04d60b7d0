"""Mixture of experts in the trainer: the balancing losses' gradients against a plain-autograd reference, every
layout (DP, PP, ZeRO 1-3, expert parallelism alone and with DP and PP, capacity drops) against the one-process
run, the expert bias's update, checkpoints that resume and reshard between ep sizes, and bad settings.

The one-process run is itself checked against a reference outside the code under test: its step-0 gradients equal
those of ``LM loss + sum over MoE layers of (aux_coeff x aux + z_coeff x z)`` backpropagated by plain autograd
(``_AddAuxLoss`` switched off by a zero scale), and ``tests/test_moe_block.py`` checks the block against a float64
per-token reference and transformers' MoE blocks.
"""
from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import (assert_grads_match, batch_fn, build_engine, checkpoint_worker, local_grads,
                                  tiny_config)

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden=32", "model.moe.aux_loss_coeff=0.01",
       "model.moe.z_loss_coeff=0.001", "model.moe.bias_update_rate=0.01", "train.seed=3"]
STEPS = 4


def moe_worker(overrides: List[str], steps: int) -> Dict[str, Any]:
    """Train ``steps`` steps; the losses, the step-0 gradients, each step's MoE record and the final expert biases."""
    engine = build_engine(tiny_config(*MOE, *overrides))
    losses, records, grads = [], [], None
    for step in range(steps):
        stats = engine.train_step(batch_fn(engine, step))
        losses.append(stats["loss"])
        records.append(stats["moe"])
        if step == 0:
            grads = local_grads(engine)
    biases = {name: t.clone() for name, t in engine.moe.buffers.items()}
    return {"losses": losses, "grads": grads, "records": records, "biases": biases,
            "val": engine.eval_loss(batch_fn(engine, 1000))}


@pytest.fixture(scope="module")
def reference() -> Dict[str, Any]:
    return run_world(moe_worker, 1, [], STEPS)[0]


def _autograd_worker():
    overrides = ["train.global_batch_size=2", "model.moe.aux_loss_coeff=0.5", "model.moe.z_loss_coeff=0.1"]
    engine = build_engine(tiny_config(*MOE, *overrides))
    twin = build_engine(tiny_config(*MOE, *overrides))  # the same initial weights, a second copy
    tokens, labels = batch_fn(engine, 0)(0)
    engine.train_step(batch_fn(engine, 0))
    [chunk] = twin.chunks
    for m in twin.moe.modules.values():
        m.aux_scale.zero_()  # no injected gradient: the terms are added to the loss by hand below
    lm = chunk(tokens, labels)
    total = lm + sum(m.aux_loss_coeff * m.aux_loss + m.z_loss_coeff * m.z_loss for m in twin.moe.modules.values())
    total.backward()
    without = {n: p.grad.clone() for n, p in twin.params.items()}
    for p in twin.params.values():
        p.grad = None
    chunk(tokens, labels).backward()  # the LM loss alone: the terms must matter for the check to mean anything
    router = "layers.0.mlp.router.weight"
    moved = (without[router] - twin.params[router].grad).abs().max().item()
    # the engine has stepped: its gradients are still in p.grad (stage 0, one rank)
    return {n: (p.grad - without[n]).abs().max().item() / without[n].abs().max().clamp_min(1e-12).item()
            for n, p in engine.params.items()}, moved



def test_balancing_losses_reach_the_gradients_as_plain_autograd_does():
    """One process, one micro-batch: the engine's step-0 gradients equal plain autograd's of the LM loss plus the
    weighted auxiliary and z losses of every MoE layer (a mutation that drops _AddAuxLoss, or scales it by the
    micro-batch count twice, fails this)."""
    errors, moved = run_world(_autograd_worker, 1)[0]
    assert moved > 1e-4, f"the balancing terms barely change the router's gradient ({moved:.2e}): a weak check"
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, f"{worst}: gradient differs from plain autograd by {errors[worst]:.2e}"


LAYOUTS = {
    "dp2": (2, []),
    "pp2": (2, ["parallel.pp=2"]),
    "zero1": (2, ["zero.stage=1"]),
    "zero3": (2, ["zero.stage=3"]),
    "ep2": (2, ["parallel.ep=2"]),
    "ep4": (4, ["parallel.ep=4"]),
    "ep2_dp4": (4, ["parallel.ep=2"]),
    "ep2_pp2": (4, ["parallel.ep=2", "parallel.pp=2"]),
    "ep2_full_recompute": (2, ["parallel.ep=2", "model.activation_checkpointing=full"]),
    "zero1_ep2": (2, ["zero.stage=1", "parallel.ep=2"]),
    "zero2_ep2_pp2": (4, ["zero.stage=2", "parallel.ep=2", "parallel.pp=2"]),
    "zero3_ep2_dp4": (4, ["zero.stage=3", "parallel.ep=2"]),
    "zero3_ep4": (4, ["zero.stage=3", "parallel.ep=4"]),
    "zero3_tp2_sp_ep2": (4, ["zero.stage=3", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp2_sp_ep2": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"]),
    # context parallelism: each CP rank routes its two chunks of every sequence (the counts summed over CP)
    "cp2_ep2": (4, ["parallel.cp=2", "parallel.ep=2"]),
    "cp2_tp2_sp_a2a_zero3": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                 "parallel.cp_comm=a2a", "zero.stage=3"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(reference, layout):
    world, overrides = LAYOUTS[layout]
    results = run_world(moe_worker, world, overrides, STEPS)
    last = results[-1]
    assert last["losses"] == pytest.approx(reference["losses"], rel=1e-5), (last["losses"], reference["losses"])
    assert last["val"] == pytest.approx(reference["val"], rel=1e-5)
    assert_grads_match([r["grads"] for r in results], reference["grads"])
    for r in results:  # every rank holding a layer moved its bias as the one process did
        for name, bias in r["biases"].items():
            torch.testing.assert_close(bias, reference["biases"][name], rtol=0, atol=1e-7)
    for got, want in zip(last["records"], reference["records"]):
        assert got["layers"].keys() == want["layers"].keys()
        for layer, row in got["layers"].items():
            assert row["load_max_over_mean"] == pytest.approx(want["layers"][layer]["load_max_over_mean"])
            assert row["aux_loss"] == pytest.approx(want["layers"][layer]["aux_loss"], rel=1e-5)


def _bias_worker():
    engine = build_engine(tiny_config(*MOE))
    m = engine.moe.modules[0]
    stats = engine.train_step(batch_fn(engine, 0))
    return stats["moe"], m.router.expert_bias.clone()



@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
def test_other_optimizers_with_expert_parallelism(reference, optimizer):
    """Muon (each expert's matrices on their own) and Adafactor on an EP rank's experts, ZeRO-1 whole tensors."""
    chosen = [f"train.optimizer={optimizer}", "train.lr=1e-2"]
    if optimizer == "adafactor":  # a relative step of 1e-2 (auto would be train.lr / model.init_std = 0.5)
        chosen += ["train.adafactor.lr=1e-2", "train.adafactor.weight_decay=0.1"]
    one = run_world(moe_worker, 1, chosen, 3)[0]
    split = run_world(moe_worker, 2, chosen + ["zero.stage=1", "zero.partition=whole_tensor", "parallel.ep=2"], 3)
    assert split[-1]["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert one["losses"][2] != pytest.approx(reference["losses"][2], rel=1e-4)  # not AdamW's curve


def test_bias_moves_against_the_load_and_is_reported():
    """After one step each expert's bias moved by -rate x sign(load - mean load) (rate 0.01); the record says the
    range the step routed with (zero) and a load ratio >= 1."""
    record, bias = run_world(_bias_worker, 1)[0]
    row = record["layers"]["0"]
    assert row["bias_min"] == row["bias_max"] == 0.0
    assert row["load_max_over_mean"] >= 1.0 and record["load_max_over_mean"] >= row["load_max_over_mean"]
    rate = torch.tensor(0.01).item()  # in the bias's fp32
    assert set(bias.abs().tolist()) <= {rate, 0.0} and bias.abs().max().item() == rate
    assert bias.sum().abs().item() < 0.05  # overloaded experts go down, idle ones up


def test_a_capacity_factor_of_1e30_trains_as_dropless(reference):
    """It passed validation and the first forward died (OverflowError: int too big to convert) after the run
    directory was made: a capacity of the token count or more drops nothing, so the run is the dropless one."""
    huge = run_world(moe_worker, 1, ["model.moe.capacity_factor=1e30"], STEPS)[0]
    assert huge["losses"] == reference["losses"] and huge["val"] == reference["val"]
    assert all(r["dropped_frac"] == 0.0 for r in huge["records"])
    assert huge["grads"].keys() == reference["grads"].keys()
    assert all(torch.equal(huge["grads"][n][-1], reference["grads"][n][-1]) for n in huge["grads"])


@pytest.fixture(scope="module")
def capacity_reference() -> Dict[str, Any]:
    return run_world(moe_worker, 1, ["model.moe.capacity_factor=0.5"], 2)[0]


@pytest.mark.parametrize("world,layout", [(2, ["parallel.ep=2"]),
                                          (2, ["parallel.tp=2", "parallel.sequence_parallel=true"])])
def test_capacity_drops_the_same_slots(capacity_reference, world, layout):
    """Expert parallelism and sequence parallelism (each TP rank routes a slice; the capacity is the sequence's,
    first come in its token order) drop exactly the one-process run's slots."""
    one = capacity_reference
    results = run_world(moe_worker, world, ["model.moe.capacity_factor=0.5"] + layout, 2)
    split = results[-1]
    dropped = [r["layers"]["0"]["dropped_frac"] for r in one["records"]]
    assert dropped[0] > 0.1, "capacity 0.5 should drop slots"
    assert [r["layers"]["0"]["dropped_frac"] for r in split["records"]] == pytest.approx(dropped)
    assert split["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert_grads_match([r["grads"] for r in results], one["grads"])


def test_shared_experts_with_their_gate_split_over_tp_and_sp():
    """Qwen2-MoE's gated shared expert: a TP-split MLP under tp2 + SP, its gate and the router partial over TP."""
    shared = ["model.moe.shared_experts=1", "model.moe.shared_gate=true", "model.moe.first_dense=1"]
    one = run_world(moe_worker, 1, shared, 3)[0]
    split = run_world(moe_worker, 4, shared + ["parallel.tp=2", "parallel.sequence_parallel=true",
                                               "parallel.ep=2"], 3)
    assert split[-1]["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert_grads_match([r["grads"] for r in split], one["grads"])


def test_checkpoint_at_ep4_resumes_at_ep2_and_ep1_on_the_same_curve(tmp_path):
    """Written at ep 4 (ZeRO-3 over the expert-data-parallel groups), resumed at ep 2 (ZeRO-1) and at one process."""
    full = run_world(checkpoint_worker, 1, MOE, "none", 6, str(tmp_path / "straight"))[0]
    run_world(checkpoint_worker, 4, MOE + ["parallel.ep=4", "zero.stage=3"], "fresh", 3, str(tmp_path / "ckpt"))
    for world, layout in ((2, ["parallel.ep=2", "zero.stage=1"]), (1, [])):
        resumed = run_world(checkpoint_worker, world, MOE + layout, "resume", 6, str(tmp_path / "ckpt"))[-1]
        assert [resumed[s] for s in (3, 4, 5)] == pytest.approx([full[s] for s in (3, 4, 5)], rel=1e-5), layout


def _bias_checkpoint_worker(ckpt_dir: str):
    from training.checkpoint import Checkpointer, CheckpointError

    cfg = tiny_config(*MOE)
    engine = build_engine(cfg)
    for step in range(2):
        engine.train_step(batch_fn(engine, step))
    saved = {n: t.clone() for n, t in engine.moe.buffers.items()}
    path = Checkpointer(cfg, ckpt_dir, engine).save(2, 16)
    again = build_engine(cfg)
    Checkpointer(cfg, ckpt_dir, again).load(path)
    dense = build_engine(tiny_config())
    try:
        Checkpointer(tiny_config(), ckpt_dir, dense).load(path)
        refused = None
    except CheckpointError as e:
        refused = str(e)
    return saved, {n: t.clone() for n, t in again.moe.buffers.items()}, refused



def test_expert_bias_is_saved_and_a_dense_checkpoint_is_refused(tmp_path):
    """The resumed run's biases are the saved ones (not zeros); a dense model cannot load an MoE checkpoint."""
    saved, loaded, refused = run_world(_bias_checkpoint_worker, 1, str(tmp_path / "c"))[0]
    assert any(t.abs().max() > 0 for t in saved.values())
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name
    assert refused is not None and "model.moe" in refused


@pytest.mark.parametrize("overrides,fragment", [
    (["model.moe.num_experts=4", "model.moe.top_k=5"], "model.moe.top_k=5 must be in [1, model.moe.num_experts=4]"),
    (["model.moe.num_experts=4", "parallel.ep=2"], "parallel.ep=2 does not divide the data-parallel size 1"),
    (["model.moe.num_experts=4", "model.moe.capacity_factor=0"], "model.moe.capacity_factor=0"),
    (["model.moe.num_experts=4", "model.moe.capacity_factor=-1.5"], "model.moe.capacity_factor=-1.5"),
    (["model.moe.num_experts=4", "model.moe.capacity_factor=inf"], "model.moe.capacity_factor=inf"),
    (["model.moe.num_experts=4", "model.moe.capacity_factor=nan"], "model.moe.capacity_factor=nan"),
    # the shared experts' derived width (8192 x the tiny model's 384) has model.moe.shared_ffn_hidden's ceiling
    (["model.moe.num_experts=4", "model.moe.shared_experts=8192"],
     f"model.moe.shared_experts=8192 makes the shared experts' width 8192 x 384 (the routed experts' width) = "
     f"{8192 * 384}, above 2**19"),
    (["parallel.ep=2"], "parallel.ep=2 needs routed experts"),
    (["model.moe.num_experts=4", "parallel.ep=2", "zero.stage=3", "zero.hpz_size=2"],
     "parallel.ep=2 with ZeRO++ (zero.hpz_size) is not built"),
])
def test_bad_settings_are_one_line_and_exit_2(overrides, fragment, capsys, tmp_path):
    import train

    assert train.main(overrides + ["train.max_steps=1", f"logging.run_dir={tmp_path / 'run'}"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_experts_not_divisible_by_ep_is_refused_by_the_layout():
    from config import ConfigError
    from parallel.layout import make_layout

    cfg = tiny_config("model.moe.num_experts=3", "parallel.ep=2", "train.global_batch_size=8")
    with pytest.raises(ConfigError, match=r"model.moe.num_experts=3 is not divisible by parallel.ep=2"):
        make_layout(cfg, 4, 4)
    assert make_layout(tiny_config("model.moe.num_experts=4", "parallel.ep=2"), 4, 4).ep == 2


def _compile_worker(compiled: bool) -> Dict[str, Any]:
    """bf16 with the experts' grouped GEMMs forced (the CUDA path; on this CPU torch._grouped_mm runs bf16 too)."""
    from torch._dynamo.utils import counters

    engine = build_engine(tiny_config(*MOE, "precision=bf16", "parallel.ep=2", f"train.compile={compiled}",
                                      "model.n_layers=1"))
    for m in engine.moe.modules.values():
        m.experts.grouped = True
    counters.clear()
    losses = [engine.train_step(batch_fn(engine, step))["loss"] for step in range(2)]  # the second: compiled backward
    return {"losses": losses, "breaks": [str(k) for k in counters["graph_break"]]}


def test_compiled_blocks_break_only_at_the_token_exchange():
    """train.compile with expert parallelism: the all-to-alls split each MoE block into compiled regions (the
    disabled ``run_experts``); nothing else breaks the graph (routing, sorting, grouped GEMMs, the balancing
    losses, the bookkeeping), and the curve is eager's."""
    # aot_eager: the graphs dynamo traces, run by torch's kernels (inductor's C++ build would take minutes here)
    compiled = run_world(_compile_worker, 2, True, timeout=600, env={"GPT_COMPILE_BACKEND": "aot_eager"})[0]
    eager = run_world(_compile_worker, 2, False)[0]
    assert compiled["breaks"] and all("run_experts" in b for b in compiled["breaks"]), compiled["breaks"]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=2e-3)


def test_kill_9_mid_step_at_ep2_resumes_exactly(tmp_path):
    """train.main on two forked ranks (ep 2, bundled corpus, balancing on): SIGKILL to one rank mid-run ends the
    job; the resumed run (same layout) logs the uninterrupted run's losses, and a resume at one process (ep 1)
    continues on the same curve. The uninterrupted run's metrics.jsonl carries the MoE record every step."""
    from tests.test_train_e2e import FAST, assert_kill_9_resumes_exactly, records

    common = FAST + ["model.moe.num_experts=4", "model.moe.ffn_hidden=64", "model.moe.bias_update_rate=0.01",
                     "model.moe.aux_loss_coeff=0.01", "train.max_steps=9", "checkpoint.interval=3"]
    assert_kill_9_resumes_exactly(tmp_path, common, ["parallel.ep=2"])
    logged = [r["moe"] for r in records(tmp_path / "straight") if "loss" in r]  # metrics.jsonl's MoE record
    assert len(logged) == 9 and all(set(m["layers"]) == {"0", "1"} for m in logged)
    assert all(m["load_max_over_mean"] >= 1.0 for m in logged) and logged[-1]["layers"]["1"]["bias_max"] > 0


def test_the_moe_record_reaches_wandb_and_the_console(tmp_path):
    from training.metrics import MetricsLogger, format_line

    class FakeWandb:
        def __init__(self):
            self.logged = []

        def log(self, flat, step):
            self.logged.append((step, flat))

    logger = MetricsLogger(tiny_config(*MOE), tmp_path, enabled=True)
    logger.wandb = FakeWandb()
    record = {"step": 3, "loss": 4.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "tflops_per_device": 0.0,
              "mfu": None, "peak_mem_bytes": 2**20,
              "moe": {"load_max_over_mean": 1.25, "dropped_frac": 0.0,
                      "layers": {"0": {"load_max_over_mean": 1.25, "dropped_frac": 0.0, "aux_loss": 1.01,
                                       "z_loss": 0.5, "bias_min": -0.01, "bias_max": 0.01}}}}
    logger.log(record)
    logger.wandb, wandb = None, logger.wandb
    logger.close()
    [(step, flat)] = wandb.logged
    assert step == 3 and flat["moe/load_max_over_mean"] == 1.25 and flat["moe/layer0/aux_loss"] == 1.01
    assert "moe" not in flat and flat["moe/layer0/bias_min"] == -0.01
    assert "moe load max/mean 1.25" in format_line(record)
