"""Files written all or nothing: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Union

__all__ = ["PathLock", "atomic_write", "exchange_paths", "incomplete_path", "publish_dir", "remove_tree"]
__all__ += ["LockUnsupportedError", "discard_ours", "kept_path", "replaced_path", "stage_dir", "end_stage"]

# ``ZETA_FSDP_FILE_LOCKS=0``: write without ``flock`` where the file system has none (one writer per path, then).
LOCKS_ENV = "ZETA_FSDP_FILE_LOCKS"
# Errors ``flock`` gives on a file system without it (Lustre without ``-o flock``, NFS without a lock manager).
_NO_FLOCK = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK, errno.EINVAL}


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


class LockUnsupportedError(OSError):
    """The file system cannot lock files (``flock`` fails): names it and the ways out.

    Example:
        try:
            save_checkpoint("/lustre/ckpt/step_100", model)
        except CheckpointError as e:
            print(e)  # "... mount it with -o flock ... or set ZETA_FSDP_FILE_LOCKS=0 ..."
    """

    def __init__(self, file: Path, error: OSError) -> None:
        super().__init__(
            error.errno,
            f"cannot lock {file}: the file system holding {file.parent} does not support file locks (flock: "
            f"{error.strerror or error}). Mount it with locking enabled (Lustre: -o flock; NFS: a running lock "
            f"manager, or -o local_lock=flock when one node writes), write to another file system, or set "
            f"{LOCKS_ENV}=0 to write without locks (then never let two jobs write the same path at once)",
        )


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

        if os.environ.get(LOCKS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
            return True  # the user's opt-out: no lock file, nothing to release
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
            except OSError as e:
                os.close(fd)
                if e.errno in _NO_FLOCK:
                    self._unlink_own()
                    raise LockUnsupportedError(self.file, e) from e
                raise
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

    def _unlink_own(self) -> None:
        """Remove the lock file after ``flock`` itself failed: nobody can hold it (locks do not work there)."""
        with contextlib.suppress(OSError):
            os.unlink(self.file)

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


# Names of the regular files this library writes in a directory of one kind (a checkpoint, a model directory).
Ours = Callable[[str], bool]


def kept_path(path: Union[str, Path]) -> Path:
    """A free name beside ``path`` for what a user put into it: ``<name>.kept``, then ``<name>.kept-2``, ...
    No clean-up of this library ever removes such a name."""
    path = Path(path)
    for i in itertools.count(1):
        candidate = path.parent / (f"{path.name}.kept" if i == 1 else f"{path.name}.kept-{i}")
        if not os.path.lexists(candidate):
            return candidate
    raise AssertionError("unreachable")


def discard_ours(
    path: Union[str, Path], ours: Ours, *, origin: Union[str, Path, None] = None, first: tuple[str, ...] = ()
) -> Optional[Path]:
    """Delete what this library wrote at ``path``: a symbolic link (the link, never its target), or a directory's
    regular files that ``ours`` names (``first`` before the others), then the directory once empty. Anything else
    (a user's file or folder) is never deleted: the directory, or a file at ``path``, moves to
    ``kept_path(origin or path)``, which is returned and named in a warning."""
    path = Path(path)
    origin = Path(origin) if origin is not None else path
    if path.is_symlink() or not os.path.lexists(path):
        path.unlink(missing_ok=True)
        return None
    foreign = [path.name] if not path.is_dir() else []
    if path.is_dir():
        for entry in sorted(os.scandir(path), key=lambda e: (e.name not in first, e.name)):
            if entry.is_file(follow_symlinks=False) and ours(entry.name):
                os.unlink(entry.path)
            else:
                foreign.append(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else ""))
        if not foreign:
            path.rmdir()
            return None
    kept = kept_path(origin)
    path.rename(kept)
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    warnings.warn(
        f"{origin}: {shown} (not written by this library) appeared there while it was being replaced; kept, "
        f"untouched, in {kept}. Move it where you want it; no clean-up of this library removes {kept.name}.",
        stacklevel=3,
    )
    return kept


def publish_dir(
    tmp: Union[str, Path],
    path: Union[str, Path],
    *,
    ours: Ours,
    replace: bool = True,
    first: tuple[str, ...] = (),
) -> Path:
    """Put the finished directory ``tmp`` in place at ``path`` (under ``path``'s ``PathLock``), then discard only
    what this library wrote of what was there (``discard_ours``: a user's file added meanwhile is kept and named).

    The target is looked at again here: without ``replace``, anything but an empty directory there now refuses
    (``FileExistsError``, ``tmp`` left for the caller to discard). Swapped in one atomic step where the system can
    (``renameat2``), else the previous entry waits in ``replaced_path(path)`` between two renames and is put back
    if the second fails. Once the new directory is in place nothing raises: a failed clean-up is a warning."""
    tmp, path = Path(tmp), Path(path)
    old = replaced_path(path)
    replacing = path.exists() or path.is_symlink()
    if replacing and not replace and not (path.is_dir() and not path.is_symlink() and not any(path.iterdir())):
        raise FileExistsError(f"{path} appeared while it was being written; it was not replaced.")
    if replacing and exchange_paths(tmp, path):
        _discard_quietly(tmp, ours, path, first)  # the previous entry, now under tmp's name
        return path
    if replacing:
        if os.path.lexists(old):  # left by an interrupted overwrite: what is at path is the newer one
            discard_ours(old, ours, origin=path, first=first)
        path.rename(old)
    try:
        tmp.rename(path)
    except BaseException:
        if replacing and not os.path.lexists(path):
            old.rename(path)  # put the previous directory back
        raise
    if replacing:
        _discard_quietly(old, ours, path, first)
    return path


def _discard_quietly(where: Path, ours: Ours, path: Path, first: tuple[str, ...]) -> None:
    """``discard_ours`` after the new ``path`` is in place: a failure is a warning naming what is left, never an
    error (the save succeeded)."""
    try:
        discard_ours(where, ours, origin=path, first=first)
    except OSError as e:
        warnings.warn(
            f"{path} was replaced, but the previous content left at {where} was not removed: {e}", stacklevel=3
        )


def stage_dir(
    path: Union[str, Path], *, ours: Ours, check: Callable[[Path], object], timeout_s: float
) -> Optional[PathLock]:
    """Lock ``path``, ``check(path)`` (raises to refuse), and make ``incomplete_path(path)`` afresh to write into
    (what an interrupted save left there goes through ``discard_ours``). Returns the held lock, ``None`` when
    another holder kept it ``timeout_s``; the lock is released if anything here raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = PathLock(path)
    if not lock.acquire(timeout_s=timeout_s):
        return None
    try:
        check(path)
        tmp = incomplete_path(path)
        if os.path.lexists(tmp):  # the lock says no one writes it now
            discard_ours(tmp, ours, origin=path)
        tmp.mkdir()
    except BaseException:
        lock.release()
        raise
    return lock


def end_stage(path: Union[str, Path], lock: Optional[PathLock], ours: Ours, *, first: tuple[str, ...] = ()) -> None:
    """After a write: discard what a failed one left in ``incomplete_path(path)`` (``discard_ours``, ``first``
    before the others), release ``stage_dir``'s lock whatever happens (a published write left nothing there)."""
    tmp = incomplete_path(path)
    try:
        if os.path.lexists(tmp):
            discard_ours(tmp, ours, origin=path, first=first)
    finally:
        if lock is not None:
            lock.release()


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
