"""4-bit communication beyond ZeRO++ (SDP4Bit, SPEC §7): qWD weight differences, Hadamard-smoothed two-level qgZ,
both at ZeRO stages 1, 2 and 3, on simulated nodes (2 x 2 unless named).

References: float64 math (the Hadamard matrix, the DP mean, the weights every rank should hold), plain runs of
the same stage, and the stage-1 post-step path for stage 3's hpZ path (the two compute the same weights by
different collectives, so their losses must agree bit for bit in fp32).
"""
import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import batch_fn, build_engine, checkpoint_worker, tiny_config, train_worker
from tests.test_comm_volume import assert_counted_equals_analytic

NODES = ["parallel.ranks_per_node=2"]
QWD4 = ["zero.quantized_weights=true", "zero.weight_bits=4", "zero.weight_delta=true"]
HQGZ4 = ["zero.quantized_gradients=true", "zero.gradient_bits=4", "zero.gradient_hadamard=true",
         "zero.qgz_min_numel=0"]
SDP4 = {  # stage -> the 4-bit configuration at that stage
    3: ["zero.stage=3", "zero.hpz_size=2"] + QWD4 + HQGZ4,
    2: ["zero.stage=2"] + QWD4 + HQGZ4 + ["zero.gradient_bits_intra=8"],
    1: ["zero.stage=1"] + QWD4 + HQGZ4,
}
_cache = {}


def run(overrides, steps=4, world=4):
    key = (tuple(overrides), steps, world)
    if key not in _cache:
        _cache[key] = run_world(train_worker, world, list(overrides), steps)
    return _cache[key]


def rel_diffs(a, b):
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


# -- the Hadamard rotation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [2, 8, 128, 1024])
def test_hadamard_rotation_is_the_float64_orthonormal_transform(block):
    from kernels.hadamard import SIGN_SEED, rotate, unrotate

    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (block,), generator=torch.Generator().manual_seed(SIGN_SEED)).double() * 2 - 1
    x = torch.randn(5 * block, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    expected = ((x.double().view(-1, block) * signs) @ h / block ** 0.5).reshape(-1)
    y = rotate(x, block)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(unrotate(y, block).double(), x.double(), rtol=0, atol=1e-5)
    # an outlier is spread over its whole block: the block's absmax falls to |outlier| / sqrt(block) or so
    spike = torch.zeros(block)
    spike[block // 3] = 100.0
    assert float(rotate(spike, block).abs().max()) == pytest.approx(100.0 / block ** 0.5, rel=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        rotate(torch.zeros(12), 12)


# -- qgZ: two-level bits and the Hadamard transform, against the float64 mean --------------------------------
def _outlier_input(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + rank)
    x = torch.randn(numel, generator=g)
    spikes = torch.randint(0, numel, (numel // 200,), generator=g)
    x[spikes] = 40 * torch.randn(spikes.numel(), generator=g)  # gradients' heavy tail: a few large values
    return x


def qgz_variants_worker(overrides, numel, variants):
    """Relative L2 error of QgzReduce's result vs the float64 DP mean of this rank's shard, per variant
    (bits intra, bits inter, hadamard)."""
    import torch.distributed as dist

    from parallel.layout import make_layout
    from parallel.mesh import Mesh
    from parallel.zero.zeropp import QgzReduce, Quant

    cfg = tiny_config(*overrides)
    mesh = Mesh(make_layout(cfg, dist.get_world_size(), cfg.parallel.ranks_per_node), torch.device("cpu"))
    dp = mesh.dp
    shard = -(-numel // dp.size)
    inputs = {r: _outlier_input(r, numel) for r in dp.ranks}
    padded = [torch.cat([inputs[r].double(), torch.zeros(shard * dp.size - numel, dtype=torch.float64)])
              for r in dp.ranks]
    mean = (sum(padded) / dp.size)[dp.rank * shard:(dp.rank + 1) * shard]
    errors = {}
    for bits_intra, bits, hadamard in variants:
        out = torch.empty(shard)
        mesh.ledger.reset()
        QgzReduce(out, inputs[mesh.rank].clone(), mesh.dp_intra, mesh.dp_inter, Quant(bits, 64), 2,
                  Quant(bits_intra, 64), hadamard).wait()
        errors[bits_intra, bits, hadamard] = (float((out.double() - mean).norm() / mean.norm()),
                                              mesh.ledger.snapshot()["by_group"])
    return errors


@pytest.mark.parametrize("name,world,overrides", [
    ("2x2", 4, NODES), ("2_nodes_x3", 6, ["parallel.ranks_per_node=3", "train.global_batch_size=12"]),
    ("one_node", 4, ["parallel.ranks_per_node=4"]), ("one_rank_per_node", 4, ["parallel.ranks_per_node=1"])])
def test_hadamard_and_two_level_bits_reduce_the_error_of_the_mean(name, world, overrides):
    numel = 64 * 60 * world + 37
    variants = [(4, 4, False), (4, 4, True), (8, 4, False), (8, 4, True), (8, 8, False)]
    for errors in run_world(qgz_variants_worker, world, overrides, numel, variants):
        err = {v: e for v, (e, _) in errors.items()}
        assert err[8, 8, False] < 0.05, err  # every variant computes the mean, not something else
        assert err[4, 4, True] < 0.15, err
        assert err[4, 4, True] < 0.7 * err[4, 4, False], f"{name}: Hadamard must cut 4-bit error on outliers {err}"
        assert err[8, 4, True] < 0.7 * err[8, 4, False], err
        if name not in ("one_rank_per_node",):  # the intra-node hop exists: 8 bits there beat 4
            assert err[8, 4, False] < err[4, 4, False], err
        by_group = {v: g for v, (_, g) in errors.items()}
        if name == "2x2":  # the intra hop carries 8-bit codes (twice the 4-bit payload), the inter hop 4-bit
            assert by_group[8, 4, False]["dp_inter"] == by_group[4, 4, False]["dp_inter"]
            assert by_group[8, 4, False]["dp_intra"] > 1.7 * by_group[4, 4, False]["dp_intra"]
            assert by_group[4, 4, True] == by_group[4, 4, False], "the rotation moves no extra bytes"


# -- qWD: the weights every rank holds ---------------------------------------------------------------------
def qwd_weights_worker(overrides, steps):
    """Stages 1-2: after each step, every unit's full weights vs the fp32 master (all gathered): max error, the
    bound of one step's difference quantization, and a digest of the full weights to compare across ranks."""
    from parallel import comm

    cfg = tiny_config(*overrides)
    engine = build_engine(cfg)
    dp = engine.dp
    prev = {id(u): u.shard.double().clone() for u in dp.units}
    out = []
    for step in range(steps):
        engine.train_step(batch_fn(engine, step))
        err, bound, digest = 0.0, 0.0, 0.0
        for u in dp.units:
            master = torch.empty(u.full.numel(), dtype=torch.float32)
            comm.all_gather(master, u.master.clone(), dp.mesh.dp)
            err = max(err, float((u.full.double() - master.double()).abs().max()))
            # this rank's difference was new master - previous reconstruction; its 4-bit step is
            # |extreme| / 8, a value errs by at most one step (half, unless clipped) plus fp32 rounding
            delta = u.master.double() - prev[id(u)]
            bound = max(bound, float(delta.abs().max()) / 8 * (1 + 1e-5))
            prev[id(u)] = u.shard.double().clone()
            digest += float((u.full.double() * torch.arange(u.full.numel(), dtype=torch.float64).sin()).sum())
        bound = torch.tensor(bound, dtype=torch.float64)
        comm.all_reduce(bound, dp.mesh.dp, op="max")
        out.append({"err": err, "bound": float(bound), "digest": digest})
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_weight_differences_do_not_accumulate_error(stage):
    """fp32: the weights every rank holds after a qWD step are the master to within one step's difference
    quantization (not the sum of all steps'), identical on every rank; direct 4-bit weights err far more."""
    base = NODES + ["precision=fp32", f"zero.stage={stage}"]
    steps = 5
    qwd = run_world(qwd_weights_worker, 4, base + QWD4, steps)
    for r in qwd:
        assert [s["digest"] for s in r] == [s["digest"] for s in qwd[0]], "ranks hold different weights"
        for s in r:
            assert s["err"] <= s["bound"], r
    direct = run_world(qwd_weights_worker, 4, base + QWD4[:2], 3)[0]
    assert qwd[0][-1]["err"] < 0.2 * direct[-1]["err"], (qwd[0], direct)


def test_stage3_hpz_differences_equal_the_stage1_post_step_gather():
    """Stage 3 rebuilds the weights from the node's secondary shards plus cross-node differences; stage 1 adds the
    same differences to the full copy every rank holds. Same arithmetic, other collectives: equal losses (fp32)."""
    s3 = run(NODES + ["precision=fp32"] + SDP4[3])
    s1 = run(NODES + ["precision=fp32"] + SDP4[1])
    assert s3[0]["losses"] == s1[0]["losses"]
    plain = run(NODES + ["precision=fp32", "zero.stage=3"])
    assert s3[0]["losses"][0] == plain[0]["losses"][0], "the first gather is exact"
    assert s3[0]["losses"][1:] != plain[0]["losses"][1:], "the later ones are 4-bit differences"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_4bit_runs_track_their_stage_and_count_their_bytes(stage):
    overrides = NODES + ["precision=bf16"] + SDP4[stage]
    ref = run(NODES + ["precision=bf16", f"zero.stage={stage}"])
    out = run(overrides)
    assert max(rel_diffs(out[0]["losses"], ref[0]["losses"])) <= 1e-2, (out[0]["losses"], ref[0]["losses"])
    assert out[0]["losses"][-1] < out[0]["losses"][0], "it must still learn"
    for r in out:
        assert r["losses"] == out[0]["losses"], "ranks disagree on the loss"
    assert_counted_equals_analytic(out, overrides, 4)  # the steady state: differences, not the exact first gather
    groups = out[0]["comm"]["by_group"]
    assert {"qwz_inter", "qwz_intra", "dp_intra", "dp_inter"} <= set(groups) and "dp" not in groups, groups
    inter = [sum(r["comm"]["by_link"].get("inter", 0) for r in run) for run in (out, ref)]
    # the bar at stage 3 (ZeRO++ int8: 0.09 after issue 18); stages 1-2 (8-bit inside the node) report it
    assert inter[0] <= (0.12 if stage == 3 else 0.2) * inter[1], (inter, stage)


def test_first_step_bytes_are_the_exact_gather():
    from parallel.layout import make_layout
    from parallel.volume import step_bytes

    overrides = NODES + ["precision=bf16"] + SDP4[3]
    counted = run(overrides, steps=1)[0]["comm"]["by_group"]
    cfg = tiny_config(*overrides)
    analytic = step_bytes(cfg, make_layout(cfg, 4, 2), 0, first_step=True)
    assert set(counted) == {g for g, v in analytic.items() if v > 0}, (counted, analytic)
    for group, n in analytic.items():
        assert abs(counted.get(group, 0) - n) <= 16, (group, counted, analytic)
    assert "qwz_inter" not in counted


# -- memory and checkpoints --------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [
    ["precision=bf16"] + SDP4[3], ["precision=fp32"] + SDP4[2], ["precision=fp32"] + SDP4[1]],
    ids=["stage3_bf16", "stage2_fp32", "stage1_fp32"])
def test_memory_estimator_counts_the_reference_and_the_master(overrides):
    from tests.test_zero_memory import measure_worker

    for r in run_world(measure_worker, 4, NODES + overrides):
        for part in ("parameters", "gradients", "optimizer"):
            assert r["measured"][part] == r["estimated"][part], (part, r["measured"], r["estimated"])


@pytest.mark.parametrize("stage", [2, 3])
def test_qwd_checkpoints_resume_bit_for_bit(tmp_path, stage):
    overrides = NODES + ["model.tie_embeddings=true"] + SDP4[stage]
    uninterrupted = run_world(checkpoint_worker, 4, overrides, "none", 4, "/nonexistent-unused")[0]
    run_world(checkpoint_worker, 4, overrides, "fresh", 2, str(tmp_path))
    resumed = run_world(checkpoint_worker, 4, overrides, "resume", 4, str(tmp_path))[0]
    assert sorted(resumed) == [2, 3]
    for step, loss in resumed.items():
        assert loss == uninterrupted[step], (step, loss, uninterrupted[step])


QWD_FP32 = {stage: NODES + ["precision=fp32", f"zero.stage={stage}"] + QWD4 + (["zero.hpz_size=2"] if stage == 3 else [])
            for stage in (1, 2, 3)}


def test_qwd_checkpoints_of_every_stage_resume_at_every_other_stage(tmp_path):
    """The weights a qWD checkpoint holds mean the same to every stage: a stage-3 checkpoint (saved right after a step,
    its differences not yet sent) resumed at stages 1-2, and stage-1/2 checkpoints resumed at the other stages, all
    continue on the uninterrupted curve, bit for bit (fp32: the three stages train identically, checked first). The
    bug this guards against: stages 1-2 read a stage-3 reference as the weights to run on, one step old."""
    uninterrupted = {stage: run_world(checkpoint_worker, 4, QWD_FP32[stage], "none", 4, "/nonexistent", ())[0]
                     for stage in (1, 2, 3)}
    assert uninterrupted[1] == uninterrupted[2] == uninterrupted[3], uninterrupted
    for saved in (1, 2, 3):
        run_world(checkpoint_worker, 4, QWD_FP32[saved], "fresh", 2, str(tmp_path / str(saved)), ())
        for resumed in {1, 2, 3} - {saved}:
            out = run_world(checkpoint_worker, 4, QWD_FP32[resumed], "resume", 4, str(tmp_path / str(saved)), ())[0]
            assert out == {2: uninterrupted[1][2], 3: uninterrupted[1][3]}, (saved, resumed, out, uninterrupted[1])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_qwd_checkpoint_saved_after_a_validation_resumes_bit_for_bit(tmp_path, stage):
    """A validation pass after step 2, then the checkpoint: at stage 3 the validation's gather already sent the step's
    differences and kept the secondary shards, so the uninterrupted run's next forward sends none; the resumed run
    must not either (it did: after_load forgot the secondary shards were current)."""
    overrides = NODES + ["model.tie_embeddings=true"] + SDP4[stage]
    uninterrupted = run_world(checkpoint_worker, 4, overrides, "none", 4, "/nonexistent", (2, 3))[0]
    run_world(checkpoint_worker, 4, overrides, "fresh", 2, str(tmp_path), (2,))
    resumed = run_world(checkpoint_worker, 4, overrides, "resume", 4, str(tmp_path), (3,))[0]
    assert resumed == {k: v for k, v in uninterrupted.items() if k not in (0, 1, "val2")}, (resumed, uninterrupted)


# -- bad combinations: one line naming the keys ---------------------------------------------------------------
@pytest.mark.parametrize("overrides,message", [
    (["zero.stage=3"] + QWD4, r"zero.weight_delta=true at zero.stage=3 needs zero.hpz_size > 1"),
    (["zero.stage=2", "zero.weight_delta=true"], r"zero.weight_delta=true needs zero.quantized_weights=true"),
    (["zero.stage=2", "zero.quantized_gradients=true", "zero.gradient_hadamard=true", "zero.quant_block=96"],
     r"zero.gradient_hadamard=true needs zero.quant_block to be a power of two \(got 96\)"),
    (["zero.stage=1", "zero.quantized_gradients=true", "zero.gradient_bits_intra=2"],
     r"zero.gradient_bits_intra=2 must be 4 or 8"),
    (["zero.stage=3", "zero.quantized_weights=true", "zero.weight_bits=6"], r"zero.weight_bits=6 must be 4 or 8"),
    (["zero.stage=2", "zero.gradient_hadamard=true"], r"zero.gradient_hadamard=True needs zero.quantized_gradients"),
    (["zero.stage=0", "zero.quantized_weights=true"], r"zero.quantized_weights=true needs zero.stage 1, 2 or 3"),
])
def test_bad_combinations_are_refused_in_one_line(overrides, message):
    from config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=message) as e:
        validate_config(tiny_config(*overrides))
    assert str(e.value).startswith("invalid configuration: ") and len(str(e.value).splitlines()) == 1, str(e.value)
