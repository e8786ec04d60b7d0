"""ZeRO-3's early step (``zero.early_step``, parallel/zero/sharded.py): each unit of the next forward's first
modules steps as soon as its gradient shard is final and its updated weights cross nodes into the hpZ secondary
shards while backward goes on. Reference: the same run with ``zero.early_step=false`` (itself tested against
plain ZeRO-3 and one process in tests/test_zeropp.py and tests/test_zero.py): every loss, gradient norm,
validation loss and master weight equal bit for bit, whether the early work is kept (the clip does not bite) or
thrown away (it does), and every step's counted bytes equal the analytic ones (parallel/volume.py, ``early``)."""
import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import batch_fn, build_engine, tiny_config
from tests.test_comm_volume import assert_counted_equals_analytic

NODES = ["parallel.ranks_per_node=2"]
ZEROPP = NODES + ["zero.stage=3", "zero.quantized_weights=true", "zero.hpz_size=2", "zero.quantized_gradients=true"]
STEPS = 4


def early_worker(overrides, steps):
    cfg = tiny_config(*overrides)
    engine = build_engine(cfg)
    losses, norms, comms, early = [], [], [], []
    for step in range(steps):
        engine.mesh.ledger.reset()
        early.append(engine.dp.last_early)  # this step's forward uses the last step's early gathers
        stats = engine.train_step(batch_fn(engine, step))
        comms.append(engine.mesh.ledger.snapshot())
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
    val = engine.eval_loss(batch_fn(engine, 1000))
    return {"losses": losses, "norms": norms, "val": val, "comms": comms, "early": early,
            "masters": [u.master.clone() for u in engine.dp.units],
            "kept": engine.dp.early_kept, "discarded": engine.dp.early_discarded}


def compare(overrides, world=4, steps=STEPS):
    on = run_world(early_worker, world, overrides + ["zero.early_step=true"], steps)
    off = run_world(early_worker, world, overrides + ["zero.early_step=false"], steps)
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"] and a["val"] == b["val"]
        assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"]))
        assert b["kept"] == b["discarded"] == 0
    for k in range(steps):  # every step's bytes, with the forward on early gathers or not
        assert_counted_equals_analytic([dict(comm=r["comms"][k], early=r["early"][k]) for r in on], overrides, world)
    return on


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_early_step_is_exact_and_kept_when_the_clip_does_not_bite(precision):
    on = compare(ZEROPP + [f"precision={precision}", "train.grad_clip=0"])
    # the first step records the forward's order; every later one steps early and keeps it
    assert on[0]["kept"] == STEPS - 1 and on[0]["discarded"] == 0
    assert on[0]["early"] == [False, False] + [True] * (STEPS - 2)
    later = on[0]["comms"][-1]["by_group"]
    assert later["qwz_inter"] > 0 and later["dp_hpz"] > 0  # the early gathers are counted in the step using them


def test_early_step_is_thrown_away_when_the_clip_bites_and_not_tried_after():
    """The clip threshold between the first step's gradient norm and a later one's: the first steps keep their early
    work, the first step whose norm exceeds the clip throws it away (its update differs), and the steps after a
    clipped one do not try."""
    ref = run_world(early_worker, 4, ZEROPP + ["precision=bf16", "train.grad_clip=0", "zero.early_step=false"], STEPS)
    norms = ref[0]["norms"]
    assert max(norms[1:]) > norms[0], norms
    clip = (norms[0] + max(norms[1:])) / 2
    on = compare(ZEROPP + ["precision=bf16", f"train.grad_clip={clip}"])
    assert on[0]["kept"] >= 1 and on[0]["discarded"] == 1, (norms, clip, on[0]["kept"], on[0]["discarded"])


def test_early_step_across_pipeline_stages():
    """tp 2 x pp 2 x dp 2 with ZeRO++: every chunk's units but its first module's step early."""
    on = compare(["parallel.tp=2", "parallel.pp=2", "parallel.ranks_per_node=4", "train.global_batch_size=16",
                  "zero.stage=3", "zero.quantized_weights=true", "zero.hpz_size=2", "zero.quantized_gradients=true",
                  "precision=bf16", "train.grad_clip=0"], world=8, steps=3)
    assert all(r["kept"] == 2 for r in on)


def test_early_step_applies_only_to_stage_3_with_hpz_and_qwz_without_qwd():
    """Elsewhere the key has no effect: no early units (volume.py) and no early step in a run (hpZ alone)."""
    on = run_world(early_worker, 4, NODES + ["zero.stage=3", "zero.hpz_size=2", "train.grad_clip=0"], 3)
    assert on[0]["kept"] == on[0]["discarded"] == 0 and not any(on[0]["early"])
    for overrides in (["zero.stage=3"], ["zero.stage=3", "zero.hpz_size=2"], ["zero.stage=2", "zero.quantized_weights=true"],
                      ["zero.stage=3", "zero.hpz_size=2", "zero.quantized_weights=true", "zero.weight_bits=4",
                       "zero.weight_delta=true"]):
        cfg = tiny_config(*NODES, *overrides)
        assert cfg.zero.early_step  # the default: on where it applies
        from parallel.volume import early_units
        assert early_units(cfg, [None, None]) == set()


def test_the_early_step_metric_of_a_skipped_step_is_false(tmp_path):
    """train.py on 2 nodes x 2 with the early step (from step 2: step 1 has no recorded forward yet). The warm-up's
    growing, huge learning rate (25, 50, 75, 100) sends the weights past bf16's range at some step (here the third;
    measured: peak 30 never, 300 from the second), whose gradients are then not finite: it is skipped, keeps
    nothing stepped early, and its record must say so (it repeated the last kept step's true)."""
    from tests.dist_harness import train_main
    from tests.test_train_e2e import FAST, records

    args = FAST + ZEROPP + ["precision=bf16", "train.max_steps=4", "train.grad_clip=0", "train.lr=100",
                            "train.warmup_steps=4", "train.global_batch_size=16", "checkpoint.interval=0",
                            "checkpoint.save_at_exit=false", f"logging.run_dir={tmp_path / 'run'}"]
    ranks = run_world(train_main, 4, args, env={"OMP_NUM_THREADS": "1"})
    assert [code for code, _, _ in ranks] == [0, 0, 0, 0], ranks[0][2][-3000:]
    steps = [(r["step"], r["skipped_steps"], r["early_step"]) for r in records(tmp_path / "run") if "early_step" in r]
    skipped = [now[1] > before[1] for before, now in zip([(0, 0, False)] + steps, steps)]
    assert not any(early for (_, _, early), skip in zip(steps, skipped) if skip), steps
    # the case that matters happened: a step kept its early gathers and the next one was skipped
    assert any(a[2] and b for a, b in zip(steps, skipped[1:])), steps
