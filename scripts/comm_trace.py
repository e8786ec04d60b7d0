"""Where a step waits: a summary of the trace ``GPT_COMM_TRACE=DIR`` writes (``parallel/comm.py``).

Every rank appends to ``DIR/rank<R>.jsonl``: each call through the communication door (its launch time, and
for a synchronous one its duration), each wait on a handle (start, end, and whether the main thread waited:
ZeRO++'s two-hop gathers are launched and waited on by a thread of their own, ``zeropp.HopRunner``) and the
engine's phase marks (forward_backward, finish_grads, scalars, step, loop). For each rank this prints the
median time per step of each phase and the main thread's waits by phase and collective; with ``--cores C``
also the cores left idle per step, found by sweeping all ranks' waits together (when more than ``ranks - C``
ranks wait at once, a core has nothing to run; each idle interval is charged to the collectives waited on).
Use it with ``scripts/bench_cluster.py`` (whose workers inherit the environment):

    GPT_COMM_TRACE=/tmp/trace python scripts/bench_cluster.py --rows zeropp --steps 12 --no-unshaped
    python scripts/comm_trace.py /tmp/trace --cores 2

A rank killed mid-write can leave a torn last line: it is skipped with a warning. Bad input (no such
directory, no rank*.jsonl in it, a file that is binary, not JSON lines or not trace events, before its last
line) exits 2 with a one-line error naming the file and line.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import statistics
import sys
from typing import Callable, Dict, List, Tuple

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # _cli beside this file, however it is loaded
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import json_line, parsed_lines  # noqa: E402


class TraceError(ValueError):
    """Bad input: reported as one line and exit code 2."""


def warn(message: str) -> None:
    print(f"comm_trace.py: {message}", file=sys.stderr, flush=True)


_LENGTHS = {"mark": 3, "call": 7, "wait": 6}  # the fewest fields of each kind of event (parallel/comm.py)
_TIMES = {"mark": (2,), "call": (4, 5), "wait": (4, 5)}  # the fields that are times (seconds)


def parse_event(line: bytes) -> list:
    """One line of a rank's trace as an event; ValueError saying what is wrong with it."""
    event = json_line(line)
    kind = event[0] if isinstance(event, list) and event else None
    if not isinstance(kind, str) or kind not in _LENGTHS:
        raise ValueError(f"not a trace event: expected [\"mark\" | \"call\" | \"wait\", ...], got {line.decode().strip()[:60]}")
    if len(event) < _LENGTHS[kind]:
        raise ValueError(f"a {kind!r} event has {len(event)} fields, expected at least {_LENGTHS[kind]}")
    for i in _TIMES[kind]:
        if isinstance(event[i], bool) or not isinstance(event[i], (int, float)):
            raise ValueError(f"field {i} of a {kind!r} event is a time, got {event[i]!r:.40}")
    return event


def load_rank(path: str, on_warning: Callable[[str], None] = warn) -> List[list]:
    """The events of one rank's trace. A bad last line after good events is what a rank killed mid-write
    leaves: skipped, with a warning through ``on_warning``. A bad line anywhere else, or a file without a good
    event, is a TraceError naming the file (and line)."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as e:
        raise TraceError(f"{path}: cannot be read ({e.strerror})") from None
    events = list(parsed_lines(lines, parse_event, path, TraceError, "skipped the torn last line, what a rank killed "
                               "mid-write leaves ({e}); using the {n} events before it", on_warning))
    if not events:
        raise TraceError(f"{path}: empty file, no trace events")
    return events


def load(directory: str, on_warning: Callable[[str], None] = warn) -> Dict[str, List[list]]:
    if not os.path.exists(directory):
        raise TraceError(f"{directory}: no such directory")
    if not os.path.isdir(directory):
        raise TraceError(f"{directory} is not a directory (give the directory GPT_COMM_TRACE named)")
    files = sorted(glob.glob(os.path.join(glob.escape(directory), "rank*.jsonl")))
    if not files:
        raise TraceError(f"no rank*.jsonl in {directory} (was GPT_COMM_TRACE set for the run?)")
    return {os.path.basename(f)[:-len(".jsonl")]: load_rank(f, on_warning) for f in files}


def step_starts(events: List[list]) -> List[float]:
    return [e[2] for e in events if e[0] == "mark" and e[1] == "forward_backward"]


def blocking(events: List[list]) -> List[Tuple[float, float, str]]:
    """The main thread's blocked intervals: waits on handles and synchronous calls, (start, end, what)."""
    out = []
    for e in events:
        if e[0] == "wait" and (len(e) < 7 or e[6]):
            out.append((e[4], e[5], f"{e[1]}/{e[2]}"))
        elif e[0] == "call" and not e[6]:
            out.append((e[4], e[5], f"{e[1]}/{e[2]} (sync)"))
    return out


def per_rank(name: str, events: List[list], skip: int) -> None:
    starts = step_starts(events)[skip:]
    steps = list(zip(starts, starts[1:]))
    if not steps:
        print(f"{name}: fewer than {skip + 2} steps traced")
        return
    marks = [(e[1], e[2]) for e in events if e[0] == "mark"]
    phases: Dict[str, List[float]] = collections.defaultdict(list)
    waits: Dict[Tuple[str, str], float] = collections.defaultdict(float)
    spans = blocking(events)
    for a, b in steps:
        inside = [(label, t) for label, t in marks if a <= t < b] + [("end", b)]
        for (label, t), (_, t2) in zip(inside, inside[1:]):
            phases[label].append(t2 - t)
        for s, e, what in spans:
            if a <= s < b:
                phase = [label for label, t in inside if t <= s][-1]
                waits[(phase, what)] += e - s
    n = len(steps)
    print(f"{name}: {n} steps, {statistics.median(b - a for a, b in steps) * 1e3:.0f} ms a step (median); phases: "
          + ", ".join(f"{k} {statistics.median(v) * 1e3:.0f}" for k, v in phases.items()) + " ms")
    for (phase, what), v in sorted(waits.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {v / n * 1e3:7.1f} ms a step waiting in {phase}: {what}")


def idle_cores(ranks: Dict[str, List[list]], cores: int, skip: int) -> None:
    first = ranks[sorted(ranks)[0]]
    starts = step_starts(first)[skip:]
    if len(starts) < 2:
        return
    a, b = starts[0], starts[-1]
    spans = [(s, e, what) for ev in ranks.values() for s, e, what in blocking(ev) if e > a and s < b]
    points = sorted({a, b} | {x for s, e, _ in spans for x in (s, e) if a < x < b})
    idle, by = 0.0, collections.defaultdict(float)
    for t0, t1 in zip(points, points[1:]):
        mid = (t0 + t1) / 2
        waiting = [what for s, e, what in spans if s <= mid < e]
        free = cores - (len(ranks) - len(waiting))
        if free > 0:
            idle += (t1 - t0) * free
            for what in waiting:
                by[what] += (t1 - t0) * free / len(waiting)
    n = len(starts) - 1
    print(f"idle cores: {idle / n:.3f} core-s a step of {cores * (b - a) / n:.3f} ({idle / (cores * (b - a)):.0%}), "
          "charged to:")
    for what, v in sorted(by.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {v / n * 1e3:7.1f} ms  {what}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory")
    p.add_argument("--skip", type=int, default=3, help="steps left out at the start (warm-up)")
    p.add_argument("--cores", type=int, help="cores the ranks shared: also report the idle cores per step")
    args = p.parse_args(argv)
    if args.skip < 0:
        p.error(f"--skip must be 0 or more, got {args.skip}")
    if args.cores is not None and args.cores < 1:
        p.error(f"--cores must be at least 1, got {args.cores}")
    warnings: List[str] = []  # printed after the summary, so that an error stays the only line
    try:
        ranks = load(args.directory, warnings.append)
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for warning in warnings:
        warn(warning)
    for name, events in ranks.items():
        per_rank(name, events, args.skip)
    if args.cores:
        idle_cores(ranks, args.cores, args.skip)
    return 0


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
