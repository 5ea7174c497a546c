"""Files written all or nothing: a reader sees the old file or the new one, never half of one.

Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> atomic_write(folder / "result.json", lambda tmp: tmp.write_text('{"ok": true}')).read_text()
    '{"ok": true}'
    >>> sorted(p.name for p in folder.iterdir())  # no temporary file left
    ['result.json']
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Union

__all__ = ["atomic_write", "incomplete_path", "publish_dir", "replaced_path"]


def incomplete_path(path: Union[str, Path]) -> Path:
    """Where ``path`` is written before it is renamed into place: ``.<name>.incomplete`` beside it.

    Hidden, and in the same folder so the final rename stays on one file system (atomic).

    Example:
        >>> incomplete_path("ckpt/model.pt").as_posix()
        'ckpt/.model.pt.incomplete'
    """
    path = Path(path)
    return path.parent / f".{path.name}.incomplete"


def replaced_path(path: Union[str, Path]) -> Path:
    """Where ``publish_dir`` keeps what was at ``path`` until the new directory is in place.

    Example:
        >>> replaced_path("ckpt/step_100").as_posix()
        'ckpt/.step_100.replaced'
    """
    path = Path(path)
    return path.parent / f".{path.name}.replaced"


def publish_dir(
    tmp: Union[str, Path], path: Union[str, Path], *, discard: Callable[[Path], object] = shutil.rmtree
) -> Path:
    """Rename the finished directory ``tmp`` to ``path``; what was at ``path`` goes only once ``tmp`` is in place.

    The previous directory waits in ``replaced_path(path)`` between the two renames and is put
    back if the second fails; ``discard`` deletes it (and a stale one left by an interrupted
    clean-up) afterwards. Returns ``path``.

    Example:
        publish_dir(incomplete_path(out), out)
    """
    tmp, path = Path(tmp), Path(path)
    old = replaced_path(path)
    replacing = path.exists()
    if replacing:
        if old.exists():
            discard(old)  # left by an interrupted clean-up: what is at path is the complete one
        path.rename(old)
    try:
        tmp.rename(path)
    except BaseException:
        if replacing and not path.exists():
            old.rename(path)  # put the previous directory back
        raise
    if replacing:
        discard(old)
    return path


def atomic_write(path: Union[str, Path], write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` to write ``incomplete_path(path)``, then rename it over ``path``.

    If ``write`` raises, ``path`` is left as it was and the temporary file is removed. Returns
    ``path``. (For folders, such as DCP checkpoints, see ``save_checkpoint``.)

    Example:
        atomic_write(out, lambda tmp: torch.save(weights, tmp))
    """
    path = Path(path)
    tmp = incomplete_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # after a failure: no half-written file left next to path
    return path
