"""ZeRO++ (qwZ, hpZ, qgZ) against ZeRO-3, on simulated nodes (``parallel.ranks_per_node``).

References: plain ZeRO-3 runs of the same layout (themselves equal to one process, tests/test_zero.py), and
float64 means for the qgZ reduction. Tolerances:

* hpZ alone moves exact copies: equal to ZeRO-3 to 1e-5 (fp32).
* qwZ (int8 weights) / qgZ (int4 gradients) perturb every step a little: each step's loss within
  ``QUANT_RTOL`` (0.5%) of ZeRO-3's at the same precision over 5 steps (measured: <= 0.1% in fp32).
"""
import math

import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import batch_fn, build_engine, checkpoint_worker, tiny_config, train_worker
from tests.test_comm_volume import assert_counted_equals_analytic

STEPS = 5
QUANT_RTOL = 5e-3
QWZ, HPZ, QGZ = "zero.quantized_weights=true", "zero.hpz_size=2", "zero.quantized_gradients=true"
ALL = [QWZ, HPZ, QGZ]
LAYOUTS = {  # name: (world, overrides); 2 nodes x 2 DP ranks, and tp2 x pp2 x dp2 with DP inside / across nodes
    "dp4_2x2": (4, ["parallel.ranks_per_node=2"]),
    "tp2_pp2_dp2_intra": (8, ["parallel.tp=2", "parallel.pp=2", "parallel.ranks_per_node=4",
                              "train.global_batch_size=16"]),
    "tp2_pp2_dp2_inter": (8, ["parallel.tp=2", "parallel.pp=2", "parallel.ranks_per_node=2",
                              "train.global_batch_size=16"]),
}
_cache = {}


def run(world, overrides, steps=STEPS):
    key = (world, tuple(overrides), steps)
    if key not in _cache:
        _cache[key] = run_world(train_worker, world, list(overrides), steps)
    return _cache[key]


def rel_diffs(a, b):
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


# -- hpZ: exact ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dp4_2x2", "tp2_pp2_dp2_intra"])
def test_hpz_alone_equals_zero3_exactly(name):
    world, overrides = LAYOUTS[name]
    ref = run(world, overrides + ["zero.stage=3"])
    out = run(world, overrides + ["zero.stage=3", HPZ])
    assert max(rel_diffs(out[0]["losses"], ref[0]["losses"])) <= 1e-5
    assert max(rel_diffs(out[0]["grad_norms"], ref[0]["grad_norms"])) <= 1e-5
    assert abs(out[0]["val_loss"] - ref[0]["val_loss"]) <= 1e-5 * ref[0]["val_loss"]
    assert out[0]["comm"]["by_group"].get("dp_hpz", 0) > 0, "backward gathers must come from secondary shards"
    assert_counted_equals_analytic(out, overrides + ["zero.stage=3", HPZ], world)


def hpz_survival_worker(overrides, steps):
    """Accumulating steps with no_grad validation between them: losses, and each step's ledger."""
    cfg = tiny_config(*overrides)
    engine = build_engine(cfg)
    losses, comms, vals = [], [], []
    for step in range(steps):
        engine.mesh.ledger.reset()
        losses.append(engine.train_step(batch_fn(engine, step))["loss"])
        comms.append(engine.mesh.ledger.snapshot())
        vals.append(engine.eval_loss(batch_fn(engine, 1000 + step)))
    return {"losses": losses, "vals": vals, "comm": comms[-1], "comms": comms}


def assert_step_bytes(comms, overrides, world, secondary_valid):
    """Each rank's counted bytes of one step (``comms[rank]``) are the analytic ones: a step that starts with
    hpZ's secondary copies already built (by a validation pass since the last optimizer step) or not."""
    from parallel.layout import make_layout
    from parallel.volume import step_bytes

    cfg = tiny_config(*overrides)
    layout = make_layout(cfg, world, cfg.parallel.ranks_per_node or world)
    for rank, comm in enumerate(comms):
        counted, analytic = comm["by_group"], step_bytes(cfg, layout, rank, secondary_valid=secondary_valid)
        assert set(counted) == {g for g, v in analytic.items() if v > 0}, (rank, counted, analytic)
        for group, n in analytic.items():
            assert abs(counted.get(group, 0) - n) <= 16, f"rank {rank} {group}: counted {counted.get(group)} vs {n}"


def test_hpz_survives_validation_and_accumulation_and_tiny_tensors():
    """One node of 8 DP ranks, hpZ over all 8, d_model 32 (norms of 32 elements: 4 per rank of the group),
    4 micro-batches a step, validation after every step: equal to ZeRO-3, and every step's counted bytes
    are the analytic ones (the secondary copy is rebuilt after each step, by the validation pass from the
    second step on, never lost or stale)."""
    model = ["model.d_model=32", "model.n_heads=2", "model.ffn_hidden=64", "train.micro_batch_size=1",
             "train.global_batch_size=32", "parallel.ranks_per_node=8", "zero.stage=3"]
    ref = run_world(hpz_survival_worker, 8, model, 3)
    out = run_world(hpz_survival_worker, 8, model + ["zero.hpz_size=8"], 3)
    assert max(rel_diffs(out[0]["losses"], ref[0]["losses"])) <= 1e-5
    assert max(rel_diffs(out[0]["vals"], ref[0]["vals"])) <= 1e-5
    assert ref[0]["losses"][-1] < ref[0]["losses"][0]
    for r in out:
        assert r["comms"][1] == r["comms"][2], "every step after validation must move the same bytes"
    assert_step_bytes([r["comms"][0] for r in out], model + ["zero.hpz_size=8"], 8, secondary_valid=False)
    assert_step_bytes([r["comms"][-1] for r in out], model + ["zero.hpz_size=8"], 8, secondary_valid=True)


def hpz_validation_worker(overrides):
    """A step; a validation pass of two batches (as ``trainer.evaluate`` with eval_iters=2); another pass; a
    step sampling qwZ's error. Each phase's bytes ("kind/link/group") and the losses."""
    cfg = tiny_config(*overrides)
    engine = build_engine(cfg)
    ledger = engine.mesh.ledger

    def phase(fn):
        ledger.reset()
        value = fn()
        return value, {f"{kind}/{link}/{name}": n for (kind, link, name), n in ledger.bytes.items()}, \
            ledger.snapshot()

    out = {}
    out["loss0"], _, _ = phase(lambda: engine.train_step(batch_fn(engine, 0))["loss"])
    for name in ("val1", "val2"):
        out[name], out[f"{name}_bytes"], _ = phase(lambda: [engine.eval_loss(batch_fn(engine, 1000 + i))
                                                          for i in range(2)])
    engine.dp.sampling = True
    out["loss1"], out["step1_bytes"], out["step1_comm"] = phase(lambda: engine.train_step(batch_fn(engine, 1))["loss"])
    out["quant_error"] = engine.dp.quant_error()
    out["val3"] = engine.eval_loss(batch_fn(engine, 1000))
    return out


@pytest.mark.parametrize("weights", ["qwz", "fp8"])
def test_validation_builds_the_hpz_secondary_copy_once_and_the_next_step_reuses_it(weights):
    """2 nodes x 2, hpZ 2 with qwZ (or FP8-LM's E4M3 gathers), 2 micro-batches: the validation pass right after a
    step gathers each unit across nodes once (building the secondary copy), its other gathers and the whole next
    pass are inside the node, and the next training step gathers nothing across nodes; validation and training
    losses equal the run without hpZ bit for bit (the copy holds exactly the weights a gather from the primary
    shards gives), and qwZ's error is still sampled on that step. Every phase's gather bytes are the analytic
    ones."""
    from parallel.layout import make_layout
    from parallel.volume import validation_gather_bytes

    world, overrides = LAYOUTS["dp4_2x2"]
    overrides = overrides + ["zero.stage=3", "train.global_batch_size=16", QWZ if weights == "qwz" else "precision=fp8"]
    ref = run_world(hpz_validation_worker, world, overrides)
    out = run_world(hpz_validation_worker, world, overrides + [HPZ])
    for key in ("loss0", "val1", "val2", "loss1", "val3"):
        assert out[0][key] == ref[0][key], (key, out[0][key], ref[0][key])
    assert out[0]["loss1"] < out[0]["loss0"]
    if weights == "qwz":
        assert 1e-4 < out[0]["quant_error"]["weights"] < 0.01, out[0]["quant_error"]

    cfg = tiny_config(*overrides, HPZ)
    layout = make_layout(cfg, world, 2)
    assert layout.num_microbatches == 2
    gathers = lambda phase: {k.split("/")[2]: n for k, n in phase.items() if k.startswith("all_gather/")}  # noqa
    inter = lambda phase: sum(n for k, n in phase.items() if k.startswith("all_gather/inter/"))  # noqa
    # primary gathers: qwZ's two hops (qwz_inter across nodes, qwz_intra inside), FP8's one over dp (spans both)
    primary, crossing = (("qwz_inter", "qwz_intra"), "qwz_inter") if weights == "qwz" else (("dp",), "dp")
    for rank, (r, plain) in enumerate(zip(out, ref)):
        first, later = (validation_gather_bytes(cfg, layout, rank, first_after_step=f) for f in (True, False))
        assert set(first) == {*primary, "dp_hpz"} and set(later) == {"dp_hpz"}
        expected_val1 = {g: first.get(g, 0) + later.get(g, 0) for g in (*primary, "dp_hpz")}
        assert gathers(r["val1_bytes"]) == pytest.approx(expected_val1, abs=16), (rank, r["val1_bytes"])
        assert gathers(r["val2_bytes"]) == pytest.approx({"dp_hpz": 2 * later["dp_hpz"]}, abs=16)
        # across nodes: one primary gather per unit, a quarter of what 2 batches x 2 micro-batches gather without
        # hpZ; then nothing until the next step
        assert 0 < inter(r["val1_bytes"]) == first[crossing] and inter(plain["val1_bytes"]) == 4 * first[crossing]
        assert inter(r["val2_bytes"]) == 0 and inter(r["step1_bytes"]) == 0
        assert r["step1_bytes"].get("all_gather/intra/dp_hpz", 0) > 0
    assert_step_bytes([r["step1_comm"] for r in out], overrides + [HPZ], world, secondary_valid=True)
    assert_step_bytes([r["step1_comm"] for r in ref], overrides, world, secondary_valid=True)  # no hpZ: no effect


# -- overlap: when communication happens, never what it carries ---------------------------------------------
def two_hop_gather_worker(overrides, shard, cases):
    """For each (bits, block, several_in_flight): qwZ's gather of this rank's random shard in one hop over dp and
    in two (``GatherRoute``), the second hops launched by ``advance`` oldest first; both results."""
    import torch.distributed as dist

    from parallel.layout import make_layout
    from parallel.mesh import Mesh
    from parallel.zero.zeropp import GatherRoute, Quant, QuantizedGather

    cfg = tiny_config(*overrides)
    layout = make_layout(cfg, dist.get_world_size(), cfg.parallel.ranks_per_node)
    mesh = Mesh(layout, torch.device("cpu"))
    inter, intra = mesh.gather_groups()
    route = GatherRoute.of(mesh.dp, inter, intra, layout.dp_inter_ranks)
    out = []
    for bits, block in cases:
        g = torch.Generator().manual_seed(1000 * mesh.dp.rank + bits)
        shards = [torch.randn(shard, generator=g).to(torch.bfloat16) for _ in range(3)]
        flat = [torch.empty(shard * mesh.dp.size, dtype=torch.bfloat16) for _ in shards]
        two = [torch.empty_like(f) for f in flat]
        for f, s in zip(flat, shards):
            QuantizedGather(f, s, mesh.dp, Quant(bits, block)).wait()
        works = [QuantizedGather(t, s, mesh.dp, Quant(bits, block), route) for t, s in zip(two, shards)]
        for w in works:  # three in flight: second hops launched in start order, whenever polled, stopping at the
            if not w.advance(block=False):  # first not ready, as sharded.py's poll does (a rank that skipped
                break                       # one would issue the intra-node hops in another order: wrong bits)
        for w in works:
            w.wait()
        out.append((flat, two, route is not None))
    return out


def test_two_hop_weight_gather_gives_the_one_hop_bytes():
    """2 nodes x 3: qwZ's two-hop gather (across nodes among peers of one local index, then inside the node) puts
    every rank's dequantized shard where the one-hop all-gather does, bit for bit (int8 and int4, ragged blocks,
    three gathers in flight)."""
    world, overrides = 6, ["parallel.ranks_per_node=3", "train.global_batch_size=12"]
    cases = [(8, 128), (4, 30)]
    for rank_out in run_world(two_hop_gather_worker, world, overrides, 1001, cases):
        for flat, two, routed in rank_out:
            assert routed
            for a, b in zip(flat, two):
                assert torch.equal(a, b)


def test_prefetch_depth_and_reduces_in_flight_change_no_bit():
    """ZeRO++ with every feature (two-hop qwZ gathers, hpZ, qgZ whose inter-node hop is launched by polling) on
    2 nodes x 2, bf16: prefetching 3 modules ahead with 4 reduces in flight, or not prefetching at all, gives the
    losses, gradient norms and validation loss of 1 module ahead and 1 reduce in flight bit for bit, and the
    counted bytes stay the analytic ones."""
    world, overrides = LAYOUTS["dp4_2x2"]
    base = overrides + ["zero.stage=3", "precision=bf16", *ALL]
    ref = run(world, base + ["zero.prefetch_depth=1", "zero.reduce_in_flight=1"])
    for extra in (["zero.prefetch_depth=3", "zero.reduce_in_flight=4"], ["zero.prefetch=false"]):
        out = run(world, base + extra)
        for key in ("losses", "grad_norms", "val_loss"):
            assert out[0][key] == ref[0][key], (extra, key, out[0][key], ref[0][key])
        assert_counted_equals_analytic(out, base + extra, world)
    assert ref[0]["losses"][-1] < ref[0]["losses"][0]


# -- qwZ / qgZ: within tolerance --------------------------------------------------------------------
# every precision on both layouts; the 8-rank layout's three runs split between DP inside and across nodes (each
# 8-rank pair of runs costs ~35 s of the suite's 2 cores)
QUANT_CASES = [("dp4_2x2", precision, "qwz_qgz") for precision in ("fp32", "bf16", "fp16")]
QUANT_CASES += [("tp2_pp2_dp2_intra", "fp32", "qwz_qgz"), ("tp2_pp2_dp2_inter", "bf16", "qwz_qgz"),
                ("tp2_pp2_dp2_inter", "fp16", "qwz_qgz")]
QUANT_CASES += [("dp4_2x2", "bf16", feature) for feature in ("qwz", "qgz", "all")]
FEATURES = {"qwz": [QWZ], "qgz": [QGZ], "qwz_qgz": [QWZ, QGZ], "all": ALL,
            "qwz4_qgz8": [QWZ, "zero.weight_bits=4", QGZ, "zero.gradient_bits=8"]}


@pytest.mark.parametrize("name,precision,feature", QUANT_CASES)
def test_quantized_runs_track_zero3(name, precision, feature):
    world, overrides = LAYOUTS[name]
    overrides = overrides + [f"precision={precision}", "zero.stage=3"]
    ref = run(world, overrides)
    out = run(world, overrides + FEATURES[feature])
    diffs = rel_diffs(out[0]["losses"], ref[0]["losses"])
    assert max(diffs) <= QUANT_RTOL, diffs
    assert out[0]["losses"] != ref[0]["losses"], "quantization must change something"
    assert out[0]["losses"][-1] < out[0]["losses"][0], "it must still learn"
    for r in out:
        assert r["losses"] == out[0]["losses"], "ranks disagree on the loss"
    kinds = out[0]["comm"]["by_kind"]
    if QGZ in FEATURES[feature]:
        assert kinds.get("all_to_all", 0) > 0
    assert_counted_equals_analytic(out, overrides + FEATURES[feature], world)


def test_int4_weights_and_int8_gradients():
    world, overrides = LAYOUTS["dp4_2x2"]
    overrides = overrides + ["zero.stage=3"]
    ref = run(world, overrides)
    out = run(world, overrides + FEATURES["qwz4_qgz8"])
    assert max(rel_diffs(out[0]["losses"], ref[0]["losses"])) <= 2 * QUANT_RTOL
    assert_counted_equals_analytic(out, overrides + FEATURES["qwz4_qgz8"], world)


# -- qgZ: the mean over all DP ranks -------------------------------------------------------------------
def _rank_input(global_rank: int, numel: int, shard: int, exact: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + global_rank)
    if not exact:
        return torch.randn(numel, generator=g) * (1 + global_rank)
    # int4-exact: quantization block k of every partition is a * w with w integers in [-8, 7] whose extreme is
    # -8 (the same on every rank) and a a power of two drawn per (rank, partition, block): every quantization
    # (scale a, codes w), sum and re-quantization is exact, so qgZ must return the mean bit for bit
    i = torch.arange(numel)
    blocks = (i // shard) * (shard // 32 + 1) + (i % shard) // 32
    w = torch.randint(-8, 8, (numel,), generator=torch.Generator().manual_seed(7)).float()
    w[(i % shard) % 32 == 0] = -8.0
    a = 2.0 ** torch.randint(-3, 4, (int(blocks.max()) + 1,), generator=g).float()
    return w * a[blocks]


def qgz_mean_worker(overrides, numel, cases):
    """For each (exact, stages, bits): run QgzReduce on this rank's DP groups; the result, the expected mean and
    the error bound."""
    import torch.distributed as dist

    from parallel.layout import make_layout
    from parallel.mesh import Mesh

    cfg = tiny_config(*overrides)
    layout = make_layout(cfg, dist.get_world_size(), cfg.parallel.ranks_per_node)
    mesh = Mesh(layout, torch.device("cpu"))
    out = []
    for exact, stages, bits in cases:
        mesh.ledger.reset()
        out.append(_qgz_mean(mesh, numel, exact, stages, bits))
    return out


def _qgz_mean(mesh, numel, exact, stages, bits):
    from parallel.zero.zeropp import QgzReduce, Quant

    from tests.test_quant_kernels import quant_error_bound

    dp, x, y = mesh.dp, mesh.dp_intra.size, mesh.dp_inter.size
    assert x * y == dp.size
    block = 32
    shard = -(-numel // dp.size)
    inputs = {r: _rank_input(r, numel, shard, exact) for r in dp.ranks}
    out = torch.empty(shard)
    QgzReduce(out, inputs[mesh.rank].clone(), mesh.dp_intra, mesh.dp_inter, Quant(bits, block), stages).wait()
    # float64 reference: the mean of this rank's partition (dp rank p = node * x + local)
    p = dp.rank
    padded = {r: torch.cat([v.double(), torch.zeros(shard * dp.size - numel, dtype=torch.float64)])
              for r, v in inputs.items()}
    part = {r: v[p * shard:(p + 1) * shard] for r, v in padded.items()}
    mean = sum(part.values()) / dp.size

    # bound: every rank's quantization, every node's re-quantization of its (perturbed) sum, then / P; each
    # within quant.py's max(|s|/2, |x| - (m-1)|s|) + fp32 terms (a value clipped beside its block's extreme errs
    # by up to |s|, the others by |s|/2)
    first = {r: quant_error_bound(v, bits, block) for r, v in part.items()}
    bound = sum(first.values())
    if x > 1 and y > 1:
        nodes = [dp.ranks[j * x:(j + 1) * x] for j in range(y)]
        bound = bound + sum(quant_error_bound(sum(part[r] for r in node), bits, block, sum(first[r] for r in node))
                            for node in nodes)
    bound = bound / dp.size + 1e-6 * mean.abs() + 1e-30
    return {"out": out, "mean": mean, "bound": bound, "x": x, "y": y,
            "by_group": mesh.ledger.snapshot()["by_group"]}


QGZ_MEAN = {  # name: (world, overrides, expected (X, Y))
    "2x2": (4, ["parallel.ranks_per_node=2"], (2, 2)),
    "3_nodes_x2": (6, ["parallel.ranks_per_node=2", "train.global_batch_size=12"], (2, 3)),
    "2_nodes_x3": (6, ["parallel.ranks_per_node=3", "train.global_batch_size=12"], (3, 2)),
    "one_node": (4, ["parallel.ranks_per_node=4"], (4, 1)),
    "one_rank_per_node": (4, ["parallel.ranks_per_node=1"], (1, 4)),
    "pp2_2x2": (8, ["parallel.pp=2", "parallel.ranks_per_node=2", "train.global_batch_size=16"], (2, 2)),
    "tp2_2x2": (8, ["parallel.tp=2", "parallel.ranks_per_node=4"], (2, 2)),
    "tp2_pp2_dp2": (8, ["parallel.tp=2", "parallel.pp=2", "parallel.ranks_per_node=2"], (1, 2)),
}


@pytest.mark.parametrize("name", list(QGZ_MEAN))
def test_qgz_returns_the_mean_over_all_dp_ranks(name):
    world, overrides, xy = QGZ_MEAN[name]
    numel = 1000 * world + 37  # not a multiple of anything: shards and stages are padded by rule
    cases = [(False, stages, bits) for stages in (1, 3) for bits in (4, 8)] + [(True, 1, 4), (True, 3, 4)]
    for rank_out in run_world(qgz_mean_worker, world, overrides, numel, cases):
        for (exact, stages, bits), r in zip(cases, rank_out):
            what = f"exact={exact} stages={stages} bits={bits}"
            assert (r["x"], r["y"]) == xy
            if exact:
                torch.testing.assert_close(r["out"], r["mean"].float(), rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
                continue
            err = (r["out"].double() - r["mean"]).abs()
            assert bool((err <= r["bound"]).all()), f"{what}: error {float((err - r['bound']).max())} over"
            # the bound is not vacuous: the result is far closer to the mean than to, e.g., the node sum
            assert float(err.max()) < 0.2 * float(r["mean"].abs().max()), what
            if xy[0] > 1:
                assert r["by_group"].get("dp_intra", 0) > 0
            if xy[1] > 1:
                assert r["by_group"].get("dp_inter", 0) > 0
            assert "dp" not in r["by_group"], "qgZ must not fall back to the flat reduce-scatter"


# -- bytes ---------------------------------------------------------------------------------------------
def test_cross_node_bytes_in_the_metrics_file_follow_the_paper(tmp_path):
    """bf16, 2 nodes x 2, train.py's main on 4 ranks: the trainer's metrics.jsonl `comm.by_link.inter` per step,
    by feature (ranks forked by tests/dist_harness.py instead of torchrun's fresh interpreters: the launch itself
    is tested by tests/test_train_e2e.py and tests/test_readme_commands.py)."""
    from tests.dist_harness import train_main
    from tests.test_train_e2e import FAST, records

    base = FAST + ["parallel.ranks_per_node=2", "precision=bf16", "zero.stage=3", "train.max_steps=2",
                   "train.global_batch_size=16",
                   "checkpoint.interval=0", "checkpoint.save_at_exit=false"]
    comm = {}
    for name, extra in {"zero3": [], "qwz": [QWZ], "hpz": [HPZ], "qgz": [QGZ], "zeropp": ALL}.items():
        run_dir = tmp_path / name
        ranks = run_world(train_main, 4, [*base, *extra, f"logging.run_dir={run_dir}"], env={"OMP_NUM_THREADS": "1"})
        assert [code for code, _, _ in ranks] == [0, 0, 0, 0], ranks[0][2][-3000:]
        comm[name] = [r for r in records(run_dir) if "comm" in r][-1]["comm"]
        assert_analytic_rank0(comm[name], base + extra)

    def inter(name, kind=None):
        c = comm[name]
        return c["by_link"]["inter"] if kind is None else c["by_kind_link"].get(f"{kind}/inter", 0)

    assert inter("zeropp") <= 0.27 * inter("zero3"), (inter("zeropp"), inter("zero3"))
    # qwZ: both gathers (no hpZ) carry int8 + scales instead of bf16, in two hops: of the P-1 = 3 pieces a rank
    # receives, (Y-1) = 1 comes across nodes (the flat gather's group spans both nodes: all 3 count as inter)
    assert inter("qwz", "all_gather") == pytest.approx(0.5 / 3 * inter("zero3", "all_gather"), rel=0.04)
    assert comm["qwz"]["by_kind_link"]["all_gather/intra"] == pytest.approx(2 * inter("qwz", "all_gather"))
    # hpZ: the backward gathers leave the inter-node link (the forward ones stay): each moved (H-1) N S / H = 2 S
    # inside the node where ZeRO-3's moved (N-1) S = 3 S across
    backward_inside = comm["hpz"]["by_group"]["dp_hpz"]
    assert inter("hpz", "all_gather") + 1.5 * backward_inside == pytest.approx(inter("zero3", "all_gather"), rel=1e-3)
    assert comm["hpz"]["by_link"]["intra"] > 0
    # qgZ: the gradient reduction's cross-node bytes fall to a quarter or less (int4 from bf16, 1/X of the data)
    reduce3 = inter("zero3", "reduce_scatter")
    reduce_q = inter("qgz", "reduce_scatter") + inter("qgz", "all_to_all")
    assert reduce_q <= 0.25 * reduce3, (reduce_q, reduce3)
    assert inter("qgz", "all_gather") == inter("zero3", "all_gather")


def assert_analytic_rank0(comm, args):
    from config import load_config
    from parallel.layout import make_layout
    from parallel.volume import STOP_FLAGS, step_bytes

    cfg = load_config(None, list(args))
    analytic = step_bytes(cfg, make_layout(cfg, 4, 2), 0, stop_flags=STOP_FLAGS)  # a train.py run's metrics
    assert set(comm["by_group"]) == {g for g, v in analytic.items() if v > 0}, (comm["by_group"], analytic)
    for group, n in analytic.items():
        assert abs(comm["by_group"].get(group, 0) - n) <= 16, (group, comm["by_group"], analytic)


# -- checkpoints ---------------------------------------------------------------------------------------
SAVE_AT, TOTAL = 3, 6
CKPT = ["parallel.ranks_per_node=2", "model.tie_embeddings=true", "zero.stage=3"]


def resave_worker(overrides, src, dst):
    """Load a checkpoint and save it again at once, elsewhere (what resharding to this layout writes)."""
    from training.checkpoint import Checkpointer

    cfg = tiny_config(*overrides)
    engine = build_engine(cfg)
    Checkpointer(cfg, src, engine).load(Checkpointer(cfg, src, engine).find_resumable())
    Checkpointer(cfg, dst, engine).save(engine.step, engine.step * cfg.train.global_batch_size)
    return engine.step


def test_zeropp_checkpoints_resume_exactly_and_reshard_through_zero3(tmp_path):
    uninterrupted = run_world(checkpoint_worker, 4, CKPT + ALL, "none", TOTAL, "/nonexistent-unused")[0]
    first = tmp_path / "zeropp"
    run_world(checkpoint_worker, 4, CKPT + ALL, "fresh", SAVE_AT, str(first))
    resumed = run_world(checkpoint_worker, 4, CKPT + ALL, "resume", TOTAL, str(first))[0]
    assert sorted(resumed) == list(range(SAVE_AT, TOTAL))
    for step, loss in resumed.items():
        assert abs(loss - uninterrupted[step]) <= 1e-6 * uninterrupted[step], (step, loss, uninterrupted[step])
    # ZeRO++ (dp4, 2 nodes) -> plain ZeRO-3 on dp2 -> ZeRO++ again: nothing is lost on the way
    plain = tmp_path / "zero3_dp2"
    assert run_world(resave_worker, 2, ["model.tie_embeddings=true", "zero.stage=3"], str(first), str(plain)) == \
        [SAVE_AT] * 2
    back = run_world(checkpoint_worker, 4, CKPT + ALL, "resume", TOTAL, str(plain))[0]
    for step, loss in back.items():
        assert abs(loss - uninterrupted[step]) <= 1e-6 * uninterrupted[step], (step, loss, uninterrupted[step])


# -- bad combinations ------------------------------------------------------------------------------------
def test_hpz_size_must_divide_the_dp_ranks_of_a_node():
    from config import ConfigError
    from parallel.layout import make_layout

    cfg = tiny_config("zero.stage=3", "zero.hpz_size=4", "parallel.ranks_per_node=2")
    with pytest.raises(ConfigError, match=r"zero.hpz_size=4 does not divide the 2 data-parallel ranks per node"):
        make_layout(cfg, 4, 2)
    cfg = tiny_config("zero.stage=3", "zero.hpz_size=4", "parallel.ranks_per_node=4", "parallel.tp=2")
    with pytest.raises(ConfigError, match=r"zero.hpz_size=4 does not divide the 2 data-parallel"):
        make_layout(cfg, 8, 4)  # tp2 leaves 2 DP ranks on a node of 4


# -- observability -----------------------------------------------------------------------------------------
def test_sampled_quantization_error_is_logged(tmp_path):
    """zero.quant_error_interval=2: steps 2 and 4 carry the relative error of the gathered weights (int8:
    about 1/(2*128*sqrt(3)) of a block's absmax, so well under 1%) and of the reduced gradients (int4)."""
    from tests.dist_harness import train_main
    from tests.test_train_e2e import FAST, ROOT, records

    run_dir = tmp_path / "run"
    args = [*FAST, "train.global_batch_size=16", "parallel.ranks_per_node=2", "zero.stage=3", QWZ, QGZ,
            "zero.quant_error_interval=2", "train.max_steps=4", "checkpoint.interval=0",
            "checkpoint.save_at_exit=false", f"logging.run_dir={run_dir}"]
    code, out, err = run_world(train_main, 4, args, str(ROOT), timeout=300, env={"OMP_NUM_THREADS": "1"})[0]
    assert code == 0, err[-3000:]
    sampled = [r for r in records(run_dir) if "quant_error" in r]
    assert [r["step"] for r in sampled] == [2, 4]
    for r in sampled:
        assert 1e-4 < r["quant_error"]["weights"] < 0.01, r
        assert 1e-3 < r["quant_error"]["gradients"] < 0.5, r
    assert "relative quantization error" in out


def test_fp16_overflow_survives_quantization_and_skips_like_zero3():
    """Non-finite gradients stay non-finite through int4 qgZ (a NaN scale poisons its block), so the
    same steps are skipped as under ZeRO-3, and the loss scale recovers the same way."""
    world, overrides = LAYOUTS["dp4_2x2"]
    overrides = overrides + ["precision=fp16", "loss_scale.initial=1048576", "zero.stage=3"]
    ref = run(world, overrides)[0]
    out = run(world, overrides + [QWZ, QGZ])[0]
    skipped = [not math.isfinite(n) for n in out["grad_norms"]]
    assert skipped == [not math.isfinite(n) for n in ref["grad_norms"]]
    assert skipped[0] and not skipped[-1], "the test must overflow first and recover later"
    assert max(rel_diffs(out["losses"], ref["losses"])) <= QUANT_RTOL


def test_hop_runner_launches_in_order_and_fails_every_later_gather():
    """zeropp.HopRunner: one thread runs the gathers' hops in the order they were submitted; a failure (a
    CommError in a real run) reaches the waiting thread through ``advance``/``wait``, and every later gather
    fails with it instead of launching hops past a broken link (its peers would wait for them forever)."""
    import threading
    from types import SimpleNamespace

    from parallel.zero.zeropp import HopRunner, QuantizedGather

    order, gate = [], threading.Event()

    class Fake:
        route = SimpleNamespace(inter=SimpleNamespace(name="qwz_inter"))

        def __init__(self, name, fail=False):
            self.name, self.fail, self.error, self.launched = name, fail, None, threading.Event()

        def launch_hops(self):
            gate.wait(10)
            order.append(self.name)
            if self.fail:
                raise RuntimeError(f"{self.name}: connection closed by peer")

        advance = QuantizedGather.advance

    runner = HopRunner()
    works = [Fake("a"), Fake("b"), Fake("c", fail=True), Fake("d")]
    for w in works:
        runner.submit(w)
    assert not any(w.launched.is_set() for w in works)  # nothing runs before the first hop may go
    gate.set()
    assert works[0].advance(block=True) and works[1].advance(block=True)
    for w in works[2:]:
        with pytest.raises(RuntimeError, match="c: connection closed by peer"):
            w.advance(block=True)
    assert order == ["a", "b", "c"]  # d never launched
