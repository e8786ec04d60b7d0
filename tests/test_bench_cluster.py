"""scripts/bench_cluster.py: the emulated cluster measures a collective on its link and leaves nothing behind.

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

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
                                 for t in ("ip", "tc", "nsenter")),
    reason="needs root, ip, tc and nsenter")


def _namespaces_of(pid: int):
    return bench_cluster.our_namespaces(pid)


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
    assert bench_cluster.parse_rate("100mbit") == 100e6
    assert bench_cluster.parse_rate("1gbit") == 1e9
    assert bench_cluster.parse_rate("2mbps") == 16e6
    assert bench_cluster.parse_delay("1ms") == pytest.approx(1e-3)
    assert bench_cluster.parse_delay("250us") == pytest.approx(250e-6)
    with pytest.raises(bench_cluster.ClusterError):
        bench_cluster.parse_rate("fast")


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
