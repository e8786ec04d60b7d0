"""train.py end to end on the bundled sample corpus (CPU, fp32): in subprocesses (``python train.py``, torchrun, srun's
environment) where the launch is what a test is about (the default job, a dying rank without a launcher agent, the
launchers); elsewhere ``train.main`` on a rank forked by tests/dist_harness.py (``run_forked``; a fresh interpreter
costs ~3 CPU-s of imports), a process of its own that a test can signal, and a reference run two tests share is made
once (a module fixture)."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAST = ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.seq_len=64", "train.micro_batch_size=4",
        "train.global_batch_size=8", "logging.interval=1", "train.eval_interval=0", "logging.wandb.mode=disabled",
        "train.warmup_steps=2"]


def train_cmd(*args, launcher=(sys.executable,)):
    return [*launcher, str(ROOT / "train.py"), *args]


def run_train(*args, timeout=300, env=None, launcher=(sys.executable,)):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(train_cmd(*args, launcher=launcher), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def run_forked(*args, timeout=300):
    """``python train.py args`` from the repository root, as ``train.main`` on one rank forked by tests/dist_harness.py
    with torchrun's environment (world size 1), for tests that are not about the launch: (exit code, stdout, stderr)
    as a CompletedProcess."""
    from tests.dist_harness import run_world, train_main

    [(code, out, err)] = run_world(train_main, 1, list(args), str(ROOT), timeout=timeout,
                                   env={"OMP_NUM_THREADS": "1"})
    return subprocess.CompletedProcess(["train.py", *args], code, out, err)


def records(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses_by_step(run_dir):
    """Last logged loss of each step, and every step that was logged twice (re-run after a resume)."""
    out, repeats = {}, {}
    for r in records(run_dir):
        if "loss" in r:
            if r["step"] in out:
                repeats.setdefault(r["step"], [out[r["step"]]]).append(r["loss"])
            out[r["step"]] = r["loss"]
    return out, repeats


def assert_same_curve(got, ref, rtol):
    assert sorted(got) == sorted(ref), f"logged steps differ: {sorted(got)} vs {sorted(ref)}"
    for step in ref:
        assert abs(got[step] - ref[step]) <= rtol * abs(ref[step]), f"step {step}: {got[step]} vs {ref[step]}"


def test_default_job_learns_and_writes_metrics_wandb_and_checkpoint(tmp_path):
    """``python train.py`` with the default config (the tiny model), shortened to 30 steps: on CPU the loss falls from
    8.20 at step 5 to 6.72 at step 30 (60 steps cost twice the CPU time for the same checks)."""
    run_dir = tmp_path / "run"
    p = run_train(f"logging.run_dir={run_dir}", "train.max_steps=30", "logging.interval=5",
                  "train.eval_interval=15", "logging.wandb.mode=offline", env={"WANDB_SILENT": "true"})
    assert p.returncode == 0, p.stderr[-3000:]
    recs = records(run_dir)
    train = [r for r in recs if "loss" in r]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "peak_mem_bytes",
                "comm"):
        assert all(key in r for r in train), key
    assert train[-1]["loss"] < train[0]["loss"] - 1.0, [r["loss"] for r in train]
    assert train[0]["tokens_per_s"] > 0 and train[0]["peak_mem_bytes"] > 0
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in val] == [15, 30] and val[1]["val_loss"] < val[0]["val_loss"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000030"
    assert list((run_dir / "wandb").glob("offline-run-*")), "no wandb offline run under the run dir"
    assert "step     30" in p.stdout and "validation loss" in p.stdout


def _wait_for_step(run_dir, step, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r.get("step", 0) >= step for r in records(run_dir)):
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached")


RESUME_STEPS = 12
RESUME_COMMON = FAST + [f"train.max_steps={RESUME_STEPS}", "checkpoint.interval=4"]


@pytest.fixture(scope="module")
def uninterrupted_losses(tmp_path_factory):
    """The losses of the uninterrupted run both interruptions are compared with (made once)."""
    ref_dir = tmp_path_factory.mktemp("uninterrupted")
    p = run_forked(*RESUME_COMMON, f"logging.run_dir={ref_dir}")
    assert p.returncode == 0, p.stderr[-3000:]
    return losses_by_step(ref_dir)[0]


def _train_main_telling_its_pid(pid_file, args):
    """train.main on a forked rank (tests/dist_harness.py) that first writes its process id, for a test to signal."""
    from tests.dist_harness import train_main

    Path(pid_file).write_text(str(os.getpid()))
    return train_main(args, str(ROOT))


def assert_kill_9_resumes_exactly(tmp_path, common, layout, world: int = 2) -> None:
    """train.main on ``world`` forked ranks (``common + layout``, 9 steps, a checkpoint every 3): an uninterrupted
    run in ``tmp_path/straight``; SIGKILL to one rank once step 4 is logged ends the job; the resumed run (same
    layout) logs the uninterrupted run's losses, and its step-6 checkpoint continued at one process (``common``
    alone) stays on the same curve."""
    from tests.dist_harness import run_world

    args, env = common + layout, {"OMP_NUM_THREADS": "1"}

    def run(ranks: int, given, run_dir) -> None:
        for code, _, err in run_world(_train_main_telling_its_pid, ranks, str(tmp_path / "pid"),
                                      given + [f"logging.run_dir={run_dir}"], timeout=300, env=env):
            assert code == 0, err[-3000:]

    run(world, args, tmp_path / "straight")
    ref, _ = losses_by_step(tmp_path / "straight")
    run_dir, outcome = tmp_path / "run", {}

    def interrupted():
        try:
            run_world(_train_main_telling_its_pid, world, str(tmp_path / "pid"),
                      args + [f"logging.run_dir={run_dir}"], timeout=300, env=env)
        except AssertionError as e:  # a rank died: run_world says so
            outcome["died"] = str(e)

    thread = threading.Thread(target=interrupted)
    thread.start()
    deadline = time.time() + 120
    while not any(r.get("step", 0) >= 4 for r in records(run_dir)):
        assert thread.is_alive() and time.time() < deadline, f"step 4 not reached: {outcome}"
        time.sleep(0.02)
    os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)
    thread.join(120)
    assert "died" in outcome, outcome
    assert max(losses_by_step(run_dir)[0]) < 9, "the run finished before the kill"
    run(world, args, run_dir)
    got, _ = losses_by_step(run_dir)
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-6), step
    one = tmp_path / "one"  # the checkpoint of step 6 continued at one process
    (one / "checkpoints").mkdir(parents=True)
    os.symlink(run_dir / "checkpoints" / "step_00000006", one / "checkpoints" / "step_00000006")
    (one / "checkpoints" / "latest").write_text("step_00000006\n")
    run(1, common, one)
    cont, _ = losses_by_step(one)
    for step in (7, 8, 9):
        assert cont[step] == pytest.approx(ref[step], rel=1e-5), step


@pytest.mark.parametrize("how", ["sigterm", "crash"])
def test_interrupted_run_resumes_with_identical_losses(tmp_path, how, uninterrupted_losses):
    """Every run is train.main on a forked rank (a process of its own: the interrupted one gets a real SIGTERM or
    SIGKILL at step 6); the uninterrupted reference is made once for both."""
    from tests.dist_harness import run_world

    steps, common, ref = RESUME_STEPS, RESUME_COMMON, uninterrupted_losses
    run_dir, pid_file, outcome = tmp_path / "run", tmp_path / "pid", {}

    def interrupted():
        try:
            outcome["ranks"] = run_world(_train_main_telling_its_pid, 1, str(pid_file),
                                         [*common, f"logging.run_dir={run_dir}"], timeout=300,
                                         env={"OMP_NUM_THREADS": "1"})
        except AssertionError as e:  # the rank died (SIGKILL): run_world says so
            outcome["died"] = str(e)

    thread = threading.Thread(target=interrupted)
    thread.start()
    deadline = time.time() + 120
    while not any(r.get("step", 0) >= 6 for r in records(run_dir)):
        assert thread.is_alive() and time.time() < deadline, f"step 6 not reached: {outcome}"
        time.sleep(0.05)
    os.kill(int(pid_file.read_text()), signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    thread.join(120)
    if how == "sigterm":
        assert "ranks" in outcome, outcome
        code, out, err = outcome["ranks"][0]
        assert code == 0, err[-3000:]
        assert "(signal)" in out
    else:
        assert "died with exit codes [-9]" in outcome.get("died", ""), outcome
    before, _ = losses_by_step(run_dir)
    stopped_at = max(before)
    assert stopped_at < steps, "the run finished before the interruption; make it longer"

    p = run_forked(*common, f"logging.run_dir={run_dir}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout
    got, repeats = losses_by_step(run_dir)
    assert_same_curve(got, ref, rtol=1e-6)
    assert not repeats, "steps re-run after the resume are logged once"
    resumed_at = int(re.search(r"resumed from \S+ at step (\d+)", p.stdout).group(1))
    rerun = [s for s in before if s > resumed_at]  # logged after the checkpoint it resumed from: run again
    for step in rerun:  # ... on the same data and weights
        assert abs(got[step] - before[step]) <= 1e-6 * abs(before[step]), (step, got[step], before[step])
    if how == "crash":
        assert rerun, "a crash after the last checkpoint should re-run some steps"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_env(rank, world, port):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world),
            "SLURM_LOCALID": str(rank), "SLURM_TASKS_PER_NODE": str(world), "SLURM_JOB_NODELIST": "localhost",
            "MASTER_PORT": str(port)}


def test_a_dying_rank_ends_the_job(tmp_path):
    """No launcher agent to clean up (srun-style): the survivor must fail by itself, promptly."""
    run_dir, port = tmp_path / "run", _free_port()
    procs = [subprocess.Popen(train_cmd(*FAST, "train.max_steps=100000", f"logging.run_dir={run_dir}"), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=slurm_env(r, 2, port))
             for r in range(2)]
    _wait_for_step(run_dir, 3, procs[0])
    procs[1].kill()
    t0 = time.time()
    _, err = procs[0].communicate(timeout=120)
    assert procs[0].returncode not in (0, None)
    assert time.time() - t0 < 60
    assert "Connection closed by peer" in err or "remote worker" in err, err[-2000:]


DP_COMMON = FAST + ["train.max_steps=6", "checkpoint.interval=0"]


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory):
    """The losses of the one-process run both launchers' two-rank runs are compared with (made once)."""
    ref_dir = tmp_path_factory.mktemp("one_process")
    p = run_forked(*DP_COMMON, f"logging.run_dir={ref_dir}")
    assert p.returncode == 0, p.stderr[-3000:]
    return losses_by_step(ref_dir)[0]


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_two_data_parallel_processes_match_one(tmp_path, launcher, one_process_losses):
    """Two ranks started by the launcher (torchrun, or two processes with srun's environment) against the same job on
    one rank (train.main on a forked rank)."""
    common, dp_dir = DP_COMMON, tmp_path / "dp"
    args = (*common, f"logging.run_dir={dp_dir}")
    if launcher == "torchrun":
        p = run_train(*args, launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc-per-node", "2"))
        assert p.returncode == 0, p.stderr[-3000:]
    else:
        port = _free_port()
        procs = [subprocess.Popen(train_cmd(*args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=slurm_env(r, 2, port)) for r in range(2)]
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
    got, _ = losses_by_step(dp_dir)
    assert_same_curve(got, one_process_losses, rtol=1e-5)
    # the ledger counts the bucketed gradient all-reduce: 2 (g-1)/g x 4 bytes x parameters, g = 2
    from config import load_config
    from model.flops import parameter_count

    n_params = parameter_count(load_config(None, common).model)["total"]
    rec = [r for r in records(dp_dir) if "loss" in r][-1]
    assert rec["comm"]["by_group"]["dp"] == 4 * n_params
    assert rec["comm"]["by_kind_link"]["all_reduce/intra"] >= 4 * n_params


def test_time_limit_stops_and_saves(tmp_path):
    run_dir = tmp_path / "run"
    p = run_forked(*FAST, "train.max_steps=1000", "train.time_limit_minutes=0.0001", f"logging.run_dir={run_dir}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "(time_limit)" in p.stdout
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_00000001"


def test_fp16_overflow_is_logged_and_training_continues(tmp_path):
    run_dir = tmp_path / "run"
    p = run_forked(*FAST, "precision=fp16", "loss_scale.initial=1e12", "train.max_steps=30",
                   f"logging.run_dir={run_dir}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step 1: non-finite gradients" in p.stdout and "step skipped; loss scale 1e+12 -> 5e+11" in p.stdout
    last = [r for r in records(run_dir) if "loss" in r][-1]
    assert 0 < last["skipped_steps"] < 30 and last["loss_scale"] < 1e12
