"""An emulated multi-node cluster on one machine: ZeRO-3 / ZeRO++ / FSDP2 over a shaped inter-node link.

Every "node" is a network namespace; the nodes are joined by veth links shaped with ``tc`` (rate and, where
the kernel has ``sch_netem``, delay: ``--rate`` / ``--delay``). Two nodes share one veth pair; more hang off
a bridge in a namespace of its own (a star: each node's link is shaped in both directions, the delay is
applied once per direction, on the node's side). The namespaces have no link to the host's network: their
only addresses are 10.77.0.<node+1>/24 and there is no route anywhere else, so nothing leaves the machine.

Each row runs the real multi-node launch path, one ``torchrun --nnodes N --node-rank i --nproc-per-node R
--master-addr 10.77.0.1 --master-port P`` per namespace, ``GLOO_SOCKET_IFNAME=veth0``: traffic between two
ranks of one node goes over that namespace's loopback, traffic between nodes over the shaped link, whose
counters (``/proc/<pid in namespace>/net/dev``, the same numbers as ``/sys/class/net/veth0/statistics``) are
sampled every 20 ms and read at the step boundaries rank 0 logs.

    python scripts/bench_cluster.py                                  # 2 nodes x 2 ranks, 100mbit, every row
    python scripts/bench_cluster.py --rows zero3,fsdp2,fsdp2_hybrid --steps 8 --rate 1gbit
    python scripts/bench_cluster.py --probe                          # wire bytes per ledger byte, by collective
    python scripts/bench_cluster.py --cleanup                        # remove what a killed run left behind

Needs root, ``ip``, ``tc`` and ``nsenter``. Namespaces, links, qdiscs and every process started are removed on
exit, on failure and on SIGINT/SIGTERM/SIGHUP.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "bcl"  # namespaces are named bcl<pid of the creator>n<node> / bcl<pid>br
IFACE = "veth0"
SUBNET = "10.77.0"
MASTER_PORT = 29400


class ClusterError(RuntimeError):
    pass


class Interrupted(BaseException):
    """SIGTERM / SIGHUP turned into an exception, so that every ``finally`` runs."""


def _which(name: str) -> str:
    path = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin:/bin")
    if not path:
        raise ClusterError(f"{name} not found (needs iproute2 and util-linux)")
    return path


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")
    return r


def parse_rate(rate: str) -> float:
    """tc's rate syntax -> bits per second ('100mbit', '1gbit', '500kbit', '12mbps' = bytes)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(bit|bps)?\s*", rate.lower())
    if not m:
        raise ClusterError(f"cannot parse rate {rate!r} (e.g. 100mbit, 1gbit)")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return value * 8 if m.group(3) == "bps" else value


def parse_delay(delay: str) -> float:
    """'1ms', '500us', '0' -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(s|ms|us)?\s*", delay.lower())
    if not m:
        raise ClusterError(f"cannot parse delay {delay!r} (e.g. 1ms, 200us, 0)")
    return float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6, None: 1e-3}[m.group(2)]


# ---------------------------------------------------------------------------------------------------------------
# processes


def _children() -> Dict[int, List[int]]:
    kids: Dict[int, List[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
                ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> List[int]:
    """``pid`` and every process below it (torchrun starts its workers in sessions of their own)."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def kill_tree(pids: Sequence[int], grace_s: float = 5.0) -> None:
    """SIGTERM every process of the trees rooted at ``pids`` (by pid), then SIGKILL what is left."""
    victims: List[int] = []
    for pid in pids:
        victims.extend(descendants(pid))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for p in victims:
            try:
                os.kill(p, sig)
                alive.append(p)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _alive(p)]
            time.sleep(0.05)
        victims = alive
        if not victims:
            return


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap our own children
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------------------------
# the cluster


@dataclass
class Cluster:
    """N namespaces joined by shaped veth links; a context manager that removes everything on exit."""

    nodes: int = 2
    rate: str = "100mbit"
    delay: str = "1ms"
    gso: bool = False
    """Keep the veths' 64 KiB GSO packets (less CPU at high rates; wire bytes then hold fewer headers)."""
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    netns: List[str] = field(default_factory=list)
    holders: List[subprocess.Popen] = field(default_factory=list)
    procs: List[subprocess.Popen] = field(default_factory=list)
    delay_emulated: bool = False
    notes: List[str] = field(default_factory=list)

    def __post_init__(self):
        if self.nodes < 2:
            raise ClusterError(f"--nodes {self.nodes}: an inter-node link needs at least 2 nodes")
        if self.nodes > 250:
            raise ClusterError(f"--nodes {self.nodes}: at most 250 nodes in {SUBNET}.0/24")
        self.rate_bps = parse_rate(self.rate)
        self.delay_s = parse_delay(self.delay)
        self.ip, self.tc, self.nsenter = _which("ip"), _which("tc"), _which("nsenter")

    # ---- names --------------------------------------------------------------------------------------------
    def node_ns(self, i: int) -> str:
        return f"{self.tag}n{i}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}br"

    @staticmethod
    def addr(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def enter(self, i: int) -> List[str]:
        """Command prefix that runs a command in node i's network namespace (nothing else changes)."""
        return [self.nsenter, f"--net=/var/run/netns/{self.node_ns(i)}"]

    # ---- life cycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        try:
            self.create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _add_ns(self, name: str) -> None:
        _run([self.ip, "netns", "add", name])
        self.netns.append(name)
        _run([self.ip, "-n", name, "link", "set", "lo", "up"])

    def create(self) -> None:
        for i in range(self.nodes):
            self._add_ns(self.node_ns(i))
        if self.nodes == 2:
            a, b = self.node_ns(0), self.node_ns(1)
            _run([self.ip, "-n", a, "link", "add", IFACE, "type", "veth", "peer", "name", IFACE, "netns", b])
        else:
            br = self.bridge_ns
            self._add_ns(br)
            _run([self.ip, "-n", br, "link", "add", "br0", "type", "bridge"])
            _run([self.ip, "-n", br, "link", "set", "br0", "up"])
            for i in range(self.nodes):
                port = f"p{i}"
                _run([self.ip, "-n", br, "link", "add", port, "type", "veth", "peer", "name", IFACE,
                      "netns", self.node_ns(i)])
                _run([self.ip, "-n", br, "link", "set", port, "master", "br0"])
                _run([self.ip, "-n", br, "link", "set", port, "up"])
        for i in range(self.nodes):
            ns = self.node_ns(i)
            _run([self.ip, "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFACE])
            # one IP/TCP header per MTU-sized frame, as a NIC puts on the wire (veths pass 64 KiB GSO packets;
            # tbf would split them only when they exceed its burst, i.e. at some rates and not at others)
            if not self.gso:
                _run([self.ip, "-n", ns, "link", "set", IFACE, "gso_max_segs", "1"])
            _run([self.ip, "-n", ns, "link", "set", IFACE, "up"])
            self._shape(ns, IFACE, with_delay=True)
            if self.nodes > 2:
                if not self.gso:
                    _run([self.ip, "-n", self.bridge_ns, "link", "set", f"p{i}", "gso_max_segs", "1"])
                self._shape(self.bridge_ns, f"p{i}", with_delay=False)
        if self.delay_s > 0 and not self.delay_emulated:
            self.notes.append(f"delay {self.delay} NOT emulated: this kernel has no sch_netem "
                              "(rate shaping only, tbf)")
        for i in range(self.nodes):  # one idle process per namespace: /proc/<pid>/net/dev is that namespace's
            self.holders.append(subprocess.Popen(self.enter(i) + ["sleep", "1000000"], stdin=subprocess.DEVNULL,
                                                 start_new_session=True))
        deadline = time.monotonic() + 10
        while not all(self._has_iface(h.pid) for h in self.holders):
            if time.monotonic() > deadline:
                raise ClusterError("the namespace holder processes did not start")
            time.sleep(0.02)

    def _shape(self, ns: str, dev: str, with_delay: bool) -> None:
        """Egress of ``dev``: tbf at the link rate; netem delay under it where the kernel has netem."""
        rate_bytes = self.rate_bps / 8
        burst = max(16384, int(rate_bytes * 0.002))  # 2 ms at line rate, at least 16 KiB (GSO segments larger)
        _run([self.tc, "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate",
              f"{int(self.rate_bps)}bit", "burst", str(burst), "latency", "50ms"])
        if with_delay and self.delay_s > 0:
            r = _run([self.tc, "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                      "delay", f"{int(round(self.delay_s * 1e6))}us", "limit", "100000"], check=False)
            self.delay_emulated = r.returncode == 0

    @staticmethod
    def _has_iface(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/net/dev") as f:
                return f"{IFACE}:" in f.read()
        except OSError:
            return False

    def remove(self) -> None:
        """Kill every process started here (by pid, with their descendants), then delete the namespaces
        (which deletes their veths and qdiscs). Safe to call twice."""
        kill_tree([p.pid for p in self.procs + self.holders])
        for p in self.procs + self.holders:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs, self.holders = [], []
        for ns in reversed(self.netns):
            for pid in _run([self.ip, "netns", "pids", ns], check=False).stdout.split():
                kill_tree([int(pid)])  # anything still inside is ours (started in a namespace we made)
            _run([self.ip, "netns", "del", ns], check=False)
        self.netns = []

    # ---- processes -----------------------------------------------------------------------------------------
    def spawn(self, i: int, cmd: Sequence[str], env: Dict[str, str], log: Path) -> subprocess.Popen:
        with open(log, "wb") as f:
            p = subprocess.Popen(self.enter(i) + list(cmd), env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(p)
        return p

    def finish(self, procs: List[subprocess.Popen], timeout_s: float) -> List[Optional[int]]:
        """Wait for ``procs``; the first failure (or the timeout) kills the rest. Returns the exit codes."""
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if not all(c is not None for c in codes):
            kill_tree([p.pid for p in procs if p.poll() is None])
            codes = [p.poll() for p in procs]
        for p in procs:
            if p in self.procs and p.poll() is not None:
                self.procs.remove(p)
        return codes

    # ---- counters ------------------------------------------------------------------------------------------
    def counters(self) -> List[Tuple[int, int]]:
        """(rx_bytes, tx_bytes) of every node's veth0."""
        out = []
        for h in self.holders:
            with open(f"/proc/{h.pid}/net/dev") as f:
                for line in f:
                    name, _, rest = line.partition(":")
                    if name.strip() == IFACE:
                        v = rest.split()
                        out.append((int(v[0]), int(v[8])))
                        break
                else:
                    raise ClusterError(f"{IFACE} vanished from node namespace of pid {h.pid}")
        return out


class Sampler(threading.Thread):
    """Samples the link counters every ``period_s``; :meth:`at` interpolates them at a wall-clock time."""

    def __init__(self, cluster: Cluster, period_s: float = 0.02):
        super().__init__(daemon=True)
        self.cluster, self.period_s = cluster, period_s
        self.samples: List[Tuple[float, List[Tuple[int, int]]]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.samples.append((time.time(), self.cluster.counters()))
            except (OSError, ClusterError):
                return
            self._stop_event.wait(self.period_s)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def at(self, t: float) -> List[Tuple[float, float]]:
        s = self.samples
        if not s or t < s[0][0] or t > s[-1][0]:
            raise ClusterError("a step boundary lies outside the sampled counters")
        lo, hi = 0, len(s) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if s[mid][0] <= t:
                lo = mid
            else:
                hi = mid
        (t0, c0), (t1, c1) = s[lo], s[hi]
        w = 0.0 if t1 == t0 else (t - t0) / (t1 - t0)
        return [(a[0] + w * (b[0] - a[0]), a[1] + w * (b[1] - a[1])) for a, b in zip(c0, c1)]


# ---------------------------------------------------------------------------------------------------------------
# rows


@dataclass
class Row:
    name: str
    script: str  # train | fsdp2
    args: List[str]
    what: str


def rows_for(ranks_per_node: int) -> Dict[str, Row]:
    z3 = ["zero.stage=3"]
    return {r.name: r for r in [
        Row("dp", "train", ["zero.stage=0"], "plain DP (all-reduce), sanity"),
        Row("zero3", "train", z3, "ZeRO-3"),
        Row("qwz", "train", z3 + ["zero.quantized_weights=true"], "qwZ alone"),
        Row("hpz", "train", z3 + [f"zero.hpz_size={ranks_per_node}"], "hpZ alone"),
        Row("qgz", "train", z3 + ["zero.quantized_gradients=true"], "qgZ alone"),
        Row("zeropp", "train", z3 + ["zero.quantized_weights=true", f"zero.hpz_size={ranks_per_node}",
                                     "zero.quantized_gradients=true"], "ZeRO++ (qwZ+hpZ+qgZ)"),
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
            + [f"train.max_steps={args.steps}", "train.eval_interval=0", "checkpoint.interval=0",
               "checkpoint.save_at_exit=false", "logging.interval=1", "logging.wandb.mode=disabled",
               f"logging.run_dir={run_dir}"] + [kv for group in args.model for kv in group])


def worker_env(cluster: Cluster) -> Dict[str, str]:
    env = dict(os.environ)
    env.update({"GLOO_SOCKET_IFNAME": IFACE, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled",
                "TORCHELASTIC_ERROR_FILE": "", "NO_PROXY": "*"})
    for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(k, None)
    return env


def torchrun(cluster: Cluster, i: int, ranks: int, port: int, script: Sequence[str]) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(cluster.nodes), "--node-rank", str(i),
            "--nproc-per-node", str(ranks), "--master-addr", cluster.addr(0), "--master-port", str(port),
            *script]


def launch(cluster: Cluster, ranks: int, port: int, script: Sequence[str], logdir: Path, name: str,
           timeout_s: float) -> Tuple[List[Optional[int]], List[Path]]:
    env = worker_env(cluster)
    logs = [logdir / f"{name}.node{i}.log" for i in range(cluster.nodes)]
    procs = [cluster.spawn(i, torchrun(cluster, i, ranks, port, script), env, logs[i]) for i in range(cluster.nodes)]
    return cluster.finish(procs, timeout_s), logs


def error_line(logs: Sequence[Path]) -> str:
    for log in logs:
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("error:"):
                return line
    for log in logs:  # a worker's own exception or abort, before torchrun's summary of it
        try:
            lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            continue
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


def combine(runs: List[dict]) -> dict:
    """Rounds of one row -> one: medians of the step time and of the bytes, the spread of the step time."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    out = dict(good[0])
    for key in ("step_time_s", "tokens_per_s", "wire_bytes", "lower_bound_s", "counted_inter_bytes"):
        out[key] = statistics.median(r[key] for r in good)
    out["ratio_to_bound"] = out["step_time_s"] / out["lower_bound_s"] if out["lower_bound_s"] else None
    out["rounds"] = [{k: r.get(k) for k in ("step_time_s", "wire_bytes", "loadavg", "error")} for r in runs]
    return out


def run_row(cluster: Cluster, row: Row, args, workdir: Path, port: int, run_dir_name: str) -> dict:
    world = cluster.nodes * args.ranks_per_node
    run_dir = workdir / run_dir_name
    overrides = common_overrides(args, run_dir, world)
    script = ["train.py"] if row.script == "train" else ["scripts/fsdp2_peer.py"]
    sampler = Sampler(cluster)
    sampler.start()
    t0 = time.monotonic()
    try:
        codes, logs = launch(cluster, args.ranks_per_node, port, script + row.args + overrides, workdir, run_dir_name,
                             args.row_timeout)
    finally:
        sampler.stop()
    out = {"row": row.name, "what": row.what, "wall_s": time.monotonic() - t0, "logs": [str(p) for p in logs],
           "loadavg": loadavg()}
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
    step_time = statistics.median(r["step_time_s"] for r in steady)
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
                "step_times": [r["step_time_s"] for r in recs]})
    return out


def cluster_seq_len(args) -> int:
    seq = 128
    for group in args.model:
        for kv in group:
            if kv.startswith("model.seq_len="):
                seq = int(kv.split("=", 1)[1])
    return seq


def mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def table(results: List[dict], cluster: Cluster, args) -> str:
    base = next((r for r in results if r["row"] == "zero3" and "error" not in r), None)
    head = ("| row | step time (s, median) | tokens/s | counted inter MiB/step | wire inter MiB/step "
            "| wire / counted | bound (s) | step / bound | counted vs ZeRO-3 | wire vs ZeRO-3 |")
    lines = [head, "|" + "---|" * 10]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['what']} | {r['error']} |" + " |" * 8)
            continue
        cv = f"{r['counted_inter_bytes'] / base['counted_inter_bytes']:.3f}" if base else "-"
        wv = f"{r['wire_bytes'] / base['wire_bytes']:.3f}" if base else "-"
        spread = ""
        if len(r.get("rounds", [])) > 1:
            ts = [x["step_time_s"] for x in r["rounds"] if x.get("step_time_s") is not None]
            spread = f" ({min(ts):.2f}-{max(ts):.2f})"
            failed = [x["error"] for x in r["rounds"] if x.get("error")]
            if failed:
                spread += f" [{len(failed)} of {len(r['rounds'])} rounds failed: {failed[0]}]"
        lines.append(f"| {r['what']} | {r['step_time_s']:.3f}{spread} | {r['tokens_per_s']:.0f} "
                     f"| {mib(r['counted_inter_bytes'])} ({r['counted_how']}) | {mib(r['wire_bytes'])} "
                     f"| {r['wire_bytes'] / r['counted_inter_bytes']:.3f} | {r['lower_bound_s']:.3f} "
                     f"| {r['ratio_to_bound']:.2f} | {cv} | {wv} |")
    kinds = sorted({k for r in results if "error" not in r for k in r["counted_rank0_by_kind"]})
    lines += ["", "rank 0's counted bytes per step by kind, MiB (trainer rows: inter-node groups only; FSDP2 rows: "
              "every group, of which hybrid's all-gather and reduce-scatter stay inside a node)", "",
              "| row | " + " | ".join(kinds) + " |", "|" + "---|" * (len(kinds) + 1)]
    for r in results:
        if "error" not in r:
            lines.append(f"| {r['what']} | " + " | ".join(mib(r["counted_rank0_by_kind"].get(k, 0)) for k in kinds)
                         + " |")
    return "\n".join(lines)


def header(cluster: Cluster, args) -> str:
    world = cluster.nodes * args.ranks_per_node
    extra = " ".join(kv for group in args.model for kv in group)
    lines = [f"{cluster.nodes} nodes x {args.ranks_per_node} ranks (dp {world}), link {cluster.rate} "
             f"(tbf, each direction, {'GSO packets' if cluster.gso else 'MTU frames'}), delay {cluster.delay if cluster.delay_emulated else '0 (not emulated)'}; "
             f"bf16, {' '.join(MODEL)}, global batch {2 * world} x seq {cluster_seq_len(args)}"
             + (f", {extra}" if extra else "") + f"; {args.steps} steps, median over steps > {args.skip}"]
    if args.repeat > 1:
        lines.append(f"{args.repeat} rounds over the rows, interleaved: medians over rounds, (min-max) of the "
                     "rounds' step-time medians")
    lines += [f"note: {n}" for n in cluster.notes]
    lines.append("counted = comm.by_link.inter (parallel/comm.py per-rank convention) summed over ranks; "
                 "wire = tx bytes of every node's veth0 per step (IP+TCP headers included), steps "
                 f"{args.skip}..last; bound = busiest link direction's bytes / link rate")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# probe: wire bytes per ledger byte, by collective


PROBE_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


def probe_worker(argv: Sequence[str]) -> int:
    """One rank of the probe (under torchrun inside a node namespace)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kinds", default=",".join(PROBE_KINDS))
    p.add_argument("--groups", default="world,inter")
    p.add_argument("--mib", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=4)
    a = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    node, lrank = rank // local, rank % local
    groups = {"world": (None, list(range(world)))}
    for l in range(local):  # every rank creates every group, in the same order
        ranks = list(range(l, world, local))
        pg = dist.new_group(ranks)
        if l == lrank:
            groups["inter"] = (pg, ranks)

    def counters():
        with open("/proc/self/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == IFACE:
                    v = rest.split()
                    return int(v[0]), int(v[8])
        raise RuntimeError(f"no {IFACE} in this namespace")

    numel = int(a.mib * 2**20) // 2 // world * world  # bf16 elements, a multiple of every group size
    results = []
    for gname in a.groups.split(","):
        pg, members = groups[gname]
        g = len(members)
        for kind in a.kinds.split(","):
            x = torch.ones(numel, dtype=torch.bfloat16)
            if kind == "all_gather":
                out = torch.empty(numel * g, dtype=torch.bfloat16)
                op, ledger = (lambda: dist.all_gather_single(out, x, group=pg)), (g - 1) * x.numel() * 2
            elif kind == "reduce_scatter":
                out = torch.empty(numel // g, dtype=torch.bfloat16)
                op, ledger = (lambda: dist.reduce_scatter_single(out, x, group=pg)), (g - 1) / g * x.numel() * 2
            elif kind == "all_to_all":
                out = torch.empty_like(x)
                op, ledger = (lambda: dist.all_to_all_single(out, x, group=pg)), (g - 1) / g * x.numel() * 2
            elif kind == "all_reduce":
                op, ledger = (lambda: dist.all_reduce(x, group=pg)), 2 * (g - 1) / g * x.numel() * 2
            else:
                raise SystemExit(f"unknown kind {kind}")
            op()  # warm-up (connections)
            deltas = {}
            for iters in (0, a.iters):
                dist.barrier()
                time.sleep(0.3)  # let the last ACKs of what came before pass
                before = counters()
                dist.barrier()  # no rank of this node may send before its reader has read
                t0 = time.perf_counter()
                for _ in range(iters):
                    op()
                dist.barrier()
                dt = time.perf_counter() - t0
                time.sleep(0.3)
                after = counters()
                deltas[iters] = (after[1] - before[1], dt)
            mine = [(deltas[a.iters][0] - deltas[0][0]) / a.iters, (deltas[a.iters][1] - deltas[0][1]) / a.iters]
            every = [None] * world
            dist.all_gather_object(every, (node, lrank, mine))
            if rank == 0:
                wire = sum(m[0] for (_, lr, m) in every if lr == 0)  # one reader per node namespace
                results.append({"kind": kind, "group": gname, "group_size": g, "input_bytes": x.numel() * 2,
                                "ledger_per_rank": ledger, "ledger_total": ledger * world,
                                "ranks_running": world, "wire_bytes": wire,
                                "time_s": max(m[1] for (_, _, m) in every)})
    if rank == 0:
        Path(a.out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


def run_probe(cluster: Cluster, args, workdir: Path) -> List[dict]:
    out = workdir / "probe.json"
    script = [str(Path(__file__).resolve()), "--probe-worker", "--out", str(out), "--kinds", args.probe_kinds,
              "--groups", args.probe_groups, "--mib", str(args.probe_mib), "--iters", str(args.probe_iters)]
    codes, logs = launch(cluster, args.ranks_per_node, MASTER_PORT - 1, script, workdir, "probe", args.row_timeout)
    if any(c != 0 for c in codes):
        raise ClusterError(f"probe failed: {error_line(logs)} (logs: {', '.join(map(str, logs))})")
    return json.loads(out.read_text())


def probe_table(results: List[dict], cluster: Cluster, args) -> str:
    lines = [f"probe: {cluster.nodes} nodes x {args.ranks_per_node} ranks, link {cluster.rate}, "
             f"{args.probe_mib} MiB bf16 input per rank, {args.probe_iters} calls each (minus a 0-call "
             "baseline of the same barriers); gloo via all_gather_single (= all_gather_into_tensor), "
             "reduce_scatter_single (= reduce_scatter_tensor), all_to_all_single, all_reduce",
             "",
             "| collective | group | g | ledger bytes per rank | ledger, all ranks | wire bytes (all veth0 tx) "
             "| wire / ledger (all ranks) | wire / input bytes | time per call (s) | eff. link MB/s |",
             "|" + "---|" * 10]
    for r in results:
        busiest = r["wire_bytes"] / cluster.nodes
        lines.append(f"| {r['kind']} | {r['group']} | {r['group_size']} | {r['ledger_per_rank']:.0f} "
                     f"| {r['ledger_total']:.0f} | {r['wire_bytes']:.0f} | {r['wire_bytes'] / r['ledger_total']:.3f} "
                     f"| {r['wire_bytes'] / r['input_bytes']:.3f} | {r['time_s']:.3f} "
                     f"| {busiest / r['time_s'] / 1e6:.2f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# stale state


def cleanup_stale() -> List[str]:
    """Remove namespaces this script made in runs that are gone (their creator pid is dead)."""
    ip = _which("ip")
    removed = []
    for line in _run([ip, "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)(n\d+|br)", name)
        if not m or _alive(int(m.group(1))):
            continue
        for pid in _run([ip, "netns", "pids", name], check=False).stdout.split():
            kill_tree([int(pid)])
        _run([ip, "netns", "del", name], check=False)
        removed.append(name)
    return removed


def our_namespaces(pid: Optional[int] = None) -> List[str]:
    out = _run([_which("ip"), "netns", "list"], check=False).stdout
    num = str(pid) if pid is not None else r"\d+"
    pat = PREFIX + num + r"(n\d+|br)"
    return [ln.split()[0] for ln in out.splitlines() if ln.split() and re.fullmatch(pat, ln.split()[0])]


# ---------------------------------------------------------------------------------------------------------------


def _raise_interrupted(signum, frame):
    raise Interrupted(f"signal {signum}")


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
                   help="rounds over the rows (interleaved); the table shows medians over rounds and the spread")
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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--probe-worker"]:
        return probe_worker(argv[1:])
    args = parse_args(argv)
    if args.skip < 1 or args.steps <= args.skip:
        print(f"error: need --steps > --skip >= 1 (got --steps {args.steps} --skip {args.skip})", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("error: needs root (network namespaces and tc)", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup_stale()
        print("removed: " + (" ".join(removed) if removed else "nothing"))
        return 0
    names = list(rows_for(args.ranks_per_node)) if args.rows == "all" else args.rows.split(",")
    table_rows = rows_for(args.ranks_per_node)
    unknown = [n for n in names if n not in table_rows]
    if unknown:
        print(f"error: unknown rows {unknown}; known: {', '.join(table_rows)}", file=sys.stderr)
        return 2
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-cluster-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(args.nodes, args.rate, args.delay, gso=args.gso)
    results: List[dict] = []
    try:
        with cluster:
            print(f"[bench_cluster] namespaces {' '.join(cluster.netns)}; logs in {workdir}", flush=True)
            for note in cluster.notes:
                print(f"[bench_cluster] warning: {note}", flush=True)
            if args.fail_after_setup:
                raise ClusterError("injected failure after set-up (--fail-after-setup)")
            if args.probe:
                res = run_probe(cluster, args, workdir)
                print(probe_table(res, cluster, args), flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps({"probe": res}, indent=1))
                return 0
            runs: Dict[str, List[dict]] = {n: [] for n in names}
            for rep in range(args.repeat):
                for k, name in enumerate(names):
                    tag = f" (round {rep + 1}/{args.repeat})" if args.repeat > 1 else ""
                    print(f"[bench_cluster] row {name}{tag} ...", flush=True)
                    run_dir_name = name if args.repeat == 1 else f"{name}.{rep}"
                    r = run_row(cluster, table_rows[name], args, workdir, MASTER_PORT + rep * len(names) + k,
                                run_dir_name)
                    runs[name].append(r)
                    if "error" in r:
                        print(f"[bench_cluster]   {name}: {r['error']}", flush=True)
                    else:
                        print(f"[bench_cluster]   {name}: {r['step_time_s']:.3f} s/step, counted "
                              f"{mib(r['counted_inter_bytes'])} MiB, wire {mib(r['wire_bytes'])} MiB per step, "
                              f"wall {r['wall_s']:.0f} s, load {r['loadavg']}", flush=True)
            results = [combine(runs[n]) for n in names]
            print()
            print(header(cluster, args))
            print()
            print(table(results, cluster, args), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"header": header(cluster, args), "rows": results}, indent=1))
        return 0 if all("error" not in r for r in results) else 1
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as e:
        print(f"[bench_cluster] interrupted ({e or 'SIGINT'}); cleaned up", file=sys.stderr)
        return 130
    finally:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # no second interrupt in the middle of clean-up
            signal.signal(s, signal.SIG_IGN)
        cluster.remove()
        for s, h in old.items():
            signal.signal(s, h)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if args.keep_logs or args.workdir:
            print(f"[bench_cluster] logs and run dirs kept in {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
