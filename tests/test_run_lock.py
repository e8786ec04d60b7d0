"""training/run_lock.py: one holder at a time, a named holder, and no lock left stuck by a dead one."""
import errno
import json
import os
import socket
import subprocess
import sys

import pytest

from training import run_lock
from training.run_lock import LOCK_NAME, RunLock, RunLockError


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_second_holder_is_refused_with_host_pid_and_job(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    first = RunLock([tmp_path / "run", tmp_path / "ckpt"]).acquire()
    holder = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and holder["slurm_job_id"] == "777"
    with pytest.raises(RunLockError) as info:
        RunLock([tmp_path / "run"]).acquire()
    msg = str(info.value)
    assert str(tmp_path / "run") in msg and f"host {socket.gethostname()}, pid {os.getpid()}, SLURM job 777" in msg
    # all or none: failing on the second directory releases the first
    with pytest.raises(RunLockError):
        RunLock([tmp_path / "other", tmp_path / "ckpt"]).acquire()
    RunLock([tmp_path / "other"]).acquire().release()
    first.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists() and not (tmp_path / "ckpt" / LOCK_NAME).exists()
    RunLock([tmp_path / "run", tmp_path / "ckpt"]).acquire().release()


def test_a_killed_holder_does_not_leave_the_lock_stuck(tmp_path):
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from training.run_lock import RunLock; "
            "RunLock([sys.argv[2]]).acquire(); print('locked', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, os.getcwd(), str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockError, match=f"pid {holder.pid}"):
            RunLock([tmp_path]).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / LOCK_NAME).exists()  # SIGKILL left the file, but not the lock
    RunLock([tmp_path]).acquire().release()


def no_flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")


def test_without_flock_a_stale_file_of_a_dead_pid_is_taken_over(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid(), "slurm_job_id": None}))
    lock = RunLock([tmp_path]).acquire()
    assert "removing the stale lock" in capsys.readouterr().out
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    with pytest.raises(RunLockError, match="in use by another trainer"):
        RunLock([tmp_path]).acquire()  # a live holder is respected
    lock.release()
    assert not lock_file.exists()


def test_without_flock_a_file_from_another_host_is_respected(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "node-elsewhere", "pid": dead_pid(), "slurm_job_id": "9"}))
    with pytest.raises(RunLockError, match="host node-elsewhere, pid .*, SLURM job 9"):
        RunLock([tmp_path]).acquire()
