"""Where scripts/export_hf.py and scripts/import_hf.py write a directory before it is complete.

A tool writes its whole output into a staging directory beside it (``.<name>.<tool>-XXXXXXXX``, on the same file
system) and swaps it in with renames once complete (:func:`publish`): the output is either the previous one or the
new one, never a mix. Each staging directory holds a marker file (:data:`MARKER`) written when it is made: the tool,
and the host, boot, pid namespace, pid and start time of the process making it. A run that is killed (SIGKILL, an
out-of-memory kill, a lost node) leaves its staging directory behind; the next run of the tool for the same output
calls :func:`sweep`, which removes those the marker proves are this tool's and whose process is gone (puts the
previous output back first, where the kill fell between the two renames of a swap) and names in one line those it
leaves: no marker (a user's entry, or an older version's), a process still running, one on another host. Nothing is
removed on its name alone.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

MARKER = ".hf_staging.json"
"""The marker file in a staging directory (and in a previous output moved aside during a swap)."""


def _first_line(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.readline().strip() or None
    except OSError:
        return None


def _start_time(pid: int) -> Optional[int]:
    """The start time of process ``pid`` (clock ticks since boot, /proc/PID/stat's 22nd field), None where
    unknown: with the pid, it tells the process from a later one given the same pid."""
    line = _first_line(f"/proc/{pid}/stat")
    try:
        return int(line.rpartition(")")[2].split()[19]) if line else None
    except (ValueError, IndexError):
        return None


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def owner() -> Dict[str, Any]:
    """What identifies this process in a marker."""
    return {"host": socket.gethostname(), "boot": _first_line("/proc/sys/kernel/random/boot_id"),
            "pid_namespace": _pid_namespace(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def owner_gone(marker: Dict[str, Any]) -> Tuple[bool, str]:
    """(whether the process that wrote ``marker`` is provably gone, why or why not, in words)."""
    me, pid, host = owner(), marker["pid"], marker["host"]
    if host != me["host"]:
        return False, f"made on host {host}"
    if marker.get("boot") and me["boot"] and marker["boot"] != me["boot"]:
        return True, f"host {host} has restarted since pid {pid} made it"
    if marker.get("pid_namespace") != me["pid_namespace"]:
        return False, f"made by pid {pid} in another process namespace (container) of host {host}"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True, f"pid {pid} on {host} has ended"
    except PermissionError:
        pass  # a process of another user's: running
    start = _start_time(pid)
    if marker.get("start") is not None and start is not None and start != marker["start"]:
        return True, f"pid {pid} on {host} has ended (the pid is another process's now)"
    return False, f"pid {pid} on {host} is still running"


def read_marker(directory: Path, tool: str) -> Optional[Dict[str, Any]]:
    """The marker ``tool`` wrote in ``directory``; None where there is none or it is not one (a file of another
    shape, another tool's)."""
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("tool") != tool or not isinstance(marker.get("host"), str):
        return None
    pid = marker.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:  # kill(0) or kill(-1) would reach others
        return None
    return marker


def staging_dir(out: Path, tool: str, role: str = "staging") -> Path:
    """An empty directory beside ``out`` (on its file system) to write ``tool``'s output into, readable as ``out``
    would be, holding only its marker; ``role`` "previous" names one that holds a previous output during a swap."""
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}.{tool}-" + ("previous-" if role == "previous" else "")
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
    marker = {"tool": tool, "role": role, "output": out.name, "created": time.time(), **owner()}
    (staging / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    if role == "staging":
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp creates it 0700
    return staging


def publish(staging: Path, out: Path, tool: str) -> None:
    """Move a complete output from ``staging`` to ``out``: one rename where ``out`` does not exist; else the
    previous directory is renamed aside (into a marked directory), the new one in, and the previous one removed, so
    that ``out`` holds exactly this output and nothing of the previous one. Where the second rename fails the
    previous directory is put back. The marker is removed from ``out`` once it is in place."""
    if not os.path.lexists(out):
        os.rename(staging, out)
    else:
        aside = staging_dir(out, tool, role="previous")
        os.rename(out, aside / out.name)
        try:
            os.rename(staging, out)
        except OSError:
            os.rename(aside / out.name, out)
            shutil.rmtree(aside, ignore_errors=True)  # its marker only
            raise
        shutil.rmtree(aside, ignore_errors=True)  # what is left is marked: the next sweep removes it
    (out / MARKER).unlink()  # killed before this, the next sweep removes it


def sweep(out: Path, tool: str, label: str) -> Tuple[List[str], List[str]]:
    """Clear what earlier runs of ``tool`` that were killed left beside ``out``: each ``.<name>.<tool>-*`` entry
    whose marker proves it ``tool``'s and its process gone is removed (a previous output moved aside by a run killed
    mid-swap is renamed back to ``out`` first, where ``out`` is missing), and a marker left in ``out`` itself by a
    run killed just after its swap is removed. One line on stderr (prefixed ``label``) says what was removed, one
    what was left and why. Returns (removed, left) as those phrases."""
    done: List[str] = []
    left: List[str] = []
    prefix = f".{out.name}.{tool}-"
    try:
        entries = sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix))
    except OSError:  # no parent yet: nothing beside it
        entries = []
    for path in entries:
        marker = read_marker(path, tool) if path.is_dir() and not path.is_symlink() else None
        if marker is None:
            left.append(f"{path.name} (it holds no {MARKER} of {tool}: not provably this tool's)")
            continue
        gone, why = owner_gone(marker)
        if not gone:
            left.append(f"{path.name} ({why})")
            continue
        previous = path / out.name
        try:
            if marker.get("role") == "previous" and previous.is_dir() and not os.path.lexists(out):
                os.rename(previous, out)
                done.append(f"put the previous {out.name} back from {path.name} ({why} mid-swap)")
            shutil.rmtree(path)
        except OSError as e:
            left.append(f"{path.name} (cannot be removed: {e.strerror or e})")
            continue
        done.append(f"removed {path.name} ({why})")
    marker = read_marker(out, tool) if out.is_dir() and not out.is_symlink() else None
    if marker is not None and owner_gone(marker)[0]:
        (out / MARKER).unlink(missing_ok=True)
        done.append(f"removed {MARKER} from {out.name} (its run ended just after moving it in)")
    if done:
        print(f"{label} beside {out}, left by runs that were killed: {'; '.join(done)}", file=sys.stderr, flush=True)
    if left:
        print(f"{label} note: left beside {out}: {'; '.join(left)}; remove them by hand once no {tool} run writes "
              "there", file=sys.stderr, flush=True)
    return done, left
