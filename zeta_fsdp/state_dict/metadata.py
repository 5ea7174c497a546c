"""One home for reading a checkpoint's ``.metadata``, and for telling whether a path is a checkpoint of ours.

DCP's own reader unpickles ``.metadata`` with plain pickle: a crafted file runs whatever it names.
Every reader in this package reads it here instead, with an unpickler that knows DCP's metadata
types only. ``checkpoint_problem`` is what every destructive call (overwrite, remove, prune) asks first.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .checks import METADATA_FILE, CheckpointError, foreign_entries

__all__ = ["checkpoint_problem", "is_full_checkpoint", "load_metadata", "shard_file_name_ok"]

_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
_METADATA_GLOBALS |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
_METADATA_GLOBALS |= {("builtins", "set"), ("builtins", "frozenset")}
_METADATA_GLOBALS |= {("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}
_METADATA_CLASSES = {"BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta"}
_METADATA_CLASSES |= {"TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"}
# The files DCP's FileSystemWriter writes: one ``__<rank>_<n>.distcp`` per rank and writer thread.
_SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickle allowing only DCP's own metadata types (plain ``pickle.load`` runs whatever a file names)."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module, name) in _METADATA_GLOBALS
            or (module == "torch.distributed.checkpoint.metadata" and name in _METADATA_CLASSES)
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


def shard_file_name_ok(name: Any) -> bool:
    """``True`` for a file name a checkpoint may point to: one plain name inside its directory."""
    plain = isinstance(name, str) and not any(c in name for c in "/\\\0")
    return plain and name not in ("", ".", "..") and not os.path.isabs(name)


def load_metadata(file: Path, caller: str) -> Metadata:
    """The DCP ``Metadata`` in ``file``, unpickled with the allow-list and checked; ``CheckpointError`` otherwise.

    Every storage record must name a shard file inside the checkpoint directory, at a
    non-negative offset: a crafted ``.metadata`` cannot make a reader open another file.
    """
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - any failure here means a damaged or foreign file
        raise CheckpointError(f"{caller}: {file} is corrupted or not DCP metadata: {e}") from e
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise CheckpointError(f"{caller}: {file} is not DCP checkpoint metadata.")
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{caller}: {file} is not DCP checkpoint metadata (no state_dict_metadata).")
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not shard_file_name_ok(name):
            raise CheckpointError(
                f"{caller}: {file} points {getattr(index, 'fqn', index)!r} at {name!r}, which is not a file "
                "inside the checkpoint directory; refusing to read it."
            )
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise CheckpointError(
                f"{caller}: {file} gives {getattr(index, 'fqn', index)!r} the byte range offset={offset!r}, "
                f"length={length!r}; corrupted metadata."
            )
    return metadata


def is_full_checkpoint(path: Any) -> bool:
    """``True`` if ``path`` is a full-format checkpoint: a ``torch.save`` file (a zip archive with a pickle in it)."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") or name == "data.pkl" for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def checkpoint_problem(path: Path) -> Optional[str]:
    """Why ``path`` is not a complete checkpoint of ours (``None`` when it is).

    Ours: a real directory whose ``.metadata`` validates, holding nothing but that file and DCP
    shard files. A checkpoint someone put their own files into is not ours to replace or delete.
    """
    path = Path(path)
    if path.is_symlink():
        return "it is a symbolic link"
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return "it is a file, not a checkpoint directory"
    if not (path / METADATA_FILE).is_file() or (path / METADATA_FILE).is_symlink():
        return f"it has no {METADATA_FILE} file"
    try:
        metadata = load_metadata(path / METADATA_FILE, "")
    except CheckpointError as e:
        return str(e).lstrip(": ")
    named = {info.relative_path for info in metadata.storage_data.values()}
    shown = foreign_entries(
        path,
        lambda e: (
            e.name == METADATA_FILE
            or (e.is_file(follow_symlinks=False) and bool(e.name in named or _SHARD_FILE.match(e.name)))
        ),
    )
    return f"it holds entries a checkpoint does not have ({shown})" if shown else None
