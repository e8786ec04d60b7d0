"""ZeRO stages 0-3 side by side: step time, bytes per step by kind and link, model-state bytes per rank.

    python scripts/bench_zero.py [--world 4] [--ranks-per-node 2] [--precision bf16] [--steps 4] [key=value ...]

Each row trains the same model on local gloo processes (simulated nodes of
--ranks-per-node ranks). Bytes are rank 0's per step (the paper's per-GPU
convention), counted by the ledger, checked against ``parallel/volume.py``;
model states are what rank 0 holds after its first steps (``memory()`` of the DP
strategy), next to ``training/memory.py``'s estimate.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from config import validate_config  # noqa: E402
from scripts._cli import at_least, load_config  # noqa: E402
from scripts.bench_layouts import MODEL, mib, worker  # noqa: E402

ROWS = [(0, "flat"), (1, "flat"), (2, "flat"), (3, "flat"), (1, "whole_tensor"), (2, "whole_tensor"),
        (3, "whole_tensor")]
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("overrides", nargs="*", help="extra config overrides, e.g. parallel.tp=2")
    args = ap.parse_args()
    at_least(args.world, 1, "--world")
    at_least(args.ranks_per_node, 1, "--ranks-per-node")
    at_least(args.steps, 2, "--steps")  # the first step is left out of the median
    base = MODEL + [f"precision={args.precision}", f"parallel.ranks_per_node={args.ranks_per_node}"] + args.overrides
    load_config(None, MODEL + base)  # bad overrides (syntax, keys, types) before torch: one line, exit 2
    from parallel.layout import make_layout
    from parallel.volume import step_bytes
    from parallel.zero.units import meta_chunks
    from tests.dist_harness import run_world
    from tests.parallel_utils import BASE, tiny_config
    from training.memory import COMPONENTS, model_state_bytes

    validate_config(load_config(None, BASE + base))  # and their combination, before any rank starts
    cfg0 = tiny_config(*base)
    print(f"model: {' '.join(MODEL)}; {args.precision}; {make_layout(cfg0, args.world, args.ranks_per_node).describe()}")
    print("rank 0, one step: MiB by kind; intra/inter-node MiB; counted = analytic; model states MiB "
          "(params + grads + optimizer + working peak) measured / estimated")
    head = (f"{'stage':>5} {'partition':<12} {'step s':>7} | " + " ".join(f"{k:>14}" for k in KINDS)
            + f" | {'intra':>8} {'inter':>8} | {'agree':>5} | {'states meas':>11} {'est':>8}")
    print(head)
    print("-" * len(head))
    states = []
    for stage, kind in ROWS:
        overrides = base + [f"zero.stage={stage}", f"zero.partition={kind}"]
        out = run_world(worker, args.world, overrides, args.steps, timeout=900)
        step_time = statistics.median(max(r["times"][i] for r in out) for i in range(1, args.steps))
        cfg = tiny_config(*overrides)
        layout = make_layout(cfg, args.world, args.ranks_per_node)
        agree = all(abs(sum(r["comm"]["by_group"].values()) - sum(step_bytes(cfg, layout, rank).values())) <= 64
                    for rank, r in enumerate(out))
        comm = out[0]["comm"]
        measured, estimated = sum(out[0]["memory"].values()), sum(model_state_bytes(cfg, layout, 0).values())
        print(f"{stage:>5} {kind:<12} {step_time:7.3f} | "
              + " ".join(f"{mib(comm['by_kind'].get(k, 0)):>14}" for k in KINDS)
              + f" | {mib(comm['by_link']['intra'])} {mib(comm['by_link']['inter'])} | {'yes' if agree else 'NO':>5} |"
              f" {mib(measured):>11} {mib(estimated)}", flush=True)
        states.append((stage, kind, out[0]["memory"], model_state_bytes(cfg, layout, 0)))
    phi = sum(p.numel() for c in meta_chunks(cfg0, make_layout(cfg0, args.world, args.ranks_per_node), 0)
              for p in c.parameters())
    print(f"\nmodel states of rank 0, MiB measured / estimated (Phi = {phi / 1e6:.3f}M parameters, "
          f"N = {args.world // (cfg0.parallel.tp * cfg0.parallel.pp)})")
    print(f"{'stage':>5} {'partition':<12} " + " ".join(f"{k:>19}" for k in COMPONENTS) + f" {'bytes/Phi':>10}")
    for stage, kind, meas, est in states:
        print(f"{stage:>5} {kind:<12} " + " ".join(f"{mib(meas[k])}/{mib(est[k])}".rjust(19) for k in COMPONENTS)
              + f" {sum(meas.values()) / phi:10.2f}")


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
