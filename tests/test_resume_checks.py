"""What a resume checks (issue 17): the data order follows the data's content, not its name; settings that change
the samples a data position stands for are refused; a run that never takes a step fails instead of saving.

Every run is the real trainer (train.main in-process) on the tiny config and the bundled corpus; curves are compared
with an uninterrupted run in one process.
"""
import os
import shutil

import pytest
import torch

import train
from tests.test_failures import SAMPLE
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
