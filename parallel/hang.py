"""Hangs named: when a collective times out, every rank writes its Python stack into the run directory.

A collective that times out already names the members that did not arrive (``parallel/comm.py``: each member
counts its collectives per group and checks in with the launcher's key-value store). What it cannot show is
*where* the missing rank is. So each rank runs a :class:`HangWatch`: a daemon thread that looks at the store
every ``POLL_S`` seconds for this attempt's alarm key. The first member whose collective times out (or sees a
peer close the connection) raises the alarm (:func:`alarm`, called by ``comm``); then every rank, the frozen
one included, writes the stacks of all its threads with ``faulthandler`` to ``<run_dir>/stacks/rank<R>.txt``,
headed by the step it was in. A rank still alive ``parallel.timeout_s + comm.ABSENT_GRACE_S + EXIT_GRACE_S`` seconds
after the alarm (the one that never arrived: the others have ended with their CommError by then) ends itself with exit
3, so the job ends even where no launcher agent kills it.

The watch is process-wide, like faulthandler and signal handlers are (one per process, registered by the trainer
with :func:`start`); the step label it keeps (:func:`at_step`) is what the job's one error line reports
(:func:`annotate`).

Limits: the thread needs the GIL, so a rank frozen inside C code that holds it (rare: gloo, NCCL and sleeps release
it) writes no stack; the key is polled (one ``check`` a second per rank on rank 0's store).
"""
from __future__ import annotations

import faulthandler
import os
import threading
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

POLL_S = 1.0
"""How often each rank looks for the alarm."""
EXIT_GRACE_S = 2.0
"""Beyond the collective timeout and the roll call, how long a rank outlives an alarm before ending itself."""
EXIT_HUNG = 3
"""The exit code of a rank that ends itself after an alarm (parallel/restart.py's EXIT_PEER: restartable)."""


class HangWatch:
    def __init__(self, run_dir: Path, rank: int, attempt: int, exit_after_s: float,
                 stopping: Optional[Callable[[], bool]] = None):
        self.dir, self.rank, self.exit_after_s, self.stopping = Path(run_dir) / "stacks", rank, exit_after_s, stopping
        self.key = f"gpt_hang/attempt{attempt}"  # a restarted group must not see the alarm of the one before
        self.step: Optional[int] = None
        self.dumped = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watch", daemon=True)
        self._thread.start()

    def path(self) -> Path:
        return self.dir / f"rank{self.rank}.txt"

    def dump(self, why: str) -> None:
        """Write this rank's stacks (all threads) once."""
        with self._lock:
            if self.dumped:
                return
            self.dumped = True
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                with open(self.path(), "w") as f:
                    f.write(f"rank {self.rank} (pid {os.getpid()}), step {self.step}: {why}\n")
                    f.flush()
                    faulthandler.dump_traceback(f, all_threads=True)
            except OSError:
                pass

    def raise_alarm(self, what: str) -> None:
        try:
            dist.distributed_c10d._get_default_store().set(self.key, what)
        except Exception:  # noqa: BLE001 - the store went with a dead rank: this rank still writes its own
            pass
        self.dump(f"a collective timed out here: {what}")

    def _watch(self) -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            while not self._stop.wait(POLL_S):
                if store.check([self.key]):
                    break
            else:
                return
            what = store.get(self.key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - no store (process group gone): nothing to watch
            return
        self.dump(f"alarm from another rank: {what}")
        if self._stop.wait(self.exit_after_s):
            return
        os._exit(EXIT_HUNG)  # still here: this rank is the one stuck (its peers have ended); end the job

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=POLL_S + 1)


_watch: Optional[HangWatch] = None


def start(run_dir: Path, rank: int, attempt: int, exit_after_s: float,
          stopping: Optional[Callable[[], bool]] = None) -> HangWatch:
    """Watch this rank. ``exit_after_s``: how long it may outlive an alarm (the collective timeout, the roll call
    and ``EXIT_GRACE_S``); ``stopping``: whether a stop signal arrived (see :func:`hurry`)."""
    global _watch
    stop()
    _watch = HangWatch(run_dir, rank, attempt, exit_after_s, stopping)
    return _watch


def stop() -> None:
    """End the watch (the run is over); it is kept for :func:`annotate`, which reads its step and stacks."""
    if _watch is not None:
        _watch.close()


def hurry() -> bool:
    """Whether a stop signal arrived (a launcher ending or restarting the group sends SIGTERM to the survivors):
    ``comm``'s roll call after a failed collective then ends at once instead of waiting out its grace."""
    return _watch is not None and _watch.stopping is not None and _watch.stopping()


def at_step(step: int) -> None:
    if _watch is not None:
        _watch.step = step


def alarm(what: str) -> None:
    """A collective timed out on this rank (``comm``): every rank writes its stack."""
    if _watch is not None:
        _watch.raise_alarm(what)


def annotate(message: str) -> str:
    """The job's error line for a failed collective, with the step and where the stacks are (the watch's last
    word: it is forgotten, so a later run in this process does not inherit it)."""
    global _watch
    watch, _watch = _watch, None
    if watch is None:
        return message
    step = f" in step {watch.step}" if watch.step is not None else ""
    stacks = f"; Python stacks of every rank in {watch.dir}/" if watch.dumped else ""
    return f"{message}{step}{stacks}"
