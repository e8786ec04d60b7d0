"""Checkpoints move between layouts, publish atomically, and keep the newest K."""
import json
from pathlib import Path

import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import batch_fn, build_engine, checkpoint_worker, tiny_config

SAVE_AT, TOTAL = 3, 6


@pytest.fixture(scope="module")
def saved_at_tp2_pp2(tmp_path_factory):
    """One uninterrupted single-process curve, and a tp=2 x pp=2 (SP) run saved at step 3."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    reference = run_world(checkpoint_worker, 1, [], "none", TOTAL, str(ckpt / "unused"))[0]
    run_world(checkpoint_worker, 4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"],
              "fresh", SAVE_AT, str(ckpt))
    return reference, ckpt


@pytest.mark.parametrize("world,layout", [(4, []), (4, ["parallel.tp=4"]), (4, ["parallel.pp=4"]),
                                          (2, ["parallel.pp=2", "parallel.virtual_stages=2"])],
                         ids=["dp4", "tp4", "pp4", "pp2_vp2"])
def test_resume_in_another_layout_continues_the_curve(saved_at_tp2_pp2, world, layout):
    reference, ckpt = saved_at_tp2_pp2
    resumed = run_world(checkpoint_worker, world, layout, "resume", TOTAL, str(ckpt))
    losses = resumed[0]
    assert sorted(losses) == list(range(SAVE_AT, TOTAL))
    for step, loss in losses.items():
        assert abs(loss - reference[step]) <= 1e-5 * reference[step], (step, loss, reference[step])
    # the optimizer state moved too: without it step 4 would differ far more than 1e-5
    assert all(r == losses for r in resumed)


def save_steps_worker(ckpt_dir, steps, keep_last, fail_save_at):
    """Save after every step; optionally make one save fail mid-write (a full disk after the tensors are written)."""
    import errno

    import training.checkpoint as ck

    cfg = tiny_config(f"checkpoint.keep_last={keep_last}")
    engine = build_engine(cfg)
    saver = ck.Checkpointer(cfg, ckpt_dir, engine)
    for step in range(steps):
        engine.train_step(batch_fn(engine, step))
        if engine.step == fail_save_at:
            real = ck._write_json

            def full_disk(path, obj):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))

            ck._write_json = full_disk
            try:
                with pytest.raises(ck.CheckpointError) as info:
                    saver.save(engine.step, 0)
            finally:
                ck._write_json = real
            return sorted(p.name for p in Path(ckpt_dir).iterdir()), str(info.value)
        saver.save(engine.step, 0)
    return sorted(p.name for p in Path(ckpt_dir).iterdir()), None


def test_keeps_the_newest_k_and_moves_latest_last(tmp_path):
    names, _ = run_world(save_steps_worker, 1, str(tmp_path), 5, 2, -1)[0]
    assert names == ["latest", "step_00000004", "step_00000005"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000005"
    manifest = json.loads((tmp_path / "step_00000005" / "manifest.json").read_text())["files"]
    on_disk = {p.name for p in (tmp_path / "step_00000005").iterdir()} - {"manifest.json"}
    assert set(manifest) == on_disk


def test_full_disk_during_save_removes_the_partial_save_and_keeps_the_previous(tmp_path):
    names, error = run_world(save_steps_worker, 1, str(tmp_path), 5, 3, 3)[0]
    # step 3's save failed before publishing: its temporary directory is gone, steps 1-2 are untouched
    assert names == ["latest", "step_00000001", "step_00000002"]
    assert "no space left on device while saving checkpoint step_00000003" in error
    assert "meta.json" in error and f"previous checkpoint {tmp_path / 'step_00000002'} is kept" in error
    assert (tmp_path / "latest").read_text().strip() == "step_00000002"
    loaded = run_world(resume_step_worker, 1, str(tmp_path))[0]
    assert loaded == 2


def resume_step_worker(ckpt_dir):
    from training.checkpoint import Checkpointer

    cfg = tiny_config()
    engine = build_engine(cfg)
    saver = Checkpointer(cfg, ckpt_dir, engine)
    return saver.load(saver.find_resumable())["step"]


def test_saved_tensors_are_the_global_single_process_tensors(tmp_path):
    """A tp=2 x pp=2 checkpoint, read without any process group, holds the single-process model's tensors.

    Saved before the first step: after one, AdamW's first update is +-lr wherever |g| >> eps, so an
    element whose gradient is ~0 can flip on 1e-7 rounding (the training curves are compared elsewhere).
    """
    run_world(checkpoint_worker, 4, ["parallel.tp=2", "parallel.pp=2"], "fresh", 0, str(tmp_path))
    run_world(checkpoint_worker, 1, [], "fresh", 0, str(tmp_path / "single"))
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "step_00000000", tmp_path / "tp2.pt")
    dcp_to_torch_save(tmp_path / "single" / "step_00000000", tmp_path / "tp1.pt")
    tp2, tp1 = torch.load(tmp_path / "tp2.pt"), torch.load(tmp_path / "tp1.pt")
    assert tp2.keys() == tp1.keys()
    assert tp1["model.layers.0.attn.qkv.weight"].shape == (3, 64, 64)
    for key in tp1:
        assert torch.equal(tp2[key], tp1[key]), key


def one_rank_disk_full_worker(ckpt_dir):
    """Rank 1's RNG file hits a full disk while saving step 2: every rank must get the error, none may hang."""
    import errno

    import torch.distributed as dist

    import training.checkpoint as ck

    cfg = tiny_config("checkpoint.keep_last=3")
    engine = build_engine(cfg)
    saver = ck.Checkpointer(cfg, ckpt_dir, engine)
    real = ck.torch.save

    def full(obj, f, *a, **k):
        if engine.step == 2 and dist.get_rank() == 1 and "rng_rank" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real(obj, f, *a, **k)

    ck.torch.save = full
    try:
        for step in range(2):
            engine.train_step(batch_fn(engine, step))
            try:
                saver.save(engine.step, 0)
            except ck.CheckpointError as e:
                return str(e)
    finally:
        ck.torch.save = real
    return None


def test_full_disk_on_one_rank_fails_every_rank_and_keeps_the_previous(tmp_path):
    errors = run_world(one_rank_disk_full_worker, 2, str(tmp_path), timeout=120)
    for e in errors:
        assert e is not None and "no space left on device while saving checkpoint step_00000002" in e
        assert "rng_rank00001.pt" in e and "step_00000001 is kept" in e
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]


def test_a_full_disk_behind_dcps_wrapped_short_write_is_named(tmp_path, monkeypatch):
    """A disk that fills during DCP's write reaches the saver as ``CheckpointException ranks:dict_keys([0])`` around
    torch's zip writer's ``RuntimeError: ... unexpected pos N vs M`` (no ENOSPC left in it; seen on a full tmpfs):
    the error names the full disk and the directory, from the free space there when the save failed."""
    import shutil
    import traceback
    from collections import namedtuple

    from torch.distributed.checkpoint.api import CheckpointException

    import training.checkpoint as ck

    inner = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    wrapped = CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (inner, traceback.StackSummary())})
    tmp = tmp_path / "ckpt" / ".step_00000002.tmp"
    tmp.mkdir(parents=True)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2**30, 2**30 - 4096, 4096))
    msg = ck._save_error(wrapped, tmp)
    assert msg.startswith("no space left on device while saving checkpoint step_00000002") and str(tmp.parent) in msg
    assert "unexpected pos" in msg and "ranks:dict_keys" not in msg, msg
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2**30, 2**29, 2**29))  # space again: a short write
    msg = ck._save_error(wrapped, tmp)
    assert "was cut short" in msg and str(tmp) in msg and "ranks:dict_keys" not in msg, msg


def _full_tmpfs_worker(mount_point):
    from training.checkpoint import Checkpointer, CheckpointError

    cfg = tiny_config()
    engine = build_engine(cfg)
    engine.train_step(batch_fn(engine, 0))
    try:
        Checkpointer(cfg, str(Path(mount_point) / "ckpt"), engine).save(1, 8)
    except CheckpointError as e:
        return str(e)
    return None


def test_a_really_full_filesystem_is_named(tmp_path):
    """The same on a real 300 KiB tmpfs (root only: skipped where mounting is not allowed)."""
    import subprocess

    point = tmp_path / "full"
    point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(point)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN)")
    try:
        error = run_world(_full_tmpfs_worker, 1, str(point), timeout=120)[0]
        assert error is not None and "no space left on device while saving checkpoint step_00000001" in error, error
        assert str(point / "ckpt") in error and "\n" not in error
        assert sorted(p.name for p in (point / "ckpt").iterdir()) == [], "the partial save is removed"
    finally:
        subprocess.run(["umount", str(point)], capture_output=True)
