"""The hardened DCP reader: an allow-list unpickler for ``.metadata``, file-length checks, a CRC-32 check of every
record, and non-tensor entries loaded with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import io
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    FileSystemReader,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .checks import METADATA_FILE, CheckpointError, dist_on, short_list
from .publish import is_checkpoint, leftovers, recover

# --- reading checkpoints safely

_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}
_METADATA_CLASSES = {
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "_MEM_FORMAT_ENCODING",
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its ``.metadata`` with plain pickle; load it allowing only DCP's own metadata types.

    Plain ``pickle.load`` (what DCP's reader does) runs whatever a crafted file names.
    """

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module, name) in _METADATA_GLOBALS
            or (module == "torch.distributed.checkpoint.metadata" and name in _METADATA_CLASSES)
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


def read_metadata(path: Path, caller: str) -> Metadata:
    recover(path)
    if not path.exists():
        raise FileNotFoundError(f"{caller}: {path} does not exist.{leftovers(path)}")
    if not path.is_dir():
        raise CheckpointError(f"{caller}: {path} is a file, not a checkpoint directory.")
    if not is_checkpoint(path):
        hint = leftovers(path)
        raise CheckpointError(f"{caller}: {path} is not a checkpoint (it has no {METADATA_FILE} file).{hint}")
    try:
        with open(path / METADATA_FILE, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - any failure here means a damaged or foreign file
        raise CheckpointError(f"{caller}: {path / METADATA_FILE} is corrupted or not DCP metadata: {e}") from e
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise CheckpointError(f"{caller}: {path / METADATA_FILE} is not DCP checkpoint metadata.")
    return metadata


def _check_files(path: Path, metadata: Metadata, caller: str) -> None:
    """Every shard file the metadata points to exists and is long enough (catches truncation early)."""
    needed: dict[str, int] = {}
    keys: dict[str, list[str]] = {}
    for index, info in metadata.storage_data.items():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
        keys.setdefault(info.relative_path, []).append(index.fqn)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{caller}: shard file {file} is missing (it holds {short_list(keys[name], 4)}).")
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(
                f"{caller}: shard file {file} is truncated: {size} bytes, the metadata needs {end} "
                f"(it holds {short_list(keys[name], 4)})."
            )


def open_checkpoint(path: Path, caller: str) -> Metadata:
    metadata = read_metadata(path, caller)
    _check_files(path, metadata, caller)
    return metadata


class _VerifyingReader(FileSystemReader):
    """DCP's file reader with safe metadata loading and a CRC-32 check of every record it reads.

    Each record in a ``.distcp`` file is a ``torch.save`` zip archive whose entries carry CRC-32s;
    ``torch.load`` does not check them, so a flipped bit would load silently as a wrong value.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path), "load")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file: Any, sinfo: Any) -> io.BytesIO:
        where = f"{Path(self.path) / sinfo.relative_path} (bytes {sinfo.offset}..{sinfo.offset + sinfo.length})"
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        if len(data) != sinfo.length:
            raise CheckpointError(f"shard record {where} is truncated.")
        try:
            bad = zipfile.ZipFile(io.BytesIO(data)).testzip()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            raise CheckpointError(f"shard record {where} is corrupted: {e}") from e
        if bad is not None:
            raise CheckpointError(f"shard record {where} is corrupted: {bad} fails its CRC-32 check.")
        return io.BytesIO(data)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but non-tensor entries load with ``torch.load(weights_only=True)``.

    Keys are matched as given (no nested flattening: ``extra`` is one object), and keys absent
    from the checkpoint are skipped (they were validated before loading).
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, allow_partial_load=True)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # ``self.state_dict`` may be a copy (sharded-tensor flattening): fill the caller's dict.
        loaded = torch.load(value, weights_only=True)
        self.state_dict[read_item.dest_index.fqn] = loaded
        self.original_state_dict[read_item.dest_index.fqn] = loaded


def dcp_load(state: dict[str, Any], path: Path, *, alone: bool = False) -> None:
    """DCP load through the safe reader and planner; ``alone``: this rank only, no collectives."""
    no_dist = alone or not dist_on()
    with warnings.catch_warnings():
        # DCP warns that it "assumes" single-process loading; here that is the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=_VerifyingReader(path), planner=_SafeLoadPlanner(), no_dist=no_dist)
