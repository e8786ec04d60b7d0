"""scripts/bench_cluster.py and its emulated network, scripts/netemu.py: the emulated cluster carries and counts
bytes on its link, measures a collective there, and leaves nothing behind.

Needs root, ``ip``, ``tc`` and ``nsenter`` (skipped otherwise). Nothing leaves the machine: the namespaces
have no link to the host's network.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_cluster.py"
sys.path.insert(0, str(ROOT / "scripts"))

import bench_cluster  # noqa: E402
import netemu  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
                                 for t in ("ip", "tc", "nsenter")),
    reason="needs root, ip, tc and nsenter")


def _namespaces_of(pid: int):
    return netemu.namespaces(bench_cluster.PREFIX, pid)


def _namespaces_of_prefix(prefix: str):
    return netemu.namespaces(prefix, os.getpid())


def _pids_in(namespaces):
    ip = shutil.which("ip", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    out = []
    for ns in namespaces:
        r = subprocess.run([ip, "netns", "pids", ns], capture_output=True, text=True)
        out += [int(p) for p in r.stdout.split()]
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except OSError:
        return False


def test_rate_and_delay_parsing():
    assert netemu.parse_rate("100mbit") == 100e6
    assert netemu.parse_rate("1gbit") == 1e9
    assert netemu.parse_rate("2mbps") == 16e6
    assert netemu.parse_delay("1ms") == pytest.approx(1e-3)
    assert netemu.parse_delay("250us") == pytest.approx(250e-6)
    with pytest.raises(netemu.NetemuError):
        netemu.parse_rate("fast")


def test_netemu_pair_counts_a_datagram_and_leaves_nothing(tmp_path):
    send = [sys.executable, "-c", "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM)"
            ".sendto(b'x' * 1000, ('10.77.0.2', 9))"]
    with netemu.Cluster("tnetpair", nodes=2, rate="1gbit", delay="0") as c:
        assert sorted(_namespaces_of_prefix("tnetpair")) == sorted(ns.name for ns in c.namespaces)
        before = c.counters()
        assert c.finish([c.spawn(0, send, dict(os.environ), tmp_path / "send.log", tmp_path)], 30) == [0]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the datagram leaves once node 1 has answered ARP
            (_, tx0), (rx1, _) = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(c.counters(), before)]
            if tx0 >= 1000 and rx1 >= 1000:
                break
            time.sleep(0.05)
        assert tx0 >= 1000 and rx1 >= 1000, (tx0, rx1)
        holders = [ns.holder.pid for ns in c.node_netns]
    assert _namespaces_of_prefix("tnetpair") == []
    assert [p for p in holders if _alive(p)] == []


def test_netemu_removes_everything_after_an_exception(tmp_path):
    with pytest.raises(RuntimeError, match="inside"):
        with netemu.Cluster("tnetexc", nodes=3, rate="1gbit", delay="0") as c:  # 3 nodes: a bridge too
            sleeper = c.spawn(1, ["sleep", "1000"], dict(os.environ), tmp_path / "sleep.log", tmp_path)
            inside = _pids_in(_namespaces_of_prefix("tnetexc"))
            raise RuntimeError("inside")
    assert len(inside) >= 4 and sleeper.pid in inside, inside  # 3 holders and the sleeper
    assert _namespaces_of_prefix("tnetexc") == []
    assert [p for p in inside if _alive(p)] == []


def test_loopback_netns_has_no_route_off_the_machine():
    with netemu.LoopbackNetns("tnetlo") as ns:
        r = subprocess.run(ns.prefix + [netemu.tool("ip"), "route", "get", "192.0.2.99"], capture_output=True,
                           text=True)
        assert r.returncode != 0 and "unreachable" in r.stderr, r
        assert _namespaces_of_prefix("tnetlo") == [ns.name]
    assert _namespaces_of_prefix("tnetlo") == []


def test_cleanup_stale_removes_only_a_dead_creators_namespaces():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"tnetstale{dead.pid}n0"
    subprocess.run([netemu.tool("ip"), "netns", "add", stale], check=True)
    try:
        with netemu.Netns("tnetstale", "n0") as live:
            assert netemu.cleanup_stale("tnetstale") == [stale]
            assert netemu.namespaces("tnetstale") == [live.name]
    finally:
        subprocess.run([netemu.tool("ip"), "netns", "del", stale], capture_output=True)


def test_probe_all_to_all_across_nodes_puts_every_ledger_byte_on_the_link(tmp_path):
    out = tmp_path / "probe.json"
    p = subprocess.Popen([sys.executable, str(SCRIPT), "--probe", "--probe-kinds", "all_to_all",
                          "--probe-groups", "inter", "--probe-mib", "0.5", "--probe-iters", "2", "--rate", "1gbit",
                          "--json", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text, _ = p.communicate(timeout=120)
    assert p.returncode == 0, text
    [r] = json.loads(out.read_text())["probe"]
    # one rank per node, g = 2: each rank's (g-1)/g of its input crosses the link, plus IP/TCP headers and ACKs
    assert r["kind"] == "all_to_all" and r["group_size"] == 2
    assert 1.0 <= r["wire_bytes"] / r["ledger_total"] < 1.25, r
    assert _namespaces_of(p.pid) == []


def test_injected_failure_removes_the_namespaces():
    p = subprocess.Popen([sys.executable, str(SCRIPT), "--nodes", "3", "--fail-after-setup"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, out + err
    assert "injected failure" in err
    assert f"bcl{p.pid}br" in out  # it had made them (3 nodes: a bridge namespace too)
    assert _namespaces_of(p.pid) == []


def test_sigterm_during_a_row_kills_the_ranks_and_removes_the_namespaces(tmp_path):
    p = subprocess.Popen([sys.executable, str(SCRIPT), "--rows", "zero3", "--steps", "1000", "--rate", "1gbit",
                          "--workdir", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline, inside = time.monotonic() + 120, []
        while time.monotonic() < deadline:
            namespaces = _namespaces_of(p.pid)
            inside = _pids_in(namespaces)
            if len(namespaces) == 2 and len(inside) >= 2 + 2 + 4:  # holders, torchrun agents, ranks
                break
            time.sleep(0.2)
        assert len(inside) >= 8, f"the ranks did not start: {inside}"
        p.send_signal(signal.SIGTERM)
        text, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, text
    assert _namespaces_of(p.pid) == []
    assert [q for q in inside if _alive(q)] == []
