"""Tests for parallel/launch.py: SLURM node lists and reading torchrun / SLURM / empty environments."""

from __future__ import annotations

import pytest

from parallel.launch import LaunchEnv, LaunchError, parse_slurm_nodelist, read_launch_env


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
                            master_port=29500, launcher="torchrun")


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
