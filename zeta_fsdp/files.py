"""Files written all or nothing: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Union

__all__ = ["PathLock", "atomic_write", "exchange_paths", "incomplete_path", "publish_dir", "remove_tree"]
__all__ += ["replaced_path"]


def _hidden_sibling(path: Union[str, Path], suffix: str) -> Path:
    path = Path(path)
    return path.parent / f".{path.name}.{suffix}"


def incomplete_path(path: Union[str, Path]) -> Path:
    """Where ``path`` is written before it is renamed into place: ``.<name>.incomplete``, hidden and
    beside it, so the final rename stays on one file system (atomic)."""
    return _hidden_sibling(path, "incomplete")


def replaced_path(path: Union[str, Path]) -> Path:
    """Where ``publish_dir`` keeps what was at ``path`` until the new directory is in place."""
    return _hidden_sibling(path, "replaced")


class PathLock:
    """An exclusive lock on ``path`` between processes (``flock`` on ``.<name>.lock`` beside it), held by every writer
    of ``path`` from its first look until what it wrote is in place. The lock file is removed on release (a waiter
    that locked a removed file sees its inode gone and locks the new one); the kernel drops it if the process dies."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        self.file = _hidden_sibling(self.path, "lock")
        self._fd: Optional[int] = None

    def acquire(self, timeout_s: float) -> bool:
        """Take the lock, waiting up to ``timeout_s`` seconds; ``False`` if another holder kept it,
        ``OSError`` when the lock file cannot be created (a read-only folder)."""
        import fcntl

        deadline = time.monotonic() + timeout_s
        while True:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.02)
                continue
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.file))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)  # the holder before us removed this file: lock the one there now
                continue
            self._fd = fd
            return True

    def release(self) -> None:
        """Remove the lock file and let the next waiter in (no-op when not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.file)  # still locked: a waiter re-checks the inode after locking
        os.close(fd)

    def __enter__(self) -> PathLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange_paths(a: Union[str, Path], b: Union[str, Path]) -> bool:
    """Swap the entries ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``): a reader of ``b``
    sees the old entry or the new one, never none. ``False`` where the system cannot (nothing changed)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def remove_tree(path: Union[str, Path]) -> None:
    """Delete ``path``: a symbolic link is unlinked (never followed), a directory removed with its content."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def publish_dir(
    tmp: Union[str, Path], path: Union[str, Path], *, discard: Callable[[Path], object] = remove_tree
) -> Path:
    """Rename the finished directory ``tmp`` to ``path``; what was there goes (``discard``) only once ``tmp`` is in
    place: swapped in one atomic step where the system can, else it waits in ``replaced_path(path)`` between two
    renames and is put back if the second fails. A symbolic link at ``path`` is replaced, never what it points to."""
    tmp, path = Path(tmp), Path(path)
    old = replaced_path(path)
    replacing = path.exists() or path.is_symlink()
    if replacing and exchange_paths(tmp, path):
        try:
            discard(tmp)  # the previous entry, now under tmp's name
        except Exception as e:  # noqa: BLE001 - the new directory is in place: say what is left, do not fail
            warnings.warn(
                f"{path} was replaced, but the previous content left at {tmp} was not removed: {e}", stacklevel=2
            )
        return path
    if replacing:
        if os.path.lexists(old):
            discard(old)  # left by an interrupted clean-up: what is at path is the complete one
        path.rename(old)
    try:
        tmp.rename(path)
    except BaseException:
        if replacing and not os.path.lexists(path):
            old.rename(path)  # put the previous directory back
        raise
    if replacing:
        discard(old)
    return path


def atomic_write(path: Union[str, Path], write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` to write ``incomplete_path(path)``, then rename it over ``path`` (returned).
    If ``write`` raises, ``path`` is left as it was and the temporary file is removed."""
    path = Path(path)
    tmp = incomplete_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # after a failure: no half-written file left next to path
    return path
