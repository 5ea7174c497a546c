"""Fail on every rank alike: a check that raises on one rank raises on all, with that rank's message.

A rank that raised alone would leave its peers waiting in the next collective until the group's
timeout. Each check therefore ends with one ``all_gather_object`` of "ok, or what went wrong".

Example:
    >>> entries = on_all_ranks(lambda: read_checkpoint_index(path))
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

__all__ = ["on_all_ranks", "rank", "world"]

T = TypeVar("T")


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world() -> int:
    """The default group's size (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def on_all_ranks(fn: Callable[[], T], errors: tuple[type, ...] = (Exception,)) -> T:
    """Run ``fn`` on every rank; if it raised anywhere, raise on every rank (the same type and message).

    Example:
        >>> on_all_ranks(lambda: check(path))
    """
    error: Optional[BaseException] = None
    result: Any = None
    try:
        result = fn()
    except errors as e:
        error = e
    if world() > 1:
        reports: list = [None] * world()
        dist.all_gather_object(reports, None if error is None else (type(error), str(error)))
        if error is None:
            for r, item in enumerate(reports):
                if item is not None:
                    cls = item[0] if isinstance(item[0], type) and issubclass(item[0], Exception) else RuntimeError
                    try:
                        raised = cls(f"{item[1]} (reported by rank {r})")
                    except TypeError:  # an exception class with another signature
                        raised = RuntimeError(f"{cls.__name__}: {item[1]} (reported by rank {r})")
                    raise raised
    if error is not None:
        raise error
    return result
