"""A checkpoint's files on disk: the manifest (size and sha256 of every file), verification against it, and finding
the checkpoint a path names (a step directory, a checkpoint root, or a run directory). ``training/checkpoint.py``
writes and reads the contents; scripts that read a checkpoint in a process of their own start here."""
from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from training.safe_load import CheckpointError, check_rng_files

STEP_DIR = re.compile(r"^step_(\d{8})$")
"""A published checkpoint's directory name."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_digest(path: Path) -> Dict[str, Any]:
    """A manifest entry: the file's size and sha256."""
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def read_manifest(path: Path) -> Tuple[Optional[str], List[Tuple[str, Dict[str, Any]]]]:
    """(what is wrong or None, sorted (file name, manifest entry) pairs) of a checkpoint's manifest.json."""
    manifest_file = path / "manifest.json"
    try:
        return None, sorted(json.loads(manifest_file.read_text())["files"].items())
    except (OSError, ValueError, KeyError) as e:
        return f"{manifest_file}: unreadable manifest ({e.__class__.__name__}: {e})", []


def file_problem(f: Path, entry: Dict[str, Any]) -> Optional[str]:
    """None if the file is present with the size and sha256 its manifest entry records, else what is wrong."""
    if not f.is_file():
        return f"{f}: missing"
    if f.stat().st_size != entry["size"]:
        return f"{f}: size {f.stat().st_size} bytes, manifest says {entry['size']} (truncated?)"
    if _sha256(f) != entry["sha256"]:
        return f"{f}: content does not match its sha256 in the manifest (corrupted)"
    return None


def verify(path: Path) -> Optional[str]:
    """None if a checkpoint is complete and intact, else what is wrong; in this process alone (scripts)."""
    problem, files = read_manifest(path)
    return problem or next(filter(None, (file_problem(path / name, entry) for name, entry in files)), None)


def checkpoint_root(path: Path) -> Path:
    """The directory holding a run's ``step_*`` checkpoints: ``path``, or the ``checkpoints/`` of a run directory."""
    return path / "checkpoints" if (path / "checkpoints").is_dir() and not any(path.glob("step_*")) else path


def find_checkpoint(path: Path, purpose: str) -> Path:
    """The checkpoint directory ``path`` names (for the scripts that read one in a process of their own): itself,
    or the newest valid one under a checkpoint root or run directory, verified against its manifest before
    anything is built. Skipped invalid ones are named on stderr ("...; <purpose> step_N"); CheckpointError (one
    line) when there is none."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory")
    if (path / "meta.json").is_file():
        problem = verify(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} is not usable: {problem}")
        check_rng_files(path)
        return path
    root = checkpoint_root(path)
    candidates = sorted((p for p in root.iterdir() if STEP_DIR.match(p.name)), reverse=True) if root.is_dir() else []
    if not candidates:
        raise CheckpointError(f"no checkpoint in {path} (expected meta.json, step_*/ or checkpoints/step_*/ there)")
    rejected = []
    for step_dir in candidates:
        problem = verify(step_dir)
        if problem is None:
            for name, why in rejected:
                print(f"WARNING: {name} is not usable ({why}); {purpose} {step_dir.name}", file=sys.stderr)
            check_rng_files(step_dir)
            return step_dir
        rejected.append((step_dir.name, problem))
    raise CheckpointError(f"no valid checkpoint in {root}: " + "; ".join(f"{n}: {p}" for n, p in rejected))


def read_verified_meta(path: Path) -> Optional[Dict[str, Any]]:
    """The meta.json of checkpoint ``path`` when its manifest lists it with the size and sha256 it has and it holds
    a JSON object, else None; nothing else is hashed (start-up checks read it; loading verifies every file)."""
    try:
        problem, files = read_manifest(path)
        entry = dict(files).get("meta.json")
        if problem is not None or entry is None or file_problem(path / "meta.json", entry) is not None:
            return None
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # not a checkpoint: the load names why
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("model"), dict) else None


def newest_with_meta(root: Path) -> Tuple[Optional[Path], Optional[Dict[str, Any]]]:
    """The newest ``step_*`` checkpoint under ``root`` whose meta.json passes ``read_verified_meta``, and that
    meta; (None, None) where there is none."""
    names = sorted((p.name for p in root.iterdir() if STEP_DIR.match(p.name)), reverse=True) if root.is_dir() else []
    for name in names:
        meta = read_verified_meta(root / name)
        if meta is not None:
            return root / name, meta
    return None, None
