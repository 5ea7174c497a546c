"""A checkpoint directory on disk: its ``.metadata`` read safely, whether it is complete and ours, and its atomic
publish (write to a hidden ``.<name>.incomplete``, rename into place), recovery and deletion.

DCP's own reader unpickles ``.metadata`` with plain pickle: a crafted file runs whatever it names.
Every reader in this package reads it here instead, with an unpickler that knows DCP's metadata
types only. ``checkpoint_problem`` is what every destructive call (overwrite, remove, prune) asks first.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ..files import PathLock, incomplete_path, publish_dir, replaced_path
from .checks import METADATA_FILE, CheckpointError, PathLike, foreign_entries

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


def load_metadata(file: Path, caller: str) -> Metadata:
    """The DCP ``Metadata`` in ``file``, unpickled with the allow-list and checked: every record names a shard file
    inside the checkpoint directory at a non-negative offset (a crafted one cannot make a reader open another file)."""
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
        # A file a checkpoint may point to: one plain name inside its directory.
        plain = isinstance(name, str) and not any(c in name for c in "/\\\0") and name not in ("", ".", "..")
        if not plain or os.path.isabs(name):
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
    """Why ``path`` is not a complete checkpoint of ours (``None`` when it is): a real directory whose ``.metadata``
    validates, holding nothing else but DCP shard files (one someone put their files into is not ours to delete)."""
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


# How long a save waits for another process saving to the same path before it refuses.
LOCK_WAIT_S = 60.0


def is_checkpoint(path: PathLike) -> bool:
    """``True`` if ``path`` is a complete checkpoint (an interrupted save never leaves one).

    Complete: its ``.metadata`` is there and validates. An overwrite that stopped between its two
    renames is finished first, so the checkpoint is found again at ``path``. A link to one is one.

    Example:
        >>> if is_checkpoint("ckpt/last"):
        ...     extra = load_checkpoint("ckpt/last", model, optimizer)
    """
    try:
        read_metadata(Path(path), "is_checkpoint()")
    except (OSError, CheckpointError):
        return False
    return True


def read_metadata(path: Path, caller: str) -> Metadata:
    """The validated metadata of the checkpoint directory ``path`` (an interrupted overwrite recovered first)."""
    recover(path)
    if not path.exists():
        raise FileNotFoundError(f"{caller}: {path} does not exist.{leftovers(path)}")
    if not path.is_dir():
        raise CheckpointError(f"{caller}: {path} is a file, not a checkpoint directory.")
    if not (path / METADATA_FILE).is_file():
        hint = leftovers(path)
        raise CheckpointError(f"{caller}: {path} is not a checkpoint (it has no {METADATA_FILE} file).{hint}")
    return load_metadata(path / METADATA_FILE, caller)


def discard_checkpoint_dir(path: Path, caller: str = "") -> None:
    """Delete a checkpoint directory of ours, ``.metadata`` first (an interrupted delete never looks complete); a link
    is unlinked, never followed. Anything else not verifiably ours (``checkpoint_problem``) raises, untouched."""
    path = Path(path)
    if path.is_symlink() or not os.path.lexists(path):
        path.unlink(missing_ok=True)
        return
    problem = None if path.is_dir() and not any(path.iterdir()) else checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(
            f"{caller + ': ' if caller else ''}{path} is not a checkpoint written by this library ({problem}); "
            "refusing to delete it. Remove it yourself if it is yours to delete."
        )
    with contextlib.suppress(OSError):
        (path / METADATA_FILE).unlink()
    shutil.rmtree(path, ignore_errors=True)


def recover(path: Path, *, locked: bool = False) -> None:
    """Finish an overwrite that stopped between its two renames: ``path`` missing, ``.<name>.replaced`` holding
    what was there. The new checkpoint goes into place if ``.<name>.incomplete`` holds it complete, else the
    previous one. Under ``path``'s lock (``locked``: the caller holds it; else waited for, so every rank that
    finds the path missing sees it back)."""
    old, tmp = replaced_path(path), incomplete_path(path)
    if os.path.lexists(path) or not old.is_dir():
        return
    if not locked:
        lock = PathLock(path)
        try:
            got = lock.acquire(timeout_s=LOCK_WAIT_S)
        except OSError:  # a read-only folder: no lock, nothing done
            return
        if got:
            with lock:
                recover(path, locked=True)
        return
    if (tmp / METADATA_FILE).is_file():
        source = tmp
    elif (old / METADATA_FILE).is_file():
        source = old
    else:
        return
    try:
        source.rename(path)
    except OSError:
        return  # another process was first, or no permission: the errors then say where the data is
    if source == tmp:
        discard_checkpoint_dir(old)
    which = "new" if source == tmp else "previous"
    warnings.warn(
        f"an overwrite of {path} was interrupted; restored the {which} checkpoint from {source}.", stacklevel=3
    )


def leftovers(path: Path) -> str:
    """What an interrupted save or overwrite of ``path`` left next to it, for error messages."""
    old, tmp = replaced_path(path), incomplete_path(path)
    hint = ""
    if old.exists():
        hint += f" An overwrite of it was interrupted: the previous checkpoint is in {old}."
    if tmp.exists():
        state = "complete" if (tmp / METADATA_FILE).is_file() else "partial"
        hint += f" A save to it was interrupted ({state} data is in {tmp})."
    return hint


def publish_checkpoint(path: Path) -> None:
    """Rename the complete ``.<name>.incomplete`` to ``path`` (rank 0, holding ``path``'s ``PathLock``); a crash
    between the two renames of a non-atomic swap is finished by the next ``recover`` of ``path``."""
    publish_dir(incomplete_path(path), path, discard=discard_checkpoint_dir)
    with contextlib.suppress(OSError):  # the rename itself on disk
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
