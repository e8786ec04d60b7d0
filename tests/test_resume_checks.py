"""What a resume checks (issue 17): the data order follows the data's content, not its name; settings that change
the samples a data position stands for are refused; a run that never takes a step fails instead of saving.

Every run is the real trainer (train.main in-process) on the tiny config and the bundled corpus; curves are compared
with an uninterrupted run in one process.
"""
import json
import os
import re
import shutil

import pytest
import torch

import train
from config import load_config
from tests.test_failures import SAMPLE, _digests
from tests.test_reliability import ckpt_names, run_inprocess
from tests.test_train_e2e import FAST, assert_same_curve, losses_by_step, records

COMMON = FAST + ["train.decay_steps=10", "checkpoint.interval=2"]  # lr schedule independent of max_steps


def copy_data(to):
    """The bundled corpus under another directory and basename: byte-identical data."""
    to.parent.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx"):
        shutil.copy(f"{SAMPLE}{ext}", f"{to}{ext}")
    return to


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Losses of 4 steps in one run on the bundled corpus."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    assert train.main([*COMMON, "train.max_steps=4", f"logging.run_dir={run_dir}"]) == 0
    return losses_by_step(run_dir)[0]


# -- 1. the data order follows the content: renamed data resumes on the same curve ---------------------------------
def test_data_renamed_between_runs_resumes_on_the_uninterrupted_curve(tmp_path, capsys, uninterrupted):
    run_dir = tmp_path / "run"
    rc, out, err = run_inprocess(capsys, *COMMON, "train.max_steps=2", f"data.paths=[{SAMPLE}]",
                                 f"logging.run_dir={run_dir}")
    assert rc == 0, err
    renamed = copy_data(tmp_path / "elsewhere" / "renamed_corpus")
    rc, out, err = run_inprocess(capsys, *COMMON, "train.max_steps=4", f"data.paths=[{renamed}]",
                                 f"logging.run_dir={run_dir}")
    assert rc == 0, err
    assert "resumed from" in out and "WARNING" not in out and "data order 1" not in out
    got, _ = losses_by_step(run_dir)
    assert_same_curve(got, uninterrupted, rtol=1e-6)


# -- 2. settings that change the samples are refused, the global batch is reported --------------------------------
@pytest.fixture
def saved_at_2(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc, _, err = run_inprocess(capsys, *COMMON, "train.max_steps=2", f"logging.run_dir={run_dir}")
    assert rc == 0, err
    return run_dir


@pytest.mark.parametrize("setting,expected", [
    ("model.seq_len=32", "model.seq_len: checkpoint 64 vs now 32"),
    ("data.split=[0.9,0.1]", "data.split: checkpoint [0.95, 0.05] vs now [0.9, 0.1]"),
])
def test_resume_with_a_setting_that_changes_the_samples_is_refused(saved_at_2, capsys, setting, expected):
    run_dir = saved_at_2
    rc, out, err = run_inprocess(capsys, *COMMON, "train.max_steps=4", setting, f"logging.run_dir={run_dir}")
    assert rc == 2, out[-2000:]
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err and "checkpoint.on_data_change=warn" in err
    assert ckpt_names(run_dir) == ["latest", "step_00000002"]
    rc, out, err = run_inprocess(capsys, *COMMON, "train.max_steps=3", setting, "checkpoint.on_data_change=warn",
                                 f"logging.run_dir={run_dir}")
    assert rc == 0, err
    assert "WARNING" in out and expected in out


def test_blend_weights_are_compared_by_what_they_mean(tmp_path, capsys):
    """[1, 1] and [2, 2] are the same blend (weights are normalised); [1, 3] is another."""
    run_dir, copy = tmp_path / "run", copy_data(tmp_path / "copy" / "corpus")
    blend = [*COMMON, f"data.paths=[{SAMPLE},{copy}]", f"logging.run_dir={run_dir}"]
    assert run_inprocess(capsys, *blend, "train.max_steps=2", "data.weights=[1,1]")[0] == 0
    rc, out, err = run_inprocess(capsys, *blend, "train.max_steps=4", "data.weights=[1,3]")
    assert rc == 2 and "data.weights: checkpoint [1.0, 1.0] vs now [1.0, 3.0]" in err, err
    rc, out, err = run_inprocess(capsys, *blend, "train.max_steps=3", "data.weights=[2,2]")
    assert rc == 0 and "resumed from" in out and "WARNING" not in out, err


def test_resume_with_another_global_batch_reads_on_and_says_so(saved_at_2, capsys):
    run_dir = saved_at_2
    rc, out, err = run_inprocess(capsys, *COMMON, "train.max_steps=3", "train.global_batch_size=16",
                                 f"logging.run_dir={run_dir}")
    assert rc == 0, err
    lines = [line for line in out.splitlines() if "train.global_batch_size" in line]
    assert lines == ["[checkpoint] train.global_batch_size: checkpoint 8 vs now 16; the run reads on from sample 16 "
                     "of the same sample stream (nothing skipped or read twice), 16 a step"], out
    assert "WARNING" not in out
    step3 = [r for r in records(run_dir) if r.get("step") == 3 and "loss" in r]
    assert [r["consumed_samples"] for r in step3] == [16 + 16]  # 2 steps of 8, then one of 16


# -- 3. checkpoints of data order 1 (shuffled by file name, before issue 17) go on in their order -----------------
def test_a_checkpoint_in_data_order_1_resumes_on_its_curve(tmp_path, capsys, monkeypatch, uninterrupted):
    """The previous version is simulated: datasets seeded by the files' basenames (data order 1, as
    tests/test_data_gpt_dataset.py checks against the old specification) and the fingerprint it recorded (no data
    order, no content hash, no seq_len or global batch)."""
    import training.trainer as trainer
    from data.indexed import fingerprint

    real_build = trainer.build_datasets

    def old_build(paths, *args, seed_names=None, **kwargs):
        return real_build(paths, *args, seed_names=[os.path.basename(p) for p in paths], **kwargs)

    def old_fingerprint(cfg):
        return {"seed": cfg.train.seed, "split": list(cfg.data.split), "weights": None,
                "files": [{"path": p, "content": {k: v for k, v in fingerprint(p).items() if k != "content_sha256"}}
                          for p in cfg.data.paths]}

    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(trainer, "build_datasets", old_build)
        m.setattr(trainer, "data_fingerprint", old_fingerprint)
        assert run_inprocess(capsys, *COMMON, "train.max_steps=6", f"logging.run_dir={ref_dir}")[0] == 0
        assert run_inprocess(capsys, *COMMON, "train.max_steps=2", f"logging.run_dir={run_dir}")[0] == 0
    ref, _ = losses_by_step(ref_dir)
    assert any(ref[s] != uninterrupted[s] for s in (3, 4)), "orders 1 and 2 must differ for this test to mean much"

    renamed = copy_data(tmp_path / "elsewhere" / "renamed_corpus")  # order 1 keeps the recorded name's order
    rc, out, err = run_inprocess(capsys, *COMMON, "train.max_steps=4", f"data.paths=[{renamed}]",
                                 f"logging.run_dir={run_dir}")
    assert rc == 0, err
    assert "reads its data in data order 1" in out and "['sample_text_document']" in out and "WARNING" not in out
    rc, out, err = run_inprocess(capsys, *COMMON, "train.max_steps=6", f"logging.run_dir={run_dir}")
    assert rc == 0, err  # step 4 was saved by this version: it records order 1 and the name
    assert "reads its data in data order 1" in out
    got, _ = losses_by_step(run_dir)
    assert_same_curve(got, ref, rtol=1e-6)


# -- 4. a run that never takes a step fails and saves nothing ------------------------------------------------------
def test_resuming_non_finite_weights_fails_and_saves_nothing(tmp_path, capsys, monkeypatch):
    import training.checkpoint as ck

    real_save = ck.Checkpointer.save

    def save_nan_weights(self, *args, **kwargs):
        with torch.no_grad():
            for p in self.engine.params.values():
                p.fill_(float("nan"))
        return real_save(self, *args, **kwargs)

    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(ck.Checkpointer, "save", save_nan_weights)
        assert run_inprocess(capsys, *COMMON, "train.max_steps=2", f"logging.run_dir={run_dir}")[0] == 0
    saved = run_dir / "checkpoints" / "step_00000002"
    rc, out, err = run_inprocess(capsys, *COMMON, "train.max_steps=5", "checkpoint.interval=1",
                                 f"logging.run_dir={run_dir}")
    assert rc == 2, out[-2000:]
    assert err.startswith("error: training diverged: ") and err.count("\n") == 1, err
    assert f"every step since resuming from {saved} (steps 3-5) had non-finite gradients" in err
    assert "nothing was saved" in err
    assert ckpt_names(run_dir) == ["latest", "step_00000002"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"


def test_a_fresh_run_whose_every_step_is_skipped_fails_and_saves_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc, out, err = run_inprocess(capsys, *FAST, "precision=fp16", "loss_scale.initial=1e12", "train.max_steps=3",
                                 "checkpoint.interval=1", f"logging.run_dir={run_dir}")
    assert rc == 2, out[-2000:]
    assert err.startswith("error: training diverged: ") and err.count("\n") == 1, err
    assert "every step since the start (steps 1-3) had non-finite gradients" in err
    assert "last good checkpoint: none; nothing was saved" in err
    assert not list((run_dir / "checkpoints").glob("step_*"))


def test_stopping_before_any_step_was_taken_saves_nothing(tmp_path, capsys, monkeypatch):
    """A signal (or the time limit) is not a divergence: exit 0, but nothing saved stands for progress."""
    import training.trainer as trainer

    real_should_stop, calls = trainer._should_stop, []

    def signal_after_step_2(*args, **kwargs):  # checked before step 1, then after each step
        calls.append(1)
        return real_should_stop(*args, **kwargs) if len(calls) < 3 else "signal"

    monkeypatch.setattr(trainer, "_should_stop", signal_after_step_2)
    run_dir = tmp_path / "run"
    rc, out, err = run_inprocess(capsys, *FAST, "precision=fp16", "loss_scale.initial=1e12", "train.max_steps=100",
                                 "checkpoint.interval=1", f"logging.run_dir={run_dir}")
    assert rc == 0, err
    assert "every step since the start (steps 1-2) had non-finite gradients (last loss" in out
    assert "nothing saved" in out and "stopped at step 2 (signal)" in out
    assert not list((run_dir / "checkpoints").glob("step_*"))


# -- 5. what a checkpoint must share with the run (issue 53): one line naming the setting and both values, exit 2,
# found before anything is created; what would work is named, and works when followed ------------------------------
MOE = ["model.moe.num_experts=4", "model.moe.ffn_hidden=32"]


def refused(capsys, keep, *args):
    """train.main must exit 2 with one line and leave ``keep`` (a saved run) as it was; returns the line."""
    before = _digests(keep)
    rc, out, err = run_inprocess(capsys, *args)
    assert rc == 2, out[-2000:]
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert _digests(keep) == before
    return err


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dense") / "run"
    assert train.main([*COMMON, "train.max_steps=2", f"logging.run_dir={run_dir}"]) == 0
    return run_dir


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A run with 4 experts (top_k 2, softmax router, renormalised gates: the config's defaults) saved at step 2."""
    run_dir = tmp_path_factory.mktemp("moe") / "run"
    assert train.main([*COMMON, *MOE, "train.max_steps=2", f"logging.run_dir={run_dir}"]) == 0
    return run_dir


@pytest.mark.parametrize("overrides,expected", [
    (["model.moe.ffn_hidden=64"], "model.moe.ffn_hidden: checkpoint 32 vs config 64"),
    (["model.moe.top_k=1"], "model.moe.top_k: checkpoint 2 vs config 1"),
    (["model.moe.num_experts=8", "model.moe.shared_experts=1"],
     "model.moe.num_experts: checkpoint 4 vs config 8, model.moe.shared_experts: checkpoint 0 vs config 1"),
    (["model.moe.num_experts=0"], "model.moe.num_experts: checkpoint 4 vs config 0"),
])
def test_a_changed_moe_setting_is_named_with_both_values(moe_run, capsys, overrides, expected):
    """Item 6: the differing model.moe keys, not the two whole model.moe records."""
    err = refused(capsys, moe_run, *COMMON, *MOE, *overrides, "train.max_steps=3", f"logging.run_dir={moe_run}")
    assert err.startswith(f"error: checkpoint {moe_run / 'checkpoints' / 'step_00000002'} was trained with a "
                          f"different model ({expected})"), err
    assert "{" not in err, err


@pytest.mark.parametrize("setting,expected", [
    ("model.moe.score=sigmoid", "model.moe.score: checkpoint 'softmax' vs config 'sigmoid'"),
    ("model.moe.norm_topk=false", "model.moe.norm_topk: checkpoint True vs config False"),
])
def test_a_resume_refuses_a_changed_router_and_init_from_takes_it_saying_so(moe_run, tmp_path, capsys, setting,
                                                                            expected):
    """Item 5: a full resume refuses another router (as another top_k or RoPE); the weights start a new phase with
    it through checkpoint.init_from, which names the change (as it names RoPE changes)."""
    ckpt = moe_run / "checkpoints" / "step_00000002"
    err = refused(capsys, moe_run, *COMMON, *MOE, setting, "train.max_steps=3", f"logging.run_dir={moe_run}")
    assert err == (f"error: checkpoint {ckpt} was trained with a different model ({expected}); to change it, start "
                   f"from its weights in a new run: logging.run_dir=<a new directory> checkpoint.init_from={ckpt} "
                   f"(checkpoint.init_from is not read while {moe_run / 'checkpoints'} holds a checkpoint to "
                   "resume)\n")
    rc, out, err = run_inprocess(capsys, *COMMON, *MOE, setting, "train.max_steps=1",
                                 f"logging.run_dir={tmp_path / 'new'}", f"checkpoint.init_from={ckpt}")
    assert rc == 0, err
    assert f"[train] MoE router changed from the checkpoint's: {expected}" in out.splitlines(), out


def test_another_optimizer_is_refused_with_advice_that_works_when_followed(tmp_path, capsys):
    """Item 4: a run directory holding a checkpoint of another optimizer, and checkpoint.load of one: the advice
    is taken literally (the placeholder filled in), starts from the checkpoint's weights, and a requeue of the
    followed command resumes its own progress; the old run is untouched throughout."""
    run_dir = tmp_path / "run"
    assert run_inprocess(capsys, *COMMON, "train.optimizer=muon", "train.max_steps=2",
                         f"logging.run_dir={run_dir}")[0] == 0
    ckpt = run_dir / "checkpoints" / "step_00000002"
    for args, new in (([f"logging.run_dir={run_dir}"], tmp_path / "new"),
                      ([f"logging.run_dir={tmp_path / 'loaded'}", f"checkpoint.load={ckpt}"], tmp_path / "loaded")):
        err = refused(capsys, run_dir, *COMMON, "train.max_steps=4", *args)
        assert (f"checkpoint {ckpt} was trained with train.optimizer=muon, this run uses train.optimizer=adamw: its "
                "optimizer state does not carry over; start from its weights ") in err, err
        advice = re.search(r"start from its weights (?:in a new run: )?(.*?)(?: \(|\n)", err).group(1)
        if "checkpoint.load" in args[-1]:  # nothing to resume there: checkpoint.init_from instead of checkpoint.load
            assert advice == f"with checkpoint.init_from={ckpt} in place of checkpoint.load", err
            followed = [args[0], f"checkpoint.init_from={ckpt}"]
        else:
            assert advice == f"logging.run_dir=<a new directory> checkpoint.init_from={ckpt}", err
            followed = advice.replace("<a new directory>", str(new)).split()
        rc, out, err = run_inprocess(capsys, *COMMON, "train.max_steps=2", *followed)
        assert rc == 0, err
        assert f"[train] model weights from {ckpt} (checkpoint.init_from; step 2 there)" in out, out
        if "checkpoint.load" in args[-1]:
            continue
        rc, out, err = run_inprocess(capsys, *COMMON, "train.max_steps=3", *followed)  # requeued: its own progress
        assert rc == 0, err
        assert f"resumed from {new / 'checkpoints' / 'step_00000002'} at step 2" in out, out


@pytest.mark.parametrize("overrides,expected", [
    (["checkpoint.load={ckpt}", "model.n_layers=3"], "was trained with a different model (model.n_layers: "
                                                     "checkpoint 2 vs config 3)"),
    (["checkpoint.load={ckpt}", "train.optimizer=muon"], "was trained with train.optimizer=adamw, this run uses "
                                                         "train.optimizer=muon"),
    (["checkpoint.load={ckpt}", "model.rope_theta=20000"], "was trained with a different model (model.rope_theta: "
                                                           "checkpoint 10000.0 vs config 20000.0)"),
    (["checkpoint.init_from={run}", "model.d_model=128"], "holds a different model (model.d_model: checkpoint 64 "
                                                          "vs config 128"),
    (["checkpoint.init_from={run}", "model.d_model=128", "checkpoint.dir={new}/elsewhere"],
     "holds a different model (model.d_model: checkpoint 64 vs config 128"),
    (["checkpoint.load={ckpt}", *MOE], "model.moe.num_experts: checkpoint 0 vs config 4"),
    (["checkpoint.load={new}"], "checkpoint.load={new} does not exist"),
], ids=["load_model", "load_optimizer", "load_rope", "init_from_model", "init_from_model_checkpoint_dir",
        "load_dense_into_moe", "load_missing"])
def test_a_refused_checkpoint_is_found_before_anything_is_created(dense_run, tmp_path, capsys, overrides, expected):
    """Item 8: checkpoint.load / checkpoint.init_from refused at start-up, like a config error: no run directory,
    lock or checkpoints/ is made (the run directory named here does not exist afterwards)."""
    new = tmp_path / "new"
    names = {"ckpt": dense_run / "checkpoints" / "step_00000002", "run": dense_run, "new": new}
    args = [o.format(**names) for o in overrides]
    err = refused(capsys, dense_run, *COMMON, "train.max_steps=3", f"logging.run_dir={new}", *args)
    assert expected.format(**names) in err, err
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


# -- 6. a resume into or out of fp16 compute: the loss scaler is the new precision's (issue 53 item 3) --------------
FP16_INITIAL = load_config(None, []).loss_scale.initial  # the config's own value


@pytest.mark.parametrize("saved,resumed", [
    (["precision=bf16"], ["precision=fp16"]),
    (["precision=fp16"], ["precision=bf16"]),
    (["precision=fp8", "fp8.gemm=bf16"], ["precision=fp8", "fp8.gemm=fp16"]),
], ids=["bf16_as_fp16", "fp16_as_bf16", "fp8_bf16_gemm_as_fp16_gemm"])
def test_a_resume_into_or_out_of_fp16_starts_that_precisions_loss_scale_and_says_so(tmp_path, capsys, saved, resumed):
    """The resumed steps run at the loss scale a fresh run of the new precision starts at (loss_scale.initial for
    fp16 compute, 1 otherwise), not at the checkpoint's (1 from bf16: fp16 gradients under 6e-8 flush to zero;
    65536 from fp16: frozen in bf16's metrics), and one line says so."""
    run_dir = tmp_path / "run"
    assert run_inprocess(capsys, *COMMON, *saved, "train.max_steps=2", f"logging.run_dir={run_dir}")[0] == 0
    then = json.loads((run_dir / "checkpoints" / "step_00000002" / "meta.json").read_text())["loss_scaler"]["scale"]
    rc, out, err = run_inprocess(capsys, *COMMON, *resumed, "train.max_steps=3", f"logging.run_dir={run_dir}")
    assert rc == 0, err
    fp16_now = "precision=fp16" in resumed or "fp8.gemm=fp16" in resumed
    [step3] = [r for r in records(run_dir) if r.get("step") == 3 and "loss" in r]
    assert step3["loss_scale"] == (FP16_INITIAL if fp16_now else 1.0)
    scale = (f"the fp16 loss scale starts fresh at loss_scale.initial={FP16_INITIAL:g}" if fp16_now else
             f"its fp16 loss scale {then:g} is dropped (bf16 computes unscaled)")
    if saved[0] == resumed[0]:  # fp8 -> fp8, another GEMM path
        line = (f"resuming a precision=fp8 checkpoint with fp8.gemm=bf16 as fp8.gemm=fp16: {scale}; mu and the FP8 "
                "optimizer state carry on")
    else:
        line = f"resuming a {saved[0]} checkpoint as {resumed[0]}: {scale}"
    said = [s for s in out.splitlines() if "resuming a precision=" in s]
    assert said == [f"[checkpoint] {line} (step_00000002)"], out


def test_every_rank_refuses_the_start_checkpoint_with_rank_0s_line(dense_run, tmp_path):
    """Item 8 on two forked ranks: rank 0 reads the checkpoint, both stop (exit 2) before anything is created."""
    from tests.dist_harness import run_world, train_main
    from tests.test_train_e2e import ROOT

    ckpt = dense_run / "checkpoints" / "step_00000002"
    args = [*COMMON, "train.max_steps=3", f"logging.run_dir={tmp_path / 'new'}", f"checkpoint.load={ckpt}",
            "train.optimizer=muon"]
    (code0, _, err0), (code1, _, err1) = run_world(train_main, 2, args, str(ROOT), env={"OMP_NUM_THREADS": "1"})
    assert (code0, code1) == (2, 2), (err0, err1)
    assert err0.startswith(f"error: checkpoint {ckpt} was trained with train.optimizer=adamw, this run uses "
                           "train.optimizer=muon") and err0.count("\n") == 1, err0
    assert err1 == ""
    assert list(tmp_path.iterdir()) == []
