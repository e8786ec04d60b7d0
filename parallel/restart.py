"""Restarts inside one launch: when a rank dies, the whole group starts again on the same nodes from the newest
checkpoint, at most ``train.max_restarts`` times, instead of ending the job (and waiting in SLURM's queue).

Who restarts depends on the launcher; each restarts processes, never in-process state (a restarted worker is a
fresh interpreter: nothing a dead group leaked, memory or a half-done collective, survives):

* ``python train.py`` (one process, no launcher): that process becomes a small supervisor (:func:`supervise`,
  no torch imported) that runs the trainer as its child and starts it again when it dies;
* ``torchrun --max-restarts N``: torchrun's agent (torchelastic) restarts all its workers when one fails;
* SLURM (``scripts/slurm/train.sbatch``): the batch script runs ``srun --kill-on-bad-exit=1`` again inside the
  allocation; SLURM kills the surviving ranks of the failed step at once (they are not waited on).

All three tell the trainer which attempt it is the way torchelastic does, ``TORCHELASTIC_RESTART_COUNT`` (0 on the
first launch) and ``TORCHELASTIC_MAX_RESTARTS``: :func:`attempt` reads them, and the trainer logs the restart and
records it as ``restarts`` in metrics.jsonl.

What is restarted: a rank killed by a signal, a collective that failed because a peer died or hung (exit 3,
``EXIT_PEER``), or any other crash. What is not: exit 0 (done, or stopped cleanly by a signal) and exit 2
(``EXIT_REFUSED``: a bad setting, data or checkpoint refused at start-up, divergence: the same input would fail the
same way again).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import List, Mapping, Optional, Tuple

EXIT_REFUSED = 2
"""A refusal (config, data, checkpoint, launch environment, divergence): restarting would fail the same way."""
EXIT_PEER = 3
"""A collective failed: a peer died, hung or timed out (``parallel.comm.CommError``): restart the group."""

COUNT, MAX = "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"


def attempt(max_restarts: int, env: Optional[Mapping[str, str]] = None) -> Tuple[int, int]:
    """(restarts so far, restarts allowed) of this launch: the launcher's ``TORCHELASTIC_*`` variables, else
    (0, ``max_restarts``) (a launch nobody restarts: the forked test harness, srun without the batch script)."""
    env = os.environ if env is None else env
    count = env.get(COUNT, "0")
    allowed = env.get(MAX, str(max_restarts))
    return (int(count) if count.isdigit() else 0), (int(allowed) if allowed.isdigit() else max_restarts)


def needs_supervisor(max_restarts: int, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this ``python train.py`` process is to supervise the trainer: restarts are asked for and nobody
    else restarts it (no torchrun/SLURM multi-rank launch around it, and it is not itself a supervised child)."""
    env = os.environ if env is None else env
    distributed = "RANK" in env or "WORLD_SIZE" in env or (
        "SLURM_PROCID" in env and env.get("SLURM_NTASKS", "1").isdigit() and int(env.get("SLURM_NTASKS", "1")) > 1)
    return max_restarts > 0 and COUNT not in env and not distributed


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return {EXIT_PEER: "exit 3: a collective failed (a peer died or hung)"}.get(code, f"exit {code}")


def supervise(argv: List[str], max_restarts: int, stop, script: str) -> int:
    """Run ``python script argv`` as a child and start it again when it dies (see the module docstring), at most
    ``max_restarts`` times. ``stop``: the StopFlag of this process; a SIGTERM/SIGUSR1 here is passed on to the
    child (which saves and exits 0) and nothing is restarted after it. Returns the exit code for the job: the
    child's; when the restarts are used up, one line says so and the code is the last failure's (128 + signal
    for a signal, as a shell reports it)."""
    began = time.monotonic()
    for count in range(max_restarts + 1):
        env = {**os.environ, COUNT: str(count), MAX: str(max_restarts)}
        child = subprocess.Popen([sys.executable, script, *argv], env=env)
        forwarded = None
        while True:
            try:
                code = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            except KeyboardInterrupt:  # Ctrl-C reached the child too (same process group): no restart after it
                code = child.wait()
                return code if code >= 0 else 128 - code
            if stop.signal and forwarded is None:  # pass the stop on: the trainer saves and exits 0
                forwarded = stop.signal
                child.send_signal(getattr(signal, forwarded))
        if code in (0, EXIT_REFUSED) or stop.signal:
            return code if code >= 0 else 128 - code
        if count < max_restarts:
            print(f"[restart] the trainer failed ({describe_exit(code)}): restart {count + 1} of "
                  f"train.max_restarts={max_restarts}, from the newest checkpoint", file=sys.stderr, flush=True)
    print(f"error: the trainer failed {max_restarts + 1} times in {time.monotonic() - began:.0f} s (last: "
          f"{describe_exit(code)}); train.max_restarts={max_restarts} restarts used up", file=sys.stderr, flush=True)
    return code if code > 0 else 128 - code
