"""Reading a checkpoint's files without running anything in them.

Checkpoints are shared between people, and ``manifest.json`` (sizes, sha256) only catches accidents: whoever
can edit a file can re-hash it. So every file is read as data. Tensors and the per-rank RNG files load with
torch's ``weights_only`` unpickler; DCP's ``.metadata``, a plain pickle, loads through an unpickler that resolves
only the globals such metadata holds (:data:`METADATA_GLOBALS`) and undoes and refuses any attribute a pickle
sets on them. Every DCP load of the project goes through :func:`load_dcp`. A refusal is one
:class:`CheckpointError` line naming the file and the global; nothing in the file has run by then.
"""
from __future__ import annotations

import enum
import functools
import importlib
import pickle
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit this model."""


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS = frozenset({
    f"{_DCP_METADATA}.{name}" for name in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                           "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {"torch.distributed.checkpoint.filesystem._StorageInfo", "torch.Size", "torch.serialization._get_layout",
     "pathlib.PosixPath"})
"""What the ``.metadata`` pickle of our checkpoints refers to (measured on every layout: tp, pp, virtual stages,
ZeRO 1-3, hpZ, GQA, fp8, imports), besides torch's dtypes (``torch.float32``...): DCP's metadata dataclasses,
the storage info of each item, ``torch.Size`` (shapes, offsets), ``_get_layout`` (rebuilds ``torch.strided``
from its name), the memory-format enum and ``PosixPath`` (the directory it was saved to). No builtins: dicts,
lists, tuples, strings and numbers are pickle opcodes. Not ``BytesStorageMetadata``: DCP loads such items with
``torch.load(weights_only=False)``, and our checkpoints hold only tensors."""


def _shown(text: str) -> str:
    """A name read from a file, safe to print on one line."""
    return text[:200] if text.isprintable() else ascii(text[:200])


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` (the C one) resolving only :data:`METADATA_GLOBALS` and torch dtypes."""

    def __init__(self, file, where: Path):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in METADATA_GLOBALS or (module == "torch" and isinstance(vars(torch).get(name), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.where}: refused: its pickle refers to {_shown(full)}, which checkpoint metadata "
                              "never holds (only torch.distributed.checkpoint's metadata classes, sizes and dtypes); "
                              "nothing in the file was run")


@functools.lru_cache(maxsize=None)
def _mutable_globals() -> Tuple[Any, ...]:
    """The allowed globals whose attributes a pickle's BUILD could set: find_class alone does not stop a pickle
    from setting attributes of an allowed class (or function, or enum member), so these are compared before and
    after a load."""
    out: List[Any] = []
    for full in sorted(METADATA_GLOBALS):
        module, _, name = full.rpartition(".")
        obj = getattr(importlib.import_module(module), name, None)
        if obj is None or obj is torch.Size:  # absent from this torch, or immutable
            continue
        out.append(obj)
        if isinstance(obj, type) and issubclass(obj, enum.Enum):
            out += list(obj)
    return tuple(out)


def read_dcp_metadata(path: Path) -> Metadata:
    """A checkpoint's DCP metadata (``.metadata``), read without running anything in it: CheckpointError (one line
    naming the file) for a pickle that asks for another global, that sets attributes of an allowed class, or that
    is not metadata of tensors stored in this directory."""
    file = Path(path) / ".metadata"
    guarded = _mutable_globals()
    before = [dict(vars(g)) for g in guarded]
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f, file).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: named, one line
        raise CheckpointError(f"{file}: not readable as checkpoint metadata ({e.__class__.__name__}: "
                              f"{_shown(str(e).splitlines()[0] if str(e) else '')})") from None
    finally:
        changed = []
        for g, saved in zip(guarded, before):
            now = vars(g)
            if now.keys() != saved.keys() or any(now[k] is not v for k, v in saved.items()):
                changed.append(getattr(g, "__qualname__", repr(g)))
                for k in set(now) - set(saved):
                    delattr(g, k)
                for k, v in saved.items():
                    if now.get(k) is not v:
                        setattr(g, k, v)
        if changed:
            raise CheckpointError(f"{file}: refused: its pickle sets attributes of {', '.join(changed)} (undone); "
                                  "checkpoint metadata never does")
    _check_metadata(metadata, file)
    return metadata


def _check_metadata(metadata: Any, file: Path) -> None:
    """Metadata of tensors only, stored in files of the checkpoint directory itself."""
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{file}: not torch.distributed.checkpoint metadata")
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{file}: entry {_shown(str(key))} is a {type(md).__name__}, not a tensor "
                                  "(our checkpoints hold only tensors)")
    for key, md in metadata.state_dict_metadata.items():  # sizes any reader may allocate from
        size = tuple(md.size)
        if any(not isinstance(n, int) or n < 0 for n in size):
            raise CheckpointError(f"{file}: tensor {_shown(str(key))} has size {_shown(str(size))}")
        for chunk in md.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if len(offsets) != len(size) or len(sizes) != len(size) or any(
                    o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, size)):
                raise CheckpointError(f"{file}: tensor {_shown(str(key))} of size {size} has a piece at "
                                      f"{_shown(str(offsets))} of size {_shown(str(sizes))}, outside it")
    for info in metadata.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or rel != Path(rel).name or rel.startswith("."):
            raise CheckpointError(f"{file}: names a data file {_shown(str(rel))} outside the checkpoint directory")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with :func:`read_dcp_metadata` for its metadata (tensor data is read as DCP does, with
    ``torch.load(weights_only=True)``). Only the global ``.metadata``: without a ``rank`` keyword DCP does not fall
    back to rank-local metadata files, which our checkpoints never have. The metadata is read once and kept, so
    :func:`load_dcp` reads it before DCP does (DCP would log a refusal with a traceback and re-raise it as text)."""

    _read: Optional[Tuple[Path, Metadata]] = None

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        path = Path(self.path)
        if self._read is None or self._read[0] != path:
            self._read = (path, read_dcp_metadata(path))
        metadata = self._read[1]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_sizes(metadata: Metadata, expected: Dict[str, Sequence[int]], file: Path) -> None:
    """Every tensor of ``expected`` (name -> global shape this model has) that the metadata holds has that size there:
    CheckpointError naming the first that has not, before anything is allocated or read (a metadata file can claim
    any size: a re-hashed one claimed 4 TB)."""
    for key, shape in expected.items():
        md = metadata.state_dict_metadata.get(key)
        if md is not None and tuple(md.size) != tuple(shape):
            raise CheckpointError(f"{file}: tensor {key} is {tuple(md.size)} there, this model's is {tuple(shape)} "
                                  "(a checkpoint of another model, or a damaged one)")


def load_dcp(state: Dict[str, torch.Tensor], path: Path, no_dist: bool = False) -> None:
    """``dcp.load`` of a checkpoint directory through :class:`SafeFileSystemReader` (every DCP load of the
    project goes through here); a refused metadata file, or one that lacks one of ``state``'s (global) tensors or
    whose sizes are not theirs, raises its one-line CheckpointError before DCP starts (on every rank: each reads
    the same file)."""
    reader = SafeFileSystemReader(str(path))
    metadata, file = reader.read_metadata(), Path(path) / ".metadata"
    missing = [key for key in state if key not in metadata.state_dict_metadata]
    if missing:  # (DCP's own "Missing key" error is a multi-line RuntimeError)
        raise CheckpointError(f"{file}: tensor {missing[0]}, which this model has, is not there (a checkpoint of "
                              "another model or of an older version of it, or a damaged one)")
    check_sizes(metadata, {k: tuple(v.shape) for k, v in state.items()}, file)
    dcp.load(state, storage_reader=reader, no_dist=no_dist)


def read_rng_file(file: Path) -> Dict[str, torch.Tensor]:
    """A per-rank RNG file's streams, loaded with ``weights_only=True`` (it holds byte tensors and a tuple of
    ints); CheckpointError naming the file (and any global it calls for) otherwise."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - named below, one line
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
        except Exception:  # noqa: BLE001 - not even a torch file
            unsafe = []
        named = re.search(r"GLOBAL (\S+)", str(e))  # torch's own words, for a file it cannot list
        unsafe = unsafe or ([named.group(1)] if named else [])
        if unsafe:
            raise CheckpointError(f"{file}: refused: it refers to {', '.join(_shown(u) for u in unsafe)}, which an "
                                  "RNG state never holds; nothing in the file was run") from None
        raise CheckpointError(f"{file}: not readable as an RNG state ({e.__class__.__name__})") from None
    rng = state.get("rng") if isinstance(state, dict) else None
    if not isinstance(rng, dict) or set(rng) != {"default", "tp", "cpu"} or \
            not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in rng.values()):
        raise CheckpointError(f"{file}: not an RNG state (expected byte tensors 'default', 'tp' and 'cpu' "
                              "under 'rng')")
    return rng


def check_rng_files(path: Path, part: int = 0, parts: int = 1) -> None:
    """Every per-rank RNG file of a checkpoint (every ``parts``-th from ``part``: ranks share the reading) must
    load as an RNG state without running anything, whether or not this load uses it (an init_from, an export,
    sampling, a resume at another layout): a checkpoint carrying a planted pickle is refused as a whole."""
    for file in sorted(Path(path).glob("rng_rank*.pt"))[part::parts]:
        read_rng_file(file)
