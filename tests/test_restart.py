"""Restarts inside one launch (issue 55, item 2): a rank killed mid-run restarts the whole group from the newest
checkpoint and the run ends on the uninterrupted curve; restarts used up end the job with one line.

The kills are ``GPT_FAULTS`` (training/faults.py): the rank SIGKILLs itself at the start of a step, in the first
attempt only (or in every attempt). The reference curve is an uninterrupted run of the same layout on ranks forked by
tests/dist_harness.py; the launches under test are real ones (torchrun's agent; ``python train.py``'s supervisor),
since the launch is what is tested.
"""
import re
import sys
import time

import pytest

from parallel.restart import EXIT_PEER, attempt, needs_supervisor
from tests.test_train_e2e import FAST, ROOT, losses_by_step, records, run_train

STEPS = ["train.max_steps=6", "checkpoint.interval=2"]


def _kill_times(stderr: str):
    return [float(t) for t in re.findall(r"\[fault\] kill rank \d+ step \d+ attempt \d+ at ([\d.]+)", stderr)]


def test_a_killed_rank_restarts_the_group_and_ends_on_the_uninterrupted_curve(tmp_path):
    """2 ranks under torchrun, train.max_restarts=2 (torchrun --max-restarts 2): rank 1 is SIGKILLed at the start
    of step 5 in the first attempt. torchrun's agent ends rank 0 (which stops waiting at once: SIGTERM cuts its roll
    call short), starts both again (TORCHELASTIC_RESTART_COUNT=1), they resume from the newest checkpoint in the same
    launch and log steps 5-6 with restarts=1; every step's loss is the uninterrupted 2-rank run's."""
    from tests.dist_harness import run_world, train_main

    ref_dir = tmp_path / "ref"
    [(c0, _, e0), (c1, _, _)] = run_world(train_main, 2, FAST + STEPS + [f"logging.run_dir={ref_dir}"], str(ROOT),
                                          env={"OMP_NUM_THREADS": "1"})
    assert c0 == c1 == 0, e0
    reference, _ = losses_by_step(ref_dir)
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]

    run_dir = tmp_path / "run"
    began = time.monotonic()
    p = run_train(*FAST, *STEPS, "train.max_restarts=2", f"logging.run_dir={run_dir}", timeout=240,
                  env={"GPT_FAULTS": "kill:rank=1:step=5"},
                  launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "--max-restarts", "2"))
    assert p.returncode == 0, p.stderr[-4000:]
    [killed_at] = _kill_times(p.stderr)
    assert "[train] restart 1 of 2 inside this launch (a rank died): resumed at step 4" in p.stdout, p.stdout
    losses, _ = losses_by_step(run_dir)
    assert sorted(losses) == sorted(reference)
    assert losses == pytest.approx(reference, rel=1e-5), (losses, reference)
    train = [r for r in records(run_dir) if "loss" in r]
    assert [(r["step"], r["restarts"]) for r in train] == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 1)]
    resumed = next(r for r in train if r["step"] == 5)["time"]
    print(f"[test_restart] kill to the resumed step 5: {resumed - killed_at:.1f} s (job {time.monotonic() - began:.0f}"
          " s in all, 2 ranks under torchrun)")


def test_restarts_used_up_end_the_job_with_one_line(tmp_path):
    """``python train.py train.max_restarts=2`` (one process: it supervises the trainer as its child) with the
    trainer SIGKILLed as it starts step 1 in every attempt: two restarts, then the third kill ends the job with one
    error line and the status of the last failure (128 + SIGKILL)."""
    run_dir = tmp_path / "run"
    p = run_train(*FAST, "train.max_steps=2", "train.max_restarts=2", f"logging.run_dir={run_dir}", timeout=240,
                  env={"GPT_FAULTS": "kill:rank=0:step=1:attempt=every"})
    assert p.returncode == 128 + 9, (p.returncode, p.stderr[-3000:])
    assert len(_kill_times(p.stderr)) == 3, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, p.stderr
    assert re.fullmatch(r"error: the trainer failed 3 times in \d+ s \(last: killed by SIGKILL\); "
                        r"train.max_restarts=2 restarts used up", errors[0]), errors[0]
    assert "[train] restart 1 of 2" in p.stdout and "[train] restart 2 of 2" in p.stdout, p.stdout
    assert not records(run_dir)


def test_who_restarts():
    assert attempt(5, {}) == (0, 5)
    assert attempt(5, {"TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3"}) == (2, 3)
    assert needs_supervisor(2, {}) and not needs_supervisor(0, {})
    assert not needs_supervisor(2, {"RANK": "0", "WORLD_SIZE": "2"})  # torchrun's agent restarts
    assert not needs_supervisor(2, {"SLURM_PROCID": "0", "SLURM_NTASKS": "8"})  # the batch script restarts
    assert needs_supervisor(2, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})  # one task: the process itself
    assert not needs_supervisor(2, {"TORCHELASTIC_RESTART_COUNT": "1"})  # the supervised child
    assert EXIT_PEER not in (0, 2)


@pytest.mark.parametrize("value", ["kill", "kill:rank=1", "explode:rank=0:step=1", "kill:rank=0:step=0",
                                   "slow:rank=0:step=1:seconds=x", "kill:rank=0:step=1:when=now"])
def test_a_malformed_fault_is_named(value):
    from parallel.launch import LaunchError
    from training.faults import parse

    with pytest.raises(LaunchError, match="GPT_FAULTS"):
        parse(value)
