"""Who am I in the job: read the launcher's environment and initialise torch.distributed.

Three launchers are understood, checked in this order:

* torchrun (and anything else that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT);
* SLURM ``srun`` (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST ...),
  the master being the first host of the node list (or MASTER_ADDR where set);
* nothing: a single process (a process group of one is still created so that
  every code path, DeviceMesh and checkpointing included, is the same).

A malformed environment is an error that names the variable.

Under SLURM the rendezvous host is resolved before any process group exists
(:func:`resolve_master_addr`): node names often are not in DNS, and a name that does not
resolve would make every rank retry for the whole ``parallel.timeout_s`` and then die with a
raw DistNetworkError. Where the name does not resolve, SLURM's own address for the node
(``scontrol show node NAME`` -> ``NodeAddr``) is used; where that does not resolve either,
the job stops at once with a LaunchError naming MASTER_ADDR and the node.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, List, Mapping, Optional

import torch
import torch.distributed as dist


class LaunchError(RuntimeError):
    """The launcher's environment is inconsistent or incomplete."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str
    """torchrun | slurm | single."""
    master_source: str = ""
    """Where master_addr came from, for error messages: 'MASTER_ADDR', or the node list variable."""


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    if value is None:
        raise LaunchError(f"environment variable {name} is not set")
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"environment variable {name}={value!r} is not an integer") from None


def parse_slurm_nodelist(nodelist: str) -> List[str]:
    """Expand SLURM's compressed host list: ``gpu[01-03,7],login1`` -> gpu01 gpu02 gpu03 gpu7 login1.

    Bracket groups may be followed by a suffix or more groups (``rack[1-2]-n[1-2]``, expanded as a
    product); anything else (unbalanced brackets, non-numeric ranges) is an error.
    """
    hosts: List[str] = []
    for item in _split_top_level(nodelist.strip(), nodelist):
        expansions = [""]
        for piece in re.split(r"(\[[^\[\]]*\])", item):
            values = _expand_ranges(piece[1:-1], nodelist) if piece.startswith("[") else [piece]
            expansions = [e + v for e in expansions for v in values]
        hosts.extend(expansions)
    if not hosts or any(not h for h in hosts):
        raise LaunchError(f"cannot parse SLURM node list {nodelist!r}")
    return hosts


def _split_top_level(text: str, nodelist: str) -> List[str]:
    """Split on commas outside brackets, checking that brackets balance."""
    items, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise LaunchError(f"cannot parse SLURM node list {nodelist!r} (unbalanced brackets)")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise LaunchError(f"cannot parse SLURM node list {nodelist!r} (unbalanced brackets)")
    return items + [current]


def _expand_ranges(ranges: str, nodelist: str) -> List[str]:
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise LaunchError(f"cannot parse SLURM node list {nodelist!r} (range {part!r})")
        out.extend(f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1))
    return out


def _slurm_tasks_on_first_node(value: str) -> int:
    """SLURM_TASKS_PER_NODE looks like '4(x2),3' – the first count is our node size."""
    m = re.match(r"(\d+)", value)
    if not m:
        raise LaunchError(f"cannot parse SLURM_TASKS_PER_NODE={value!r}")
    return int(m.group(1))


def read_launch_env(env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    env = os.environ if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
        addr = env.get("MASTER_ADDR")
        if addr is None:
            raise LaunchError("RANK/WORLD_SIZE are set but MASTER_ADDR is not (launch with torchrun or set it)")
        port = _int(env, "MASTER_PORT")
        launcher = "torchrun"
        return _checked(LaunchEnv(rank, world, local_rank, local_world, addr, port, launcher, "MASTER_ADDR"))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env and _int(env, "SLURM_NTASKS") > 1:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID")
        per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if per_node is None:
            raise LaunchError("SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE is not set")
        local_world = _slurm_tasks_on_first_node(per_node)
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if nodelist is None:
            raise LaunchError("SLURM_JOB_NODELIST is not set")
        if env.get("MASTER_ADDR"):
            addr, source = env["MASTER_ADDR"], "MASTER_ADDR"
        else:
            source = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
            addr = parse_slurm_nodelist(nodelist)[0]
        job = _int(env, "SLURM_JOB_ID") if env.get("SLURM_JOB_ID") else 0
        # a restart inside the allocation (scripts/slurm/train.sbatch) moves to the next port: the dead group's
        # rendezvous port may still be held by its sockets
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        attempt = int(attempt) if attempt.isdigit() else 0
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 20000 + (job + attempt) % 20000
        launcher = "slurm"
        return _checked(LaunchEnv(rank, world, local_rank, local_world, addr, port, launcher, source))
    else:
        return LaunchEnv(0, 1, 0, 1, "127.0.0.1", 0, "single")


def _checked(e: LaunchEnv) -> LaunchEnv:
    rank, world, local_rank, local_world, launcher = e.rank, e.world_size, e.local_rank, e.local_world_size, e.launcher
    if not 0 <= rank < world:
        raise LaunchError(f"rank {rank} is outside the world size {world} ({launcher} environment)")
    if not 0 <= local_rank < local_world or local_world > world:
        raise LaunchError(f"local rank {local_rank} / local world size {local_world} are inconsistent with "
                          f"world size {world} ({launcher} environment)")
    return e


# ---- the rendezvous host ----------------------------------------------------------------------------

Resolver = Callable[[str], bool]
NodeAddr = Callable[[str], Optional[str]]


def resolves(host: str) -> bool:
    """True if ``host`` is an IP address or a name the system resolver knows (hosts file, DNS)."""
    try:
        return bool(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (socket.gaierror, UnicodeError, OSError):
        return False


def scontrol_node_addr(node: str, timeout_s: float = 20.0) -> Optional[str]:
    """SLURM's NodeAddr for ``node`` (``scontrol show node -o NODE``); None if scontrol is absent or fails."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        out = subprocess.run([scontrol, "show", "node", "-o", node], capture_output=True, text=True,
                             timeout=timeout_s)
    except (subprocess.SubprocessError, OSError):
        return None
    m = re.search(r"(?:^|\s)NodeAddr=(\S+)", out.stdout)
    if out.returncode != 0 or not m or m.group(1) in ("(null)", "None"):
        return None
    return m.group(1)


def resolve_master_addr(env: LaunchEnv, resolver: Resolver = resolves,
                        node_addr: NodeAddr = scontrol_node_addr) -> LaunchEnv:
    """Make sure every rank can reach the rendezvous host before it tries (SLURM launches only).

    MASTER_ADDR, where set, must resolve. Otherwise the first node of the node list is used if its
    name resolves, else SLURM's NodeAddr for it (``scontrol show node``); if neither resolves the
    error names the node, what was tried and MASTER_ADDR as the way out. torchrun and single-process
    launches are returned unchanged (torchrun's agent has already reached its store).
    """
    if env.launcher != "slurm":
        return env
    host = env.master_addr
    if resolver(host):
        return env
    if env.master_source == "MASTER_ADDR":
        raise LaunchError(f"MASTER_ADDR={host!r} does not resolve (no DNS or hosts entry) on this node "
                          f"({socket.gethostname()}, rank {env.rank}); set MASTER_ADDR to an address of rank 0's node")
    addr = node_addr(host)
    if addr is not None and addr != host and resolver(addr):
        return dataclasses.replace(env, master_addr=addr, master_source=f"NodeAddr of {host}")
    tried = (f"`scontrol show node {host}` gives NodeAddr={addr}, which does not resolve either" if addr is not None
             else f"`scontrol show node {host}` gives no NodeAddr (is scontrol on PATH?)")
    raise LaunchError(f"cannot find rank 0's node: node {host!r} (first node of {env.master_source}) does not "
                      f"resolve and {tried}; set MASTER_ADDR to an address of node {host!r} "
                      f"(e.g. in the batch script: export MASTER_ADDR=<its IP>)")


def pick_device(requested: str, env: LaunchEnv) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise LaunchError("device=cuda was requested but CUDA is not available")
    count = torch.cuda.device_count()
    if env.local_rank >= count:
        raise LaunchError(f"local rank {env.local_rank} has no GPU: this node has {count} visible GPUs")
    torch.cuda.set_device(env.local_rank)
    return torch.device("cuda", env.local_rank)


def init_distributed(env: LaunchEnv, device: torch.device, timeout_s: float) -> None:
    """Create the default process group: NCCL on GPU, gloo on CPU, with a collective timeout."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if env.launcher == "single":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    env = resolve_master_addr(env)
    # env:// honours torchrun's agent-hosted store (TORCHELASTIC_USE_AGENT_STORE); for SLURM we export
    # the variables it reads.
    os.environ.update(MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port),
                      RANK=str(env.rank), WORLD_SIZE=str(env.world_size))
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restart not in ("", "0"):
        # torchrun restarting its workers: the agent's store still holds the keys of the group before (gloo's and
        # NCCL's peer addresses among them), and a restarted rank could read a dead rank's address and fail to
        # connect. Each attempt gets a namespace of its own in it.
        kwargs["store"] = dist.PrefixStore(f"attempt_{restart}/", dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout))
    else:
        kwargs["init_method"] = "env://"
    try:
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs)
    except (dist.DistNetworkError, dist.DistStoreError) as e:  # cannot connect; the store's wait timed out
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LaunchError(f"rank {env.rank} could not reach the rendezvous at MASTER_ADDR={env.master_addr} "
                          f"MASTER_PORT={env.master_port} (from {env.master_source or 'the launcher'}) within "
                          f"{timeout_s:g} s: {first_line}") from e
