"""What the loop does for goodput beside training: restarts counted, stragglers and hangs named.

Four calls from ``training/trainer.py``: built once the run has resumed, ``step_began``/``step_ended`` around each
training step, ``record`` into each logged record, ``close`` at the end. The pieces:

* restarts: which attempt of the launch this is (``parallel/restart.py``), said once at the start of a restarted
  attempt and recorded as ``restarts`` in every metrics record;
* stragglers: ``training/straggler.py`` (``step_time_max_s``, ``step_time_median_s``, ``slowest_rank``);
* hangs: ``parallel/hang.py`` (every rank's Python stack in ``<run_dir>/stacks/`` when a collective times out);
* ``training/faults.py``: the faults the tests inject (``GPT_FAULTS``; nothing in a real run).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict

from parallel import comm, hang
from parallel.launch import read_launch_env
from parallel.restart import MAX, attempt
from training.faults import Faults
from training.straggler import StragglerWatch


class Goodput:
    def __init__(self, cfg, mesh, run_dir: Path, step: int, stop):
        main, launcher = mesh.rank == 0, read_launch_env().launcher
        self.attempt, self.allowed = attempt(cfg.train.max_restarts)
        self.faults = Faults(mesh.rank, self.attempt)
        self.straggler = StragglerWatch(cfg.logging.straggler_factor, mesh.world, main)
        self.hang = hang.start(run_dir, mesh.rank, self.attempt,
                               cfg.parallel.timeout_s + comm.ABSENT_GRACE_S + hang.EXIT_GRACE_S,
                               lambda: stop.signal is not None)
        if not main:
            return
        if self.attempt:
            print(f"[train] restart {self.attempt} of {self.allowed} inside this launch (a rank died): "
                  + (f"resumed at step {step}" if step else "no checkpoint yet, from step 0"), flush=True)
        wanted = cfg.train.max_restarts
        if launcher != "single" and wanted and MAX not in os.environ:
            print(f"[train] WARNING: train.max_restarts={wanted}, but nothing restarts this launch: launch with "
                  f"scripts/slurm/train.sbatch (which reads it) or torchrun --max-restarts {wanted}", flush=True)
        elif launcher == "torchrun" and wanted and self.allowed != wanted:
            print(f"[train] WARNING: train.max_restarts={wanted}, but torchrun restarts at most {self.allowed} times"
                  f" (--max-restarts {self.allowed}): under torchrun its agent decides", flush=True)

    def step_began(self, step: int) -> None:
        hang.at_step(step)
        self.straggler.step_began()
        self.faults.step(step)

    def step_ended(self) -> None:
        self.straggler.step_ended()

    def record(self, step: int) -> Dict[str, Any]:
        """Fields of the logged record (every rank calls it: the straggler times are gathered)."""
        return {"restarts": self.attempt, **self.straggler.record(step)}

    def close(self) -> None:
        hang.stop()
