"""Atomic publish of a checkpoint directory: write to a hidden ``.<name>.incomplete``, rename into place, recover
an overwrite interrupted between its two renames."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from ..files import incomplete_path, publish_dir, replaced_path
from .checks import METADATA_FILE, PathLike


def is_checkpoint(path: PathLike) -> bool:
    """``True`` if ``path`` is a complete checkpoint (an interrupted save never leaves one).

    An overwrite that stopped between its two renames (see ``save_checkpoint``) is finished first,
    so the checkpoint is found again at ``path``.

    Example:
        >>> if is_checkpoint("ckpt/last"):
        ...     extra = load_checkpoint("ckpt/last", model, optimizer)
    """
    recover(Path(path))
    return (Path(path) / METADATA_FILE).is_file()


# Where save_checkpoint writes before renaming into place, and where overwrite=True keeps the
# previous checkpoint until the new one is in place (zeta_fsdp.files: one naming for every write).
incomplete_dir = incomplete_path
replaced_dir = replaced_path


def discard_checkpoint_dir(path: Path) -> None:
    """Delete a checkpoint directory, its ``.metadata`` first: an interrupted delete never looks complete."""
    try:
        (path / METADATA_FILE).unlink()
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def recover(path: Path) -> None:
    """Finish an overwrite that stopped between its two renames (``save_checkpoint``'s last step).

    Then ``path`` is missing and ``.<name>.replaced`` holds what was there: the new checkpoint is
    renamed into place if ``.<name>.incomplete`` holds it complete, else the previous one is put back.
    Ranks and processes may race here: a rename that loses fails and changes nothing.
    """
    old, tmp = replaced_dir(path), incomplete_dir(path)
    if path.exists() or not old.is_dir():
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
    old, tmp = replaced_dir(path), incomplete_dir(path)
    hint = ""
    if old.exists():
        hint += f" An overwrite of it was interrupted: the previous checkpoint is in {old}."
    if tmp.exists():
        state = "complete" if (tmp / METADATA_FILE).is_file() else "partial"
        hint += f" A save to it was interrupted ({state} data is in {tmp})."
    return hint


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish_checkpoint(path: Path) -> None:
    """Rename the complete ``.<name>.incomplete`` to ``path``, replacing a checkpoint there only once it is in place.

    One process only (rank 0). A crash between the two renames leaves the previous checkpoint in
    ``.<name>.replaced`` and the new one, complete, in ``.<name>.incomplete``: the next
    ``is_checkpoint``, load or save of ``path`` finishes the job (``recover``).
    """
    publish_dir(incomplete_dir(path), path, discard=discard_checkpoint_dir)
    fsync_dir(path.parent)
