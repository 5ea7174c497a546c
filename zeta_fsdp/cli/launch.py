"""Launching local ranks: ``torch.distributed.run`` in a session of its own, stopped as a whole.

Ctrl-C or SIGTERM is forwarded to ``torch.distributed.run``, then no rank process may be left
(Linux ``/proc``); if the launcher is killed outright, ``PR_SET_PDEATHSIG`` stops the ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from ..distributed import without_launcher_env

__all__ = ["LaunchTimeoutError", "launch_and_wait", "progress_tty", "rank_env"]


class LaunchTimeoutError(RuntimeError):
    """The ranks did not finish in time; every one of them was stopped."""


def rank_env() -> dict[str, str]:
    """Ours without a job's launcher variables, one intra-op thread per rank (the ranks share the cores)."""
    env = without_launcher_env()
    env["OMP_NUM_THREADS"] = "1"
    return env


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else None
        except OSError:
            continue
        if stat:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after it
            children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _is_ours(pid: int, marker: bytes) -> bool:
    """Is ``pid`` still one of our rank processes (not a reused pid, not a zombie)?"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z" and (marker in cmdline or b"torch.distributed.run" in cmdline)


def _stop(proc: subprocess.Popen, marker: bytes, timeout_s: float = 20.0) -> None:
    """Stop the launcher and every rank: SIGTERM to ``torch.distributed.run`` (it forwards it to
    its ranks and waits for them), then SIGKILL anything of ours still alive."""
    ranks = _descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + timeout_s
    for pid in ranks:
        while _is_ours(pid, marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _is_ours(pid, marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """A SIGTERM to the launcher (a CI timeout, ``kill``) cleans up like Ctrl-C instead of orphaning ranks."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _die_with_launcher() -> None:
    """Child-side (Linux): if the launcher itself is killed (SIGKILL, no clean-up), the kernel
    sends SIGTERM to ``torch.distributed.run``, which then stops its ranks."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def progress_tty() -> str:
    """The terminal the launcher's stderr is on, for rank 0's progress bar (``""`` when not a TTY)."""
    try:
        return os.ttyname(sys.stderr.fileno()) if sys.stderr.isatty() else ""
    except (OSError, ValueError, AttributeError):
        return ""


def launch_and_wait(cmd: list[str], log_path: Path, timeout_s: float, marker: str) -> int:
    """Run the launcher ``cmd`` (output to ``log_path``) and return its exit code; on Ctrl-C,
    SIGTERM or timeout stop every rank first (processes whose command line holds ``marker``, or
    ``torch.distributed.run``), then raise ``KeyboardInterrupt`` / ``LaunchTimeoutError``."""
    with open(log_path, "w") as log, _sigterm_as_interrupt():
        # A session of its own: a terminal's Ctrl-C reaches only us, and we stop the ranks in order.
        proc = subprocess.Popen(
            cmd,
            env=rank_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_launcher if sys.platform.startswith("linux") else None,
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc, marker.encode())
            raise LaunchTimeoutError(f"the ranks did not finish within {timeout_s:.0f} s; stopped them") from None
        except KeyboardInterrupt:
            _stop(proc, marker.encode())
            raise
