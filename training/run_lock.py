"""One trainer per run directory: an exclusive lock that a dead holder never leaves stuck.

Two trainers writing one run or checkpoint directory (a double submission, a requeued
job overlapping the old one) would delete each other's saves in progress, mix their
checkpoints and interleave metrics.jsonl. The trainer therefore locks each directory
it writes before touching anything in it.

A lock is the file ``<dir>/.trainer.lock``:

* held with ``flock`` (the kernel, or the NFS/Lustre lock manager, drops it when the
  holding process dies, however it dies), and
* holding a JSON record of the holder (host, pid, SLURM job id, since), so that a
  refused trainer can say who has the directory.

Where the file system has no ``flock`` (ENOLCK/EOPNOTSUPP/ENOSYS, e.g. Lustre mounted
without ``-o flock``), the file's existence is the lock (created with O_EXCL); a file
left by a holder whose pid is dead on this same host is stale and taken over, and one
left by a process on another host is reported with its path, to be removed by hand
once that job is known to be gone.

Releasing removes the file (while still holding the lock), so a finished run leaves
nothing behind.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

LOCK_NAME = ".trainer.lock"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunLockError(RuntimeError):
    """The directory is in use by another trainer, or a lock cannot be taken there."""


def holder_record() -> Dict[str, object]:
    """Who this process is, as written into the lock file."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def describe(holder: Optional[Dict[str, object]]) -> str:
    if not holder:
        return "an unknown process (the lock file is empty or unreadable)"
    job = holder.get("slurm_job_id")
    return (f"host {holder.get('host')}, pid {holder.get('pid')}, "
            f"SLURM job {job if job else 'none'}, since {holder.get('since')}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _read(path: Path) -> Optional[Dict[str, object]]:
    try:
        data = json.loads(path.read_text() or "null")
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


class _DirLock:
    """The lock on one directory."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.path = self.dir / LOCK_NAME
        self.fd: Optional[int] = None

    def _in_use(self, holder: Optional[Dict[str, object]]) -> RunLockError:
        note = ""
        if holder and holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", -1))):
            note = " - that pid is gone, so a process it started may still hold the lock"
        return RunLockError(f"{self.dir} is in use by another trainer ({describe(holder)}{note}; lock file {self.path}). "
                            "Wait for it to end or cancel it; two trainers on one directory destroy each other's "
                            "checkpoints")

    def acquire(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for _ in range(10):  # retried only if the file was replaced between open and flock
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    raise self._in_use(_read(self.path)) from None
                except OSError as e:
                    os.close(fd)
                    if e.errno not in _NO_FLOCK:
                        raise
                    self._acquire_without_flock()
                    return
                if os.fstat(fd).st_ino != _inode(self.path):  # released and removed by its holder meanwhile
                    os.close(fd)
                    continue
                self.fd = fd
                self._write_holder(fd)
                return
            raise RunLockError(f"could not take the lock {self.path}: it keeps being replaced")
        except RunLockError:
            raise
        except OSError as e:
            raise RunLockError(f"cannot write in {self.dir} ({e.strerror}; {e.filename or self.path}): "
                               "the directory must be writable") from None

    def _acquire_without_flock(self) -> None:
        """File-existence lock for file systems without flock; stale when its pid is dead on this host."""
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = _read(self.path)
                if (holder and holder.get("host") == socket.gethostname()
                        and not _pid_alive(int(holder.get("pid", -1)))):
                    print(f"[lock] removing the stale lock {self.path} of a dead process ({describe(holder)})",
                          flush=True)
                    self.path.unlink(missing_ok=True)
                    continue
                raise self._in_use(holder) from None
            self.fd = fd
            self._write_holder(fd)
            return
        raise self._in_use(_read(self.path))

    @staticmethod
    def _write_holder(fd: int) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder_record()).encode() + b"\n", 0)
        os.fsync(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if _inode(self.path) == os.fstat(self.fd).st_ino:
                self.path.unlink()  # still holding it: nobody can have taken it in between
        except OSError:
            pass
        finally:
            os.close(self.fd)  # drops the flock
            self.fd = None


def _inode(path: Path) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


class RunLock:
    """Exclusive locks on several directories (run dir, checkpoint dir), taken in order, all or none."""

    def __init__(self, directories: Sequence[Path]):
        unique: List[Path] = []
        for d in directories:
            d = Path(os.path.abspath(d))
            if d not in unique:
                unique.append(d)
        self.locks = [_DirLock(d) for d in unique]

    def acquire(self) -> "RunLock":
        taken = []
        try:
            for lock in self.locks:
                lock.acquire()
                taken.append(lock)
        except BaseException:
            for lock in reversed(taken):
                lock.release()
            raise
        return self

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
