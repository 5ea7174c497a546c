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
from pathlib import Path
from typing import Callable, Union

__all__ = ["atomic_write", "incomplete_path"]


def incomplete_path(path: Union[str, Path]) -> Path:
    """Where ``path`` is written before it is renamed into place: ``.<name>.incomplete`` beside it.

    Hidden, and in the same folder so the final rename stays on one file system (atomic).

    Example:
        >>> incomplete_path("ckpt/model.pt").as_posix()
        'ckpt/.model.pt.incomplete'
    """
    path = Path(path)
    return path.parent / f".{path.name}.incomplete"


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
