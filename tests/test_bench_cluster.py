"""scripts/bench_cluster.py and its emulated network, scripts/netemu.py: the emulated cluster carries and counts
bytes on its link, measures a collective there, and leaves nothing behind.

The tests that make namespaces need root, ``ip``, ``tc`` and ``nsenter`` (skipped otherwise); those of the
table's arithmetic, on synthetic results, run anywhere. Nothing leaves the machine: the namespaces
have no link to the host's network.
"""
import json
import os
import re
import shutil
import signal
import statistics
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

# the tests that make namespaces and qdiscs; the table's arithmetic (synthetic results) runs anywhere
needs_net = pytest.mark.skipif(
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


def _pids_once_inside(namespaces, pid: int, timeout: float = 30.0):
    """``_pids_in`` once ``pid`` is among them: a spawned process runs ``nsenter``, which enters the namespace a moment
    after it starts (under load, after the first look: seen on a loaded 2-core machine)."""
    deadline = time.monotonic() + timeout
    while True:
        inside = _pids_in(namespaces)
        if pid in inside or time.monotonic() > deadline:
            return inside
        time.sleep(0.05)


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


@needs_net
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


@needs_net
def test_netemu_removes_everything_after_an_exception(tmp_path):
    with pytest.raises(RuntimeError, match="inside"):
        with netemu.Cluster("tnetexc", nodes=3, rate="1gbit", delay="0") as c:  # 3 nodes: a bridge too
            sleeper = c.spawn(1, ["sleep", "1000"], dict(os.environ), tmp_path / "sleep.log", tmp_path)
            inside = _pids_once_inside(_namespaces_of_prefix("tnetexc"), sleeper.pid)
            raise RuntimeError("inside")
    assert len(inside) >= 4 and sleeper.pid in inside, inside  # 3 holders and the sleeper
    assert _namespaces_of_prefix("tnetexc") == []
    assert [p for p in inside if _alive(p)] == []


@needs_net
def test_loopback_netns_has_no_route_off_the_machine():
    with netemu.LoopbackNetns("tnetlo") as ns:
        r = subprocess.run(ns.prefix + [netemu.tool("ip"), "route", "get", "192.0.2.99"], capture_output=True,
                           text=True)
        assert r.returncode != 0 and "unreachable" in r.stderr, r
        assert _namespaces_of_prefix("tnetlo") == [ns.name]
    assert _namespaces_of_prefix("tnetlo") == []


@needs_net
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


@needs_net
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


@needs_net
def test_injected_failure_removes_the_namespaces():
    p = subprocess.Popen([sys.executable, str(SCRIPT), "--nodes", "3", "--fail-after-setup"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, out + err
    assert "injected failure" in err
    assert f"bcl{p.pid}br" in out  # it had made them (3 nodes: a bridge namespace too)
    assert _namespaces_of(p.pid) == []


@needs_net
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


# ---------------------------------------------------------------------------------------------------------------
# the unshaped pass: shaping off and on at runtime


def _qdisc_show(ns: netemu.Netns, dev: str) -> str:
    """``tc qdisc show dev <dev>`` run inside the namespace (nsenter --net)."""
    r = subprocess.run(ns.prefix + [netemu.tool("tc"), "qdisc", "show", "dev", dev], capture_output=True,
                       text=True, check=True)
    return r.stdout.strip()


def _links_of(c: netemu.Cluster):
    """Every shaped device, listed here rather than asked of the cluster: each node's veth0 and, with a bridge,
    the bridge's port of each node."""
    links = [(ns, "veth0") for ns in c.node_netns]
    if c.nodes > 2:
        links += [(c.bridge, f"p{i}") for i in range(c.nodes)]
    return links


@needs_net
def test_unshape_and_reshape_remove_and_restore_the_qdiscs():
    with netemu.Cluster("tnetunsh", nodes=3, rate="100mbit", delay="1ms") as c:  # a bridge: 6 shaped devices
        links = _links_of(c)
        shaped = [_qdisc_show(ns, dev) for ns, dev in links]
        assert c.shaped and all("tbf" in q and "rate 100Mbit" in q for q in shaped), shaped
        if c.delay_emulated:  # netem under the nodes' tbf where the kernel has sch_netem
            assert all("netem" in q for q in shaped[:3]), shaped

        def assert_unshaped():
            qs = [_qdisc_show(ns, dev) for ns, dev in links]
            assert not c.shaped and not [q for q in qs if "tbf" in q or "netem" in q], qs

        c.unshape()
        assert_unshaped()
        c.unshape()  # twice: still fine
        assert_unshaped()
        c.reshape()
        assert c.shaped and [_qdisc_show(ns, dev) for ns, dev in links] == shaped
        c.reshape()  # on shaped links: the same again, not a second tbf
        assert [_qdisc_show(ns, dev) for ns, dev in links] == shaped
        with c.unshaped():
            assert_unshaped()
        assert c.shaped and [_qdisc_show(ns, dev) for ns, dev in links] == shaped
        assert c.qdiscs() == shaped
    assert _namespaces_of_prefix("tnetunsh") == []


@needs_net
@pytest.mark.parametrize("state", ["context", "unshaped", "half"])
def test_an_exception_while_unshaped_removes_the_namespaces(tmp_path, state):
    prefix = f"tnetux{state[0]}"
    with pytest.raises(RuntimeError, match="while unshaped"):
        with netemu.Cluster(prefix, nodes=2, rate="100mbit", delay="0") as c:
            sleeper = c.spawn(0, ["sleep", "1000"], dict(os.environ), tmp_path / "sleep.log", tmp_path)
            inside = _pids_once_inside(_namespaces_of_prefix(prefix), sleeper.pid)
            if state == "context":
                with c.unshaped():
                    assert "tbf" not in _qdisc_show(c.node_netns[0], "veth0")
                    raise RuntimeError("while unshaped")
            elif state == "unshaped":
                c.unshape()
            else:  # half way: one link unshaped, the other still shaped
                c.node_netns[0].tc("qdisc", "del", "dev", "veth0", "root")
                assert "tbf" not in _qdisc_show(c.node_netns[0], "veth0")
                assert "tbf" in _qdisc_show(c.node_netns[1], "veth0")
            raise RuntimeError("while unshaped")
    assert sleeper.pid in inside
    assert _namespaces_of_prefix(prefix) == []
    assert [p for p in inside if _alive(p)] == []


# ---------------------------------------------------------------------------------------------------------------
# the table's arithmetic, on synthetic results


def _raw(name, what, step, bound, script="train", wire=2e6, counted=3e6, error=None):
    """One pass of one row as run_row returns it."""
    if error:
        return {"row": name, "what": what, "script": script, "logs": [], "loadavg": "0", "error": error}
    return {"row": name, "what": what, "script": script, "logs": [], "loadavg": "0", "step_time_s": step,
            "tokens_per_s": 1024 / step, "wire_bytes": wire, "lower_bound_s": bound, "counted_inter_bytes": counted,
            "counted_how": "sum over ranks", "counted_rank0_by_kind": {"all_gather": counted / 8}}


# per row: what, script, per round (shaped step, bound, unshaped step); the bound wins for some, the unshaped
# step for others, and for qwz one round each way
SYNTHETIC = {
    "zero3": ("ZeRO-3", "train", [(3.10, 2.70, 0.80), (2.90, 2.74, 0.84)]),
    "qwz": ("qwZ alone", "train", [(2.40, 2.00, 1.90), (2.20, 2.10, 2.30)]),
    "zeropp": ("ZeRO++ (qwZ+hpZ+qgZ)", "train", [(1.05, 0.47, 0.91), (1.01, 0.49, 0.95)]),
    "zeropp_nohpz": ("ZeRO++ without hpZ", "train", [(1.50, 1.20, 0.90), (1.70, 1.10, 1.00)]),
    "fsdp2": ("FSDP2 full shard", "fsdp2", [(2.70, 2.40, 0.70), (2.74, 2.50, 0.72)]),
    "fsdp2_hybrid": ("FSDP2 hybrid shard", "fsdp2", [(1.23, 0.90, 1.00), (1.27, 0.92, 1.10)]),
}


def _synthetic(names=tuple(SYNTHETIC), unshaped=True, failed=()):
    out = []
    for name in names:
        what, script, rounds = SYNTHETIC[name]
        runs = [_raw(name, what, s, b, script, error="boom" if name in failed else None) for s, b, _ in rounds]
        uruns = [_raw(name, what, u, 0.01, script, wire=9e9) for _, _, u in rounds] if unshaped else None
        out.append(bench_cluster.combine(runs, uruns))
    return out


def _cells(text: str, what: str):
    [line] = [ln for ln in text.splitlines() if ln.startswith(f"| {what} |")][:1]
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _expected(name):
    _, _, rounds = SYNTHETIC[name]
    step = statistics.median(s for s, _, _ in rounds)
    bound = statistics.median(b for _, b, _ in rounds)
    unshaped = statistics.median(u for _, _, u in rounds)
    return step, bound, unshaped


def test_table_ratio_is_step_over_the_larger_of_unshaped_and_bound():
    results = _synthetic()
    text = bench_cluster.table(results)
    head = [c.strip() for c in text.splitlines()[0].strip().strip("|").split("|")]
    assert head[:5] == ["row", "step (s, shaped, median, spread)", "unshaped step (s)", "bound (s)",
                        "step / max(unshaped, bound)"]
    for r in results:
        step, bound, unshaped = _expected(r["row"])
        ratio = step / max(unshaped, bound)
        assert r["unshaped_step_time_s"] == pytest.approx(unshaped)
        assert r["lower_bound_s"] == pytest.approx(bound)  # the shaped pass's, not the unshaped pass's 0.01
        assert r["wire_bytes"] == pytest.approx(2e6)
        assert r["overlap_ratio"] == pytest.approx(ratio)
        _, _, rounds = SYNTHETIC[r["row"]]
        assert [x["overlap_ratio"] for x in r["rounds"]] == pytest.approx([s / max(u, b) for s, b, u in rounds])
        assert [x["unshaped_step_time_s"] for x in r["rounds"]] == pytest.approx([u for _, _, u in rounds])
        cells = _cells(text, r["what"])
        assert cells[0] == r["what"]
        assert cells[1].split()[0] == f"{step:.3f}"
        assert cells[2].split()[0] == f"{unshaped:.3f}"
        us = [u for _, _, u in rounds]
        assert f"({min(us):.2f}-{max(us):.2f})" in cells[2]
        assert cells[3] == f"{bound:.3f}"
        assert cells[4].split()[0] == f"{ratio:.2f}"
        if len(rounds) > 1:  # each round's ratio beside the median's
            assert cells[4].endswith("(rounds " + ", ".join(f"{s / max(u, b):.2f}" for s, b, u in rounds) + ")")
    json.dumps(results)  # what --json writes


def test_speed_up_lines_over_fsdp2_hybrid():
    results = _synthetic()
    hybrid = _expected("fsdp2_hybrid")[0]
    want = [f"speed-up of {n} over fsdp2_hybrid: {hybrid / _expected(n)[0]:.2f}x"
            for n in ("zero3", "zeropp", "zeropp_nohpz")]  # not qwz, not the FSDP2 rows
    assert bench_cluster.summary_lines(results) == want
    text = bench_cluster.table(results)
    assert [ln for ln in text.splitlines() if ln.startswith("speed-up of")] == want
    lines = text.splitlines()
    last_row = min(i for i, ln in enumerate(lines) if ln.startswith("| FSDP2 hybrid shard |"))
    by_kind = min(i for i, ln in enumerate(lines) if ln.startswith("rank 0's counted bytes"))
    assert last_row < lines.index(want[0]) < by_kind  # under the rows' table, above the by-kind one
    # no line where fsdp2_hybrid did not run or failed, nor for a failed trainer row
    assert bench_cluster.summary_lines(_synthetic(("zero3", "zeropp"))) == []
    assert bench_cluster.summary_lines(_synthetic(failed=("fsdp2_hybrid",))) == []
    assert bench_cluster.summary_lines(_synthetic(failed=("zero3",))) == want[1:]


def test_without_the_unshaped_pass_its_columns_show_a_dash():
    results = _synthetic(unshaped=False)
    text = bench_cluster.table(results)
    for r in results:
        step, bound, _ = _expected(r["row"])
        assert r["unshaped_step_time_s"] is None and r["overlap_ratio"] is None
        cells = _cells(text, r["what"])
        assert cells[2] == "-" and cells[4] == "-" and cells[3] == f"{bound:.3f}"
    # a failed unshaped pass: said in its column, no ratio
    what, script, rounds = SYNTHETIC["zero3"]
    r = bench_cluster.combine([_raw("zero3", what, s, b, script) for s, b, _ in rounds],
                              [_raw("zero3", what, 0, 0, script, error="boom") for _ in rounds])
    cells = _cells(bench_cluster.table([r]), what)
    assert re.match(r"failed: boom", cells[2]) and cells[4] == "-" and r["overlap_ratio"] is None


def test_calibrated_point_sets_the_bound_to_the_unshaped_step_and_reports_its_ratio():
    """The calibrated pass's rate makes the row's wire bound equal its unshaped step (busiest direction's bytes per
    step x 8 / unshaped seconds); its cells are the medians of rate, step and bound and step / max(unshaped,
    bound) with each round's ratio against that round's unshaped step; a failed pass shows its error."""
    shaped = {"busiest_direction_bytes": 1.25e6, "step_time_s": 0.5}
    assert bench_cluster.calibrated_rate(shaped, {"step_time_s": 0.25}) == pytest.approx(40e6)
    assert bench_cluster.calibrated_rate(shaped, {"error": "boom"}) is None
    assert bench_cluster.calibrated_rate({"error": "boom"}, {"step_time_s": 0.25}) is None
    [row] = _synthetic(("zeropp",))
    unshaped = [u for _, _, u in SYNTHETIC["zeropp"][2]]  # 0.91, 0.95
    passes = [{"rate_bps": 40e6, "step_time_s": 1.10, "lower_bound_s": 0.90},
              {"rate_bps": 44e6, "step_time_s": 1.20, "lower_bound_s": 0.96}]
    out = bench_cluster.with_calibrated(dict(row), passes)
    cal = out["calibrated"]
    assert cal["rate_bps"] == pytest.approx(42e6) and cal["step_time_s"] == pytest.approx(1.15)
    assert cal["overlap_ratio"] == pytest.approx(1.15 / max(row["unshaped_step_time_s"], 0.93))
    assert [r["overlap_ratio"] for r in cal["rounds"]] == pytest.approx(
        [1.10 / max(unshaped[0], 0.90), 1.20 / max(unshaped[1], 0.96)])
    cells = _cells(bench_cluster.table([out]), row["what"])
    assert cells[5] == "42.0, 1.150, 0.930"
    assert cells[6].split()[0] == f"{cal['overlap_ratio']:.2f}"
    failed = bench_cluster.with_calibrated(dict(row), [{"error": "boom"}, {"error": "boom"}])
    assert _cells(bench_cluster.table([failed]), row["what"])[5] == "failed: boom"
    assert bench_cluster.with_calibrated(dict(row), None) == row
    json.dumps(out)


def test_link_profile_bins_each_steps_busiest_tx_by_time_since_the_step_began():
    """Two steps of 40 ms at 8 Mbit/s (1 MB/s): node 1 sends at full rate in each step's first 20 ms and idles in
    the second, node 0 sends at half rate throughout: the profile is 1.0 then 0.5 (the busiest node per sample)."""
    samples, tx = [], [0, 0]
    for k in range(17):  # every 5 ms, 0..80 ms
        t = 100.0 + 0.005 * k
        samples.append((t, [(0, tx[0]), (0, tx[1])]))
        tx[0] += 2500  # 0.5 MB/s
        tx[1] += 5000 if (k % 8) < 4 else 0  # 1 MB/s in the first 20 ms of each 40 ms step
    prof = bench_cluster.link_profile(samples, [100.0, 100.04, 100.08], 8e6)
    assert [round(t, 3) for t, _, _ in prof] == [0.0, 0.02]
    assert [u for _, u, _ in prof] == pytest.approx([1.0, 0.5])
    assert [n for _, _, n in prof] == [8, 8]
    lines = bench_cluster.profile_lines([{"what": "row", "link_profile": prof}, {"what": "other"}])
    assert lines[1].startswith("link utilisation through the step, row") and len(lines) == 5
    assert lines[3].split()[-1] == "1.00" and lines[4].split()[-1] == "0.50"


def test_chain_floor_and_its_table():
    """The floor an exact schedule cannot beat when ``share`` of the step's bytes cross while every rank waits:
    at the calibrated point (bound = unshaped) 1 + share; where the wire dominates, the wire alone (1.00) until the
    unshaped step plus the chain passes it. ``chain_share`` is the analytic chain of the row's own config (only
    ZeRO-3 trainer rows), and the table puts each floor beside the measured ratio."""
    assert bench_cluster.chain_floor(0.25, 0.5, 0.5) == pytest.approx(1.25)
    assert bench_cluster.chain_floor(0.25, 0.5, 2.0) == pytest.approx(1.0)
    assert bench_cluster.chain_floor(0.25, 0.7, 0.8) == pytest.approx((0.7 + 0.2) / 0.8)
    assert bench_cluster.chain_floor(0.25, 1.0, 0.4) == pytest.approx(1.1)
    assert bench_cluster.chain_floor(0.25, None, 0.4) is None
    args = bench_cluster.parse_args(["--rows", "zero3,zeropp,fsdp2_hybrid"])
    rows = bench_cluster.rows_for(args.ranks_per_node)
    assert bench_cluster.chain_share(rows["fsdp2_hybrid"], args, 4) is None
    assert bench_cluster.chain_share(rows["dp"], args, 4) is None
    stage2 = bench_cluster.parse_args(["--rows", "zero3", "--model", "zero.stage=2"])
    assert bench_cluster.chain_share(rows["zero3"], stage2, 4) is None  # --model made it stage 2: no chain
    z3, zpp = (bench_cluster.chain_share(rows[n], args, 4) for n in ("zero3", "zeropp"))
    assert 0 < zpp["chain"] < z3["chain"] and zpp["share"] == pytest.approx(zpp["chain"] / zpp["step"])
    results = _synthetic(("zero3", "zeropp", "fsdp2_hybrid"))
    for r in results:
        r["chain"] = {"zero3": z3, "zeropp": zpp}.get(r["row"])
    results[1] = bench_cluster.with_calibrated(results[1], [{"rate_bps": 4e7, "step_time_s": 1.2, "lower_bound_s": 0.93}] * 2)
    lines = bench_cluster.chain_lines(results)
    assert not [ln for ln in lines if ln.startswith("| FSDP2")]
    cells = _cells("\n".join(lines), "ZeRO++ (qwZ+hpZ+qgZ)")
    step, bound, unshaped = _expected("zeropp")
    assert cells[3] == f"{zpp['share']:.3f}"
    assert cells[4] == f"{max(unshaped + zpp['share'] * bound, bound) / max(unshaped, bound):.2f}"
    assert cells[6] == f"{max(unshaped + zpp['share'] * 0.93, 0.93) / max(unshaped, 0.93):.2f}"
    assert cells[7] == f"{1.2 / max(unshaped, 0.93):.2f}"
    assert _cells("\n".join(lines), "ZeRO-3")[6] == "-"
    assert bench_cluster.chain_lines(_synthetic(("fsdp2_hybrid",))) == []
