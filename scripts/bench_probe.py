"""The probe of scripts/bench_cluster.py (``--probe``): wire bytes per ledger byte, by collective.

Each rank runs this under ``torchrun`` inside a node namespace of the emulated cluster (scripts/netemu.py):
every collective runs ``--iters`` times and once with 0 calls (the same barriers), and the difference of the
namespace's veth0 tx counters is what that many calls put on the link. Rank 0 writes the results to ``--out``
as JSON and as the table bench_cluster.py prints (it passes every option).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, List, Sequence, Tuple

import torch
import torch.distributed as dist

import _cli
import netemu


def _collective(kind: str, numel: int, g: int, pg) -> Tuple[Callable[[], None], float, int]:
    """(one call of ``kind`` on a bf16 input of ``numel`` over group ``pg`` of size g, the bytes parallel/comm.py's
    ledger counts per rank for it, the input's bytes)."""
    x = torch.ones(numel, dtype=torch.bfloat16)
    nbytes = x.numel() * 2
    if kind == "all_gather":
        out = torch.empty(numel * g, dtype=torch.bfloat16)
        return (lambda: dist.all_gather_single(out, x, group=pg)), (g - 1) * nbytes, nbytes
    if kind == "reduce_scatter":
        out = torch.empty(numel // g, dtype=torch.bfloat16)
        return (lambda: dist.reduce_scatter_single(out, x, group=pg)), (g - 1) / g * nbytes, nbytes
    if kind == "all_to_all":
        out = torch.empty_like(x)
        return (lambda: dist.all_to_all_single(out, x, group=pg)), (g - 1) / g * nbytes, nbytes
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(x, group=pg)), 2 * (g - 1) / g * nbytes, nbytes
    raise _cli.InputError(f"unknown kind {kind}")


def _tx_and_time(op: Callable[[], None], iters: int) -> Tuple[int, float]:
    """This namespace's veth0 tx bytes and the time of ``iters`` calls, between barriers."""
    dist.barrier()
    time.sleep(0.3)  # let the last ACKs of what came before pass
    before = netemu.iface_bytes("/proc/self/net/dev", netemu.IFACE)
    dist.barrier()  # no rank of this node may send before its reader has read
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    dist.barrier()
    dt = time.perf_counter() - t0
    time.sleep(0.3)
    return netemu.iface_bytes("/proc/self/net/dev", netemu.IFACE)[1] - before[1], dt


def _inter_group(world: int, local: int, lrank: int):
    """This rank's "inter" group: one rank per node, those of its local rank. Every rank must create every
    group, in the same order."""
    groups = [(dist.new_group(list(range(l, world, local))), list(range(l, world, local))) for l in range(local)]
    return groups[lrank]


def table(results: List[dict], a: argparse.Namespace, nodes: int, local: int) -> str:
    lines = [f"probe: {nodes} nodes x {local} ranks, link {a.rate}, "
             f"{a.mib} MiB bf16 input per rank, {a.iters} calls each (minus a 0-call "
             "baseline of the same barriers); gloo via all_gather_single (= all_gather_into_tensor), "
             "reduce_scatter_single (= reduce_scatter_tensor), all_to_all_single, all_reduce",
             "",
             "| collective | group | g | ledger bytes per rank | ledger, all ranks | wire bytes (all veth0 tx) "
             "| wire / ledger (all ranks) | wire / input bytes | time per call (s) | eff. link MB/s |",
             "|" + "---|" * 10]
    for r in results:
        busiest = r["wire_bytes"] / nodes
        lines.append(f"| {r['kind']} | {r['group']} | {r['group_size']} | {r['ledger_per_rank']:.0f} "
                     f"| {r['ledger_total']:.0f} | {r['wire_bytes']:.0f} | {r['wire_bytes'] / r['ledger_total']:.3f} "
                     f"| {r['wire_bytes'] / r['input_bytes']:.3f} | {r['time_s']:.3f} "
                     f"| {busiest / r['time_s'] / 1e6:.2f} |")
    return "\n".join(lines)


KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
GROUPS = ("world", "inter")


def check_args(a: argparse.Namespace) -> None:
    """Bad options and a launch without torchrun, before any process group: one line, exit code 2."""
    for option, given, known in (("--kinds", a.kinds, KINDS), ("--groups", a.groups, GROUPS)):
        unknown = [x for x in given.split(",") if x not in known]
        if unknown:
            raise _cli.InputError(f"{option}: unknown {unknown}; known: {','.join(known)}")
    if not a.mib > 0:
        raise _cli.InputError(f"--mib must be more than 0, got {a.mib}")
    _cli.at_least(a.iters, 1, "--iters")
    _cli.output_file(a.out, "--out")
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        raise _cli.InputError(f"{', '.join(missing)} not set: bench_probe.py is a rank of bench_cluster.py --probe "
                              "and runs under torchrun (python scripts/bench_cluster.py --probe)")


def main(argv: Sequence[str]) -> int:
    """One rank of the probe; rank 0 writes ``--out`` (JSON) and the table next to it (``.md``)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kinds", required=True, help="comma list: all_gather,reduce_scatter,all_to_all,all_reduce")
    p.add_argument("--groups", required=True, help="comma list: world (all ranks), inter (one rank per node)")
    p.add_argument("--mib", type=float, required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--rate", required=True, help="the link's rate, for the table's title")
    a = p.parse_args(argv)
    check_args(a)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    node, lrank = rank // local, rank % local
    groups = {"world": (None, list(range(world))), "inter": _inter_group(world, local, lrank)}
    numel = int(a.mib * 2**20) // 2 // world * world  # bf16 elements, a multiple of every group size
    results = []
    for gname in a.groups.split(","):
        pg, members = groups[gname]
        g = len(members)
        for kind in a.kinds.split(","):
            op, ledger, input_bytes = _collective(kind, numel, g, pg)
            op()  # warm-up (connections)
            (tx0, t0), (tx, t) = _tx_and_time(op, 0), _tx_and_time(op, a.iters)
            every = [None] * world
            dist.all_gather_object(every, (node, lrank, ((tx - tx0) / a.iters, (t - t0) / a.iters)))
            wire = sum(m[0] for (_, lr, m) in every if lr == 0)  # one reader per node namespace
            results.append({"kind": kind, "group": gname, "group_size": g, "input_bytes": input_bytes,
                            "ledger_per_rank": ledger, "ledger_total": ledger * world,
                            "ranks_running": world, "wire_bytes": wire,
                            "time_s": max(m[1] for (_, _, m) in every)})
    if rank == 0:
        Path(a.out).write_text(json.dumps(results, indent=1))
        Path(a.out).with_suffix(".md").write_text(table(results, a, world // local, local))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_cli.run(main, sys.argv[1:]))
