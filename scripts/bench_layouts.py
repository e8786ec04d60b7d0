"""Per-layout step time and bytes per step, counted by the ledger and predicted analytically (CPU, gloo).

    python scripts/bench_layouts.py [--steps 4] [--ranks-per-node 2]
    python scripts/bench_layouts.py --cp [--steps 4]

Each layout trains the same model for a few steps on local processes (simulated
nodes of --ranks-per-node ranks). The table shows the median step time and, summed
over all ranks, the bytes of one step by group (counted / analytic) and by link.

``--cp``: context parallelism instead. The same model in bf16 at sequence lengths CP_SEQS, each at cp 1, 2 and 4
(world = cp, one micro-batch of 2 sequences a step): tokens/s (the world's, median step), the activation bytes per
rank, measured (what autograd saves for backward in the first step's micro-batch, ``training/memory.py
SavedActivations``) beside ``activation_bytes``' estimate, and the CP bytes each rank sends a step (ledger /
``parallel/volume.py``). The ranks share the machine's cores: at cp 4 on 2 cores tokens/s is not a speed-up.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts._cli import at_least  # noqa: E402

MODEL = ["model.n_layers=8", "model.d_model=256", "model.n_heads=8", "model.seq_len=256", "model.vocab_size=4096",
         "model.ffn_hidden=1024", "train.micro_batch_size=2", "train.global_batch_size=16"]
LAYOUTS = [
    ("single", 1, []),
    ("dp2", 2, []),
    ("tp2", 2, ["parallel.tp=2"]),
    ("tp2 sp", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("pp2", 2, ["parallel.pp=2"]),
    ("pp4 vp2", 4, ["parallel.pp=4", "parallel.virtual_stages=2"]),
    ("tp2 pp2 sp", 4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]),
    ("tp2 dp2", 4, ["parallel.tp=2"]),
    ("tp2 pp2 dp2", 8, ["parallel.tp=2", "parallel.pp=2"]),
]


def worker(overrides, steps):
    from tests.parallel_utils import batch_fn, build_engine, tiny_config

    engine = build_engine(tiny_config(*overrides))
    times = []
    for step in range(steps):
        engine.mesh.ledger.reset()
        t0 = time.perf_counter()
        engine.train_step(batch_fn(engine, step))
        times.append(time.perf_counter() - t0)
    return {"times": times, "comm": engine.mesh.ledger.snapshot(), "memory": engine.dp.memory()}


CP_SEQS = (256, 512, 1024)
CP_SIZES = (1, 2, 4)


def cp_worker(overrides, steps):
    from tests.parallel_utils import batch_fn, build_engine, tiny_config
    from training.memory import SavedActivations

    engine = build_engine(tiny_config(*overrides))
    times, saved = [], SavedActivations(engine.chunks)
    for step in range(steps):
        engine.mesh.ledger.reset()
        t0 = time.perf_counter()
        if step == 0:  # measured in the first step only, which the median leaves out (the hooks cost time)
            with saved:
                engine.train_step(batch_fn(engine, step))
        else:
            engine.train_step(batch_fn(engine, step))
        times.append(time.perf_counter() - t0)
    return {"times": times, "comm": engine.mesh.ledger.snapshot(), "saved": saved.peak}


def bench_cp(steps: int) -> None:
    """The --cp table (module docstring)."""
    from parallel.layout import make_layout
    from parallel.volume import step_bytes
    from tests.dist_harness import run_world
    from tests.parallel_utils import tiny_config
    from training.memory import activation_bytes

    base = MODEL + ["precision=bf16", "train.global_batch_size=2"]
    print(f"model: {' '.join(base)}  CPU/gloo, world = cp; activations MiB per rank, CP MiB per rank and step")
    head = (f"{'seq':>5} {'cp':>3} {'step s':>7} {'tokens/s':>9} | {'act measured':>12} {'act estimate':>12} "
            f"{'meas/est':>8} | {'cp MiB cnt/ana':>19}")
    print(head)
    print("-" * len(head))
    for seq in CP_SEQS:
        for cp in CP_SIZES:
            overrides = base + [f"model.seq_len={seq}", f"parallel.cp={cp}"]
            out = run_world(cp_worker, cp, overrides, steps, timeout=900)
            step_time = statistics.median(max(r["times"][i] for r in out) for i in range(1, steps))
            cfg = tiny_config(*overrides)
            layout = make_layout(cfg, cp, cp)
            measured = max(r["saved"] for r in out)
            estimate = max(activation_bytes(cfg, layout, r)["stored"] for r in range(cp))
            counted = max(r["comm"]["by_group"].get("cp", 0) for r in out)
            analytic = max(step_bytes(cfg, layout, r).get("cp", 0) for r in range(cp))
            tokens = cfg.train.global_batch_size * seq
            print(f"{seq:>5} {cp:>3} {step_time:7.3f} {tokens / step_time:9.0f} | {mib(measured):>12} "
                  f"{mib(estimate):>12} {measured / estimate:8.2f} | {mib(counted)}/{mib(analytic)}", flush=True)


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--cp", action="store_true", help="context parallelism: tokens/s and activation bytes per rank "
                                                      "at cp 1, 2, 4 for several sequence lengths")
    args = ap.parse_args()
    at_least(args.steps, 2, "--steps")  # the first step is left out of the median
    at_least(args.ranks_per_node, 1, "--ranks-per-node")
    if args.cp:
        return bench_cp(args.steps)
    from parallel.layout import make_layout  # torch and the model: after the options are checked
    from parallel.volume import step_bytes
    from tests.dist_harness import run_world
    from tests.parallel_utils import tiny_config

    groups = ["tp", "pp", "dp", "embedding"]
    print(f"model: {' '.join(MODEL)}  fp32, CPU/gloo, ranks_per_node={args.ranks_per_node}")
    head = f"{'layout':<12} {'ranks':>5} {'step s':>7} | " + " | ".join(f"{g + ' MiB cnt/ana':>19}" for g in groups)
    print(head + f" | {'intra MiB':>9} {'inter MiB':>9} | agree")
    print("-" * len(head) + "-" * 30)
    for name, world, layout_overrides in LAYOUTS:
        overrides = MODEL + layout_overrides + [f"parallel.ranks_per_node={min(args.ranks_per_node, world)}"]
        out = run_world(worker, world, overrides, args.steps, timeout=900)
        step_time = statistics.median(max(r["times"][i] for r in out) for i in range(1, args.steps))
        cfg = tiny_config(*overrides)
        layout = make_layout(cfg, world, min(args.ranks_per_node, world))
        counted = {g: sum(r["comm"]["by_group"].get(g, 0) for r in out) for g in groups}
        analytic = {g: sum(step_bytes(cfg, layout, r).get(g, 0) for r in range(world)) for g in groups}
        links = {k: sum(r["comm"]["by_link"][k] for r in out) for k in ("intra", "inter")}
        agree = all(abs(counted[g] - analytic[g]) <= 16 * world for g in groups)
        cells = " | ".join(f"{mib(counted[g])}/{mib(analytic[g])}" for g in groups)
        print(f"{name:<12} {world:>5} {step_time:7.3f} | {cells} | {mib(links['intra']):>9} {mib(links['inter']):>9}"
              f" | {'yes' if agree else 'NO'}", flush=True)


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
