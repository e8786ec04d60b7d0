"""Stragglers named: every ``logging.interval`` the slowest rank's step time against the median of all ranks'.

What is measured, per rank and step: the step's wall time (``Engine.train_step``, the fault hooks and, on CUDA,
the synchronize after it) less the time the main thread spent blocked in the communication door during it
(``parallel.comm.waited_s``: synchronous collectives, waits on their handles). In a synchronous step every rank
has the same wall time, the slow one's own work and the others' wait for it; what is left after taking the waits
out is the rank's own work, so the slow rank stands out. (On CUDA, NCCL returns before the transfer ends and the
wait lands in the synchronize: ranks then differ only by their host-side work. A device-side measure, CUDA events
around the compute as Megatron-LM's straggler detector has, is left for later.)

Every logging step each rank's mean over the window since the last one is gathered (control plane,
``comm.all_gather_object``: not counted in the step's ledger) and the record gets ``step_time_max_s``,
``step_time_median_s`` and ``slowest_rank``. *Persistently slower*: the same rank is the slowest and above
``logging.straggler_factor`` x the median in ``PATIENCE`` logging intervals in a row; rank 0 then prints one
warning line naming it and its host (once per streak: again only after it has recovered).
"""
from __future__ import annotations

import socket
import statistics
import time
from typing import Any, Dict, Optional

from parallel import comm

PATIENCE = 3
"""Logging intervals in a row a rank must be above the factor to be named."""


class StragglerWatch:
    def __init__(self, factor: float, world: comm.Group, main: bool):
        self.factor, self.world, self.main = factor, world, main
        self.host = socket.gethostname()
        self.own, self.steps = 0.0, 0
        self._t0 = self._w0 = 0.0
        self.suspect: Optional[int] = None
        self.streak = 0

    def step_began(self) -> None:
        self._t0, self._w0 = time.perf_counter(), comm.waited_s()

    def step_ended(self) -> None:
        self.own += max(0.0, (time.perf_counter() - self._t0) - (comm.waited_s() - self._w0))
        self.steps += 1

    def record(self, step: int) -> Dict[str, Any]:
        """Called on every rank at each logging step: the straggler fields of its record (rank 0 prints the
        warning)."""
        mine = self.own / self.steps if self.steps else 0.0
        self.own, self.steps = 0.0, 0
        rows = comm.all_gather_object((mine, self.host), self.world)
        times = [t for t, _ in rows]
        slowest = max(range(len(times)), key=times.__getitem__)
        median = statistics.median(times)
        slow = self.factor > 0 and times[slowest] > self.factor * median
        if slow and slowest == self.suspect:
            self.streak += 1
        else:
            self.suspect, self.streak = (slowest, 1) if slow else (None, 0)
        if self.main and self.streak == PATIENCE:
            print(f"[train] WARNING: straggler: rank {slowest} on {rows[slowest][1]} took {times[slowest]:.3f} s a "
                  f"step of its own work, {times[slowest] / median:.1f}x the median {median:.3f} s of all "
                  f"{len(times)} ranks, for {PATIENCE} logging intervals up to step {step} "
                  f"(logging.straggler_factor={self.factor:g})", flush=True)
        return {"step_time_max_s": times[slowest], "step_time_median_s": median, "slowest_rank": slowest}
