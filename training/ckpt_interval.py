"""``checkpoint.interval=auto``: the checkpoint interval from the failure rate (Young/Daly).

With a mean time between failures M (``checkpoint.mtbf_hours``, of the whole job) and a checkpoint that costs the
training C seconds (the measured save stall: what the loop waits for a save, the staging copy and any wait for the
previous write under ``checkpoint.async_save``; plus, under async_save, what the write cost the steps it ran beside:
their time above the median step without a write, ``Saver.write_overhead_s`` -- on a CPU the writer takes cores
from the training, and a save every step or two would keep one always in flight), the expected time lost per unit of time is C / T for the saves plus
T / (2 M) for the work redone after a failure (half an interval on average); it is least at Young's interval

    T = sqrt(2 C M)

(Daly's refinement, sqrt(2 C M) - C for C << M, differs by C: nothing at these ratios). In steps: T / step time,
rounded, at least 1. The first save comes after the first step (it measures C); after every save C and the step time
are measured again and the interval follows them. Rank 0 decides and every rank saves at the steps it names.
"""
from __future__ import annotations

import math
from typing import Optional

CHANGE = 0.2
"""A new interval is said (one line) when it differs from the last said by more than this fraction."""


def young_daly_steps(save_stall_s: float, mtbf_s: float, step_time_s: float) -> int:
    """Young's optimal interval sqrt(2 C M) in steps of ``step_time_s``, rounded, at least 1."""
    if step_time_s <= 0 or not math.isfinite(step_time_s):
        return 1
    return max(1, round(math.sqrt(2.0 * max(save_stall_s, 0.0) * mtbf_s) / step_time_s))


class AutoInterval:
    """The interval in steps, recomputed from each save's stall and the step time measured between saves."""

    def __init__(self, mtbf_hours: float):
        self.mtbf_s = mtbf_hours * 3600.0
        self.steps: Optional[int] = None
        """The interval chosen last (None: no save measured yet)."""
        self._said: Optional[int] = None

    def update(self, save_stall_s: float, step_time_s: float, write_overhead_s: float = 0.0) -> Optional[str]:
        """Choose the interval from a save's stall (plus, under async_save, the last write's overhead on the steps
        beside it) and the step time; returns the line to print when it changed materially (first choice, or more
        than ``CHANGE`` from the last said), else None."""
        cost = max(save_stall_s, 0.0) + max(write_overhead_s, 0.0)
        self.steps = young_daly_steps(cost, self.mtbf_s, step_time_s)
        if self._said is not None and abs(self.steps - self._said) <= CHANGE * self._said:
            return None
        self._said = self.steps
        seconds = math.sqrt(2.0 * cost * self.mtbf_s)
        what = (f"save stall {save_stall_s:.3g} s" if not write_overhead_s else
                f"save cost {cost:.3g} s = stall {save_stall_s:.3g} s + the write's {write_overhead_s:.3g} s on the "
                "steps beside it")
        return (f"[checkpoint] interval auto: every {self.steps} steps (Young/Daly: sqrt(2 x {what} x MTBF "
                f"{self.mtbf_s / 3600:g} h) = {seconds:.4g} s, over a step time of {step_time_s:.3g} s)")
