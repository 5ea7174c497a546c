"""Atomic publish of a checkpoint directory: write to a hidden ``.<name>.incomplete``, rename into place, recover
an overwrite interrupted between its two renames."""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Optional

from ..files import PathLock, incomplete_path, publish_dir, replaced_path
from .checks import METADATA_FILE, CheckpointError, PathLike
from .metadata import checkpoint_problem, load_metadata

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
    path = Path(path)
    recover(path)
    if not (path / METADATA_FILE).is_file():
        return False
    try:
        load_metadata(path / METADATA_FILE, "is_checkpoint()")
    except CheckpointError:
        return False
    return True


# Where save_checkpoint writes before renaming into place (zeta_fsdp.files: one naming for every write).
incomplete_dir = incomplete_path


def removal_problem(path: Path) -> Optional[str]:
    """Why ``discard_checkpoint_dir`` would refuse ``path`` (``None``: a link, an empty folder, or a checkpoint of ours)."""
    path = Path(path)
    if path.is_symlink() or not os.path.lexists(path):
        return None
    if path.is_dir() and not any(path.iterdir()):
        return None
    return checkpoint_problem(path)


def discard_checkpoint_dir(path: Path) -> None:
    """Delete a checkpoint directory of ours, its ``.metadata`` first: an interrupted delete never looks complete.

    A symbolic link is unlinked (its target never touched); anything not verifiably a checkpoint
    (``removal_problem``) raises ``CheckpointError`` naming the path and why, and is left as it is.
    """
    path = Path(path)
    problem = removal_problem(path)  # None for a link or nothing at all
    if problem is not None:
        raise CheckpointError(
            f"{path} is not a checkpoint written by this library ({problem}); refusing to delete it. "
            "Remove it yourself if it is yours to delete."
        )
    if path.is_symlink() or not os.path.lexists(path):
        path.unlink(missing_ok=True)
        return
    with contextlib.suppress(OSError):
        (path / METADATA_FILE).unlink()
    shutil.rmtree(path, ignore_errors=True)


def recover(path: Path, *, locked: bool = False) -> None:
    """Finish an overwrite that stopped between its two renames (``save_checkpoint``'s last step).

    Then ``path`` is missing and ``.<name>.replaced`` holds what was there: the new checkpoint is
    renamed into place if ``.<name>.incomplete`` holds it complete, else the previous one is put back.
    Done under ``path``'s lock (``locked``: the caller holds it), waited for up to ``LOCK_WAIT_S`` so
    every rank that finds the path missing sees it back; without the lock nothing is done.
    """
    old, tmp = replaced_path(path), incomplete_dir(path)
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
    old, tmp = replaced_path(path), incomplete_dir(path)
    hint = ""
    if old.exists():
        hint += f" An overwrite of it was interrupted: the previous checkpoint is in {old}."
    if tmp.exists():
        state = "complete" if (tmp / METADATA_FILE).is_file() else "partial"
        hint += f" A save to it was interrupted ({state} data is in {tmp})."
    return hint


def publish_checkpoint(path: Path) -> None:
    """Rename the complete ``.<name>.incomplete`` to ``path``, replacing a checkpoint there only once it is in place.

    One process only (rank 0, holding ``path``'s ``PathLock``). Where the two directories cannot be
    swapped atomically, a crash between two renames is finished by the next ``recover`` of ``path``.
    """
    publish_dir(incomplete_dir(path), path, discard=discard_checkpoint_dir)
    with contextlib.suppress(OSError):  # the rename itself on disk
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
