"""Plan a run before it is launched: predicted step time, tokens/s, TFLOP/s per GPU, MFU and memory of a layout,
or the fastest layouts that fit (docs/planning.md).

    python scripts/plan.py --config configs/gpt_175b.yaml --gpus 768 --gpu h100              # the config's layout
    python scripts/plan.py --config configs/gpt_175b.yaml --gpus 1024 --gpu h100 --search    # the top 10 layouts
    python scripts/plan.py --config configs/gpt_7b.yaml --gpus 64 --gpu a100 --json parallel.tp=4

The config is read as train.py reads it (``--config FILE`` and ``key=value`` overrides): the model, precision,
seq_len, global batch and, for the evaluation, the layout keys. The cluster: ``--gpus``, ``--gpus-per-node``,
``--gpu`` (v100, a100, h100, h200, cpu: training/plan/devices.py, every figure with its source),
``--inter-node-gbps`` (per node, all NICs together) and ``--intra-node-gbps`` (per GPU, one way) to override the
kind's. ``--calibrate FILE`` replaces figures with measurements (training/plan/calibrate.py). Bad input is one
line, ``error: ...``, and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from scripts._cli import InputError, load_config  # noqa: E402

COLUMNS = ("tp", "pp", "vp", "cp", "ep", "dp", "mbs", "recompute", "zero", "tokens/s", "step s", "TFLOP/s", "MFU",
           "GiB", "fits")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="default: the kind's node (8; v100: 16)")
    ap.add_argument("--gpu", default="h100", help="kind: v100, a100, h100, h200, cpu (default h100)")
    ap.add_argument("--inter-node-gbps", type=float, default=None, help="Gbit/s per node, all NICs together")
    ap.add_argument("--intra-node-gbps", type=float, default=None, help="GB/s per GPU, one way (NVLink)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--evaluate", action="store_true", help="the config's own layout (the default)")
    mode.add_argument("--search", action="store_true", help="rank every valid layout that fits")
    ap.add_argument("--top", type=int, default=10, help="layouts --search shows (default 10)")
    ap.add_argument("--json", action="store_true", help="one JSON object per layout, one per line")
    ap.add_argument("--calibrate", metavar="FILE", help="measurements in place of the table's figures")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return ap.parse_intermixed_args(argv)  # key=value overrides may come between the options


def cluster_of(args, cfg):
    from training.plan.calibrate import calibrated
    from training.plan.devices import PlanInputError, make_cluster

    try:
        cluster = make_cluster(args.gpu, args.gpus, args.gpus_per_node, args.inter_node_gbps, args.intra_node_gbps)
        return calibrated(cluster, cfg, args.calibrate)
    except PlanInputError as e:
        raise InputError(str(e)) from None


def row(p: dict) -> list:
    k = p["layout"]
    zero = str(k["zero.stage"]) + ("++" if k.get("zero.quantized_weights") else "+hpZ" if k.get("zero.hpz_size")
                                   else "")
    cp = k["parallel.cp"] if k["parallel.cp"] == 1 else f"{k['parallel.cp']} {k['parallel.cp_comm']}"
    return [k["parallel.tp"], k["parallel.pp"], k["parallel.virtual_stages"], cp, k["parallel.ep"],
            k["dp"], k["train.micro_batch_size"], k["model.activation_checkpointing"], zero,
            f"{p['tokens_per_s']:,.0f}", f"{p['step_time_s']:.3f}", f"{p['tflops_per_gpu']:.1f}",
            f"{100 * p['mfu']:.1f}%", f"{p['memory_gib']:.1f}",
            "yes" if p["fits"] else f"no (+{p['over_gib']:.1f})"]


def table(preds) -> str:
    cells = [list(COLUMNS)] + [[str(c) for c in row(p)] for p in preds]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def keys_line(p: dict) -> str:
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in p["layout"].items()
                    if k != "dp")


def breakdown_lines(p: dict) -> list:
    b, step = p["breakdown"], p["step_time_s"]
    return [f"  {k:10} {v:9.4f} s  {100 * v / step:5.1f}%" for k, v in b.items()]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.top < 1:
        raise InputError(f"--top must be at least 1, got {args.top}")
    cfg = load_config(args.config, args.overrides)  # ConfigError: one line, exit 2
    from config import ConfigError, validate_config

    try:
        validate_config(cfg)
    except ConfigError as e:
        if not e.problems:
            raise
        raise ConfigError("invalid configuration: " + "; ".join(e.problems)) from None
    cluster = cluster_of(args, cfg)
    from training.plan import evaluate
    from training.plan.search import search

    where = (f"{cluster.gpus} x {cluster.device.name} ({cluster.nodes} node(s) of {cluster.gpus_per_node}, "
             f"{cluster.inter_node_gbit:g} Gbit/s per node, {cluster.intra_node_gbps:g} GB/s NVLink per GPU)")
    if args.search:
        stats: dict = {}
        preds = search(cfg, cluster, args.top, stats)
        if not preds:
            raise InputError(f"no layout of this model fits {cluster.device.memory_bytes / 2**30:.1f} GiB per GPU on "
                             f"{where}: the least any needs is {stats['least_gib']:.1f} GiB (estimator's lower bound)")
    else:
        started = time.perf_counter()
        try:
            preds = [evaluate(cfg, cluster)]
        except ConfigError as e:
            text = "; ".join(e.problems) if e.problems else str(e).split(": ", 1)[-1]
            raise ConfigError(f"impossible parallel layout on {cluster.gpus} GPUs: {text}") from None
        stats = {"total_s": time.perf_counter() - started}
    if args.json:
        for p in preds:
            print(json.dumps(p, sort_keys=False))
        return 0
    print(f"{'search' if args.search else 'evaluate'}: {where}; precision={cfg.precision}, "
          f"seq_len={cfg.model.seq_len}, global batch {cfg.train.global_batch_size}")
    print(table(preds))
    best = preds[0]
    print(f"\n{'top layout' if args.search else 'layout'}: {keys_line(best)}")
    print("breakdown of its step:")
    print("\n".join(breakdown_lines(best)))
    if not best["fits"]:
        print(f"does not fit: {best['memory_gib']:.1f} GiB per GPU, {best['over_gib']:.1f} GiB over the "
              f"{cluster.device.memory_bytes / 2**30:.1f} GiB of a {cluster.device.name}")
    if args.search:
        print(f"({stats['candidates']} valid layouts, {stats['cannot_fit']} cannot fit, {stats['predicted_whole']} "
              f"predicted whole, {stats['total_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
