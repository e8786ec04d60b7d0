"""Run a function on N local processes joined by gloo, as a test would on a cluster.

``run_world(fn, world_size, *args)`` starts ranks from a forkserver that has torch
pre-imported (cheap starts), hosts the rendezvous store in the parent on a free port
chosen by the OS, and returns each rank's return value. It fails instead of hanging:
a rank that raises or dies ends the whole world at once (its traceback in the error),
and a world that has not finished by ``timeout`` seconds is killed and reported as a
deadlock, naming the ranks still running. Collectives inside also carry a timeout.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

_CTX = None
PRELOAD = ["torch", "torch.distributed", "numpy", "torch._dynamo", "training.trainer", "tests.parallel_utils"]
"""Imported once by the forkserver, so each rank it forks starts with them: the project's modules and torch's
(``torch._dynamo`` is what torch.optim imports on the first optimizer) took each rank ~1 s of CPU to import
anew, the largest cost of a small world (measured with tests/suite_clock.py)."""
STARTED = {"ranks": 0}
"""Ranks this process has started (tests/suite_clock.py reports them per test)."""


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def _worker(fn, rank, world_size, port, args, env, results, collective_timeout):
    try:
        os.environ.update(env)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=collective_timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout))
        out = fn(*args)
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
        if dist.is_initialized():  # the trainer destroys it itself (train_main)
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1)


def run_world(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
              env: Optional[Dict[str, str]] = None, collective_timeout: float = 60.0) -> List[Any]:
    ctx = _context()
    STARTED["ranks"] += world_size
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn, r, world_size, store.port, args, dict(env or {}), results, collective_timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    time.sleep(0.5)  # give its traceback a moment to arrive
                    while not results.empty():
                        rank, status, payload = results.get()
                        if status == "error":
                            raise AssertionError(f"rank {rank} failed:\n{payload}")
                    raise AssertionError(f"rank(s) {dead} died with exit codes "
                                         f"{[procs[r].exitcode for r in dead]} and no traceback")
                if time.monotonic() > deadline:
                    running = [r for r in range(world_size) if r not in outputs]
                    raise TimeoutError(f"deadlock or hang: rank(s) {running} of {world_size} did not finish "
                                       f"within {timeout:.0f} s")
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
    return [outputs[r] for r in range(world_size)]


def train_main(args: List[str], cwd: Optional[str] = None) -> tuple:
    """``train.py args`` on a rank of ``run_world``: what torchrun runs on each rank, minus a fresh interpreter
    (each would import torch and the project anew, ~3 CPU-s). The launch environment is torchrun's variables
    (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) and the default group already exists,
    so the trainer's launch code reads the same environment and skips only its own rendezvous. Runs in ``cwd``
    if given; returns ``(exit code of train.main, stdout, stderr)`` of this rank."""
    import sys
    import tempfile

    import train

    if cwd is not None:
        os.chdir(cwd)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        streams = ((sys.stdout, 1, out), (sys.stderr, 2, err))
        saved = []
        for stream, fd, file in streams:
            stream.flush()
            saved.append(os.dup(fd))
            os.dup2(file.fileno(), fd)
        try:
            code = train.main(list(args))
        finally:
            for (stream, fd, _), old in zip(streams, saved):
                stream.flush()
                os.dup2(old, fd)
                os.close(old)
        out.seek(0)
        err.seek(0)
        return code, out.read(), err.read()
