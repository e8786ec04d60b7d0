"""A throwaway Slurm cluster on this machine: munged, slurmctld and one slurmd per logical node.

For testing ``train.sbatch`` end to end without a cluster (tests/test_slurm.py)::

    python scripts/slurm/local_slurm.py                       # start, print how to use it, stop on Ctrl-C
    python scripts/slurm/local_slurm.py -- sbatch --wrap=hostname   # run one command inside, then stop

    with LocalSlurm(nodes=2, cpus=2) as cluster:               # from Python
        subprocess.run(["sinfo"], env=cluster.env())

What it does: Debian's ``munge``, ``slurmctld`` and ``slurmd`` (``apt-get install munge slurmctld
slurmd slurm-client``; :func:`ensure_packages` does it when run as root) are started in the
foreground as children of this process, with their key, config, state, spool and logs in one
temporary directory. The nodes (``smk1``, ``smk2``, ...; names that deliberately do not resolve,
as on clusters whose node names are not in DNS) all have ``NodeAddr=127.0.0.1`` and their own
port (Debian's slurmd is built with multiple-slurmd support: ``slurmd -N smk1``). Every daemon
binds to loopback only (``CommunicationParameters=NoInAddrAny``); the munge socket is private.
Daemons, Slurm commands and so the jobs run in a network namespace of their own with no route
off the machine (scripts/netemu.py's :class:`LoopbackNetns`): looking up the unresolvable node names
sends nothing.
The logical nodes share this machine's cores,
so no CPU binding (``TaskPlugin=task/none``: binding would pin the ranks of both nodes to the same
core numbers); the CPUs SLURM grants a step are still visible in ``scontrol show step``. No
accounting database: ``scontrol``/``squeue``/``sinfo`` work, ``sacct`` does not.

On exit (also on failure or Ctrl-C) jobs are cancelled, the daemons are stopped by PID
(SIGTERM, then SIGKILL), any process still carrying this cluster's ``SLURM_CONF`` in its
environment (job steps left behind) is killed by PID, and the directory is removed.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

SCRIPTS = str(Path(__file__).resolve().parents[1])
if SCRIPTS not in sys.path:  # run as a script (from any directory) or imported from tests/
    sys.path.insert(0, SCRIPTS)

import netemu  # noqa: E402

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo", "scancel", "srun")


class LocalSlurmError(RuntimeError):
    """The local cluster could not be installed, started or used (the message carries the daemon logs)."""


def missing_binaries() -> List[str]:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def ensure_packages(timeout_s: float = 600.0) -> str:
    """Install the Debian packages if a binary is missing; returns what was done (for logs).

    Raises LocalSlurmError when apt-get is needed but missing, not root, or fails.
    """
    if not missing_binaries():
        return "slurm and munge already installed"
    if shutil.which("apt-get") is None:
        raise LocalSlurmError(f"missing {', '.join(missing_binaries())} and no apt-get to install "
                              f"{' '.join(PACKAGES)}")
    if os.geteuid() != 0:
        raise LocalSlurmError(f"missing {', '.join(missing_binaries())}; installing {' '.join(PACKAGES)} "
                              "needs root (apt-get)")
    import fcntl
    with open(os.path.join(tempfile.gettempdir(), "local-slurm-apt.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test workers: one apt-get at a time (dpkg's lock would fail)
        if not missing_binaries():
            return "slurm and munge installed by another process"
        return _apt_install(timeout_s)


def _apt_install(timeout_s: float) -> str:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    began = time.monotonic()
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:  # the package lists may be missing (fresh image): update once and retry
        u = subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True, timeout=timeout_s)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            raise LocalSlurmError(f"{' '.join(cmd)} failed (exit {r.returncode}):\n{u.stderr[-2000:]}"
                                  f"{r.stdout[-3000:]}{r.stderr[-3000:]}")
    if missing_binaries():
        raise LocalSlurmError(f"after installing {' '.join(PACKAGES)}, still missing {missing_binaries()}")
    return f"installed {' '.join(PACKAGES)} in {time.monotonic() - began:.1f} s"


def _free_ports(n: int) -> List[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _which(name: str) -> str:
    path = shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin")
    if path is None:
        raise LocalSlurmError(f"{name} is not installed (apt-get install {' '.join(PACKAGES)})")
    return path


class LocalSlurm:
    """Context manager: a running local cluster; :meth:`env` is the environment for Slurm commands."""

    def __init__(self, nodes: int = 2, cpus: int = 2, prefix: str = "smk", start_timeout_s: float = 60.0):
        self.node_names = [f"{prefix}{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self.start_timeout_s = start_timeout_s
        self.dir: Optional[Path] = None
        self.procs: Dict[str, subprocess.Popen] = {}
        self.conf: Optional[Path] = None
        self.netns = netemu.LoopbackNetns()  # daemons, commands and jobs: loopback only, no DNS

    # ---- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "LocalSlurm":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="local-slurm-"))
        try:
            self.netns.create()
        except netemu.NetemuError as e:
            raise LocalSlurmError(f"the cluster's network namespace: {e}") from e
        d = self.dir
        (d / "ctld").mkdir()
        (d / "munge").mkdir(mode=0o700)
        for n in self.node_names:
            (d / "spool" / n).mkdir(parents=True)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = d / "munge" / "munge.sock"
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--socket={sock}",
                               f"--key-file={key}", f"--pid-file={d / 'munge' / 'munged.pid'}",
                               f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munge' / 'seed'}",
                               "--num-threads=2"])
        self._wait_for(lambda: sock.exists(), "munged's socket", "munged")

        ctld_port, *node_ports = _free_ports(1 + len(self.node_names))
        host = socket.gethostname().split(".")[0]
        first_job = 1000 + int.from_bytes(os.urandom(2), "little") % 9000  # distinct MASTER_PORTs per cluster
        nodes = "\n".join(
            f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={host} Port={p} CPUs={self.cpus} Sockets=1 "
            f"CoresPerSocket={self.cpus} ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN"
            for n, p in zip(self.node_names, node_ports))
        self.conf = d / "slurm.conf"
        self.conf.write_text(f"""\
# generated by scripts/slurm/local_slurm.py: a throwaway cluster, removed on exit
ClusterName=localsmoke
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire=10
CommunicationParameters=NoInAddrAny
StateSaveLocation={d / 'ctld'}
SlurmdSpoolDir={d / 'spool'}/%n
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'spool'}/%n/slurmd.pid
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'spool'}/%n/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
FirstJobId={first_job}
MinJobAge=600
KillWait=10
InactiveLimit=0
MailProg=/bin/true
PlugStackConfig={d / 'plugstack.conf'}
{nodes}
PartitionName=smoke Nodes=ALL Default=YES MaxTime=60 State=UP
""")
        (d / "plugstack.conf").write_text("")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for n in self.node_names:
            self._spawn(f"slurmd[{n}]", [_which("slurmd"), "-D", "-N", n, "-f", str(self.conf)])
        self._wait_for(self._nodes_idle, f"nodes {','.join(self.node_names)} to be idle", None)

    def _spawn(self, name: str, cmd: List[str]) -> None:
        log = open(self.dir / f"{re.sub(r'[^a-z0-9]', '_', name)}.stdout", "wb")
        try:
            self.procs[name] = subprocess.Popen(self.netns.prefix + cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                env=self.env(), start_new_session=True)
        finally:
            log.close()

    def _wait_for(self, ready, what: str, daemon: Optional[str]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise LocalSlurmError(f"{', '.join(dead)} exited while waiting for {what}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise LocalSlurmError(f"timed out after {self.start_timeout_s:.0f} s waiting for {what}\n{self.logs()}")

    def _nodes_idle(self) -> bool:
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=10)
        states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
        return all(states.get(n, "").startswith("idle") for n in self.node_names)

    def stop(self) -> None:
        """Cancel jobs, stop the daemons by PID, kill leftovers of this cluster, remove the directory."""
        if self.dir is None:
            return
        try:
            if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
                try:
                    self.run(["scancel", "--full", "--partition=smoke"], check=False, timeout=10)
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline:
                        r = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10)
                        if r.returncode == 0 and not r.stdout.strip():
                            break
                        time.sleep(0.5)
                except (subprocess.SubprocessError, OSError):
                    pass
            for name in reversed(list(self.procs)):  # slurmd, slurmctld, then munged
                p = self.procs[name]
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait(timeout=10)
            self._kill_leftovers()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
            self.netns.remove()

    def _kill_leftovers(self) -> None:
        """Kill (by PID) every process whose environment names this cluster's slurm.conf: job steps,
        slurmstepd, ranks. They were all started by this cluster's daemons, which pass the variable on."""
        marker = f"SLURM_CONF={self.conf}".encode()
        for _ in range(3):
            found = []
            for pid_dir in Path("/proc").glob("[0-9]*"):
                pid = int(pid_dir.name)
                if pid == os.getpid():
                    continue
                try:
                    if marker in (pid_dir / "environ").read_bytes().split(b"\0"):
                        found.append(pid)
                except OSError:
                    continue
            if not found:
                return
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)

    # ---- use -------------------------------------------------------------------------------------
    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """Environment for Slurm commands (and jobs: sbatch passes it on) against this cluster."""
        env = dict(os.environ if base is None else base)
        env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        env["SLURM_CONF"] = str(self.dir / "slurm.conf")
        env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
        return env

    def run(self, cmd: Sequence[str], check: bool = True, timeout: float = 30.0, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run(self.netns.prefix + list(cmd), env=kw.pop("env", None) or self.env(), capture_output=True, text=True,
                           timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise LocalSlurmError(f"{' '.join(cmd)} failed (exit {r.returncode}): {r.stdout}{r.stderr}")
        return r

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, BeginTime, ...); {} if unknown."""
        r = self.run(["scontrol", "show", "job", "-o", job_id], check=False, timeout=15)
        if r.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout))

    def logs(self, tail: int = 3000) -> str:
        if self.dir is None:
            return ""
        parts = []
        for f in sorted(self.dir.rglob("*.log")) + sorted(self.dir.glob("*.stdout")):
            try:
                text = f.read_text(errors="replace")
            except OSError:
                continue
            if text.strip():
                parts.append(f"--- {f.relative_to(self.dir)} ---\n{text[-tail:]}")
        return "\n".join(parts)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=2, help="CPUs per logical node")
    ap.add_argument("--install", action="store_true", help="apt-get install the packages if missing")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...: run it inside the cluster, then stop")
    args = ap.parse_args(argv)
    if args.install:
        print(f"[local_slurm] {ensure_packages()}", flush=True)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    with LocalSlurm(args.nodes, args.cpus) as cluster:
        print(f"[local_slurm] up: nodes {','.join(cluster.node_names)}; SLURM_CONF={cluster.conf}", flush=True)
        if cmd:
            return subprocess.run(cluster.netns.prefix + cmd, env=cluster.env()).returncode  # where the daemons listen
        print(f"[local_slurm] from another shell: SLURM_CONF={cluster.conf} {' '.join(cluster.netns.prefix)} sinfo ...; "
              "Ctrl-C stops it", flush=True)
        try:
            signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
            while all(p.poll() is None for p in cluster.procs.values()):
                time.sleep(1)
            print(f"[local_slurm] a daemon exited\n{cluster.logs()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(main())
