"""An emulated multi-node cluster on one machine: ZeRO-3 / ZeRO++ / FSDP2 over a shaped inter-node link.

Every "node" is a network namespace (scripts/netemu.py); the nodes are joined by veth links shaped with ``tc``
(rate and, where the kernel has ``sch_netem``, delay: ``--rate`` / ``--delay``). Two nodes share one veth pair;
more hang off a bridge in a namespace of its own (a star: each node's link is shaped in both directions, the
delay is applied once per direction, on the node's side). The namespaces have no link to the host's network:
their only addresses are 10.77.0.<node+1>/24 and there is no route anywhere else, so nothing leaves the machine.

Each row runs the real multi-node launch path, one ``torchrun --nnodes N --node-rank i --nproc-per-node R
--master-addr 10.77.0.1 --master-port P`` per namespace, ``GLOO_SOCKET_IFNAME=veth0``: traffic between two
ranks of one node goes over that namespace's loopback, traffic between nodes over the shaped link, whose
counters (``/proc/<pid in namespace>/net/dev``, the same numbers as ``/sys/class/net/veth0/statistics``) are
sampled every 20 ms and read at the step boundaries rank 0 logs.

The step time of a row is wall clock per step over the measured steps (the same window as the wire counters),
so it includes the training loop's own work between steps (metrics, the stop check) and any communication that
runs there; the trainer's ``step_time_s`` (``train_step`` alone) is kept in the JSON as ``train_step_s``.

Every row runs twice: a shaped pass (the step time, the wire bytes and from them the bound: the busiest link
direction's bytes per step / the link rate, what the wire alone needs) and an unshaped pass, the same row with
the links' tbf (and netem) taken off (``netemu.Cluster.unshaped``), so that its step time is compute plus local
overhead (gloo's CPU work included; the veth is then limited only by the CPU). The table's
``step / max(unshaped, bound)`` is each row's overlap efficiency: 1.00 when a step takes no longer than the
slower of its compute and its wire time (communication fully hidden), up to (unshaped + bound) / max(...)
when the two run one after the other. ``--no-unshaped`` skips the second pass (those columns then show '-');
with ``--repeat R`` every round runs both passes of every row (their order alternating from round to round,
so that drift in the machine's load spreads over both) and the table shows medians over the rounds. Under the
table one line per pair that ran, ``speed-up of <row> over fsdp2_hybrid: X.XXx`` (FSDP2 hybrid shard's shaped
step time / the row's) for zero3 and every ``zeropp*`` trainer row.

Under that, for every ZeRO-3 row, the step boundary's chain (``parallel/volume.boundary_chain_bytes``): the
embedding's and the first block's last gradient reduce and next weight gather cross the link between the end of
the first block's backward and the start of its next forward, while every rank waits, so no exact schedule
steps faster than the unshaped step plus that share of the wire time. The table puts the floor this sets,
max(unshaped + share x bound, bound) / max(unshaped, bound), beside the measured ratio at both points (at the
calibrated point 1 + share). The unshaped step stands for the compute: where it waits on communication itself,
the floor is overstated.

    python scripts/bench_cluster.py                                  # 2 nodes x 2 ranks, 100mbit, every row
    sudo python scripts/bench_cluster.py --rows zero3,zeropp,fsdp2_hybrid --steps 10 --repeat 2
                                                                     # ZeRO++ vs FSDP2 HSDP, with overlap
    python scripts/bench_cluster.py --rows zero3,fsdp2,fsdp2_hybrid --steps 8 --rate 1gbit --no-unshaped
    python scripts/bench_cluster.py --probe                          # wire bytes per ledger byte, by collective
    python scripts/bench_cluster.py --cleanup                        # remove what a killed run left behind

Needs root, ``ip``, ``tc`` and ``nsenter``. Namespaces, links, qdiscs and every process started are removed on
exit, on failure and on SIGINT/SIGTERM/SIGHUP.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import _cli
import netemu

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "bcl"  # namespaces are named bcl<pid of the creator>n<node> / bcl<pid>br
MASTER_PORT = 29400
PROBE_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


class ClusterError(RuntimeError):
    """A benchmark's own failure (the probe's ranks failed; an injected failure); the network's are NetemuError."""


@dataclass
class Row:
    name: str
    script: str  # train | fsdp2
    args: List[str]
    what: str


def rows_for(ranks_per_node: int) -> Dict[str, Row]:
    # stage 3 prefetches 4 modules ahead (the config's default is 2): on this model the link needs about a
    # module's forward time per module's weights, so the next forward's first gathers must leave in the step
    # (zero.prefetch_depth + 1 of them) and the rest stay queued; ``--model zero.prefetch_depth=K`` overrides it
    z3 = ["zero.stage=3", "zero.prefetch_depth=4"]
    hpz = [f"zero.hpz_size={ranks_per_node}"]
    qwd4 = ["zero.quantized_weights=true", "zero.weight_bits=4", "zero.weight_delta=true"]
    hqgz4 = ["zero.quantized_gradients=true", "zero.gradient_bits=4", "zero.gradient_hadamard=true"]
    return {r.name: r for r in [
        Row("dp", "train", ["zero.stage=0"], "plain DP (all-reduce), sanity"),
        Row("zero3", "train", z3, "ZeRO-3"),
        Row("qwz", "train", z3 + ["zero.quantized_weights=true"], "qwZ alone"),
        Row("hpz", "train", z3 + [f"zero.hpz_size={ranks_per_node}"], "hpZ alone"),
        Row("qgz", "train", z3 + ["zero.quantized_gradients=true"], "qgZ alone"),
        Row("zeropp", "train", z3 + ["zero.quantized_weights=true", f"zero.hpz_size={ranks_per_node}",
                                     "zero.quantized_gradients=true"], "ZeRO++ (qwZ+hpZ+qgZ)"),
        Row("zeropp_4bit", "train", z3 + hpz + qwd4 + hqgz4,
            "4-bit weight differences + hpZ + Hadamard 4-bit gradients (SDP4Bit-style)"),
        Row("zeropp_4bit_direct", "train", z3 + hpz + qwd4[:2] + hqgz4,
            "direct 4-bit weights + hpZ + Hadamard 4-bit gradients"),
        Row("zeropp_4bit_two_level", "train", z3 + hpz + qwd4 + hqgz4 + ["zero.gradient_bits_intra=8"],
            "4-bit weight differences + hpZ + Hadamard gradients, 8 bits inside the node, 4 across"),
        Row("fsdp2", "fsdp2", ["--mesh", "full"], "FSDP2 full shard"),
        Row("fsdp2_hybrid", "fsdp2", ["--mesh", "hybrid"], "FSDP2 hybrid shard"),
        Row("fsdp2_dim0", "fsdp2", ["--mesh", "full", "--placement", "dim0"],
            "FSDP2 full shard, dim-0 padding (FSDP2's default placement)"),
    ]}


DEFAULT_ROWS = "zero3,qwz,hpz,qgz,zeropp,fsdp2,fsdp2_hybrid"
MODEL = ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.seq_len=128"]


def common_overrides(args, run_dir: Path, world: int) -> List[str]:
    return (["precision=bf16", "device=cpu", "parallel.tp=1", "parallel.pp=1",
             f"train.global_batch_size={2 * world}", "train.micro_batch_size=2"] + MODEL
            + [f"train.max_steps={args.steps}", f"train.grad_clip={args.grad_clip}", "train.eval_interval=0", "checkpoint.interval=0",
               "checkpoint.save_at_exit=false", "logging.interval=1", "logging.wandb.mode=disabled",
               f"logging.run_dir={run_dir}"] + [kv for group in args.model for kv in group])


def worker_env() -> Dict[str, str]:
    """gloo over the node's link; one thread per rank (the nodes share this machine's cores); no proxies."""
    env = dict(os.environ)
    env.update({"GLOO_SOCKET_IFNAME": netemu.IFACE, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled",
                "TORCHELASTIC_ERROR_FILE": "", "NO_PROXY": "*"})
    for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(k, None)
    return env


def torchrun(cluster: netemu.Cluster, i: int, ranks: int, port: int, script: Sequence[str]) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(cluster.nodes), "--node-rank", str(i),
            "--nproc-per-node", str(ranks), "--master-addr", cluster.addr(0), "--master-port", str(port),
            *script]


def launch(cluster: netemu.Cluster, ranks: int, port: int, script: Sequence[str], logdir: Path, name: str,
           timeout_s: float) -> Tuple[List[Optional[int]], List[Path]]:
    """One torchrun per node; waits for them (or ``timeout_s``). Returns the exit codes and the nodes' logs."""
    logs = [logdir / f"{name}.node{i}.log" for i in range(cluster.nodes)]
    procs = [cluster.spawn(i, torchrun(cluster, i, ranks, port, script), worker_env(), logs[i], ROOT)
             for i in range(cluster.nodes)]
    return cluster.finish(procs, timeout_s), logs


def error_line(logs: Sequence[Path]) -> str:
    """Why a row failed, from its nodes' logs: train.py's own ``error:`` line, else the first worker exception
    or abort (before torchrun's summary of it), else torchrun's root cause."""
    texts = [(log, [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()])
             for log in logs if log.exists()]
    for _, lines in texts:
        for ln in lines:
            if ln.startswith("error:"):
                return ln
    for log, lines in texts:
        for ln in lines:
            if ln.startswith("terminate called") or (re.match(r"^[\w.]+(Error|Exception): ", ln)
                                                     and "ChildFailedError" not in ln
                                                     and "SignalException" not in ln):
                return ln[:300]
        for i, ln in enumerate(lines):
            if ln.startswith("Root Cause"):
                cause = " ".join(x for x in lines[i + 1:i + 8] if x.startswith(("rank", "exitcode", "traceback")))
                return f"{cause} ({log.name})"[:300]
    return "failed (see logs)"


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def overlap_ratio(step_s: Optional[float], unshaped_s: Optional[float], bound_s: Optional[float]) -> Optional[float]:
    """step / max(unshaped, bound): 1 when the shaped step takes no longer than the slower of its compute (the
    unshaped step) and its wire time (the bound); None where a term is missing."""
    if step_s is None or unshaped_s is None or bound_s is None:
        return None
    floor = max(unshaped_s, bound_s)
    return step_s / floor if floor > 0 else None


def combine(runs: List[dict], unshaped: Optional[List[dict]] = None) -> dict:
    """Rounds of one row -> one: medians of the shaped passes' step time and bytes (the bound too: it is the
    shaped pass's), the median of the unshaped passes' step time (``unshaped``: one per round, or None when
    skipped) and from the medians ``overlap_ratio``; ``rounds`` keeps every round's figures."""
    good = [r for r in runs if "error" not in r]
    ugood = [u for u in unshaped or [] if "error" not in u]
    out = dict(good[0] if good else runs[0])
    if good:
        for key in ("step_time_s", "tokens_per_s", "wire_bytes", "lower_bound_s", "counted_inter_bytes"):
            out[key] = statistics.median(r[key] for r in good)
        out["ratio_to_bound"] = out["step_time_s"] / out["lower_bound_s"] if out["lower_bound_s"] else None
    out["unshaped_step_time_s"] = statistics.median(u["step_time_s"] for u in ugood) if ugood else None
    if unshaped and not ugood:
        out["unshaped_error"] = unshaped[0]["error"]
    out["overlap_ratio"] = (overlap_ratio(out["step_time_s"], out["unshaped_step_time_s"], out["lower_bound_s"])
                            if good else None)
    if unshaped:
        out["unshaped_logs"] = [p for u in unshaped for p in u.get("logs", [])]
    rounds = []
    for i, r in enumerate(runs):
        rnd = {k: r.get(k) for k in ("step_time_s", "wire_bytes", "lower_bound_s", "loadavg", "error")}
        if unshaped is not None:
            u = unshaped[i] if i < len(unshaped) else {}
            rnd.update({"unshaped_step_time_s": u.get("step_time_s"), "unshaped_wire_bytes": u.get("wire_bytes"),
                        "unshaped_loadavg": u.get("loadavg"), "unshaped_error": u.get("error"),
                        "overlap_ratio": overlap_ratio(r.get("step_time_s"), u.get("step_time_s"),
                                                       r.get("lower_bound_s"))})
        rounds.append(rnd)
    out["rounds"] = rounds
    return out


def run_row(cluster: netemu.Cluster, row: Row, args, workdir: Path, port: int, run_dir_name: str) -> dict:
    world = cluster.nodes * args.ranks_per_node
    run_dir = workdir / run_dir_name
    overrides = common_overrides(args, run_dir, world)
    script = ["train.py"] if row.script == "train" else ["scripts/fsdp2_peer.py"]
    sampler = netemu.Sampler(cluster, 0.005 if args.link_profile else 0.02)
    sampler.start()
    t0 = time.monotonic()
    try:
        codes, logs = launch(cluster, args.ranks_per_node, port, script + row.args + overrides, workdir, run_dir_name,
                             args.row_timeout)
    finally:
        sampler.stop()
    out = {"row": row.name, "what": row.what, "script": row.script, "shaped": cluster.shaped,
           "wall_s": time.monotonic() - t0, "logs": [str(p) for p in logs], "loadavg": loadavg()}
    if any(c != 0 for c in codes):
        out["error"] = error_line(logs) if any(c is not None for c in codes) else f"timed out ({args.row_timeout}s)"
        return out
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    recs = [r for r in recs if "step_time_s" in r]
    steady = [r for r in recs if r["step"] > args.skip]
    if len(steady) < 1:
        out["error"] = f"only {len(recs)} steps logged; need more than --skip {args.skip}"
        return out
    first = next(r for r in recs if r["step"] == args.skip)
    last = recs[-1]
    n = last["step"] - first["step"]
    c0, c1 = sampler.at(first["time"]), sampler.at(last["time"])
    rx = [(b[0] - a[0]) / n for a, b in zip(c0, c1)]
    tx = [(b[1] - a[1]) / n for a, b in zip(c0, c1)]
    # wall clock per step over the wire counters' window (first..last record's end-of-step time): what a step
    # costs including the loop's own work between steps (metrics, the stop check), so communication that
    # runs there (a gather started by the optimizer step) is not hidden from the figure; the trainer's
    # own step_time_s (train_step alone) is kept beside it
    step_time = (last["time"] - first["time"]) / n
    tokens = (2 * world) * cluster_seq_len(args)
    inter_rank0 = statistics.median(r["comm"]["by_link"]["inter"] for r in steady)
    if "comm_by_rank" in steady[0]:
        counted = statistics.median(sum(r["comm_by_rank"]["inter"]) for r in steady)
        counted_how = "sum over ranks"
    else:
        counted = inter_rank0 * world
        counted_how = f"rank 0 x {world}"
    kinds = sorted({k for r in steady for k in r["comm"].get("by_kind_link", {}) if k.endswith("/inter")})
    by_kind = {k.split("/")[0]: statistics.median(r["comm"].get("by_kind_link", {}).get(k, 0) for r in steady)
               for k in kinds}
    if not by_kind:  # fsdp2_peer.py: by_kind holds inter and intra together; its inter bytes are by_link
        by_kind = {k: statistics.median(r["comm"]["by_kind"].get(k, 0) for r in steady)
                   for k in steady[0]["comm"].get("by_kind", {})}
    wire = sum(tx)
    busiest = max(max(a, b) for a, b in zip(rx, tx))  # full duplex: each direction of each node link is a link
    lower_bound = busiest * 8 / cluster.rate_bps
    out.update({"step_time_s": step_time, "tokens_per_s": tokens / step_time, "counted_inter_bytes": counted,
                "counted_how": counted_how, "counted_inter_rank0": inter_rank0, "wire_bytes": wire,
                "counted_rank0_by_kind": by_kind,
                "wire_tx_by_node": tx, "wire_rx_by_node": rx, "busiest_direction_bytes": busiest,
                "lower_bound_s": lower_bound, "ratio_to_bound": step_time / lower_bound if lower_bound else None,
                "steps_measured": n, "loss_last": last.get("loss"),
                "train_step_s": statistics.median(r["step_time_s"] for r in steady),
                "step_times": [r["step_time_s"] for r in recs]})
    if args.link_profile and cluster.shaped:
        ends = [r["time"] for r in recs if r["step"] >= args.skip]
        out["link_profile"] = link_profile(sampler.samples, ends, cluster.rate_bps)
    return out


def link_profile(samples: List[Tuple[float, List[Tuple[int, int]]]], ends: List[float], rate_bps: float,
                 bin_s: float = 0.02) -> List[Tuple[float, float, int]]:
    """Where in a step the link is busy: for each ``bin_s`` of time since a step began (the previous step's end),
    the mean over steps of the busiest node's tx rate / the link rate, from counter samples (time, [(rx, tx) per
    node]); (bin start s, utilisation, samples)."""
    bins: Dict[int, List[float]] = {}
    for a, b in zip(ends, ends[1:]):
        pts = [(t, c) for t, c in samples if a <= t <= b]
        for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
            if t1 > t0:
                busy = max(y[1] - x[1] for x, y in zip(c0, c1)) * 8 / (t1 - t0) / rate_bps
                bins.setdefault(int((t0 - a) / bin_s + 1e-6), []).append(busy)
    return [(k * bin_s, statistics.mean(v), len(v)) for k, v in sorted(bins.items())]


def chain_share(row: Row, args, world: int) -> Optional[Dict[str, float]]:
    """A ZeRO-3 trainer row's step-boundary chain (``parallel/volume.boundary_chain_bytes``, rank 0, the analytic
    bytes on groups that cross nodes): ``chain`` and ``step`` bytes and ``share`` = chain / step. None for other
    rows (plain DP, FSDP2: not this trainer's units)."""
    if row.script != "train":
        return None
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from config import load_config
    from parallel.layout import make_layout
    from parallel.volume import boundary_chain_bytes
    from parallel.zero.sharded import early_step_applies

    cfg = load_config(None, row.args + common_overrides(args, Path("unused"), world))  # as run_row launches it
    layout = make_layout(cfg, world, args.ranks_per_node)
    try:
        out = boundary_chain_bytes(cfg, layout, 0, early=early_step_applies(cfg.zero))
    except ValueError:  # not ZeRO-3 (the dp row, or --model made it another stage), or pipelined: not modelled
        return None
    return {**out, "share": out["chain"] / out["step"]}


def chain_floor(share: float, unshaped_s: Optional[float], bound_s: Optional[float]) -> Optional[float]:
    """The least ``step / max(unshaped, bound)`` an exact schedule can reach when ``share`` of the step's bytes
    cross the link while every rank waits (the step boundary's chain), the unshaped step taken as the compute:
    max(unshaped + share * bound, bound) / max(unshaped, bound). None where a term is missing."""
    if unshaped_s is None or bound_s is None or max(unshaped_s, bound_s) <= 0:
        return None
    return max(unshaped_s + share * bound_s, bound_s) / max(unshaped_s, bound_s)


def chain_lines(results: List[dict]) -> List[str]:
    """The step-boundary chain of every ZeRO-3 row, with the floor it sets at both points beside the measured
    ratio."""
    rows = [r for r in results if r.get("chain") and "error" not in r]
    if not rows:
        return []

    def cell(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = ["", "step boundary chain (parallel/volume.boundary_chain_bytes): the embedding's and the first block's last "
             "gradient reduce and next weight gather, rank 0's bytes on groups that cross nodes; they cross while "
             "every rank waits, so no exact schedule beats the floor = max(unshaped + share x bound, bound) / "
             "max(unshaped, bound) (the unshaped step taken as the compute: where it waits on communication itself, "
             "the floor is overstated)", "",
             "| row | chain MiB/step | step MiB/step | share | floor | step / max(unshaped, bound) | calibrated floor "
             "| calibrated step / max(unshaped, bound) |", "|" + "---|" * 8]
    for r in rows:
        c, u = r["chain"], r.get("unshaped_step_time_s")
        cal = r.get("calibrated") or {}
        cal_bound = cal.get("lower_bound_s") if "error" not in cal else None
        lines.append(f"| {r['what']} | {mib(c['chain'])} | {mib(c['step'])} | {c['share']:.3f} "
                     f"| {cell(chain_floor(c['share'], u, r['lower_bound_s']))} | {cell(r.get('overlap_ratio'))} "
                     f"| {cell(chain_floor(c['share'], u, cal_bound))} | {cell(cal.get('overlap_ratio'))} |")
    return lines


def profile_lines(results: List[dict]) -> List[str]:
    """``--link-profile``'s table: per row (its first shaped pass at the fixed rate), the link's utilisation by
    20 ms of the step."""
    lines = []
    for r in results:
        prof = r.get("link_profile")
        if not prof:
            continue
        lines += ["", f"link utilisation through the step, {r['what']} (busiest node's tx / rate, mean over steps):", ""]
        lines += [f"  {t * 1e3:5.0f} ms  {'#' * int(round(u * 40)):<42s} {u:.2f}" for t, u, _ in prof]
    return lines


def cluster_seq_len(args) -> int:
    """The rows' model.seq_len: MODEL's unless ``--model`` overrides it."""
    seqs = [int(kv.split("=", 1)[1]) for group in args.model for kv in group if kv.startswith("model.seq_len=")]
    return seqs[-1] if seqs else 128


def mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def speedups(results: List[dict], base: str = "fsdp2_hybrid") -> List[Tuple[str, float]]:
    """(row, ``base``'s shaped step time / the row's) for zero3 and every trainer row named ``zeropp*``, where
    both ran."""
    ref = next((r for r in results if r["row"] == base and "error" not in r), None)
    if ref is None:
        return []
    return [(r["row"], ref["step_time_s"] / r["step_time_s"]) for r in results
            if "error" not in r and r.get("script", "train") == "train"
            and (r["row"] == "zero3" or r["row"].startswith("zeropp"))]


def summary_lines(results: List[dict]) -> List[str]:
    return [f"speed-up of {name} over fsdp2_hybrid: {x:.2f}x" for name, x in speedups(results)]


def _spread(values: List[float]) -> str:
    return f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""


def _time_cell(median: float, rounds: List[dict], time_key: str, error_key: str) -> str:
    """A step-time median with the rounds' spread and, if some failed, how many and the first error."""
    cell = f"{median:.3f}" + _spread([x[time_key] for x in rounds if x.get(time_key) is not None])
    failed = [x[error_key] for x in rounds if x.get(error_key)]
    if failed:
        cell += f" [{len(failed)} of {len(rounds)} rounds failed: {failed[0]}]"
    return cell


def _rounds(rounds: List[dict]) -> str:
    """Each round's overlap ratio, when there are several: ' (rounds 1.12, 1.15)'."""
    ratios = [x.get("overlap_ratio") for x in rounds]
    if len(ratios) < 2 or any(x is None for x in ratios):
        return ""
    return " (rounds " + ", ".join(f"{x:.2f}" for x in ratios) + ")"


def calibrated_cells(cal: Optional[dict]) -> Tuple[str, str]:
    """The calibrated point's two cells: 'rate, step, bound' and the ratio (with each round's); '-' when that
    pass did not run, the error when it failed."""
    if cal is None:
        return "-", "-"
    if "error" in cal:
        return f"failed: {cal['error']}", "-"
    ratio = f"{cal['overlap_ratio']:.2f}" if cal.get("overlap_ratio") is not None else "-"
    return (f"{cal['rate_bps'] / 1e6:.1f}, {cal['step_time_s']:.3f}, {cal['lower_bound_s']:.3f}",
            ratio + _rounds(cal["rounds"]))


def table(results: List[dict], cluster: Optional[netemu.Cluster] = None, args=None) -> str:
    """The rows' table, the speed-up lines under it (:func:`summary_lines`) and rank 0's bytes by kind."""
    base = next((r for r in results if r["row"] == "zero3" and "error" not in r), None)
    head = ("| row | step (s, shaped, median, spread) | unshaped step (s) | bound (s) | step / max(unshaped, bound) "
            "| calibrated: rate Mbit/s, step s, bound s | calibrated: step / max(unshaped, bound) "
            "| tokens/s | counted inter MiB/step | wire inter MiB/step | wire / counted | counted vs ZeRO-3 "
            "| wire vs ZeRO-3 |")
    ncol = 13
    lines = [head, "|" + "---|" * ncol]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['what']} | {r['error']} |" + " |" * (ncol - 2))
            continue
        rounds = r.get("rounds", [])
        cv = f"{r['counted_inter_bytes'] / base['counted_inter_bytes']:.3f}" if base else "-"
        wv = f"{r['wire_bytes'] / base['wire_bytes']:.3f}" if base else "-"
        step = _time_cell(r["step_time_s"], rounds, "step_time_s", "error")
        if r.get("unshaped_step_time_s") is not None:
            ushaped = _time_cell(r["unshaped_step_time_s"], rounds, "unshaped_step_time_s", "unshaped_error")
        else:
            ushaped = f"failed: {r['unshaped_error']}" if r.get("unshaped_error") else "-"
        ratio = f"{r['overlap_ratio']:.2f}" + _rounds(r.get("rounds", [])) if r.get("overlap_ratio") is not None else "-"
        cal, cal_ratio = calibrated_cells(r.get("calibrated"))
        lines.append(f"| {r['what']} | {step} | {ushaped} | {r['lower_bound_s']:.3f} | {ratio} | {cal} | {cal_ratio} "
                     f"| {r['tokens_per_s']:.0f} | {mib(r['counted_inter_bytes'])} ({r['counted_how']}) "
                     f"| {mib(r['wire_bytes'])} | {r['wire_bytes'] / r['counted_inter_bytes']:.3f} | {cv} | {wv} |")
    summary = summary_lines(results)
    if summary:
        lines += [""] + summary
    kinds = sorted({k for r in results if "error" not in r for k in r["counted_rank0_by_kind"]})
    lines += ["", "rank 0's counted bytes per step by kind, MiB (trainer rows: inter-node groups only; FSDP2 rows: "
              "every group, of which hybrid's all-gather and reduce-scatter stay inside a node)", "",
              "| row | " + " | ".join(kinds) + " |", "|" + "---|" * (len(kinds) + 1)]
    for r in results:
        if "error" not in r:
            lines.append(f"| {r['what']} | " + " | ".join(mib(r["counted_rank0_by_kind"].get(k, 0)) for k in kinds)
                         + " |")
    return "\n".join(lines)


def header(cluster: netemu.Cluster, args) -> str:
    world = cluster.nodes * args.ranks_per_node
    extra = " ".join(kv for group in args.model for kv in group)
    lines = [f"{cluster.nodes} nodes x {args.ranks_per_node} ranks (dp {world}), link {cluster.rate} "
             f"(tbf, each direction, {'GSO packets' if cluster.gso else 'MTU frames'}), delay {cluster.delay if cluster.delay_emulated else '0 (not emulated)'}; "
             f"bf16, {' '.join(MODEL)}, global batch {2 * world} x seq {cluster_seq_len(args)}"
             + (f", {extra}" if extra else "") + f"; {args.steps} steps, median over steps > {args.skip}"]
    if args.repeat > 1:
        lines.append(f"{args.repeat} rounds over the rows, interleaved (each round the shaped and the unshaped pass "
                     "of each row, their order alternating): medians over rounds, (min-max) of the rounds' "
                     "step-time medians")
    lines += [f"note: {n}" for n in cluster.notes]
    lines.append("counted = comm.by_link.inter (parallel/comm.py per-rank convention) summed over ranks; "
                 "wire = tx bytes of every node's veth0 per step (IP+TCP headers included), steps "
                 f"{args.skip}..last; bound = busiest link direction's bytes / link rate (shaped pass)")
    if args.unshaped:
        lines.append("unshaped = the same row with the links' tbf removed (compute + local overhead, the veth "
                     "limited by the CPU only); step / max(unshaped, bound): 1.00 = communication fully "
                     "overlapped, higher = time neither compute nor the wire explains")
        if args.calibrated:
            lines.append("calibrated = the same row again with the link rate set to its busiest direction's bytes per "
                         "step / its unshaped step (that round's), so that the bound equals the unshaped step: "
                         "compute and wire the same size")
    else:
        lines.append("unshaped pass skipped (--no-unshaped)")
    lines.append(f"gradient clip {args.grad_clip or 'off'} (train.grad_clip, every row)")
    return "\n".join(lines)


def run_probe(cluster: netemu.Cluster, args, workdir: Path) -> Tuple[List[dict], str]:
    """scripts/bench_probe.py on every node: its results and their table."""
    out = workdir / "probe.json"
    script = [str(Path(__file__).with_name("bench_probe.py")), "--out", str(out), "--kinds", args.probe_kinds,
              "--groups", args.probe_groups, "--mib", str(args.probe_mib), "--iters", str(args.probe_iters),
              "--rate", cluster.rate]
    codes, logs = launch(cluster, args.ranks_per_node, MASTER_PORT - 1, script, workdir, "probe", args.row_timeout)
    if any(c != 0 for c in codes):
        raise ClusterError(f"probe failed: {error_line(logs)} (logs: {', '.join(map(str, logs))})")
    return json.loads(out.read_text()), out.with_suffix(".md").read_text()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate", default="100mbit", help="link rate, tc syntax (each direction of each node link)")
    p.add_argument("--delay", default="1ms", help="one-way delay per direction (needs sch_netem; else not applied)")
    p.add_argument("--gso", action="store_true",
                   help="keep 64 KiB GSO packets on the veths (default: MTU frames, one header each, as on a NIC; "
                        "costs CPU at 1gbit and above)")
    p.add_argument("--steps", type=int, default=8, help="train.max_steps of every row")
    p.add_argument("--skip", type=int, default=2, help="steps left out of the medians and the wire window")
    p.add_argument("--rows", default=DEFAULT_ROWS,
                   help=f"comma list of rows, or 'all' (adds dp, plain DP as a sanity row, and fsdp2_dim0, FSDP2 "
                        f"with its default dim-0 placement); default {DEFAULT_ROWS}")
    p.add_argument("--model", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config overrides passed to every row, e.g. --model model.n_layers=2 model.d_model=512")
    p.add_argument("--keep-logs", action="store_true", help="keep run dirs and logs (printed at the end)")
    p.add_argument("--workdir", help="where run dirs and logs go (default: a temporary directory)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds over the rows (interleaved, each round both passes of each row); the table shows "
                        "medians over rounds and the spread")
    p.add_argument("--no-unshaped", dest="unshaped", action="store_false",
                   help="skip the unshaped pass of every row (the same row with the links' shaping removed: its "
                        "step time is compute + local overhead); its columns then show '-'")
    p.add_argument("--no-calibrated", dest="calibrated", action="store_false",
                   help="skip the calibrated pass of every row: the same row again with the link rate set so that "
                        "its wire bound equals its unshaped step (compute and wire the same size, the hardest case "
                        "for overlap); needs the unshaped pass")
    p.add_argument("--grad-clip", type=float, default=0.0,
                   help="train.grad_clip of every row (FSDP2's too); default 0 = off: the steps of a pretraining "
                        "run whose gradient norm stays under the clip, where ZeRO-3 with hpZ steps early "
                        "(zero.early_step); a clip that bites makes those steps wait for the global norm")
    p.add_argument("--link-profile", action="store_true",
                   help="sample the link counters every 5 ms and print, per row, the link's utilisation through the "
                        "step (20 ms bins since the step began): where the wire stands idle")
    p.add_argument("--row-timeout", type=float, default=600.0)
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("--probe", action="store_true", help="measure wire bytes per ledger byte of each collective")
    p.add_argument("--probe-kinds", default=",".join(PROBE_KINDS))
    p.add_argument("--probe-groups", default="world,inter", help="world: all ranks; inter: one rank per node")
    p.add_argument("--probe-mib", type=float, default=1.0)
    p.add_argument("--probe-iters", type=int, default=4)
    p.add_argument("--cleanup", action="store_true", help="remove namespaces left by killed runs, then exit")
    p.add_argument("--fail-after-setup", action="store_true", help=argparse.SUPPRESS)  # tests: injected failure
    return p.parse_args(argv)


def run_rows(cluster: netemu.Cluster, args, names: List[str], workdir: Path) -> List[dict]:
    """Every row ``--repeat`` times, the rounds interleaved (drift in the machine's load spreads over all rows);
    each round runs the row's shaped pass and, unless ``--no-unshaped``, its unshaped pass (the links' shaping
    removed for it), in an order that alternates from round to round. One combined result per row."""
    table_rows = rows_for(args.ranks_per_node)
    runs: Dict[str, List[dict]] = {n: [] for n in names}
    unshaped_runs: Dict[str, List[dict]] = {n: [] for n in names}
    calibrated_runs: Dict[str, List[dict]] = {n: [] for n in names}
    for rep in range(args.repeat):
        for k, name in enumerate(names):
            passes = [False, True] if args.unshaped else [False]
            if rep % 2:
                passes.reverse()
            for unshaped in passes:
                tag = " unshaped" if unshaped else ""
                tag += f" (round {rep + 1}/{args.repeat})" if args.repeat > 1 else ""
                print(f"[bench_cluster] row {name}{tag} ...", flush=True)
                run_dir_name = (name if args.repeat == 1 else f"{name}.{rep}") + (".unshaped" if unshaped else "")
                port = MASTER_PORT + 2 * (rep * len(names) + k) + int(unshaped)
                with cluster.unshaped() if unshaped else contextlib.nullcontext():
                    r = run_row(cluster, table_rows[name], args, workdir, port, run_dir_name)
                (unshaped_runs if unshaped else runs)[name].append(r)
                label = f"{name}{' unshaped' if unshaped else ''}"
                report(label, r)
            if args.unshaped and args.calibrated:
                rate = calibrated_rate(runs[name][-1], unshaped_runs[name][-1])
                if rate is None:
                    r = {"error": "no calibrated pass: its shaped or unshaped pass failed"}
                else:
                    print(f"[bench_cluster] row {name} calibrated, {rate / 1e6:.1f} mbit"
                          + (f" (round {rep + 1}/{args.repeat})" if args.repeat > 1 else "") + " ...", flush=True)
                    port = MASTER_PORT + 2 * args.repeat * len(names) + rep * len(names) + k
                    with cluster.at_rate(rate):
                        r = run_row(cluster, table_rows[name], args, workdir, port,
                                    (name if args.repeat == 1 else f"{name}.{rep}") + ".calibrated")
                    r["rate_bps"] = rate
                    report(f"{name} calibrated", r)
                calibrated_runs[name].append(r)
    return [with_calibrated(combine(runs[n], unshaped_runs[n] if args.unshaped else None),
                            calibrated_runs[n] if args.unshaped and args.calibrated else None) for n in names]


def report(label: str, r: dict) -> None:
    if "error" in r:
        print(f"[bench_cluster]   {label}: {r['error']}", flush=True)
    else:
        print(f"[bench_cluster]   {label}: {r['step_time_s']:.3f} s/step, counted "
              f"{mib(r['counted_inter_bytes'])} MiB, wire {mib(r['wire_bytes'])} MiB per step, "
              f"wall {r['wall_s']:.0f} s, load {r['loadavg']}", flush=True)


def calibrated_rate(shaped: dict, unshaped: dict) -> Optional[float]:
    """The link rate (bits/s) at which this row's wire bound equals its unshaped step: the busiest link
    direction's bytes per step (from the shaped pass: the same bytes at any rate) over the unshaped step time,
    the point where compute and wire are the same size (the hardest case for overlap). None if a pass failed."""
    if "error" in shaped or "error" in unshaped or not unshaped["step_time_s"] > 0:
        return None
    return shaped["busiest_direction_bytes"] * 8 / unshaped["step_time_s"]


def with_calibrated(out: dict, calibrated: Optional[List[dict]]) -> dict:
    """A row's combined result with its calibrated passes (``calibrated``): the medians of their rate, step and
    bound, the overlap ratio of those medians against the row's unshaped median, and each round's figures with
    that round's ratio (against that round's unshaped step). Unchanged when there were none."""
    if calibrated is None:
        return out
    cal: Dict[str, object] = {"rounds": []}
    for c, rnd in zip(calibrated, out["rounds"]):
        cal["rounds"].append({k: c.get(k) for k in ("rate_bps", "step_time_s", "lower_bound_s", "error")}
                             | {"overlap_ratio": overlap_ratio(c.get("step_time_s"), rnd.get("unshaped_step_time_s"),
                                                               c.get("lower_bound_s"))})
    good = [c for c in calibrated if "error" not in c]
    if good:
        cal.update({k: statistics.median(c[k] for c in good) for k in ("rate_bps", "step_time_s", "lower_bound_s")})
        cal["overlap_ratio"] = overlap_ratio(cal["step_time_s"], out.get("unshaped_step_time_s"), cal["lower_bound_s"])
    else:
        cal["error"] = calibrated[0]["error"]
    out["calibrated"] = cal
    return out


def bench(cluster: netemu.Cluster, args, names: List[str], workdir: Path) -> int:
    print(f"[bench_cluster] namespaces {' '.join(ns.name for ns in cluster.namespaces)}; logs in {workdir}",
          flush=True)
    for note in cluster.notes:
        print(f"[bench_cluster] warning: {note}", flush=True)
    if args.fail_after_setup:
        raise ClusterError("injected failure after set-up (--fail-after-setup)")
    if args.probe:
        res, probe_table = run_probe(cluster, args, workdir)
        print(probe_table, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"probe": res}, indent=1))
        return 0
    table_rows, world = rows_for(args.ranks_per_node), cluster.nodes * args.ranks_per_node
    chains = {name: chain_share(table_rows[name], args, world) for name in names}  # before minutes of measuring
    results = run_rows(cluster, args, names, workdir)
    for r in results:
        r["chain"] = chains[r["row"]]
    print(f"\n{header(cluster, args)}\n\n{table(results, cluster, args)}", flush=True)
    for line in chain_lines(results) + profile_lines(results):
        print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header(cluster, args), "rows": results,
                                               "speedups_over_fsdp2_hybrid": dict(speedups(results)),
                                               "summary": summary_lines(results)}, indent=1))
    return 0 if all("error" not in r for r in results) else 1


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def check_args(args) -> None:
    """Bad options, found before anything is set up (namespaces, runs) or run for minutes (--json is written at
    the end): an InputError or ConfigError, one line and exit code 2 through scripts/_cli.py."""
    _cli.at_least(args.ranks_per_node, 1, "--ranks-per-node")
    _cli.at_least(args.repeat, 1, "--repeat")
    _cli.at_least(args.probe_iters, 1, "--probe-iters")
    if not args.probe_mib > 0:
        raise _cli.InputError(f"--probe-mib must be more than 0, got {args.probe_mib}")
    if not args.row_timeout > 0:
        raise _cli.InputError(f"--row-timeout must be more than 0, got {args.row_timeout}")
    unknown = [k for k in args.probe_kinds.split(",") if k not in PROBE_KINDS]
    if unknown:
        raise _cli.InputError(f"--probe-kinds: unknown {unknown}; known: {','.join(PROBE_KINDS)}")
    unknown = [g for g in args.probe_groups.split(",") if g not in ("world", "inter")]
    if unknown:
        raise _cli.InputError(f"--probe-groups: unknown {unknown}; known: world,inter")
    if args.json:
        _cli.output_file(args.json, "--json")
    if args.workdir:
        _cli.output_dir(args.workdir, "--workdir")
    overrides = [kv for group in args.model for kv in group]
    if overrides:
        _cli.load_config(None, overrides)  # "key=value" of known keys and types (model.seq_len is read here too)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    check_args(args)
    table_rows = rows_for(args.ranks_per_node)
    names = list(table_rows) if args.rows == "all" else args.rows.split(",")
    if args.skip < 1 or args.steps <= args.skip:
        return fail(f"need --steps > --skip >= 1 (got --steps {args.steps} --skip {args.skip})")
    if not args.cleanup and any(n not in table_rows for n in names):
        return fail(f"unknown rows {[n for n in names if n not in table_rows]}; known: {', '.join(table_rows)}")
    if os.geteuid() != 0:
        return fail("needs root (network namespaces and tc)")
    if args.cleanup:
        removed = netemu.cleanup_stale(PREFIX)
        print("removed: " + (" ".join(removed) if removed else "nothing"))
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-cluster-"))
    workdir.mkdir(parents=True, exist_ok=True)
    with netemu.interrupts_raise():  # SIGTERM/SIGHUP, like SIGINT, leave through the ``with`` that removes all
        try:
            with netemu.Cluster(PREFIX, args.nodes, args.rate, args.delay, gso=args.gso) as cluster:
                return bench(cluster, args, names, workdir)
        except (ClusterError, netemu.NetemuError) as e:
            return fail(str(e))
        except (KeyboardInterrupt, netemu.Interrupted) as e:
            print(f"[bench_cluster] interrupted ({e or 'SIGINT'}); cleaned up", file=sys.stderr)
            return 130
        finally:
            if args.keep_logs or args.workdir:
                print(f"[bench_cluster] logs and run dirs kept in {workdir}", file=sys.stderr)
            else:
                shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(_cli.run(main))
