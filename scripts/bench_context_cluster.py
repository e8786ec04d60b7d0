"""Context parallelism on the emulated two-node cluster: the CP ring inside a node against across nodes, ring
attention (p2p) against all-gathered K/V, the CP bytes per step against the formula, and how much of the ring's
transfer time its attention hides; and the all-to-all form (DeepSpeed-Ulysses, ``parallel.cp_comm=a2a``).

The cluster is scripts/bench_cluster.py's (network namespaces joined by a ``tc``-shaped veth link, one ``torchrun
--nnodes`` per namespace, gloo over the link; see its docstring), and so is each row's measurement (its
``run_row``: wall clock per step, the link's byte counters, the trainer's ledger). The model is bench_cluster's
(4 layers, d_model 256, 4 heads, bf16, 2 x world sequences a step, micro-batches of 2) at ``--seq-len`` tokens
(default 1024: K/V traffic is then most of what crosses the link) with ``--kv-heads`` K/V heads; ZeRO off. Every
row trains the same tokens per step; CP ranks count as data-parallel ones for the gradients, so the gradient
all-reduce spans all the ranks in every row. The rows differ in ``parallel.cp`` / ``parallel.cp_comm``:

  cp1      no CP: the baseline; only the gradient all-reduce crosses the link
  cp<n>    CP of n ranks, ring attention (p2p): inside a node when n <= --ranks-per-node (the ring runs on the
           node's loopback, dp across the link), else across nodes (with 2 ranks per node, cp4's ring
           0 -> 1 -> 2 -> 3 -> 0 crosses the link at hops 1 -> 2 and 3 -> 0, and every ring step waits on it)
  cp<n>_ag   the same with K/V all-gathered (Llama 3's form): no overlap, the exchange is synchronous
  cp<n>_a2a  the same with all-to-alls (parallel/ulysses.py): heads scattered, the whole sequence gathered;
             synchronous like the all-gather
  (n in 2, 4; --ranks-per-node 4 puts cp 4 inside a node: 2 nodes x 4 ranks, dp 2 across)

Columns: ``CP (MiB)`` is rank 0's ledger bytes on the ``cp`` group per step (median over the measured steps) and
``formula`` ``parallel/volume.py``'s ``step_bytes(...)["cp"]`` for the same config and layout; ``inter-node`` the
link's bytes per step (both directions, from the veth counters: every kind of traffic).

**Overlap**, from the communication trace (``GPT_COMM_TRACE``, ``parallel/comm.py``) every rank writes: on each
rank's timeline, ``in flight`` is the union of the intervals from posting a CP transfer to having waited for it
(a ring step's isend + irecv: from the first post to the end of the wait on the second; a synchronous all-gather
or reduce-scatter: the call), ``blocked`` the union of the main thread's waits and synchronous calls on the ``cp``
group, and ::

    overlap = (in flight - blocked) / in flight

the share of the time a CP transfer was under way that the rank spent computing (the attention of the block in
hand, or anything else the step does meanwhile) instead of waiting for it; 0 for ``all_gather`` by construction.
``blocked`` and ``in flight`` are seconds per step, means over the 4 ranks of the measured steps (from the start
of step ``--skip + 1`` to the start of the last step; the trace marks step starts). The trace costs an append
per call and a file write per phase mark.

    sudo python scripts/bench_context_cluster.py                      # 2 nodes x 2 ranks, 100mbit, default rows
    sudo python scripts/bench_context_cluster.py --ranks-per-node 4 --rows cp4,cp4_ag,cp4_a2a   # cp 4 in a node
    python scripts/bench_context_cluster.py --rate 1gbit --steps 5 --rows cp2,cp4 --kv-heads 1

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
from typing import Dict, List, Optional, Tuple

import _cli
import bench_cluster
import netemu

ROWS = ("cp1", "cp2", "cp2_ag", "cp2_a2a", "cp4", "cp4_ag", "cp4_a2a")
DEFAULT_ROWS = ("cp1", "cp2", "cp4", "cp4_ag", "cp4_a2a")
PREFIX = "bcc"
FORMS = {"": ("p2p", "ring", " (p2p)"), "_ag": ("all_gather", "all-gathered K/V", ""),
         "_a2a": ("a2a", "all-to-all", " (a2a)")}


def row_for(name: str, ranks_per_node: int = 2) -> bench_cluster.Row:
    cp = int(name[2])
    form, what, tag = FORMS[name[3:]]
    world = 2 * ranks_per_node
    where = (f"no CP (dp {world})" if cp == 1 else
             f"{what} inside a node{tag}, dp {world // cp} across" if cp <= ranks_per_node else
             f"{what} across nodes{tag}")
    return bench_cluster.Row(name, "train", ["zero.stage=0", f"parallel.cp={cp}", f"parallel.cp_comm={form}"],
                             where)


def formula_bytes(row: bench_cluster.Row, args, world: int) -> float:
    """``parallel/volume.py``'s CP bytes of rank 0 per step for the row's config, as run_row launches it."""
    if str(bench_cluster.ROOT) not in sys.path:
        sys.path.insert(0, str(bench_cluster.ROOT))
    from parallel.layout import make_layout
    from parallel.volume import step_bytes

    cfg = _cli.load_config(None, row.args + bench_cluster.common_overrides(args, Path("unused"), world))
    layout = make_layout(cfg, world, args.ranks_per_node)
    return step_bytes(cfg, layout, 0).get("cp", 0.0)


def measured_cp(run_dir: Path, skip: int) -> float:
    """Rank 0's bytes on the cp group per step (median over the steps after ``skip``)."""
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return statistics.median(r["comm"]["by_group"].get("cp", 0) for r in recs if "comm" in r and r["step"] > skip)


def _union(spans: List[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def rank_overlap(events: List[list], skip: int) -> Optional[Dict[str, float]]:
    """One rank's CP ``in_flight`` and ``blocked`` seconds per step over the measured steps (module docstring);
    None when fewer than two measured step starts were traced."""
    starts = [e[2] for e in events if e[0] == "mark" and e[1] == "forward_backward"][skip:]
    if len(starts) < 2:
        return None
    lo, hi = starts[0], starts[-1]
    cp = [e for e in events if e[0] in ("call", "wait") and e[2] == "cp" and lo <= e[4] < hi]
    posts = [e for e in cp if e[0] == "call" and e[6]]  # async: the ring's isend / irecv
    waits = [e for e in cp if e[0] == "wait" and (len(e) < 7 or e[6])]
    sync = [(e[4], e[5]) for e in cp if e[0] == "call" and not e[6]]
    # a ring step posts its two transfers together and waits for both together, in the order posted, and its
    # steps are waited for in the order they were posted (parallel/context.py's _Shift and _Ring)
    if len(posts) % 2 or len(posts) != len(waits):
        raise ValueError(f"the trace's cp transfers do not pair up: {len(posts)} posts, {len(waits)} waits")
    flight = [(posts[i][4], waits[i + 1][5]) for i in range(0, len(posts), 2)] + sync
    blocked = [(e[4], e[5]) for e in waits] + sync
    n = len(starts) - 1
    return {"in_flight": _union(flight) / n, "blocked": _union(blocked) / n}


def overlap(trace_dir: Path, skip: int) -> Dict[str, float]:
    """Means over ranks of ``rank_overlap`` and the overlap of those means."""
    sys.path.insert(0, str(Path(__file__).parent))
    import comm_trace

    per = [rank_overlap(ev, skip) for ev in comm_trace.load(str(trace_dir)).values()]
    per = [p for p in per if p is not None]
    if not per:
        raise ValueError(f"{trace_dir}: fewer than two measured steps traced")
    out = {k: statistics.mean(p[k] for p in per) for k in ("in_flight", "blocked")}
    out["overlap"] = (out["in_flight"] - out["blocked"]) / out["in_flight"] if out["in_flight"] > 0 else None
    return out


def table(results: List[dict]) -> str:
    def mib(x: Optional[float]) -> str:
        return "-" if x is None else f"{x / 2**20:.2f}"

    lines = ["| row | what | step (s) | tokens/s | CP rank 0 (MiB/step) | formula (MiB) | inter-node (MiB/step) "
             "| CP in flight (s/step) | CP blocked (s/step) | overlap |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['what']} | error: {r['error']} ||||||||")
            continue
        o = r.get("overlap") or {}
        share = "-" if o.get("overlap") is None else f"{o['overlap']:.2f}"
        secs = ("-", "-") if not o else (f"{o['in_flight']:.3f}", f"{o['blocked']:.3f}")
        lines.append(f"| {r['row']} | {r['what']} | {r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{mib(r['cp_bytes'])} | {mib(r['formula'])} | {mib(r['wire_bytes'])} | {secs[0]} | {secs[1]} "
                     f"| {share} |")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma list of {', '.join(ROWS)} (default "
                                                                  f"{','.join(DEFAULT_ROWS)})")
    p.add_argument("--ranks-per-node", type=int, default=2, choices=(2, 4),
                   help="2 (default: cp 4 crosses the link) or 4 (2 nodes x 4 ranks: cp 4 inside a node)")
    p.add_argument("--rate", default="100mbit", help="link rate, tc syntax")
    p.add_argument("--delay", default="1ms", help="one-way delay per direction")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024, help="model.seq_len (a multiple of 8: cp 4 cuts it in 8)")
    p.add_argument("--kv-heads", type=int, default=4, help="model.n_kv_heads (divides the 4 query heads)")
    p.add_argument("--row-timeout", type=float, default=600.0)
    p.add_argument("--workdir", help="keep run dirs, traces and logs here (default: a temporary directory, removed)")
    return p.parse_args(argv)


def check_args(args) -> List[str]:
    """The rows, after every option is checked (before anything is set up): InputError on a bad one."""
    names = args.rows.split(",")
    if any(n not in ROWS for n in names):
        raise _cli.InputError(f"--rows: unknown {[n for n in names if n not in ROWS]}; known: {','.join(ROWS)}")
    _cli.at_least(args.seq_len, 8, "--seq-len")
    if args.seq_len % 8:
        raise _cli.InputError(f"--seq-len must be a multiple of 8 (cp 4 cuts a sequence into 8 chunks), "
                              f"got {args.seq_len}")
    if args.kv_heads not in (1, 2, 4):
        raise _cli.InputError(f"--kv-heads must divide the model's 4 heads (1, 2 or 4), got {args.kv_heads}")
    if args.skip < 1 or args.steps <= args.skip + 1:
        raise _cli.InputError(f"need --steps > --skip + 1 >= 2: the overlap spans step starts after --skip "
                              f"(got --steps {args.steps} --skip {args.skip})")
    if not args.row_timeout > 0:
        raise _cli.InputError(f"--row-timeout must be more than 0, got {args.row_timeout}")
    if args.workdir:
        _cli.output_dir(args.workdir, "--workdir")
    return names


def configure(args) -> None:
    """What bench_cluster's run_row reads of its arguments; the model: bench_cluster's at --seq-len, --kv-heads."""
    args.link_profile, args.grad_clip = False, 0.0
    args.model = [[f"model.seq_len={args.seq_len}", f"model.n_kv_heads={args.kv_heads}"]]


def run_rows(cluster: netemu.Cluster, names: List[str], args, workdir: Path, world: int) -> List[dict]:
    results = []
    for k, name in enumerate(names):
        print(f"[bench_context_cluster] row {name} ...", flush=True)
        row, trace = row_for(name, args.ranks_per_node), workdir / f"{name}.trace"
        os.environ["GPT_COMM_TRACE"] = str(trace)  # the workers' environment is this process's (worker_env)
        try:
            r = bench_cluster.run_row(cluster, row, args, workdir, bench_cluster.MASTER_PORT + 20 + k, name)
        finally:
            os.environ.pop("GPT_COMM_TRACE", None)
        r["formula"] = formula_bytes(row, args, world)
        if "error" not in r:
            r["cp_bytes"] = measured_cp(workdir / name, args.skip)
            r["overlap"] = overlap(trace, args.skip) if row.args[1] != "parallel.cp=1" else None
            print(f"[bench_context_cluster]   {name}: {r['step_time_s']:.3f} s/step, cp {r['cp_bytes'] / 2**20:.2f} "
                  f"MiB, wire {r['wire_bytes'] / 2**20:.2f} MiB per step", flush=True)
        results.append(r)
    return results


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    names = check_args(args)
    if os.geteuid() != 0:
        raise _cli.InputError("needs root (network namespaces and tc)")
    configure(args)
    nodes, world = 2, 2 * args.ranks_per_node
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-context-cluster-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: List[dict] = []
    with netemu.interrupts_raise():
        try:
            with netemu.Cluster(PREFIX, nodes, args.rate, args.delay) as cluster:
                results = run_rows(cluster, names, args, workdir, world)
                header = (f"2 nodes x {args.ranks_per_node} ranks, link {args.rate} / {args.delay}, bench_cluster's model (4 layers, "
                          f"d 256, 4 heads, {args.kv_heads} KV heads, bf16) at seq {args.seq_len}, "
                          f"{2 * world} sequences a step, {args.steps} steps (medians after {args.skip})")
                print(f"\n{header}\n\n{table(results)}", flush=True)
        except netemu.NetemuError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            if args.workdir:
                print(f"[bench_context_cluster] logs, traces and run dirs kept in {workdir}", file=sys.stderr)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    return 0 if results and all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(_cli.run(main))
