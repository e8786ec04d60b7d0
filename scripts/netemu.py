"""Emulated networks on one machine: network namespaces, shaped veth links, and the processes inside them.

The one home of this machinery for the scripts that need a network of their own:

* :class:`Netns`: one namespace, ``lo`` up, nothing else. Commands enter it with ``nsenter --net`` only,
  so /sys/fs/cgroup, /etc and the mounts stay the host's.
* :class:`LoopbackNetns`: a namespace with no route anywhere (scripts/slurm/local_slurm.py's daemons and jobs).
* :class:`Cluster`: N node namespaces joined by veth links shaped with ``tc`` (scripts/bench_cluster.py),
  with interface byte counters (:class:`Sampler`), process spawning and process-tree killing; the shaping can
  be taken off every link and put back at runtime (:meth:`Cluster.unshape`, :meth:`Cluster.reshape`,
  ``with cluster.unshaped():``).

Nothing leaves the machine: no namespace made here has a link to the host's network, and the only addresses
are the ones given here (10.77.0.0/24 for a cluster's nodes, 192.0.2.1/32 for a loopback namespace).

Everything is removed on every exit path: ``with`` removes on normal exit and on any exception (a failed
create too, as far as it got, and whether the links are shaped, unshaped or half way between: the qdiscs go
with their namespaces); :func:`interrupts_raise` turns SIGTERM/SIGHUP into an exception like SIGINT's,
so that the ``with`` or ``finally`` still runs; a removal ignores further signals until it is done. Only
SIGKILL skips all that: namespaces are named ``<prefix><pid of their creator><suffix>`` so that
:func:`cleanup_stale` can tell the leftovers of a dead run from a live one's.

Needs root, ``ip`` and ``nsenter`` (iproute2, util-linux) and, for shaping, ``tc``.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

IFACE = "veth0"  # every cluster node's link, as its NIC
SUBNET = "10.77.0"
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class NetemuError(RuntimeError):
    """A tool is missing, or a namespace, link or qdisc could not be made or read."""


class Interrupted(BaseException):
    """SIGTERM / SIGHUP turned into an exception (:func:`interrupts_raise`), so that every ``finally`` runs."""


def tool(name: str) -> str:
    """Absolute path of ``name``; /usr/sbin and /sbin searched too (root's tools, often off a user's PATH)."""
    path = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin:/bin")
    if not path:
        raise NetemuError(f"{name} not found (needs iproute2 and util-linux)")
    return path


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise NetemuError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")
    return r


def parse_rate(rate: str) -> float:
    """tc's rate syntax -> bits per second ('100mbit', '1gbit', '500kbit', '12mbps' = bytes)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(bit|bps)?\s*", rate.lower())
    if not m:
        raise NetemuError(f"cannot parse rate {rate!r} (e.g. 100mbit, 1gbit)")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return value * 8 if m.group(3) == "bps" else value


def parse_delay(delay: str) -> float:
    """'1ms', '500us', '0' -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(s|ms|us)?\s*", delay.lower())
    if not m:
        raise NetemuError(f"cannot parse delay {delay!r} (e.g. 1ms, 200us, 0)")
    return float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6, None: 1e-3}[m.group(2)]


# ---------------------------------------------------------------------------------------------------------------
# signals


def _raise_interrupted(signum, frame):
    raise Interrupted(f"signal {signum}")


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP raise :class:`Interrupted` as SIGINT raises KeyboardInterrupt: a run told to
    stop still leaves through its ``with`` and ``finally`` blocks, which remove what it made."""
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP ignored inside: a second Ctrl-C must not cut a removal short. Only the main
    thread may set handlers; in another this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


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
    """``pid`` and every process below it (torchrun starts its workers in sessions of their own, so a process
    group or session kill would miss them)."""
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
        alive_now = []
        for p in victims:
            try:
                os.kill(p, sig)
                alive_now.append(p)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while alive_now and time.monotonic() < deadline:
            alive_now = [p for p in alive_now if alive(p)]
            time.sleep(0.05)
        victims = alive_now
        if not victims:
            return


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not); reaps it if it is a child of this process."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------------------------
# namespaces


class _Managed:
    """``with`` over create() / remove(); a create that fails half way is undone as far as it got."""

    def create(self) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def iface_bytes(net_dev: str, iface: str) -> Tuple[int, int]:
    """(rx_bytes, tx_bytes) of ``iface`` from a ``/proc/<pid>/net/dev``: the counters of that process's network
    namespace, the same numbers as its /sys/class/net/<iface>/statistics, read without entering it."""
    with open(net_dev) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                v = rest.split()
                return int(v[0]), int(v[8])
    raise NetemuError(f"no {iface} in {net_dev}")


def _delete_namespace(name: str) -> None:
    """Kill every process inside (what runs in a namespace made here is ours), then delete it: its links and
    qdiscs go with it."""
    ip = tool("ip")
    kill_tree([int(p) for p in _run([ip, "netns", "pids", name], check=False).stdout.split()])
    _run([ip, "netns", "del", name], check=False)


class Netns(_Managed):
    """One network namespace with ``lo`` up, named ``<prefix><pid of this process><suffix>`` (a suffix starts
    with a letter, so that the pid can be read back: :func:`cleanup_stale`).

    :attr:`prefix` is the command prefix that runs a command inside (empty until created). :meth:`hold`
    starts an idle process inside, through whose /proc entry :meth:`counters` reads the namespace's
    interfaces. Removing it kills every process inside.
    """

    def __init__(self, prefix: str, suffix: str = ""):
        self.name = f"{prefix}{os.getpid()}{suffix}"
        self.prefix: List[str] = []
        self.holder: Optional[subprocess.Popen] = None

    def ip(self, *args: str) -> None:
        _run([tool("ip"), "-n", self.name, *args])

    def tc(self, *args: str, check: bool = True) -> bool:
        return _run([tool("tc"), "-n", self.name, *args], check=check).returncode == 0

    def create(self) -> None:
        nsenter = tool("nsenter")
        _run([tool("ip"), "netns", "add", self.name])
        self.prefix = [nsenter, f"--net=/var/run/netns/{self.name}"]
        self.ip("link", "set", "lo", "up")

    def remove(self) -> None:
        """Safe to call twice, or after a create that failed."""
        if not self.prefix:
            return
        with _signals_ignored():
            _delete_namespace(self.name)  # the holder too: it is inside
            if self.holder is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.holder.wait(timeout=5)
            self.prefix, self.holder = [], None

    def hold(self, iface: str, timeout_s: float = 10.0) -> None:
        """Start the idle process :meth:`counters` reads through; returns once ``iface`` shows there."""
        self.holder = subprocess.Popen(self.prefix + ["sleep", "1000000"], stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError, NetemuError):
                self.counters(iface)
                return
            if time.monotonic() > deadline:
                raise NetemuError(f"the holder process of namespace {self.name} did not start")
            time.sleep(0.02)

    def counters(self, iface: str) -> Tuple[int, int]:
        """(rx_bytes, tx_bytes) of ``iface`` in this namespace (needs :meth:`hold`)."""
        return iface_bytes(f"/proc/{self.holder.pid}/net/dev", iface)


class LoopbackNetns(Netns):
    """A namespace of loopback only: what runs under :attr:`prefix` talks to nothing but itself.

    It has no route anywhere, so looking up a name that exists nowhere fails at once: the DNS query cannot be
    sent, nothing leaves the machine. Besides ``lo`` it holds a veth pair with a documentation address
    (192.0.2.1/32) of its own, because getaddrinfo(AI_ADDRCONFIG), which Slurm uses, returns nothing on a host
    whose only addresses are loopback. A random suffix keeps two of one process apart.
    """

    def __init__(self, prefix: str = "gptlo"):
        super().__init__(prefix, f"x{int.from_bytes(os.urandom(2), 'little')}")

    def create(self) -> None:
        super().create()
        self.ip("link", "add", "v0", "type", "veth", "peer", "name", "v1")
        self.ip("addr", "add", "192.0.2.1/32", "dev", "v0")
        for dev in ("v0", "v1"):
            self.ip("link", "set", dev, "up")


def namespaces(prefix: str, pid: Optional[int] = None) -> List[str]:
    """Names of the namespaces :class:`Netns` made with ``prefix`` in process ``pid`` (any process if None)."""
    pattern = re.compile(rf"{re.escape(prefix)}({pid if pid is not None else '[0-9]+'})([a-z]\w*)?")
    listed = [ln.split()[0] for ln in _run([tool("ip"), "netns", "list"], check=False).stdout.splitlines()
              if ln.strip()]
    return [name for name in listed if pattern.fullmatch(name)]


def cleanup_stale(prefix: str) -> List[str]:
    """Remove the namespaces made with ``prefix`` by processes that are gone (a run killed by SIGKILL, which no
    ``finally`` survives), with every process still inside. Returns their names."""
    removed = []
    for name in namespaces(prefix):
        creator = int(re.match(rf"{re.escape(prefix)}([0-9]+)", name).group(1))
        if not alive(creator):
            _delete_namespace(name)
            removed.append(name)
    return removed


# ---------------------------------------------------------------------------------------------------------------
# a cluster of nodes on shaped links


def shape(ns: Netns, dev: str, rate_bps: float, delay_s: float) -> bool:
    """Egress of ``dev``: tbf at the link rate, netem ``delay_s`` under it where the kernel has sch_netem.
    Returns whether the delay is applied."""
    burst = max(16384, int(rate_bps / 8 * 0.002))  # 2 ms at line rate, at least 16 KiB (GSO segments larger)
    ns.tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{int(rate_bps)}bit",
          "burst", str(burst), "latency", "50ms")
    return delay_s > 0 and ns.tc("qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem", "delay",
                                 f"{int(round(delay_s * 1e6))}us", "limit", "100000", check=False)


class Cluster(_Managed):
    """``nodes`` namespaces joined by veth links shaped with tc; node i's link is its ``veth0``, address
    10.77.0.<i+1>/24, no route anywhere else.

    Two nodes share one veth pair; more hang off a bridge in a namespace of its own (a star: each node's link
    is shaped in both directions, the delay applied once per direction, on the node's side). ``gso`` keeps the
    veths' 64 KiB GSO packets (less CPU at high rates; the wire bytes then hold fewer headers).

    :meth:`unshape` takes the shaping (tbf, and netem under it) off every shaped device, so that the links are
    limited by the CPU only; :meth:`reshape` puts it back as :meth:`create` made it; ``with
    cluster.unshaped():`` does both around a block. :attr:`shaped` says which state the links are in. The
    framing (``gso``) stays either way, so the wire bytes of a run count the same headers.
    """

    def __init__(self, prefix: str, nodes: int = 2, rate: str = "100mbit", delay: str = "1ms", gso: bool = False):
        if nodes < 2:
            raise NetemuError(f"--nodes {nodes}: an inter-node link needs at least 2 nodes")
        if nodes > 250:
            raise NetemuError(f"--nodes {nodes}: at most 250 nodes in {SUBNET}.0/24")
        self.nodes, self.rate, self.delay, self.gso = nodes, rate, delay, gso
        self.rate_bps, self.delay_s = parse_rate(rate), parse_delay(delay)
        for name in ("ip", "tc", "nsenter"):  # missing tools fail here, before anything is made
            tool(name)
        self.node_netns = [Netns(prefix, f"n{i}") for i in range(nodes)]
        self.bridge = Netns(prefix, "br") if nodes > 2 else None
        self.procs: List[subprocess.Popen] = []
        self.delay_emulated = False
        self.shaped = False  # whether the tbf (and netem) qdiscs are on the links now
        self.notes: List[str] = []

    @property
    def namespaces(self) -> List[Netns]:
        return self.node_netns + ([self.bridge] if self.bridge else [])

    @staticmethod
    def addr(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def create(self) -> None:
        for ns in self.namespaces:
            ns.create()
        self._link()
        for i, ns in enumerate(self.node_netns):
            ns.ip("addr", "add", f"{self.addr(i)}/24", "dev", IFACE)
            ns.ip("link", "set", IFACE, "up")
        for ns, dev, delay_s in self.shaped_devices():
            if not self.gso:
                self._frames(ns, dev)
            self._shape(ns, dev, delay_s)
        self.shaped = True
        if self.delay_s > 0 and not self.delay_emulated:
            self.notes.append(f"delay {self.delay} NOT emulated: this kernel has no sch_netem "
                              "(rate shaping only, tbf)")
        for ns in self.node_netns:
            ns.hold(IFACE)

    def _link(self) -> None:
        """The veths: one pair between two nodes, else one per node from a bridge."""
        if self.bridge is None:
            a, b = self.node_netns
            a.ip("link", "add", IFACE, "type", "veth", "peer", "name", IFACE, "netns", b.name)
            return
        br = self.bridge
        br.ip("link", "add", "br0", "type", "bridge")
        br.ip("link", "set", "br0", "up")
        for i, ns in enumerate(self.node_netns):
            br.ip("link", "add", f"p{i}", "type", "veth", "peer", "name", IFACE, "netns", ns.name)
            br.ip("link", "set", f"p{i}", "master", "br0")
            br.ip("link", "set", f"p{i}", "up")

    def shaped_devices(self) -> List[Tuple[Netns, str, float]]:
        """(namespace, device, delay) of every shaped device: each node's veth0 (with the delay) and, with a
        bridge, the bridge's end of each node's link (rate only)."""
        out = [(ns, IFACE, self.delay_s) for ns in self.node_netns]
        if self.bridge:
            out += [(self.bridge, f"p{i}", 0.0) for i in range(self.nodes)]
        return out

    @staticmethod
    def _frames(ns: Netns, dev: str) -> None:
        # one IP/TCP header per MTU-sized frame, as a NIC puts on the wire (veths pass 64 KiB GSO packets;
        # tbf would split them only when they exceed its burst, i.e. at some rates and not at others)
        ns.ip("link", "set", dev, "gso_max_segs", "1")

    def _shape(self, ns: Netns, dev: str, delay_s: float) -> None:
        if shape(ns, dev, self.rate_bps, delay_s):
            self.delay_emulated = True

    def qdiscs(self) -> List[str]:
        """``tc qdisc show dev <dev>`` of every shaped device (:meth:`shaped_devices`' order), run inside its
        namespace."""
        return [_run([tool("tc"), "-n", ns.name, "qdisc", "show", "dev", dev]).stdout.strip()
                for ns, dev, _ in self.shaped_devices()]

    def unshape(self) -> None:
        """Take the shaping off every link: delete the root qdisc (the tbf, and the netem under it) of every
        shaped device, which leaves the kernel's default (noqueue on a veth); the links are then limited by the
        CPU only. Safe to call when already unshaped, or half way (a device without a root qdisc of ours is
        left as it is)."""
        self.shaped = False
        for ns, dev, _ in self.shaped_devices():
            ns.tc("qdisc", "del", "dev", dev, "root", check=False)  # fails only where there is none
        left = [q for q in self.qdiscs() if re.search(r"\b(tbf|netem)\b", q)]
        if left:
            raise NetemuError(f"could not remove the shaping: {left}")

    def reshape(self) -> None:
        """Put the shaping back on every link as :meth:`create` made it (:func:`shape`: same rate, burst and
        delay). Whatever state a device is in (shaped, unshaped, or left half way by an interrupted call), its
        root qdisc is deleted first, so the result is the same."""
        for ns, dev, delay_s in self.shaped_devices():
            ns.tc("qdisc", "del", "dev", dev, "root", check=False)
            self._shape(ns, dev, delay_s)
        self.shaped = True

    @contextlib.contextmanager
    def at_rate(self, rate_bps: float) -> Iterator["Cluster"]:
        """The links shaped to ``rate_bps`` (bits/s, each direction) inside, to the cluster's own rate after (the
        delay and framing unchanged); on an exception as :meth:`unshaped`."""
        own = self.rate_bps
        self.rate_bps = rate_bps
        try:
            self.reshape()
            yield self
        except BaseException:
            self.rate_bps = own
            with contextlib.suppress(NetemuError, subprocess.SubprocessError, OSError):
                self.reshape()
            raise
        self.rate_bps = own
        self.reshape()

    @contextlib.contextmanager
    def unshaped(self) -> Iterator["Cluster"]:
        """The links unshaped inside, shaped again after. On an exception the reshaping is tried but its own
        failure is not raised over the exception's (the namespaces may be half gone; :meth:`remove` deletes
        them with their qdiscs in any state)."""
        self.unshape()
        try:
            yield self
        except BaseException:
            with contextlib.suppress(NetemuError, subprocess.SubprocessError, OSError):
                self.reshape()
            raise
        self.reshape()

    def remove(self) -> None:
        """Kill every process started here (by pid, with their descendants), then delete the namespaces (with
        anything left inside, their veths and qdiscs). Safe to call twice; signals wait until it is done."""
        with _signals_ignored():
            kill_tree([p.pid for p in self.procs])
            for p in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
            self.procs = []
            for ns in reversed(self.namespaces):
                ns.remove()

    def spawn(self, i: int, cmd: Sequence[str], env: Dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
        """Run ``cmd`` in node i's namespace, in a session of its own, output to ``log``."""
        with open(log, "wb") as f:
            p = subprocess.Popen(self.node_netns[i].prefix + list(cmd), env=env, cwd=cwd, stdout=f,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
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
        self.procs = [p for p in self.procs if p not in procs or p.poll() is None]
        return codes

    def counters(self) -> List[Tuple[int, int]]:
        """(rx_bytes, tx_bytes) of every node's veth0."""
        return [ns.counters(IFACE) for ns in self.node_netns]


class Sampler(threading.Thread):
    """Samples a cluster's link counters every ``period_s``; :meth:`at` interpolates them at a wall-clock time
    (the step boundaries a trainer logs fall between samples)."""

    def __init__(self, cluster: Cluster, period_s: float = 0.02):
        super().__init__(daemon=True)
        self.cluster, self.period_s = cluster, period_s
        self.samples: List[Tuple[float, List[Tuple[int, int]]]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.samples.append((time.time(), self.cluster.counters()))
            except (OSError, NetemuError):
                return
            self._stop_event.wait(self.period_s)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def at(self, t: float) -> List[Tuple[float, float]]:
        s = self.samples
        if not s or t < s[0][0] or t > s[-1][0]:
            raise NetemuError("a step boundary lies outside the sampled counters")
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run as a script, the library only says what it is; it takes no arguments (a usage error, exit code 2)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="netemu.py", description="Emulated networks on one machine: the library scripts/bench_cluster.py and "
        "scripts/slurm/local_slurm.py use. It takes no arguments; bench_cluster.py --cleanup removes the "
        "namespaces a killed run left behind.")
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    import sys

    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
