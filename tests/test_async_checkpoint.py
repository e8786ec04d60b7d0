"""Asynchronous checkpoints (checkpoint.async_save) and the checkpoint interval from the failure rate
(checkpoint.interval=auto), against the synchronous save as the reference: the same bytes in every layout, the same
resumed run, nothing older lost when the process dies at any point of a write, bad settings refused in one line."""
import json
import os
import signal
import threading
from pathlib import Path

import pytest

import train
from tests.dist_harness import run_world, train_main
from tests.test_failures import fails_with
from tests import test_reliability
from tests.test_train_e2e import FAST, ROOT, losses_by_step, run_forked
from training.checkpoint_files import verify
from training.ckpt_interval import AutoInterval, young_daly_steps

unwritable_dir = test_reliability.unwritable_dir  # (a fixture: a directory nobody may write into)

QWZ, HPZ, QGZ = "zero.quantized_weights=true", "zero.hpz_size=2", "zero.quantized_gradients=true"
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden=32", "model.moe.bias_update_rate=0.01"]
LAYOUTS = {  # 4 ranks each, the layouts the reliability tests resume in
    "zero1_tp2": ["zero.stage=1", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "zero2_pp2": ["zero.stage=2", "parallel.pp=2", "zero.partition=whole_tensor"],
    "zero3_tp2_pp2": ["zero.stage=3", "parallel.tp=2", "parallel.pp=2"],
    "stage0_tp2_pp2": ["parallel.tp=2", "parallel.pp=2"],
    "zeropp_2x2": ["parallel.ranks_per_node=2", "model.tie_embeddings=true", "zero.stage=3", QWZ, HPZ, QGZ],
    "fp8lm_zero1": ["precision=fp8", "zero.stage=1"],
    "ep2_zero1": MOE + ["parallel.ep=2", "zero.stage=1"],
    "cp2_zero3": ["parallel.cp=2", "zero.stage=3"],
}


def _digests(step_dir: Path) -> dict:
    """Every file's sha256 from the manifest; DCP's .metadata as what it says of the tensors and where they are (it
    also holds its path and a random save id); meta.json without its time."""
    from torch.distributed.checkpoint import FileSystemReader

    files = json.loads((step_dir / "manifest.json").read_text())["files"]
    dcp_meta = FileSystemReader(str(step_dir)).read_metadata()
    meta = json.loads((step_dir / "meta.json").read_text())
    meta.pop("time")
    return {"files": {k: v["sha256"] for k, v in files.items() if k not in ("meta.json", ".metadata")},
            "tensors": repr(sorted(dcp_meta.state_dict_metadata.items())),
            "where": repr(sorted(dcp_meta.storage_data.items(), key=repr)), "meta": meta}


def layouts_worker(root: str, names):
    """Per layout: 2 steps, a synchronous save of step 2 (the reference), then an asynchronous save of step 2 whose
    writer is held until the training thread has taken step 3 (so the write runs beside a step that changes every
    tensor it writes), then the end of the write. Rank 0 returns both checkpoints' digests and 'latest'."""
    from tests.parallel_utils import batch_fn, build_engine, tiny_config
    from training import checkpoint_publish
    from training.async_checkpoint import Saver
    from training.checkpoint import Checkpointer
    from training.memory import checkpoint_staging_bytes

    gate = threading.Event()
    checkpoint_publish.reached = lambda point: gate.wait() if point == "staged" else None
    out = {}
    for name in names:
        cfg = tiny_config(*LAYOUTS[name], "checkpoint.async_save=true")
        engine = build_engine(cfg)
        for step in range(2):
            engine.train_step(batch_fn(engine, step))
        sync_dir, async_dir = Path(root) / name / "sync", Path(root) / name / "async"
        Checkpointer(cfg, str(sync_dir), engine).save(2, 16)
        gate.clear()
        saver = Saver(cfg, Checkpointer(cfg, str(async_dir), engine), engine.mesh)
        saver.save(2, 16)
        assert not (async_dir / "latest").exists()  # (the writer waits at the gate)
        engine.train_step(batch_fn(engine, 2))
        gate.set()
        saver.finish()
        if engine.mesh.rank == 0:
            out[name] = (_digests(sync_dir / "step_00000002"), _digests(async_dir / "step_00000002"),
                         (async_dir / "latest").read_text().strip(), verify(async_dir / "step_00000002"),
                         saver.staging.nbytes(), checkpoint_staging_bytes(cfg, engine.mesh.layout, 0))
    return out


def test_async_save_writes_the_synchronous_bytes_in_every_layout(tmp_path):
    """The checkpoint written while the next step runs is byte for byte the synchronous save of the same step (the
    tensors, the RNG files, meta.json), so it resumes as that one does (tests/test_zero_checkpoint.py,
    test_zeropp.py, test_fp8_e2e.py, test_moe_train.py, test_context_train.py resume those bit for bit). The
    memory estimate counts the staging copy rank 0 keeps (training/memory.py, within 1%: it counts ZeRO's shard
    padding, not the few bytes of FP8 scaling states and expert biases)."""
    got = run_world(layouts_worker, 4, str(tmp_path), list(LAYOUTS), timeout=600)[0]
    assert sorted(got) == sorted(LAYOUTS)
    for name, (sync, written, latest, problem, staged, estimate) in got.items():
        assert written == sync, name
        assert latest == "step_00000002" and problem is None, (name, latest, problem)
        assert abs(staged - estimate) <= 0.01 * estimate, (name, staged, estimate)  # (ZeRO pads its shards)


def _waiting_in(thread_id: int, function: str) -> bool:
    """Whether the thread is (somewhere down its stack) inside ``function`` now."""
    import sys

    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def one_in_flight_worker(root: str):
    """The first write is held until the training thread is seen waiting for it in the second save; returns, for
    each write, what 'latest' named when its writer started."""
    import time

    from tests.parallel_utils import batch_fn, build_engine, tiny_config
    from training import checkpoint_publish
    from training.async_checkpoint import Saver
    from training.checkpoint import Checkpointer

    gate, seen = threading.Event(), []
    latest = Path(root) / "latest"

    def reached(point: str) -> None:
        if point == "staged":
            seen.append(latest.read_text().strip() if latest.exists() else None)
            if len(seen) == 1:
                gate.wait()

    checkpoint_publish.reached = reached
    cfg = tiny_config("checkpoint.async_save=true")
    engine = build_engine(cfg)
    saver = Saver(cfg, Checkpointer(cfg, root, engine), engine.mesh)
    engine.train_step(batch_fn(engine, 0))
    saver.save(1, 8)
    engine.train_step(batch_fn(engine, 1))  # while step 1's write is held
    me = threading.get_ident()

    def release() -> None:  # once the training thread waits for the held write (its stack says so), let it go
        while not _waiting_in(me, "_collect"):
            time.sleep(0.01)
        gate.set()

    threading.Thread(target=release, daemon=True).start()
    saver.save(2, 16)
    saver.finish()
    return seen, latest.read_text().strip()


def test_the_next_save_waits_for_the_write_in_flight(tmp_path):
    seen, latest = run_world(one_in_flight_worker, 1, str(tmp_path))[0]
    assert seen == [None, "step_00000001"], seen  # the second writer started after the first had published
    assert latest == "step_00000002" and verify(tmp_path / "step_00000001") is None


# -- the trainer: resume, failures, crashes -------------------------------------------------------------------------
COMMON = FAST + ["train.max_steps=6", "checkpoint.interval=2", "train.decay_steps=8"]  # (the schedule of 8 steps)


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """The synchronous reference: 8 steps, a checkpoint every 2 (keeps 6 and 8); its step-2 and step-6 digests."""
    run_dir = tmp_path_factory.mktemp("sync")
    p = run_forked(*FAST, "train.max_steps=8", "checkpoint.interval=2", "train.decay_steps=8", "checkpoint.keep_last=4",
                   f"logging.run_dir={run_dir}")
    assert p.returncode == 0, p.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    return losses_by_step(run_dir)[0], {s: _without_meta(_digests(ckpts / f"step_{s:08d}")) for s in (2, 4, 6, 8)}


def _without_meta(digests: dict) -> dict:
    """(meta.json records the run's settings: max_steps, async_save)"""
    return {k: v for k, v in digests.items() if k != "meta"}


def test_async_run_saves_and_resumes_like_the_synchronous_one(tmp_path, sync_run):
    ref, digests = sync_run
    run_dir = tmp_path / "run"
    p = run_forked(*COMMON, "checkpoint.async_save=true", f"logging.run_dir={run_dir}")
    assert p.returncode == 0, p.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    assert sorted(q.name for q in ckpts.iterdir() if not q.name.startswith(".trainer")) == \
        ["latest", "step_00000004", "step_00000006"]  # published, pruned, no temporary directory left
    assert (ckpts / "latest").read_text().strip() == "step_00000006"  # the final save was waited for
    for step in (4, 6):
        assert _without_meta(_digests(ckpts / f"step_{step:08d}")) == digests[step], step
    p = run_forked(*COMMON, "train.max_steps=8", "checkpoint.async_save=true", f"logging.run_dir={run_dir}")
    assert p.returncode == 0 and "resumed from" in p.stdout, p.stderr[-3000:]
    got, _ = losses_by_step(run_dir)
    assert got == ref  # bit for bit
    assert _without_meta(_digests(ckpts / "step_00000008")) == digests[8]


def test_sigterm_ends_with_a_published_async_save(tmp_path):
    """SIGTERM once step 3 is logged (checkpoint.interval=0: the exit save is the only one): exit code 0, and the
    exit save's write was waited for: 'latest' names the step the run stopped at, complete and verified (a daemon
    writer thread not waited for would die with the process)."""
    import time

    from tests.test_train_e2e import _train_main_telling_its_pid, records

    run_dir, pid_file, outcome = tmp_path / "run", tmp_path / "pid", {}
    args = [*FAST, "train.max_steps=1000", "checkpoint.interval=0", "checkpoint.async_save=true",
            f"logging.run_dir={run_dir}"]

    def interrupted():
        outcome["ranks"] = run_world(_train_main_telling_its_pid, 1, str(pid_file), args, timeout=300,
                                     env={"OMP_NUM_THREADS": "1"})

    thread = threading.Thread(target=interrupted)
    thread.start()
    deadline = time.time() + 120
    while not any(r.get("step", 0) >= 3 for r in records(run_dir)):
        assert thread.is_alive() and time.time() < deadline, f"step 3 not reached: {outcome}"
        time.sleep(0.05)
    os.kill(int(pid_file.read_text()), signal.SIGTERM)
    thread.join(120)
    code, out, err = outcome["ranks"][0]
    assert code == 0 and "(signal)" in out, err[-3000:]
    stopped = max(r["step"] for r in records(run_dir) if "loss" in r)
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{stopped:08d}"
    assert verify(ckpts / f"step_{stopped:08d}") is None


def _train_killed_at(point: str, nth: int, args):
    """train.main on a forked rank whose process is killed (SIGKILL, from the writer thread) the ``nth`` time a save
    reaches ``point`` (training/checkpoint_publish.py ``reached``)."""
    from training import checkpoint_publish

    seen = []

    def reached(at: str) -> None:
        if at == point:
            seen.append(at)
            if len(seen) == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_publish.reached = reached
    return train_main(args, str(ROOT))


@pytest.mark.parametrize("point", ["staged", "written", "manifest", "published"])
def test_kill_9_during_an_async_write_loses_nothing_older(tmp_path, sync_run, point):
    """The process (with its writer thread) dies at a point of the step-4 write: 'latest' names a complete, verified
    checkpoint, step 2 is the reference's byte for byte, and the run resumes onto the uninterrupted curve."""
    ref, digests = sync_run
    run_dir = tmp_path / "run"
    with pytest.raises(AssertionError, match=r"died with exit codes \[-9\]"):
        run_world(_train_killed_at, 1, point, 2, [*COMMON, "checkpoint.async_save=true", "checkpoint.keep_last=4",
                                                  f"logging.run_dir={run_dir}"], timeout=300,
                  env={"OMP_NUM_THREADS": "1"})
    ckpts = run_dir / "checkpoints"
    latest = (ckpts / "latest").read_text().strip()
    assert latest == "step_00000002", latest  # 'latest' moves only after the rename, which comes last
    assert verify(ckpts / latest) is None
    assert _without_meta(_digests(ckpts / "step_00000002")) == digests[2]
    if point == "published":  # renamed before it died: complete, and the newest a resume finds
        assert verify(ckpts / "step_00000004") is None
        assert _without_meta(_digests(ckpts / "step_00000004")) == digests[4]
    else:
        assert not (ckpts / "step_00000004").exists()
    p = run_forked(*COMMON, "checkpoint.async_save=true", f"logging.run_dir={run_dir}")
    assert p.returncode == 0, p.stderr[-3000:]
    resumed_at = 4 if point == "published" else 2
    assert f"step_{resumed_at:08d} at step {resumed_at}" in p.stdout, p.stdout
    assert not list(ckpts.glob(".step_*.tmp")), "the dead write's temporary directory is removed"
    got, _ = losses_by_step(run_dir)
    assert {s: got[s] for s in range(1, 7)} == {s: ref[s] for s in range(1, 7)}


def test_a_failed_async_write_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch):
    """A full disk while the writer writes step 4's RNG file: exit 2 with the synchronous save's one line, and the
    directory holds step 2 as 'latest' and nothing partial."""
    import errno

    import torch

    real, saves = torch.save, []

    def full(obj, f, *a, **k):
        if "rng_rank" in str(f):
            saves.append(f)
            if len(saves) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full)
    run_dir = tmp_path / "run"
    err = fails_with(capsys, *COMMON, "checkpoint.async_save=true", f"logging.run_dir={run_dir}")
    assert err.count("\n") == 1 and "no space left on device while saving checkpoint step_00000004" in err, err
    assert f"previous checkpoint {run_dir / 'checkpoints' / 'step_00000002'} is kept" in err, err
    ckpts = run_dir / "checkpoints"
    assert sorted(q.name for q in ckpts.iterdir() if not q.name.startswith(".trainer")) == \
        ["latest", "step_00000002"]
    assert (ckpts / "latest").read_text().strip() == "step_00000002" and verify(ckpts / "step_00000002") is None


# -- bad settings ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,expected", [
    (["checkpoint.interval=auto"], "checkpoint.interval=auto needs checkpoint.mtbf_hours"),
    (["checkpoint.interval=auto", "checkpoint.mtbf_hours=0"], "checkpoint.mtbf_hours=0.0 must be a finite"),
    (["checkpoint.interval=auto", "checkpoint.mtbf_hours=-2"], "checkpoint.mtbf_hours=-2.0 must be"),
    (["checkpoint.interval=auto", "checkpoint.mtbf_hours=inf"], "checkpoint.mtbf_hours=inf must be"),
    (["checkpoint.mtbf_hours=24"], "is read only with checkpoint.interval=auto"),
    (["checkpoint.interval=often"], "checkpoint.interval='often' must be a number of steps >= 0 or auto"),
    (["checkpoint.interval=-1"], "checkpoint.interval=-1 must be >= 0"),
    (["checkpoint.async_save=maybe"], "checkpoint.async_save"),
])
def test_bad_checkpoint_settings_are_one_line(tmp_path, capsys, args, expected):
    err = fails_with(capsys, *FAST, f"logging.run_dir={tmp_path / 'run'}", *args)
    assert err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "run").exists()


def test_async_save_into_an_unwritable_directory_is_refused_at_start(tmp_path, capsys, unwritable_dir):
    err = fails_with(capsys, *FAST, "train.max_steps=2", "checkpoint.async_save=true",
                     f"logging.run_dir={tmp_path / 'run'}", f"checkpoint.dir={unwritable_dir}")
    assert err.count("\n") == 1 and f"cannot write in {unwritable_dir}" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# -- interval=auto ---------------------------------------------------------------------------------------------------
def test_young_daly_interval():
    # sqrt(2 x 2 s x 3600 s) = 120 s: 240 steps of 0.5 s; 1 h of MTBF and 0.05 s saves: 18.97 s, 19 steps of 1 s
    assert young_daly_steps(2.0, 3600.0, 0.5) == 240
    assert young_daly_steps(0.05, 3600.0, 1.0) == 19
    assert young_daly_steps(0.001, 1.0, 10.0) == 1  # at least one step
    auto = AutoInterval(mtbf_hours=1.0)
    assert "every 240 steps" in auto.update(2.0, 0.5) and "MTBF 1 h" in auto.update(2.0, 0.25)  # 480: said
    assert auto.update(2.2, 0.25) is None and auto.steps == 503  # within 20% of 480: not said again
    assert "every 240 steps" in auto.update(2.0, 0.5)


@pytest.mark.parametrize("mtbf,saved", [("1e-9", [2, 3, 4, 5, 6]), ("1000", [2, 6])])
def test_auto_interval_saves_at_the_steps_it_says(tmp_path, capsys, mtbf, saved):
    """A tiny MTBF gives the 1-step floor (a save after every step from the second on), a long one an interval
    beyond the run (the first save after step 2, then the one at exit); the line says what and why."""
    run_dir = tmp_path / "run"
    rc = train.main([*FAST, "train.max_steps=6", "checkpoint.interval=auto", f"checkpoint.mtbf_hours={mtbf}",
                     "checkpoint.keep_last=10", "checkpoint.async_save=true", f"logging.run_dir={run_dir}"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = [x for x in out.splitlines() if x.startswith("[checkpoint] interval auto: every ")]
    assert lines and "Young/Daly" in lines[0] and f"MTBF {float(mtbf):g} h" in lines[0], out
    steps = int(lines[0].split("every ")[1].split()[0])
    assert steps == 1 if saved[1] == 3 else steps > 4, lines
    assert sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")) == saved


def test_auto_interval_counts_the_write_beside_the_steps(monkeypatch):
    """interval=auto under async_save: a checkpoint's cost is its stall plus what its write cost the steps beside
    it (their time above the median step without a write); Young/Daly then spaces the saves by that cost."""
    import training.async_checkpoint as ac

    auto = AutoInterval(mtbf_hours=1.0)
    line = auto.update(0.2, 1.0, 7.8)  # cost 8 s: sqrt(2 x 8 x 3600) = 240 s = 240 steps of 1 s
    assert auto.steps == 240 and "save cost 8 s = stall 0.2 s + the write's 7.8 s" in line
    saver = ac.Saver.__new__(ac.Saver)  # the step accounting alone (no mesh: poll stubbed)
    saver.__dict__.update(_last=None, _step_times=[], _writing=False, _clean=[], write_overhead_s=0.0, auto=auto,
                          next_save=None, every=0, _thread=None)
    saver.poll = lambda: None
    clock = iter([0.0, 1.0, 2.0, 3.0, 4.5, 6.5, 7.5])
    monkeypatch.setattr(ac.time, "perf_counter", lambda: next(clock))
    for step in range(4):  # steps of 1 s, no write
        saver.due(step)
    saver._thread, saver._writing = object(), True  # a write starts beside the step now running
    saver.due(4)  # that step took 1.5 s: 0.5 s above the clean median
    saver.due(5)  # still writing: 2.0 s, 1.0 s above
    saver._thread = None  # the write finished during this step (poll saw it)
    saver.due(6)
    assert saver.write_overhead_s == pytest.approx(1.5) and saver._step_times == [1.0, 1.0, 1.0]


def test_a_lost_peer_abandons_the_write_in_flight():
    """After a failed collective (a peer died) the writers' own collectives wait for the same dead rank: leaving
    must not join the writer (measured: 30 s of torchrun's grace lost per fault in scripts/bench_goodput.py)."""
    import threading

    import training.async_checkpoint as ac

    release = threading.Event()
    stuck = threading.Thread(target=release.wait, daemon=True)
    stuck.start()
    saver = ac.Saver.__new__(ac.Saver)
    saver._thread = stuck
    saver.close(peer_lost=True)  # returns at once
    assert saver._thread is None and stuck.is_alive()
    release.set()
    saver._thread = stuck
    saver.close()  # any other error: the write is let finish
    assert not stuck.is_alive()
