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
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
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

        wall0, cpu0, own0, sub0 = (time.perf_counter(), machine_cpu_seconds(), os.times(),
                                   _STARTED["subprocesses"])
        worlds0 = dict(dist_harness.STARTED)
        yield
        own1 = os.times()
        record = {
            "test": item.nodeid,
            "wall": time.perf_counter() - wall0,
            "cpu": machine_cpu_seconds() - cpu0,
            "own_cpu": (own1.user - own0.user) + (own1.system - own0.system),
            "subprocesses": _STARTED["subprocesses"] - sub0,
            "worlds": dist_harness.STARTED["worlds"] - worlds0["worlds"],
            "ranks": dist_harness.STARTED["ranks"] - worlds0["ranks"],
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
    rows.sort(key=lambda r: -r["wall"])
    print(f"{'wall s':>7} {'cpu s':>7} {'idle':>5} {'ranks':>5} {'subp':>4}  test   ({cores} cores)")
    for r in rows[:top]:
        idle = 1 - r["cpu"] / max(r["wall"] * cores, 1e-9)
        print(f"{r['wall']:7.1f} {r['cpu']:7.1f} {idle:5.0%} {r['ranks']:5d} {r['subprocesses']:4d}  {r['test']}")
    by_file = defaultdict(lambda: [0.0, 0.0, 0, 0, 0])
    for r in rows:
        f = by_file[r["test"].split("::")[0]]
        f[0] += r["wall"]; f[1] += r["cpu"]; f[2] += r["ranks"]; f[3] += r["subprocesses"]; f[4] += 1
    print(f"\n{'wall s':>7} {'cpu s':>7} {'idle':>5} {'ranks':>5} {'subp':>4} {'tests':>5}  file")
    for name, (w, c, k, s, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0]):
        print(f"{w:7.1f} {c:7.1f} {1 - c / max(w * cores, 1e-9):5.0%} {k:5d} {s:4d} {n:5d}  {name}")
    w = sum(r["wall"] for r in rows); c = sum(r["cpu"] for r in rows)
    print(f"\n{w:7.1f} {c:7.1f} {1 - c / max(w * cores, 1e-9):5.0%} "
          f"{sum(r['ranks'] for r in rows):5d} {sum(r['subprocesses'] for r in rows):4d} {len(rows):5d}  all")


if __name__ == "__main__":
    report(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
