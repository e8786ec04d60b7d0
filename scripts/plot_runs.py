"""Plot the loss curves (and other metrics) of one or more runs from their ``metrics.jsonl``.

    python scripts/plot_runs.py runs/a runs/b -o curves.png
    python scripts/plot_runs.py runs/base runs/zeropp runs/fp8 --labels base ZeRO++ FP8 \\
        --metrics loss val_loss lr grad_norm tokens_per_s -o curves.png

One subplot per metric (default: loss and val_loss), x = step, one line per run,
labelled by the run directory's name or ``--labels``; validation loss is drawn
with markers. A metric is any numeric key of the records; a dotted name reaches
into nested ones (``fp8.mu``, ``quant_error.weights``). Records without the
metric are skipped; a step logged more than once (a resumed run) keeps its last
value. A table of each run's last step, loss and val_loss is printed too.

A run killed mid-write (kill -9, a node lost) can leave a torn last line: it is
skipped with a warning and the records before it are plotted. A default panel no
run has data for (val_loss of runs with train.eval_interval=0) is left out with a
note; a metric named with ``--metrics`` must be in some run.

matplotlib is optional (``pip install matplotlib``); it is imported only here,
with the non-interactive Agg backend. Bad input (a missing, empty or binary file, a
malformed line before the last, an ``-o`` that cannot be written) exits 2 with a one-line error naming the
file.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # _cli beside this file, however it is loaded
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cli import json_line, parsed_lines  # noqa: E402

Series = Dict[int, float]  # step -> value


class InputError(Exception):
    """Bad input: reported as one line and exit code 2."""


DEFAULT_METRICS = ["loss", "val_loss"]


def warn(message: str) -> None:
    print(f"plot_runs.py: {message}", file=sys.stderr, flush=True)


def lookup(record: dict, metric: str) -> Optional[float]:
    """The numeric value of ``metric`` (dotted for nested dicts) in ``record``, or None."""
    value = record
    for key in metric.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _parse(line: bytes) -> dict:
    """One metrics.jsonl line as a record; ValueError saying what is wrong with it."""
    record = json_line(line)
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return record


def load_run(run_dir: Path, metrics: List[str], on_warning: Callable[[str], None] = warn) -> Dict[str, Series]:
    """Read ``run_dir/metrics.jsonl`` into one step-sorted series per metric, plus ``"step"`` (all steps).

    A bad last line after good records is what a writer killed mid-line leaves: it is skipped, with a warning
    through ``on_warning``. A bad line anywhere else, or a file with no good record, is an InputError."""
    path = run_dir / "metrics.jsonl"
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(f"{run_dir} is a file, not a run directory (one holding metrics.jsonl)")
    if not path.is_file():
        raise InputError(f"{path}: no such file (is {run_dir} a run directory?)")
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise InputError(f"{path}: cannot be read ({e.strerror})") from None
    series: Dict[str, Series] = {m: {} for m in ["step"] + metrics}
    n_records = 0
    for record in parsed_lines(lines, _parse, path, InputError, "skipped the torn last record, what a writer killed "
                               "mid-line leaves ({e}); plotting the {n} records before it", on_warning):
        n_records += 1
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            continue
        series["step"][step] = float(step)
        for m in metrics:
            value = lookup(record, m)
            if value is not None:
                series[m][step] = value  # a later record of the same step replaces an earlier one
    if n_records == 0:
        raise InputError(f"{path}: empty file, no records")
    return {m: dict(sorted(s.items())) for m, s in series.items()}


def last(series: Series) -> Optional[float]:
    return series[max(series)] if series else None


def fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(labels: List[str], runs: List[Dict[str, Series]]) -> str:
    """Per run: last step, last loss, last val_loss."""
    width = max(len("run"), *(len(label) for label in labels))
    rows = [f"{'run':<{width}}  {'last step':>9}  {'loss':>9}  {'val_loss':>9}"]
    for label, run in zip(labels, runs):
        step, loss, val = last(run["step"]), last(run["loss"]), last(run["val_loss"])
        rows.append(f"{label:<{width}}  {fmt(step, '9.0f')}  {fmt(loss, '9.4f')}  {fmt(val, '9.4f')}")
    return "\n".join(rows)


def plot(labels: List[str], runs: List[Dict[str, Series]], metrics: List[str], output: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("matplotlib is not installed; run `pip install matplotlib` to plot runs") from None
    fig, axes = plt.subplots(len(metrics), 1, sharex=True, squeeze=False, figsize=(8, 1 + 2.5 * len(metrics)))
    for ax, metric in zip(axes[:, 0], metrics):
        for i, (label, run) in enumerate(zip(labels, runs)):
            s = run[metric]
            if s:
                ax.plot(list(s), list(s.values()), color=f"C{i}", label=label,
                        marker="o" if metric == "val_loss" else None, markersize=4)
        ax.set_ylabel(metric)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(output, dpi=100)
    except OSError as e:  # e.g. no permission, a full disk (a file in the way is found by check_output)
        raise InputError(f"cannot write {output}: {e.strerror or e}") from None
    except ValueError as e:  # matplotlib: an unknown format (the suffix of -o)
        raise InputError(f"cannot write {output}: {e}") from None
    finally:
        plt.close(fig)


def check_output(output: Path) -> None:
    """``-o`` can be written: not a directory, and no regular file where a directory of its path must be."""
    if output.is_dir():
        raise InputError(f"-o {output} is a directory; give the PNG's file name")
    parent = output.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"-o {output} cannot be written: {parent} is a file, not a directory")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    ap.add_argument("-o", "--output", type=Path, default=Path("curves.png"), help="PNG to write (curves.png)")
    ap.add_argument("--metrics", nargs="+",
                    help="one subplot each, e.g. loss val_loss lr grad_norm tokens_per_s (default: loss val_loss, "
                         "leaving out one that no run has)")
    ap.add_argument("--labels", nargs="+", help="one legend label per run (default: the run directories' names)")
    args = ap.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        ap.error(f"--labels has {len(args.labels)} names for {len(args.runs)} runs")
    labels = args.labels or [run.resolve().name for run in args.runs]
    metrics = list(dict.fromkeys(args.metrics or DEFAULT_METRICS))  # drop repeats, keep order
    notes: List[str] = []  # printed once the plot is written, so an error stays the only line
    try:
        check_output(args.output)  # before reading anything: a bad -o is found first, not after the plot
        wanted = list(dict.fromkeys(metrics + DEFAULT_METRICS))  # the table shows loss and val_loss
        runs = [load_run(run, wanted, notes.append) for run in args.runs]
        paths = ", ".join(str(run / "metrics.jsonl") for run in args.runs)
        absent = [m for m in metrics if not any(run[m] for run in runs)]
        if args.metrics:
            if absent:
                raise InputError(f"metric {absent[0]!r} is in no run ({paths})")
        elif len(absent) == len(metrics):
            raise InputError(f"no run has {' or '.join(metrics)} records ({paths})")
        elif absent:
            metrics = [m for m in metrics if m not in absent]
            why = " (validation off, train.eval_interval=0, or not reached yet)" if absent == ["val_loss"] else ""
            notes.append(f"note: no run has {' or '.join(absent)} records{why}; plotting {', '.join(metrics)}")
        plot(labels, runs, metrics, args.output)
    except InputError as e:
        print(f"plot_runs.py: error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        warn(note)
    print(table(labels, runs))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
