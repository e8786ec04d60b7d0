"""Faults on purpose, for the tests of restarts, stragglers and hangs: ``GPT_FAULTS`` (unset in real runs).

A comma-separated list of ``ACTION:rank=R:step=S[:seconds=X][:attempt=A|every]``, acted on at the start of step S
(``slow``: of every step from S on) by rank R, in launch attempt A (``TORCHELASTIC_RESTART_COUNT``; default 0, the
first launch only, so the restarted group does not die again; ``every``: in every attempt):

* ``kill``   the rank SIGKILLs itself (a node or process lost: no error, no message from it);
* ``freeze`` the rank sleeps for ever (a hang: its peers wait in their next collective);
* ``slow``   the rank sleeps X seconds in each step (a straggler).

Before acting it prints ``[fault] ACTION rank R step S attempt A at T`` (T: time.time()) to stderr. A malformed
value is a LaunchError naming it (exit 2), found at start-up.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

from parallel.launch import LaunchError

ACTIONS = ("kill", "freeze", "slow")


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int
    step: int
    seconds: float = 0.0
    attempt: Optional[int] = 0
    """None: every attempt."""


def parse(text: Optional[str]) -> List[Fault]:
    faults = []
    for item in filter(None, (text or "").split(",")):
        action, *fields = item.strip().split(":")
        try:
            kv = dict(f.split("=", 1) for f in fields)
            attempt = kv.pop("attempt", "0")
            fault = Fault(action, int(kv.pop("rank")), int(kv.pop("step")), float(kv.pop("seconds", 0)),
                          None if attempt == "every" else int(attempt))
        except (ValueError, KeyError):
            fault = None
        if fault is None or action not in ACTIONS or kv or fault.step < 1:
            raise LaunchError(f"GPT_FAULTS={text!r}: {item!r} is not ACTION:rank=R:step=S[:seconds=X]"
                              f"[:attempt=A|every] with ACTION one of {', '.join(ACTIONS)}")
        faults.append(fault)
    return faults


class Faults:
    def __init__(self, rank: int, attempt: int, env=None):
        env = os.environ if env is None else env
        self.rank, self.attempt = rank, attempt
        self.mine = [f for f in parse(env.get("GPT_FAULTS")) if f.rank == rank and f.attempt in (None, attempt)]

    def step(self, step: int) -> None:
        for f in self.mine:
            if step == f.step or (f.action == "slow" and step > f.step):
                if f.action != "slow" or step == f.step:
                    print(f"[fault] {f.action} rank {self.rank} step {step} attempt {self.attempt} at "
                          f"{time.time():.3f}", file=sys.stderr, flush=True)
                if f.action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif f.action == "freeze":
                    while True:
                        time.sleep(3600)
                else:
                    time.sleep(f.seconds)
