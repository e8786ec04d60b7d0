"""How a save becomes a checkpoint, and how a failed one is reported (split from ``training/checkpoint.py``).

A save writes into a hidden temporary directory ``.step_<N>.tmp`` beside the published ones; once every rank has
written its files and the manifest (size and sha256 of every file) is there, ``publish`` renames it to
``step_<N>``, then moves ``latest`` (written beside, then renamed over), then prunes the oldest: a crash at any
point leaves the previous checkpoints intact and ``latest`` naming a complete one. A save that fails is one line
(``save_error``) naming the cause and the file, a full disk recognised even where DCP's wrapping hides its ENOSPC.
The synchronous save (``Checkpointer.save``) and the asynchronous writer (``training/async_checkpoint.py``) both
go through here.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any, List, Optional

from training.checkpoint_files import STEP_DIR


def _chain(e: BaseException) -> List[BaseException]:
    """e, its causes and contexts, and every rank's failure inside a DCP CheckpointException (recursively)."""
    seen, out, todo = set(), [], [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        out.append(x)
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return out


def _oserror(e: BaseException) -> Optional[OSError]:
    """The OSError behind e: itself, its cause/context, or one rank's failure inside a DCP CheckpointException."""
    return next((x for x in _chain(e) if isinstance(x, OSError)), None)


FULL_BELOW_BYTES = 16 * 2**20
"""A failed save on a filesystem with less free space than this is reported as a full disk."""


def _free_bytes(path: Path) -> Optional[int]:
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def save_error(e: BaseException, tmp: Path) -> str:
    """One line on why saving into ``tmp`` failed, naming the file when known. A full disk often reaches us without
    its ENOSPC: torch's zip writer turns the short write into ``RuntimeError: ... unexpected pos N vs M`` inside
    DCP's CheckpointException; so a failure with (almost) no free space left where it was writing is a full disk,
    checked before the partial save is removed."""
    os_err = _oserror(e)
    where = os_err.filename if os_err is not None and os_err.filename else tmp
    name = tmp.name.strip('.')[:-4]
    text = " ".join(str(x) for x in _chain(e))
    if os_err is not None and os_err.errno == errno.ENOSPC or "No space left" in text:
        return f"no space left on device while saving checkpoint {name} ({where})"
    free = _free_bytes(tmp) if os_err is None or os_err.errno != errno.EACCES else None
    if free is not None and free < FULL_BELOW_BYTES:
        return (f"no space left on device while saving checkpoint {name} ({tmp.parent}: {free / 2**20:.1f} MiB free "
                f"when the save failed: {_first_line(e)})")
    if "unexpected pos" in text:  # the zip writer's short write, with space free again (another writer's?)
        return f"a write of checkpoint {name} into {tmp} was cut short (disk full or over quota?): {_first_line(e)}"
    if os_err is not None:
        return f"cannot write checkpoint {tmp.name.strip('.')[:-4]}: {os_err.strerror or os_err} ({where})"
    return f"saving checkpoint into {tmp} failed: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    """The innermost failure's type and first line (a CheckpointException's own text names only ranks)."""
    x = next((x for x in _chain(e) if not getattr(x, "failures", None)), e)
    return f"{x.__class__.__name__}: {str(x).splitlines()[0] if str(x) else ''}"


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON beside ``path``, flushed to disk, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def publish(directory: Path, tmp: Path, final: Path, keep_last: int, protect: Optional[Path] = None) -> None:
    """Rename the complete save ``tmp`` to ``final``, move ``latest`` to it, prune all but the ``keep_last`` newest
    (never ``final`` nor ``protect``)."""
    trash = None
    if final.exists():  # re-saving a step (e.g. after a fall-back): swap, then drop the old one
        trash = final.with_name(f".{final.name}.old")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(tmp, final)
    reached("published")
    latest_tmp = directory / "latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, directory / "latest")
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    complete = sorted(p for p in directory.iterdir() if STEP_DIR.match(p.name))
    keep = {final, Path(protect)} if protect is not None else {final}
    for old in complete[:-keep_last]:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)


def reached(point: str) -> None:
    """A named point of a save: ``written`` (this rank's files written and hashed), ``manifest`` (rank 0: meta.json
    and the manifest written, not yet renamed), ``published`` (renamed, ``latest`` not yet moved); the asynchronous
    writer adds ``staged`` (its thread started). Nothing happens here: the crash tests replace it to kill the
    process at that point (tests/test_async_checkpoint.py)."""
