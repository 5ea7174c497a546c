"""Measuring a training step: peak memory by category (each engine's PyTorch memory tracker, exact
on CPU), collectives (``CommDebugMode``) and step time. Shared by the demo, the planner's accuracy
checks and the benchmarks; nothing here asserts: callers decide what the numbers mean.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from .engines import engine_of, gradient_bucket_bytes, memtracker_categories, restore_fsdp_hooks

__all__ = [
    "collectives_per_step",
    "gradient_bucket_bytes",
    "median_step_seconds",
    "memtracker_categories",
    "peak_memory_by_category",
    "restore_fsdp_hooks",
]


def peak_memory_by_category(
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    step: Callable[[], Any],
    *,
    inputs: tuple = (),
    warmup: int = 1,
) -> dict[str, int]:
    """Per-rank peak bytes by FSDP category (``"Sharded Param"``, ``"OptState"``, ...) over one ``step()``.

    FSDP2 models are measured with ``FSDPMemTracker``; NO_SHARD on DDP's engine with ``MemTracker``
    under the same names (a whole tensor is each rank's "shard"). ``warmup`` untracked steps run
    first, so lazily created optimizer state exists. ``"Total"`` is the peak of the sum.

    Example:
        peak = peak_memory_by_category(model, optimizer, lambda: train_step(batch), inputs=(batch,))
        peak["Sharded Param"], peak["Total"]
    """
    for _ in range(warmup):
        step()
    with _frozen_params_accept_hooks(model):
        return engine_of(model).peak_memory(model, optimizer, step, inputs)


class _NoHook:
    """The handle of a hook never registered."""

    def remove(self) -> None:
        pass


@contextlib.contextmanager
def _frozen_params_accept_hooks(model: nn.Module) -> Iterator[None]:
    """Let the memory trackers register their gradient hooks on frozen parameters (as no-ops).

    torch's ``MemTracker`` (DDP's engine) hooks every parameter's gradient and fails on a frozen one
    ("cannot register a hook on a tensor that doesn't require gradient"); a frozen parameter gets no
    gradient, so its hook would never run. Restored on exit.
    """
    frozen = [p for p in model.parameters() if not p.requires_grad]
    for param in frozen:
        param.register_hook = param.register_post_accumulate_grad_hook = lambda hook: _NoHook()
    try:
        yield
    finally:
        for param in frozen:
            for name in ("register_hook", "register_post_accumulate_grad_hook"):
                vars(param).pop(name, None)


def collectives_per_step(step: Callable[[], Any]) -> dict[str, int]:
    """Collective ops issued by one ``step()``, by op name (e.g. ``"all_gather_into_tensor"``).

    Example:
        >>> collectives_per_step(lambda: None)
        {}
    """
    from torch.distributed.tensor.debug import CommDebugMode

    comm = CommDebugMode()
    with comm:
        step()
    counts: dict[str, int] = {}
    for op, n in comm.get_comm_counts().items():
        name = getattr(op, "__name__", str(op)).split(".")[-1]
        counts[name] = counts.get(name, 0) + int(n)
    return counts


def median_step_seconds(step: Callable[[], Any], *, steps: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``step()`` over ``steps`` runs after ``warmup`` runs.

    Example:
        >>> median_step_seconds(lambda: sum(range(1000)), steps=3) >= 0.0
        True
    """
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median_high(times)
