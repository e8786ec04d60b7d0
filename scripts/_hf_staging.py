"""Where scripts/export_hf.py writes a directory before it is complete: a staging directory beside the output (on
its file system), swapped in with renames once the whole directory is written."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def staging_dir(out: Path) -> Path:
    """An empty directory beside ``out`` (on its file system) to write the export into, readable as ``out``
    would be."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export_hf-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp creates it 0700
    return staging


def publish(staging: Path, out: Path) -> None:
    """Move a complete export from ``staging`` to ``out``: one rename where ``out`` does not exist; else the
    previous directory is renamed aside, the new one in, and the previous one removed, so that ``out`` holds exactly
    this export and nothing of the previous one. Where the second rename fails the previous directory is put back."""
    if not os.path.lexists(out):
        os.rename(staging, out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.export_hf-previous-", dir=out.parent))
    os.rename(out, aside / out.name)
    try:
        os.rename(staging, out)
    except OSError:
        os.rename(aside / out.name, out)
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)
