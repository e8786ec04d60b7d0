"""FP8-LM at ZeRO stage 0 without 16-bit copies of the FP8 linears' weights (``fp8/zero.py`` ``_weight_source``).

The reference is the layout that kept them (every weight's bf16 working copy materialised from the masters once a
step, the FP8 linear casting it at its first forward): the same engine with ``fp8.scaling.fp8_only_weights``
answering "none", so nothing is sourced. Against it, per layout (TP 2 with sequence
parallelism and grouped-query attention whose one KV head is replicated on both TP ranks, so the operand is
GroupedQKVLinear's two pieces; one rank with an FP8 output head, untied and tied to the embedding, which reads it
and so keeps its copy; one rank compiled with CUDA's packed unit work, where each unit's weights are cast in one
compiled call):

* every step's loss and a validation loss are the same bits (the E4M3 operands are the same bytes, their amaxes
  enter the same delayed-scaling histories);
* the working bytes held between steps fall by exactly the compute dtype's 2 bytes of every FP8 linear weight, and
  the estimator (``training/memory.py``) says so to the byte;
* the weights hold a NaN placeholder (no data; a read cannot pass for a value) and ``full_weights()`` gives each its
  16-bit value on demand, the reference's working copy bit for bit.
"""
import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import batch_fn, build_engine, tiny_config

FP8 = ["precision=fp8", "fp8.gemm=fp8"]
LAYOUTS = {  # world, overrides, environment (one rank plain is the FP8-head layout's subset: not run on its own)
    "tp2_sp_gqa_replicated": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "model.n_heads=8",
                                  "model.n_kv_heads=1", "model.bias=true"], {}),
    # an FP8 output head: its own weight comes from the masters; tied to the embedding (which reads it) it keeps a copy
    "single_fp8_head": (1, ["fp8.output_head=true"], {}),
    "single_fp8_head_tied": (1, ["fp8.output_head=true", "model.tie_embeddings=true"], {}),
    # what CUDA runs: the whole-unit updates and each unit's weights cast in one compiled call (make_weight_copies)
    "single_compiled_packed": (1, ["train.compile=true"], {"FP8_PACKED": "1", "GPT_COMPILE_BACKEND": "aot_eager"}),
}


def _pair_worker(overrides):
    """The reference, then the layout under test, on the same ranks: one process each rank, so that under
    train.compile the graphs both trace alike are traced once (dynamo reuses a graph only where its guards hold: the
    single compiled layout costs a quarter less CPU time than as two worlds)."""
    import fp8.zero

    sourced_by = fp8.zero.fp8_only_weights
    fp8.zero.fp8_only_weights = lambda chunks: {}  # the reference: no weight is sourced from the masters
    try:
        ref = _worker(overrides)
    finally:
        fp8.zero.fp8_only_weights = sourced_by
    return ref, _worker(overrides)


def _worker(overrides):
    from training.memory import held_between_steps

    cfg = tiny_config(*overrides)
    engine = build_engine(cfg)
    losses = [engine.train_step(batch_fn(engine, step))["loss"] for step in range(3)]
    valid = engine.eval_loss(batch_fn(engine, 100))
    losses.append(engine.train_step(batch_fn(engine, 3))["loss"])  # and training goes on after validation
    sourced = [n for n, p in engine.params.items() if p.stride() and 0 in p.stride()]
    nan_outside = all(bool(engine.params[n].isnan().all()) for n in sourced)
    dp = engine.dp
    with dp.full_weights():
        values = {n: p.detach().clone() for n, p in engine.params.items()}
    return {"losses": losses, "valid": valid, "held": dp.working.now,
            "held_estimate": held_between_steps(cfg, engine.mesh.layout, engine.mesh.rank),
            "sourced": sourced, "sourced_numel": sum(engine.params[n].numel() for n in sourced),
            "nan_outside": nan_outside, "values": values,
            "placeholders_back": all(0 in engine.params[n].stride() for n in sourced)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stage0_fp8_weights_come_from_the_masters_bit_for_bit(name):
    world, overrides, env = LAYOUTS[name]
    over = FP8 + overrides
    for k, r in run_world(_pair_worker, world, over, timeout=300, env=env):
        assert r["losses"] == k["losses"] and r["valid"] == k["valid"], (r["losses"], k["losses"])
        assert not k["sourced"] and r["sourced"], "the reference keeps every copy; the layout under test does not"
        # every FP8 linear's weight (qkv or GQA's q and kv, proj, up, down of each layer; an untied FP8 head), nothing
        # else
        head = name == "single_fp8_head"
        assert all(n.endswith(".weight") and (".attn." in n or ".mlp." in n or n == "head.weight" and head)
                   for n in r["sourced"]), r["sourced"]
        assert len(r["sourced"]) == 4 * 4 + (4 if "gqa" in name else 0) + head, r["sourced"]
        assert r["held"] == k["held"] - 2 * r["sourced_numel"], (r["held"], k["held"], r["sourced_numel"])
        assert r["held"] == r["held_estimate"] and k["held"] == k["held_estimate"] + 2 * r["sourced_numel"]
        assert r["nan_outside"] and r["placeholders_back"]
        for n, v in k["values"].items():
            assert torch.equal(r["values"][n], v), n


@pytest.mark.parametrize("master_dtype,record,compiled", [
    (torch.float16, True, False), (torch.float16, False, True), (torch.float32, True, True)],
    ids=["fp16_master_eager", "fp16_master_compiled_no_record", "fp32_master_compiled"])
def test_cast_from_master_is_the_cast_of_the_16bit_weight(master_dtype, record, compiled):
    """``cast_from_master`` (train.compile's one pass from the master, a unit's at once: ``cast_unit_from_masters``)
    against ``ScaleState.cast`` of the 16-bit weight the working copy held: the same E4M3 bytes, the same scale, the
    same pending amax; values that round in bf16, saturate in E4M3 and underflow to its subnormals."""
    from config import Fp8Config
    from fp8 import adam
    from fp8.format import E4M3
    from fp8.scaling import ScaleState
    from fp8.zero_unit import cast_from_master, cast_unit_from_masters

    g = torch.Generator().manual_seed(5)
    values = torch.randn(6000, generator=g) * torch.exp2(torch.randint(-14, 3, (6000,), generator=g).float())
    values[:4] = torch.tensor([3.9, -5.0, 1e-7, 1.0 + 2.0 ** -9])  # saturating at the scale below; a bf16 tie
    master = torch.zeros(values.numel(), dtype=master_dtype)
    master_scale = torch.ones((), dtype=torch.float32)
    adam.set_master(master, master_scale, values)
    states = []
    for _ in range(2):
        st = ScaleState(Fp8Config(), "weight")
        st.scale.fill_(2.0 ** 7)
        st.pending.fill_(0.5)
        st.initialized.fill_(True)
        st._ready = True
        states.append(st)
    weight = adam.master_value(master, master_scale if master_dtype == torch.float16 else None).to(torch.bfloat16)
    q_ref, s_ref = states[0].cast(weight, None, record=record)
    ms = master_scale if master_dtype == torch.float16 else None
    if compiled:
        [(q, s)] = torch.compile(cast_unit_from_masters, backend="aot_eager")([master], [ms], [states[1].scale],
                                                                             [states[1].pending], record, torch.bfloat16)
    else:
        q, s = cast_from_master(master, ms, states[1].scale, states[1].pending, record, torch.bfloat16)
    assert q.dtype == E4M3 and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref) and torch.equal(states[1].pending, states[0].pending)
    assert float(states[1].pending) == (max(0.5, float(weight.abs().max())) if record else 0.5)


def test_inductor_keeps_the_bf16_rounding_of_the_weight_cast(monkeypatch):
    """Compiled by inductor (as on a GPU), the unit's weight casts round each value to bf16 before the E4M3 cast, as
    the working copy did: inductor's default keeps such a value at fp32 inside the fused kernel, which changed 3% of
    the bytes here (``_compiled_without_grad(exact_casts=True)``)."""
    from fp8.format import E4M3
    from fp8.zero_unit import _compiled_without_grad, cast_from_master, cast_unit_from_masters

    monkeypatch.setenv("GPT_COMPILE_BACKEND", "inductor")
    master = torch.randn(1 << 14, generator=torch.Generator().manual_seed(1)) * 0.05
    scale = torch.tensor(2.0 ** 8)
    want, _ = cast_from_master(master, None, scale, torch.zeros(()), False, torch.bfloat16)
    direct = (master * scale).clamp(-448, 448).to(E4M3)  # without the bf16 rounding: differs on this data
    assert not torch.equal(want.view(torch.uint8), direct.view(torch.uint8))
    [(q, _)] = _compiled_without_grad(cast_unit_from_masters, exact_casts=True)([master], [None], [scale],
                                                                               [torch.zeros(())], False, torch.bfloat16)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
