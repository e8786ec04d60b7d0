"""Tests for parallel/launch.py: SLURM node lists, reading torchrun / SLURM / empty environments, and
finding rank 0's node when SLURM node names do not resolve."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
import torch

from parallel.launch import (LaunchEnv, LaunchError, init_distributed, parse_slurm_nodelist, read_launch_env,
                             resolve_master_addr, scontrol_node_addr)


# ---- node lists -------------------------------------------------------------------------------------

@pytest.mark.parametrize("nodelist, hosts", [
    ("node7", ["node7"]),
    ("n[01-03]", ["n01", "n02", "n03"]),
    ("a1,b[2,4-5]", ["a1", "b2", "b4", "b5"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("gpu[01-03,7],login1", ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]),
    ("c[8-10]", ["c8", "c9", "c10"]),
    ("x[007],y[1-2],z", ["x007", "y1", "y2", "z"]),
    ("  n[1-2]\n", ["n1", "n2"]),
    ("node-a[1-2]", ["node-a1", "node-a2"]),
])
def test_parse_slurm_nodelist(nodelist: str, hosts: list) -> None:
    assert parse_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "n[a-b]", "n[1-x]"])
def test_unparsable_nodelist_raises(nodelist: str) -> None:
    with pytest.raises(LaunchError):
        parse_slurm_nodelist(nodelist)


@pytest.mark.parametrize("nodelist, hosts", [("n[1-2]-ib", ["n1-ib", "n2-ib"]), ("n[1-3", None)])
def test_nodelist_never_returns_garbage(nodelist: str, hosts) -> None:
    try:
        got = parse_slurm_nodelist(nodelist)
    except LaunchError:
        return
    assert got == hosts


# ---- environments -----------------------------------------------------------------------------------

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_TASKS_PER_NODE": "4(x2)",
         "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}


def test_torchrun_environment() -> None:
    env = read_launch_env(dict(TORCHRUN))
    assert env == LaunchEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, master_addr="10.0.0.1",
                            master_port=29500, launcher="torchrun", master_source="MASTER_ADDR")


def test_torchrun_takes_precedence_over_slurm() -> None:
    env = read_launch_env({**SLURM, **TORCHRUN})
    assert env.launcher == "torchrun" and env.rank == 5


def test_slurm_environment() -> None:
    env = read_launch_env(dict(SLURM))
    assert env.launcher == "slurm"
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (6, 8, 2, 4)
    assert env.master_addr == "gpu07"  # first host of the node list
    assert env.master_port == 20000 + 123456 % 20000


def test_slurm_master_overrides_and_step_nodelist() -> None:
    env = read_launch_env({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "1234",
                           "SLURM_STEP_NODELIST": "step[3-4]", "SLURM_NTASKS_PER_NODE": "4"})
    assert (env.master_addr, env.master_port, env.local_world_size) == ("head", 1234, 4)
    env = read_launch_env({**SLURM, "SLURM_STEP_NODELIST": "step[3-4]"})
    assert env.master_addr == "step3"
    env = read_launch_env({**SLURM, "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2,2,2,2"})
    assert env.local_world_size == 2


def test_no_launcher_is_a_single_process() -> None:
    env = read_launch_env({})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (0, 1, 0, 1, "single")
    # a SLURM allocation with one task is also a single process
    env = read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"})
    assert env.launcher == "single" and env.world_size == 1


@pytest.mark.parametrize("env, variable", [
    ({**TORCHRUN, "RANK": "five"}, "RANK"),
    ({**TORCHRUN, "WORLD_SIZE": "8.0"}, "WORLD_SIZE"),
    ({k: v for k, v in TORCHRUN.items() if k != "RANK"}, "RANK"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "MASTER_PORT"),
    ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "SLURM_JOB_NODELIST"),
    ({**SLURM, "SLURM_PROCID": "x"}, "SLURM_PROCID"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"}, "SLURM_LOCALID"),
    ({k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"}, "SLURM_TASKS_PER_NODE"),
    ({**SLURM, "SLURM_TASKS_PER_NODE": "(x2)"}, "SLURM_TASKS_PER_NODE"),
])
def test_malformed_environment_names_the_variable(env: dict, variable: str) -> None:
    with pytest.raises(LaunchError, match=variable):
        read_launch_env(env)


@pytest.mark.parametrize("env, numbers", [
    ({**TORCHRUN, "RANK": "8"}, ["8"]),
    ({**TORCHRUN, "RANK": "-1"}, ["-1", "8"]),
    ({**SLURM, "SLURM_PROCID": "9"}, ["9", "8"]),
    ({**TORCHRUN, "LOCAL_RANK": "4"}, ["4"]),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "16"}, ["16", "8"]),
])
def test_out_of_range_ranks(env: dict, numbers: list) -> None:
    with pytest.raises(LaunchError) as e:
        read_launch_env(env)
    msg = str(e.value)
    assert "rank" in msg.lower()
    for n in numbers:
        assert n in msg


@pytest.mark.parametrize("env, variable", [
    ({**TORCHRUN, "LOCAL_RANK": "one"}, "LOCAL_RANK"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "4x"}, "LOCAL_WORLD_SIZE"),
    ({**SLURM, "SLURM_NTASKS": "eight"}, "SLURM_NTASKS"),
    ({**SLURM, "MASTER_PORT": "port"}, "MASTER_PORT"),
])
def test_malformed_optional_integers_name_the_variable(env: dict, variable: str) -> None:
    with pytest.raises(LaunchError, match=variable):
        read_launch_env(env)


# ---- rank 0's node: resolve before rendezvous, fail fast naming MASTER_ADDR and the node ---------------

def _resolver(known):
    """A resolver that knows only ``known`` (and records what it was asked): no DNS in these tests."""
    asked = []

    def resolve(host: str) -> bool:
        asked.append(host)
        return host in known
    resolve.asked = asked
    return resolve


def _node_addr(table):
    asked = []

    def lookup(node: str):
        asked.append(node)
        return table.get(node)
    lookup.asked = asked
    return lookup


def test_unresolvable_node_name_uses_slurms_node_addr() -> None:
    env = read_launch_env(dict(SLURM))
    lookup = _node_addr({"gpu07": "10.1.0.7", "gpu08": "10.1.0.8"})
    got = resolve_master_addr(env, resolver=_resolver({"10.1.0.7"}), node_addr=lookup)
    assert got.master_addr == "10.1.0.7" and lookup.asked == ["gpu07"]
    assert (got.rank, got.world_size, got.master_port) == (env.rank, env.world_size, env.master_port)


def test_resolvable_node_name_is_kept_without_asking_slurm() -> None:
    env = read_launch_env(dict(SLURM))
    lookup = _node_addr({"gpu07": "10.1.0.7"})
    assert resolve_master_addr(env, resolver=_resolver({"gpu07"}), node_addr=lookup) == env
    assert lookup.asked == []


@pytest.mark.parametrize("table", [{}, {"gpu07": "gpu07"}, {"gpu07": "gpu07-ib.nowhere"}])
def test_unresolvable_node_fails_fast_naming_master_addr_and_node(table) -> None:
    env = read_launch_env(dict(SLURM))
    began = time.monotonic()
    with pytest.raises(LaunchError) as e:
        resolve_master_addr(env, resolver=_resolver(set()), node_addr=_node_addr(table))
    assert time.monotonic() - began < 1
    msg = str(e.value)
    assert "MASTER_ADDR" in msg and "'gpu07'" in msg and "SLURM_JOB_NODELIST" in msg


def test_unresolvable_master_addr_is_an_error_naming_it() -> None:
    env = read_launch_env({**SLURM, "MASTER_ADDR": "head-node.nowhere"})
    lookup = _node_addr({"head-node.nowhere": "10.0.0.1"})
    with pytest.raises(LaunchError, match=r"MASTER_ADDR='head-node.nowhere' does not resolve"):
        resolve_master_addr(env, resolver=_resolver(set()), node_addr=lookup)
    assert lookup.asked == []  # an explicit MASTER_ADDR is the user's choice: not second-guessed


def test_torchrun_and_single_launches_are_not_resolved() -> None:
    for env in (read_launch_env(dict(TORCHRUN)), read_launch_env({})):
        assert resolve_master_addr(env, resolver=_resolver(set()), node_addr=_node_addr({})) == env


@pytest.fixture
def fake_scontrol(tmp_path: Path, monkeypatch):
    """An ``scontrol`` on PATH that answers ``show node -o NAME`` like SLURM 22.05 and logs its arguments."""
    log = tmp_path / "scontrol.log"
    script = tmp_path / "scontrol"
    script.write_text(f"""#!/bin/sh
echo "$@" >> {log}
[ "$1 $2 $3" = "show node -o" ] || exit 1
case "$4" in
  gpu07) echo "NodeName=gpu07 Arch=x86_64 CoresPerSocket=48 CPUAlloc=0 NodeAddr=127.0.0.1 NodeHostName=gpu07 Version=22.05.8 OS=Linux" ;;
  gpu08) echo "NodeName=gpu08 Arch=x86_64 CoresPerSocket=48 CPUAlloc=0 NodeAddr=gpu08 NodeHostName=gpu08" ;;
  *) echo "Node $4 not found" >&2; exit 1 ;;
esac
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return log


def test_scontrol_node_addr_reads_nodeaddr(fake_scontrol: Path) -> None:
    assert scontrol_node_addr("gpu07") == "127.0.0.1"
    assert scontrol_node_addr("gpu08") == "gpu08"
    assert scontrol_node_addr("gpu99") is None
    assert fake_scontrol.read_text().splitlines() == [f"show node -o {n}" for n in ("gpu07", "gpu08", "gpu99")]


def test_scontrol_missing_gives_no_address(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert scontrol_node_addr("gpu07") is None


RANK_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from parallel import launch
launch.resolves = lambda host: host == "127.0.0.1"   # no DNS: only the loopback address is known
env = launch.read_launch_env()
launch.init_distributed(env, torch.device("cpu"), timeout_s=float(sys.argv[1]))
t = torch.tensor([env.rank + 1.0])
dist.all_reduce(t)
print("rank", env.rank, "master", os.environ["MASTER_ADDR"], "sum", t.item(), flush=True)
dist.destroy_process_group()
"""


def _slurm_rank_env(rank: int, nodelist: str, port: int, path: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE",
                                                                       "LOCAL_RANK", "TORCHELASTIC"))}
    return {**env, "PATH": path, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1",
            "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "1(x2)",
            "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": "77", "MASTER_PORT": str(port)}


def _run_ranks(nodelist: str, path: str, timeout_s: float) -> list:
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with _netns() as ns:  # the ranks look up names that exist nowhere: no DNS query may leave the machine
        procs = [subprocess.Popen(ns.prefix + [sys.executable, "-c", RANK_SCRIPT, str(timeout_s)],
                                  env=_slurm_rank_env(r, nodelist, port, path), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]
        out = []
        try:
            for p in procs:
                out.append((p.wait(timeout=timeout_s + 60), p.stdout.read()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return out


def _netns():
    """A loopback-only network namespace (scripts/netemu.py); these tests need root for it."""
    import sys

    if os.geteuid() != 0:
        pytest.skip("a loopback-only network namespace needs root")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from netemu import LoopbackNetns

    return LoopbackNetns()


def test_slurm_rendezvous_on_an_unresolvable_node_name(fake_scontrol: Path) -> None:
    """The reported bug, end to end with two rank processes: SLURM_JOB_NODELIST names nodes that are in
    no DNS or hosts file. Before the fix every rank retried 'gpu07' for the whole timeout and died with a
    raw DistNetworkError; now they meet at SLURM's NodeAddr for it (127.0.0.1, from scontrol)."""
    began = time.monotonic()
    results = _run_ranks("gpu[07-08]", os.environ["PATH"], timeout_s=30)
    for rank, (code, out) in enumerate(results):
        assert code == 0 and f"rank {rank} master 127.0.0.1 sum 3.0" in out, out
    assert time.monotonic() - began < 30


def test_slurm_rendezvous_fails_fast_when_no_address_is_known(fake_scontrol: Path) -> None:
    """gpu08's NodeAddr is its own unresolvable name: every rank stops at once with a LaunchError naming
    MASTER_ADDR and the node, instead of waiting out parallel.timeout_s."""
    began = time.monotonic()
    results = _run_ranks("gpu[08-09]", os.environ["PATH"], timeout_s=120)
    assert time.monotonic() - began < 60  # far below the 120 s rendezvous timeout
    for code, out in results:
        assert code != 0 and "LaunchError" in out and "MASTER_ADDR" in out and "'gpu08'" in out, out


def test_rendezvous_that_nobody_answers_is_a_launch_error_naming_master_addr_and_port(tmp_path: Path) -> None:
    """Rank 1 of 2, MASTER_ADDR resolves but nothing listens there: after parallel.timeout_s the error is a
    LaunchError naming MASTER_ADDR, MASTER_PORT and where the address came from, not a raw DistNetworkError."""
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    env = {**_slurm_rank_env(1, "gpu[07-08]", port, os.environ["PATH"]), "MASTER_ADDR": "127.0.0.1"}
    began = time.monotonic()
    r = subprocess.run([sys.executable, "-c", RANK_SCRIPT, "2"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and time.monotonic() - began < 45
    assert f"LaunchError: rank 1 could not reach the rendezvous at MASTER_ADDR=127.0.0.1 MASTER_PORT={port} " \
           f"(from MASTER_ADDR) within 2 s" in r.stderr, r.stderr[-3000:]
