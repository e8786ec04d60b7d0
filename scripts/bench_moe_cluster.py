"""Expert parallelism on the emulated two-node cluster: EP inside a node against EP across nodes, and the
all-to-all bytes per step against the formula.

The cluster is scripts/bench_cluster.py's (network namespaces joined by a ``tc``-shaped veth link, one ``torchrun
--nnodes`` per namespace, gloo over the link; see its docstring), and so is each row's measurement (its
``run_row``: wall clock per step, the link's byte counters, the trainer's ledger). The model is bench_cluster's
(4 layers, d_model 256, bf16, 2 x world sequences of 128 tokens a step) with every MLP an MoE layer of
``--experts`` routed experts, top-2, aux-loss-free balancing on. The rows differ only in ``parallel.ep``:

  ep1   every rank holds every expert: no token exchange; the experts' gradients join the DP all-reduce
        across the link
  ep2   EP inside a node (consecutive DP ranks, ranks_per_node 2): the all-to-alls stay on the node's loopback;
        the experts' gradients are reduced over the expert-data-parallel group, one rank per node, across the link
  ep4   EP across nodes: half of every all-to-all crosses the link; no expert gradient crosses it (each expert
        lives on one rank)

The formula column: per rank and step, each MoE layer and micro-batch sends ``T k (ep-1)/ep`` token rows of
``d_model`` compute-dtype values four times (dispatch and combine, forward and backward) plus the per-expert
counts (``E`` int64, ``(ep-1)/ep`` of them leave), where ``T`` is the micro-batch's tokens and ``k`` top-k, if
the routing spread the slots uniformly over the experts; the measured bytes (rank 0's ledger, all_to_all) depend
on the actual routing, so their ratio to the formula is the routing's skew towards other ranks' experts (1.00 =
uniform).

    sudo python scripts/bench_moe_cluster.py                          # 2 nodes x 2 ranks, 100mbit, three rows
    python scripts/bench_moe_cluster.py --rate 1gbit --steps 6 --rows ep2,ep4

Needs root, ``ip``, ``tc`` and ``nsenter``; everything it sets up is removed on exit, failure and signals.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import _cli
import bench_cluster
import netemu

ROWS = ("ep1", "ep2", "ep4")
PREFIX = "bmc"


def moe_args(args) -> List[str]:
    return [f"model.moe.num_experts={args.experts}", "model.moe.top_k=2", f"model.moe.ffn_hidden={args.expert_ffn}",
            "model.moe.bias_update_rate=0.001"]


def formula_bytes(args, ep: int, world: int) -> float:
    """All-to-all bytes rank 0 sends per step if the routing were uniform (see the module docstring)."""
    if ep == 1:
        return 0.0
    layers, d = 4, 256
    micro, seq = 2, bench_cluster.cluster_seq_len(args)
    microbatches = (2 * world) // (micro * world)
    rows = micro * seq * 2 * (ep - 1) / ep
    return layers * microbatches * (4 * rows * d * 2 + (ep - 1) / ep * args.experts * 8)


def measured(run_dir: Path, skip: int) -> Dict[str, float]:
    """Rank 0's all-to-all bytes per step by link (median over the steps after ``skip``)."""
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steady = [r for r in recs if "comm" in r and r["step"] > skip]
    out = {}
    for link in ("intra", "inter"):
        out[link] = statistics.median(r["comm"].get("by_kind_link", {}).get(f"all_to_all/{link}", 0)
                                      for r in steady)
    out["inter_all"] = statistics.median(r["comm"]["by_link"].get("inter", 0) for r in steady)
    out["load"] = statistics.median(r["moe"]["load_max_over_mean"] for r in steady if r.get("moe"))
    return out


def row_for(name: str, args) -> bench_cluster.Row:
    ep = int(name[2:])
    where = {1: "experts replicated", 2: "EP inside a node", 4: "EP across nodes"}[ep]
    return bench_cluster.Row(name, "train", ["zero.stage=0", f"parallel.ep={ep}"] + moe_args(args), where)


def table(results: List[dict], args, world: int) -> str:
    def mib(x: Optional[float]) -> str:
        return "-" if x is None else f"{x / 2**20:.2f}"

    lines = ["| row | what | step (s) | tokens/s | all-to-all intra (MiB) | all-to-all inter (MiB) | formula (MiB) "
             "| measured / formula | inter-node total (MiB) | load max/mean |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['what']} | error: {r['error']} |||||||")
            continue
        ep = int(r["row"][2:])
        m, f = r["measured"], formula_bytes(args, ep, world)
        total = m["intra"] + m["inter"]
        lines.append(f"| {r['row']} | {r['what']} | {r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{mib(m['intra'])} | {mib(m['inter'])} | {mib(f)} | "
                     f"{total / f:.2f} |" if f else
                     f"| {r['row']} | {r['what']} | {r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{mib(m['intra'])} | {mib(m['inter'])} | 0 | - |")
        lines[-1] += f" {mib(m['inter_all'])} | {m['load']:.2f} |"
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    p.add_argument("--rate", default="100mbit", help="link rate, tc syntax")
    p.add_argument("--delay", default="1ms", help="one-way delay per direction")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer (a multiple of 4)")
    p.add_argument("--expert-ffn", type=int, default=256, help="each expert's FFN width")
    p.add_argument("--row-timeout", type=float, default=600.0)
    p.add_argument("--workdir", help="keep run dirs and logs here (default: a temporary directory, removed)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    names = args.rows.split(",")
    if any(n not in ROWS for n in names):
        raise _cli.InputError(f"--rows: unknown {[n for n in names if n not in ROWS]}; known: {','.join(ROWS)}")
    _cli.at_least(args.experts, 4, "--experts")
    if args.experts % 4:
        raise _cli.InputError(f"--experts must be a multiple of 4 (ep up to 4), got {args.experts}")
    _cli.at_least(args.expert_ffn, 8, "--expert-ffn")
    if args.skip < 1 or args.steps <= args.skip:
        raise _cli.InputError(f"need --steps > --skip >= 1 (got --steps {args.steps} --skip {args.skip})")
    if args.workdir:
        _cli.output_dir(args.workdir, "--workdir")
    if os.geteuid() != 0:
        raise _cli.InputError("needs root (network namespaces and tc)")
    # what bench_cluster's run_row reads of its arguments
    args.ranks_per_node, args.link_profile, args.grad_clip, args.model = 2, False, 0.0, []
    nodes, world = 2, 4
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-moe-cluster-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    with netemu.interrupts_raise():
        try:
            with netemu.Cluster(PREFIX, nodes, args.rate, args.delay) as cluster:
                for k, name in enumerate(names):
                    print(f"[bench_moe_cluster] row {name} ...", flush=True)
                    r = bench_cluster.run_row(cluster, row_for(name, args), args, workdir,
                                              bench_cluster.MASTER_PORT + 10 + k, name)
                    if "error" not in r:
                        r["measured"] = measured(workdir / name, args.skip)
                    results.append(r)
                header = (f"2 nodes x 2 ranks, link {args.rate} / {args.delay}, bench_cluster's model (4 layers, "
                          f"d 256, bf16) with {args.experts} experts (FFN {args.expert_ffn}) top-2 in every layer, "
                          f"{args.steps} steps (medians after {args.skip})")
                print(f"\n{header}\n\n{table(results, args, world)}", flush=True)
        except netemu.NetemuError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            if args.workdir:
                print(f"[bench_moe_cluster] logs and run dirs kept in {workdir}", file=sys.stderr)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(_cli.run(main))
