"""Goodput under faults: synchronous saves, asynchronous saves and the interval from the failure rate, side by side.

    python scripts/bench_goodput.py [--mtbf-minutes 3] [--steps 40] [--interval 10] [--seed 3] [key=value ...]

Three modes, one after the other in one invocation, on the same model, seed and fault schedule:

* ``sync``:  synchronous saves every ``--interval`` steps (default 10: about a minute at the 6-7 s step of this
  model on a 2-core CPU, a third of the default mean time between faults, a sync save costing a few % of it);
* ``async``: ``checkpoint.async_save=true`` at the same interval;
* ``auto``:  ``checkpoint.async_save=true checkpoint.interval=auto checkpoint.mtbf_hours=<--mtbf-minutes / 60>``.

Each mode is one launch, ``torchrun --nproc-per-node 4 --max-restarts K train.py`` (K: ``--max-restarts``), of a GPT
of 119.6M parameters (12 layers, d_model 768, the bundled tokenizer's vocabulary of 4096, untied; seq_len 128, one
sample a rank a step) with AdamW at ``zero.stage=1``: 1.4 GB a checkpoint. ``parallel.ranks_per_node=2`` makes the
four local ranks two emulated nodes (the byte ledger counts their traffic by link; no network namespace).

Faults: this script SIGKILLs a random worker (one of the four ``train.py`` children of the torchrun agent it started,
found in /proc) at exponentially distributed wall times of mean ``--mtbf-minutes``, counted from the launch, until
the run ends or ``--max-minutes-per-mode`` passes (then it is stopped with SIGTERM). The draws (times and ranks) come
from ``--seed`` and are the same in every mode. ``--freeze-fraction F`` makes that share of the faults a SIGSTOP (a
frozen rank: its peers time out after ``parallel.timeout_s``, set to ``--freeze-timeout-s``) instead of a kill.
torchrun's agent restarts the whole group from the newest checkpoint (``parallel/restart.py``).

What is measured (this script polls ``metrics.jsonl``, written with ``logging.interval=1``, and the checkpoint
directory while a mode runs; a resumed run drops the records of the steps it redoes, so they are kept here as seen):

* the save stall of the step s that saved: the time between the records of steps s and s+1 of the same attempt,
  less step s+1's ``step_time_s``, less the median of that difference over the steps that did not save (logging and
  the stop check): what the save held the loop (the whole write when synchronous; the CPU copy and any wait for the
  previous write when asynchronous). The save at the end of the run has no next step and is not in the median;
* the fault-free step time, one for all modes (the machine's load drifts from one mode to the next): the median
  ``step_time_s`` over every mode's steps with no write in flight (under ``async_save``: no step overlapping the time
  from a save's temporary directory appearing to its published one appearing), the first step of each attempt left
  out; a mode's own median over all its steps is the table's ``step s``;
* the wall time lost per fault: from the time progress reached step H (the highest step logged before the kill) to
  the first step above H logged after it, less one fault-free step (that step's own time): the part of the step in
  flight that was lost, the restart, and the steps redone since the checkpoint. A fault before step 1 counts from
  the kill. A fault before the last one was recovered from is part of the same loss, counted once;
* goodput = steps done x fault-free step time / wall time of the launch (start-up and the final save included).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._cli import InputError, at_least, load_config, output_dir, output_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RANKS = 4
MODEL = ["model.n_layers=12", "model.d_model=768", "model.n_heads=12", "model.ffn_hidden=3072", "model.seq_len=128",
         "train.micro_batch_size=1", f"train.global_batch_size={RANKS}", "precision=fp32", "zero.stage=1",
         "parallel.ranks_per_node=2", "logging.interval=1", "train.eval_interval=0", "logging.wandb.mode=disabled",
         "checkpoint.keep_last=2"]
MODES = ("sync", "async", "auto")
SEED = 3
"""The default fault schedule: the first seed whose draws at the default mean (3 min) put the expected number of
faults, round(7 / 3) = 2, into the first 7 minutes of a launch (a mode's length here): 49 s (rank 1) and 216 s
(rank 0). Seed 0 has one fault in 10 minutes, seed 2 none: chosen from the schedule alone, before any run."""
POLL_S = 0.25
STOP_GRACE_S = 120
"""After the SIGTERM at --max-minutes-per-mode, how long the launch has to stop before its process group is killed."""


def mode_overrides(mode: str, interval: int, mtbf_minutes: float) -> List[str]:
    if mode == "sync":
        return [f"checkpoint.interval={interval}", "checkpoint.async_save=false"]
    if mode == "async":
        return [f"checkpoint.interval={interval}", "checkpoint.async_save=true"]
    return ["checkpoint.interval=auto", f"checkpoint.mtbf_hours={mtbf_minutes / 60:.6g}", "checkpoint.async_save=true"]


# ---- the arithmetic ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    at_s: float
    """Seconds after the launch."""
    rank: int
    freeze: bool


def schedule(seed: int, mean_s: float, horizon_s: float, ranks: int = RANKS, freeze_fraction: float = 0.0
             ) -> List[Fault]:
    """Fault times (exponential gaps of mean ``mean_s``) up to ``horizon_s``, each with its rank and kind; the same
    for the same seed."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(1.0 / mean_s)
        rank, freeze = rng.randrange(ranks), rng.random() < freeze_fraction
        if t > horizon_s:
            return out
        out.append(Fault(t, rank, freeze))


def parse_records(text: str) -> List[dict]:
    """The training records of a metrics.jsonl text (a line being written, the last one, may be torn: skipped)."""
    out = []
    for line in text.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and "loss" in r and "time" in r and "step" in r:
            out.append(r)
    return out


def save_stalls(records: Iterable[dict], saves: Dict[int, float]) -> Tuple[Dict[int, float], float]:
    """({saved step: stall s}, the median overhead of a step that did not save). ``records``: every training record
    seen (all attempts); ``saves``: saved step -> the time its checkpoint directory (temporary or published) was
    first seen. The save of step s belongs to the attempt that logged s last before that time."""
    by_attempt: Dict[int, Dict[int, dict]] = {}
    for r in records:
        by_attempt.setdefault(r.get("restarts", 0), {})[r["step"]] = r
    owner = {}
    for s, seen in saves.items():
        logged = [(r["time"], a) for a, rs in by_attempt.items() for st, r in rs.items() if st == s and r["time"] <= seen]
        if logged:
            owner[s] = max(logged)[1]
    plain, saved = [], {}
    for a, rs in by_attempt.items():
        for s, r in rs.items():
            nxt = rs.get(s + 1)
            if nxt is None:
                continue
            extra = nxt["time"] - r["time"] - nxt["step_time_s"]
            if owner.get(s) == a:
                saved[s] = extra
            elif s not in saves:
                plain.append(extra)
    base = statistics.median(plain) if plain else 0.0
    return {s: max(0.0, x - base) for s, x in sorted(saved.items())}, base


def clean_steps(records: Iterable[dict], writes: Sequence[Tuple[float, float]] = ()) -> List[float]:
    """step_time_s of the steps that are not the first of their attempt and overlap no (begin, end) of ``writes``
    (the wall times a write was in flight)."""
    by_attempt: Dict[int, List[dict]] = {}
    for r in records:
        by_attempt.setdefault(r.get("restarts", 0), []).append(r)
    return [r["step_time_s"] for rs in by_attempt.values() for r in sorted(rs, key=lambda r: r["step"])[1:]
            if not any(b < r["time"] and r["time"] - r["step_time_s"] < e for b, e in writes)]


def write_windows(saves: Dict[int, float], published: Dict[int, float]) -> List[Tuple[float, float]]:
    """(begin, end) of each write seen published: its checkpoint directory first seen (temporary or not) to its
    published directory first seen."""
    return [(saves[s], published[s]) for s in published if s in saves]


def reference_step_s(records: Iterable[dict], writes: Sequence[Tuple[float, float]] = ()) -> Optional[float]:
    """The median of :func:`clean_steps`."""
    times = clean_steps(records, writes)
    return statistics.median(times) if times else None


def fault_losses(records: Sequence[dict], kills: Sequence[float], step_s: float, end: float) -> List[dict]:
    """The wall time each fault cost (module docstring): a list of episodes {faults, from_step, lost_s, recovered};
    a kill before the previous one was recovered from joins its episode."""
    episodes: List[dict] = []
    for t in sorted(kills):
        if episodes and t < episodes[-1]["until"]:
            episodes[-1]["faults"] += 1
            continue
        before = [r for r in records if r["time"] < t]
        high = max((r["step"] for r in before), default=0)
        since = min((r["time"] for r in before if r["step"] == high), default=t)
        after = [r["time"] for r in records if r["time"] > t and r["step"] > high]
        until = min(after) if after else end
        episodes.append({"faults": 1, "from_step": high, "since": since, "until": until, "recovered": bool(after)})
    for e in episodes:
        e["lost_s"] = max(0.0, e["until"] - e["since"] - step_s)
    return episodes


def goodput(steps: int, step_s: float, wall_s: float) -> float:
    return steps * step_s / wall_s if wall_s > 0 else 0.0


AUTO_LINE = re.compile(r"\[checkpoint\] interval auto: every (\d+) steps")
PARAMS_LINE = re.compile(r"\[train\] model: ([\d.]+)M parameters")


def summarize(mode: dict, step_s: float) -> dict:
    """One mode's row from what was recorded while it ran."""
    stalls, base = save_stalls(mode["records"], {int(k): v for k, v in mode["saves"].items()})
    episodes = fault_losses(mode["records"], [k["time"] for k in mode["kills"]], step_s, mode["end"])
    lost = sum(e["lost_s"] for e in episodes)
    faults = len(mode["kills"])
    steps = max((r["step"] for r in mode["records"]), default=0)
    wall = mode["end"] - mode["start"]
    own = reference_step_s(mode["records"])
    return {"mode": mode["name"], "steps": steps, "wall_s": wall, "saves": len(mode["saves"]),
            "stall_median_s": statistics.median(stalls.values()) if stalls else None, "stalls_s": stalls,
            "plain_overhead_s": base, "faults": faults, "lost_s_per_fault": lost / faults if faults else None,
            "lost_s": lost, "episodes": episodes, "step_s": own, "goodput": goodput(steps, step_s, wall),
            "auto_intervals": [int(m) for m in AUTO_LINE.findall(mode.get("log", ""))],
            "exit_code": mode.get("exit_code"), "capped": mode.get("capped", False),
            "restarts": max((r.get("restarts", 0) for r in mode["records"]), default=0)}


def table(rows: List[dict]) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    out = ["| mode | steps | wall s | saves | median save stall s | faults | lost s per fault | step s | goodput |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        steps = f"{r['steps']}" + (" (capped)" if r["capped"] else "")
        out.append(f"| {r['mode']} | {steps} | {r['wall_s']:.0f} | {r['saves']} | {num(r['stall_median_s'], '.2f')} | "
                   f"{r['faults']} | {num(r['lost_s_per_fault'], '.0f')} | {num(r['step_s'], '.2f')} | "
                   f"{r['goodput']:.3f} |")
    return "\n".join(out)


# ---- running a mode ----------------------------------------------------------------------------------------------


def workers(agent: int) -> Dict[int, int]:
    """{rank: pid} of the live train.py children of the torchrun agent ``agent`` (from /proc)."""
    kids: List[int] = []
    try:
        for task in os.listdir(f"/proc/{agent}/task"):
            with open(f"/proc/{agent}/task/{task}/children") as f:
                kids += [int(p) for p in f.read().split()]
    except OSError:
        return {}
    out = {}
    for pid in kids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env and env[b"RANK"].isdigit():
            out[int(env[b"RANK"])] = pid
    return out


def run_mode(name: str, overrides: List[str], faults: List[Fault], run_dir: Path, cap_s: float, max_restarts: int,
             threads: int) -> dict:
    """Launch one mode, inject its faults, and record what it logged, saved and cost."""
    metrics, ckpt_dir, log_path = run_dir / "metrics.jsonl", run_dir / "checkpoints", run_dir.with_suffix(".log")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
           "--max-restarts", str(max_restarts), str(ROOT / "train.py"), *overrides, f"logging.run_dir={run_dir}",
           f"train.max_restarts={max_restarts}"]
    env = {k: v for k, v in os.environ.items() if k not in ("GPT_FAULTS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT", "GPT_COMM_TRACE")}
    env["OMP_NUM_THREADS"] = str(threads)
    seen: Dict[Tuple[int, int], dict] = {}
    saves: Dict[int, float] = {}
    published: Dict[int, float] = {}
    kills: List[dict] = []
    pending, hit, capped = list(faults), set(), False

    def look() -> None:
        try:
            for r in parse_records(metrics.read_text(errors="replace")):
                seen.setdefault((r.get("restarts", 0), r["step"]), r)
        except OSError:
            pass
        try:
            for p in ckpt_dir.iterdir():
                m = re.fullmatch(r"\.?step_(\d+)(\.tmp)?", p.name)
                if m:
                    saves.setdefault(int(m.group(1)), time.time())
                    if not m.group(2):
                        published.setdefault(int(m.group(1)), time.time())
        except OSError:
            pass

    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while proc.poll() is None:
            now = time.time()
            look()
            if pending and now - start >= pending[0].at_s:
                alive = {r: p for r, p in workers(proc.pid).items() if p not in hit}
                if len(alive) == RANKS:  # not while the agent restarts the group: a fault hits a running group
                    f = pending.pop(0)
                    look()
                    pid = alive[f.rank]
                    os.kill(pid, signal.SIGSTOP if f.freeze else signal.SIGKILL)
                    hit.add(pid)
                    kills.append({"time": time.time(), "at_s": time.time() - start, "scheduled_s": f.at_s,
                                  "rank": f.rank, "pid": pid, "freeze": f.freeze})
                    print(f"[bench_goodput] {name}: {'SIGSTOP' if f.freeze else 'SIGKILL'} rank {f.rank} (pid {pid}) "
                          f"at {time.time() - start:.0f} s", flush=True)
            if not capped and now - start > cap_s:
                capped = True
                print(f"[bench_goodput] {name}: --max-minutes-per-mode reached, stopping the launch", flush=True)
                proc.send_signal(signal.SIGTERM)
            if capped and now - start > cap_s + STOP_GRACE_S:
                os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(POLL_S)
        end = time.time()
        look()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of this launch's group is left (a frozen rank)
        except ProcessLookupError:
            pass
    text = log_path.read_text(errors="replace")
    return {"name": name, "start": start, "end": end, "records": sorted(seen.values(), key=lambda r: r["time"]),
            "saves": saves, "published": published, "kills": kills, "exit_code": proc.returncode, "capped": capped, "log": text,
            "overrides": overrides}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mtbf-minutes", type=float, default=3.0, help="mean time between faults (default 3)")
    ap.add_argument("--steps", type=int, default=40, help="train.max_steps of each mode (default 40)")
    ap.add_argument("--interval", type=int, default=10, help="the fixed checkpoint interval of sync and async "
                                                             "(steps, default 10)")
    ap.add_argument("--seed", type=int, default=SEED, help=f"seed of the fault schedule (default {SEED})")
    ap.add_argument("--modes", default=",".join(MODES), help="which modes, in order (default sync,async,auto)")
    ap.add_argument("--max-minutes-per-mode", type=float, default=10.0, help="stop a mode after this (default 10)")
    ap.add_argument("--max-restarts", type=int, default=100, help="torchrun --max-restarts (default 100)")
    ap.add_argument("--freeze-fraction", type=float, default=0.0, help="share of faults that freeze a rank "
                                                                       "(SIGSTOP) instead of killing it")
    ap.add_argument("--freeze-timeout-s", type=float, default=30.0, help="parallel.timeout_s when ranks freeze")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // RANKS), help="OMP threads a rank")
    ap.add_argument("--workdir", default=None, help="where the runs go (default: a temporary directory); their "
                                                    "checkpoints are removed after each mode")
    ap.add_argument("--json", default=None, help="write the measurements here too")
    ap.add_argument("overrides", nargs="*", help="extra config overrides (key=value)")
    args = ap.parse_args()
    at_least(args.steps, 2, "--steps")
    at_least(args.interval, 1, "--interval")
    at_least(args.max_restarts, 1, "--max-restarts")
    at_least(args.threads, 1, "--threads")
    for value, option in ((args.mtbf_minutes, "--mtbf-minutes"), (args.max_minutes_per_mode, "--max-minutes-per-mode"),
                          (args.freeze_timeout_s, "--freeze-timeout-s")):
        if not (value > 0 and math.isfinite(value)):
            raise InputError(f"{option} must be a positive number of minutes or seconds, got {value}")
    if not 0 <= args.freeze_fraction <= 1:
        raise InputError(f"--freeze-fraction must be between 0 and 1, got {args.freeze_fraction}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise InputError(f"--modes {args.modes}: give some of {', '.join(MODES)}, each once, comma-separated")
    bad = [o for o in args.overrides if o.split("=", 1)[0] in ("logging.run_dir", "train.max_steps")
           or o.startswith("checkpoint.")]
    if bad:
        raise InputError(f"{bad[0]}: the bench sets logging.run_dir, train.max_steps and checkpoint.* itself")
    extra = [f"parallel.timeout_s={args.freeze_timeout_s:g}"] if args.freeze_fraction else []
    per_mode = {m: MODEL + extra + args.overrides + [f"train.max_steps={args.steps}"]
                + mode_overrides(m, args.interval, args.mtbf_minutes) for m in modes}
    for m in modes:  # bad overrides: one line, exit 2, before anything is launched
        load_config(None, per_mode[m])
    if args.json is not None:
        output_file(args.json, "--json")
    if args.workdir is not None:
        output_dir(args.workdir, "--workdir").mkdir(parents=True, exist_ok=True)

    faults = schedule(args.seed, args.mtbf_minutes * 60, args.max_minutes_per_mode * 60,
                      freeze_fraction=args.freeze_fraction)
    print(f"[bench_goodput] modes {', '.join(modes)}; {args.steps} steps each; faults at "
          + (", ".join(f"{f.at_s:.0f} s (rank {f.rank}{', freeze' if f.freeze else ''})" for f in faults) or "none")
          + f" after each launch (mean {args.mtbf_minutes:g} min, seed {args.seed})", flush=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as scratch:
        base = Path(args.workdir) if args.workdir is not None else Path(scratch)
        raw = []
        for m in modes:
            run_dir = base / m
            if run_dir.exists():
                shutil.rmtree(run_dir)
            r = run_mode(m, per_mode[m], faults, run_dir, args.max_minutes_per_mode * 60, args.max_restarts,
                         args.threads)
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            print(f"[bench_goodput] {m}: exit {r['exit_code']} after {r['end'] - r['start']:.0f} s, "
                  f"{len(r['kills'])} fault(s)", flush=True)
            raw.append(r)
    clean = [t for x in raw for t in clean_steps(x["records"], [] if x["name"] == "sync" else write_windows(
        x["saves"], x["published"]))]
    step_s = statistics.median(clean) if clean else None
    if step_s is None:
        raise InputError("no mode logged two steps in one attempt: nothing to measure (see the runs' logs)")
    rows = [summarize(x, step_s) for x in raw]
    params = next((float(p) for x in raw for p in PARAMS_LINE.findall(x["log"])), None)
    auto = next((r["auto_intervals"] for r in rows if r["mode"] == "auto"), [])
    print(f"\nmodel {params}M parameters, {RANKS} ranks as 2 emulated nodes (zero.stage=1, fp32), "
          f"{args.steps} steps a mode; fault-free step {step_s:.2f} s; faults every {args.mtbf_minutes:g} min on "
          f"average (seed {args.seed}); fixed interval {args.interval} steps"
          + (f"; auto interval chosen: {', '.join(map(str, auto))} steps" if auto else ""))
    print(table(rows))
    for r in rows:
        if r["exit_code"] not in (0, None) and not r["capped"]:
            print(f"note: {r['mode']} ended with exit code {r['exit_code']}")
    best = max(rows, key=lambda r: r["goodput"])
    print("goodput: " + ", ".join(f"{r['mode']} {r['goodput']:.3f}" for r in rows) + f"; highest: {best['mode']}")
    if args.json is not None:
        slim = [{**{k: v for k, v in x.items() if k not in ("records", "log")}, "records": [
            {k: rec.get(k) for k in ("step", "time", "step_time_s", "restarts", "loss")} for rec in x["records"]]}
            for x in raw]
        Path(args.json).write_text(json.dumps({"settings": {**vars(args), "step_s": step_s, "params_M": params,
                                                            "faults": [asdict(f) for f in faults]},
                                               "rows": rows, "runs": slim}, indent=1, default=str))


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
