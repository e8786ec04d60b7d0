"""Where the suite's time goes: per test, its wall time, the CPU time the machine spent meanwhile and the
processes it started.

``GPT_SUITE_CLOCK=DIR python -m pytest -n 0`` (one test at a time, so the machine's CPU time is the test's own,
its child processes included) appends one JSON line per test to ``DIR/<worker>.jsonl``;
``python tests/suite_clock.py DIR`` prints the tests by wall time with their CPU time, the share of the
cores that stood idle (waiting: sleeps, timeouts, rendezvous, I/O) and the ``run_world`` ranks and
subprocesses each started, then the totals by file. Under ``-n 2`` the CPU column mixes both workers' tests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict

import pytest

_STARTED = {"subprocesses": 0}


def machine_cpu_seconds() -> float:
    """CPU time (all cores, busy states) the machine has spent since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class Clock:
    """The pytest plugin (registered by tests/conftest.py when GPT_SUITE_CLOCK is set)."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.path = os.path.join(directory, f"{worker}.jsonl")
        original = subprocess.Popen.__init__

        def counting_init(popen, *args, **kwargs):
            _STARTED["subprocesses"] += 1
            original(popen, *args, **kwargs)

        subprocess.Popen.__init__ = counting_init

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        from tests import dist_harness

        wall0, cpu0 = time.perf_counter(), machine_cpu_seconds()
        sub0, ranks0 = _STARTED["subprocesses"], dist_harness.STARTED["ranks"]
        yield
        record = {
            "test": item.nodeid,
            "wall": time.perf_counter() - wall0,
            "cpu": machine_cpu_seconds() - cpu0,
            "subprocesses": _STARTED["subprocesses"] - sub0,
            "ranks": dist_harness.STARTED["ranks"] - ranks0,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def report(directory: str, top: int = 40) -> None:
    rows = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                rows += [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise SystemExit(f"no records in {directory}")
    cores = os.cpu_count() or 1

    def line(wall: float, cpu: float, ranks: int, subprocesses: int) -> str:
        idle = 1 - cpu / max(wall * cores, 1e-9)
        return f"{wall:7.1f} {cpu:7.1f} {idle:5.0%} {ranks:5d} {subprocesses:4d}"

    def total(group: list) -> str:
        return line(*(sum(r[k] for r in group) for k in ("wall", "cpu", "ranks", "subprocesses")))

    rows.sort(key=lambda r: -r["wall"])
    print(f"{'wall s':>7} {'cpu s':>7} {'idle':>5} {'ranks':>5} {'subp':>4}  test   ({cores} cores)")
    for r in rows[:top]:
        print(f"{total([r])}  {r['test']}")
    by_file = defaultdict(list)
    for r in rows:
        by_file[r["test"].split("::")[0]].append(r)
    print(f"\n{'wall s':>7} {'cpu s':>7} {'idle':>5} {'ranks':>5} {'subp':>4} {'tests':>5}  file")
    for name, group in sorted(by_file.items(), key=lambda kv: -sum(r["wall"] for r in kv[1])):
        print(f"{total(group)} {len(group):5d}  {name}")
    print(f"\n{total(rows)} {len(rows):5d}  all")


if __name__ == "__main__":
    report(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
