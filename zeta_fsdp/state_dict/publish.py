"""A checkpoint directory on disk: its ``.metadata`` read safely, whether it is complete and ours, and its atomic
publish (write to a hidden ``.<name>.incomplete``, rename into place), recovery and deletion.

DCP's own reader unpickles ``.metadata`` with plain pickle: a crafted file runs whatever it names.
Every reader in this package reads it here instead, with an unpickler that knows DCP's metadata
types only. ``checkpoint_problem`` is what every destructive call (overwrite, remove, prune) asks first.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ..files import Ours, PathLock, discard_ours, incomplete_path, publish_dir, replaced_path
from .checks import METADATA_FILE, CheckpointError, PathLike, foreign_entries

_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
_METADATA_GLOBALS |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
_METADATA_GLOBALS |= {("builtins", "set"), ("builtins", "frozenset")}
_METADATA_GLOBALS |= {("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}
_METADATA_CLASSES = {"BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta"}
_METADATA_CLASSES |= {"TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"}
# The files DCP's FileSystemWriter writes: one ``__<rank>_<n>.distcp`` per rank and writer thread.
_SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")
# Everything DCP's FileSystemWriter may leave in a directory it writes (the metadata's temporary names too).
_WRITTEN = re.compile(r"^(\.metadata(\.tmp)?|__\d+_\d+\.distcp|__\d+\.metadata(\.tmp)?)$")


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
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            problem = chunk_problem(fqn, md, metadata.storage_data)
        else:
            problem = None if MetadataIndex(fqn) in metadata.storage_data else "it has no stored record"
        if problem is not None:
            raise CheckpointError(
                f"{caller}: {file} describes {fqn!r} inconsistently: {problem}; corrupted or crafted metadata, "
                "nothing was loaded."
            )
    return metadata


def chunk_problem(fqn: str, md: TensorStorageMetadata, records: dict) -> Optional[str]:
    """Why the saved chunks of one tensor do not cover it exactly once (``None`` when they do): each chunk lies
    inside the tensor and has a stored record, no two overlap, and their volumes add up to the tensor's."""
    size = tuple(md.size)
    boxes = []
    for chunk in md.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        inside = len(offsets) == len(sizes) == len(size) and all(
            isinstance(o, int) and isinstance(n, int) and o >= 0 and n >= 0 and o + n <= d
            for o, n, d in zip(offsets, sizes, size)
        )
        if not inside:
            return f"a chunk at offsets {list(offsets)} of sizes {list(sizes)} lies outside its size {list(size)}"
        if math.prod(sizes) and MetadataIndex(fqn, torch.Size(offsets)) not in records:
            return f"its chunk at offsets {list(offsets)} has no stored record"
        boxes.append((offsets, sizes))
    covered = sum(math.prod(n) for _, n in boxes)
    if covered != math.prod(size):
        why = "a chunk is missing" if covered < math.prod(size) else "chunks overlap or repeat"
        return f"its chunks hold {covered} of its {math.prod(size)} elements {list(size)} ({why})"
    live = sorted((b for b in boxes if math.prod(b[1])), key=lambda b: b[0][:1])
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for offsets, sizes in live:  # sweep along dim 0: only chunks whose rows meet can overlap
        active = [a for a in active if not size or a[0][0] + a[1][0] > offsets[0]]
        for a in active:
            if all(max(a[0][d], offsets[d]) < min(a[0][d] + a[1][d], offsets[d] + sizes[d]) for d in range(len(size))):
                return f"its chunks at offsets {list(a[0])} and {list(offsets)} overlap"
        active.append((offsets, sizes))
    return None


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
    """``True`` if ``path`` is a complete checkpoint (an interrupted save never leaves one). Only reads: no lock,
    no rename, no warning.

    Complete: its ``.metadata`` is there and validates. An overwrite that stopped between its two renames
    counts when the checkpoint ``load_checkpoint`` would restore at ``path`` is complete. A link to one is one.

    Example:
        >>> if is_checkpoint("ckpt/last"):
        ...     extra = load_checkpoint("ckpt/last", model, optimizer)
    """
    path = Path(path)
    if not os.path.lexists(path):
        path = _recoverable(path) or path
    try:
        _checked_metadata(path, "is_checkpoint()")
    except (OSError, CheckpointError):
        return False
    return True


def read_metadata(path: Path, caller: str) -> Metadata:
    """The validated metadata of the checkpoint directory ``path`` (an interrupted overwrite recovered first)."""
    recover(path)
    return _checked_metadata(path, caller)


def _checked_metadata(path: Path, caller: str) -> Metadata:
    if not path.exists():
        raise FileNotFoundError(f"{caller}: {path} does not exist.{leftovers(path)}")
    if not path.is_dir():
        raise CheckpointError(f"{caller}: {path} is a file, not a checkpoint directory.")
    if not (path / METADATA_FILE).is_file():
        hint = leftovers(path)
        raise CheckpointError(f"{caller}: {path} is not a checkpoint (it has no {METADATA_FILE} file).{hint}")
    return load_metadata(path / METADATA_FILE, caller)


def _recoverable(path: Path) -> Optional[Path]:
    """Where ``recover`` would take ``path`` from after an overwrite stopped between its renames (``None``: none)."""
    old, tmp = replaced_path(path), incomplete_path(path)
    if os.path.lexists(path) or not old.is_dir():
        return None
    return tmp if (tmp / METADATA_FILE).is_file() else old if (old / METADATA_FILE).is_file() else None


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
    source = _recoverable(path)
    if source is None:
        return
    try:
        source.rename(path)
    except OSError:
        return  # another process was first, or no permission: the errors then say where the data is
    if source == tmp:
        discard_ours(old, checkpoint_files(old), origin=path, first=(METADATA_FILE,))
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


def checkpoint_files(path: Path) -> Ours:
    """The names of the files this library wrote in the checkpoint directory ``path``: what DCP writes, and the
    shard files its ``.metadata`` names (when it reads): ``discard_ours`` deletes these and keeps anything else."""
    named: set[str] = set()
    try:
        if (path / METADATA_FILE).is_file() and not (path / METADATA_FILE).is_symlink():
            named = {info.relative_path for info in load_metadata(path / METADATA_FILE, "").storage_data.values()}
    except (OSError, CheckpointError):
        pass
    return lambda name: name in named or bool(_WRITTEN.match(name))


def discard_staging(path: Path) -> None:
    """Remove what a save of ``path`` left in ``.<name>.incomplete`` (the caller holds ``path``'s lock): the files
    DCP writes; anything else in it is kept (``discard_ours``)."""
    tmp = incomplete_path(path)
    discard_ours(tmp, checkpoint_files(tmp), origin=path, first=(METADATA_FILE,))


def publish_checkpoint(path: Path, *, replace: bool = True) -> None:
    """Put the complete ``.<name>.incomplete`` in place at ``path`` (rank 0, holding ``path``'s ``PathLock``) with
    ``publish_dir``: of the previous checkpoint only our files go, a file a user added meanwhile is kept. A crash
    between the two renames of a non-atomic swap is finished by the next ``recover`` of ``path``."""
    ours = checkpoint_files(path)
    publish_dir(incomplete_path(path), path, ours=ours, replace=replace, first=(METADATA_FILE,))
    with contextlib.suppress(OSError):  # the rename itself on disk
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
