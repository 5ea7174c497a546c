"""Measuring a training step: peak memory by category, collectives, step time.

Shared by the demo, the planner's accuracy checks, the benchmarks and users' notebooks.

Memory comes from PyTorch's ``FSDPMemTracker`` (exact on CPU: it counts tensor storages by
category), collectives from ``CommDebugMode``, time from ``time.perf_counter``. Nothing here
asserts anything: callers decide what the numbers mean.

Example:
    >>> model = torch.nn.Linear(4, 4)
    >>> collectives_per_step(lambda: model(torch.ones(2, 4)).sum().backward())  # no process group: none
    {}
    >>> median_step_seconds(lambda: None, steps=3) < 1.0
    True

    With a sharded model (see ``examples/notebook.py``)::

        peak = peak_memory_by_category(model, optimizer, lambda: train_step(batch), inputs=(batch,))
        peak["Sharded Param"], peak["OptState"], peak["Total"]
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from .wrapped import fsdp_param_groups, fsdp_state, replicated_modules

__all__ = [
    "collectives_per_step",
    "gradient_bucket_bytes",
    "median_step_seconds",
    "memtracker_categories",
    "peak_memory_by_category",
    "restore_fsdp_hooks",
]

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs")


@contextlib.contextmanager
def restore_fsdp_hooks(model: nn.Module) -> Iterator[None]:
    """Put every module's forward hooks (and FSDP's hook handles) back as they were.

    ``FSDPMemTracker`` (torch 2.13) swaps FSDP's forward hooks for its own and, on exit,
    re-registers them per module, which breaks units made of several modules
    (``fully_shard([norm, head])``): the group's shared hook is lost and tracker hooks are left
    behind, and the group's backward methods stay patched. Restoring the exact hook tables and
    methods keeps the model trainable after a measurement.
    """
    saved = [(m, {name: dict(getattr(m, name)) for name in _HOOK_DICTS}) for m in model.modules()]
    states = []
    groups: dict[int, Any] = {}
    for module in model.modules():
        state = fsdp_state(module)
        if state is not None:
            states.append((state, state._pre_forward_hook_handle, state._post_forward_hook_handle))
            groups.update((id(group), group) for group in fsdp_param_groups(module) or ())
    patched = ("pre_backward", "post_backward")
    group_attrs = [(g, {a: vars(g)[a] for a in patched if a in vars(g)}) for g in groups.values()]
    try:
        yield
    finally:
        for module, tables in saved:
            for name, table in tables.items():
                hooks = getattr(module, name)
                hooks.clear()
                hooks.update(table)
        for state, pre_handle, post_handle in states:
            state._pre_forward_hook_handle, state._post_forward_hook_handle = pre_handle, post_handle
        for group, attrs in group_attrs:  # drop instance-level patches, keep the class methods
            for attr in patched:
                vars(group).pop(attr, None)
            vars(group).update(attrs)


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
    under the same category names (a whole tensor is each rank's "shard"; see ``_replicated_peak``).

    ``warmup`` steps run first, untracked, so lazily created optimizer state exists and the
    tracked step is a steady-state one. Adds ``"Total"`` (peak of the sum, not sum of peaks).

    Example:
        peak = peak_memory_by_category(model, optimizer, lambda: train_step(batch), inputs=(batch,))
        peak["Sharded Param"], peak["Total"]
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    for _ in range(warmup):
        step()
    if replicated_modules(model):
        return _replicated_peak(model, optimizer, step, inputs)
    with restore_fsdp_hooks(model):
        tracker = FSDPMemTracker(model, optimizer)
        if inputs:
            tracker.track_inputs(inputs)
        with tracker:
            step()
    peak = tracker.get_tracker_snapshot("peak")
    per_device = next(iter(peak.values())) if peak else {}
    return {getattr(k, "value", str(k)): int(v) for k, v in per_device.items()}


# MemTracker's categories under FSDPMemTracker's names: on DDP's engine every rank's "shard" is the
# whole tensor, so one table reads the same for both engines.
_MEMTRACKER_NAMES = {
    "Parameter": "Sharded Param",
    "Gradient": "Sharded Grad",
    "Optstate": "OptState",
    "Other": "Inputs",  # what track_external(inputs) records
}


def memtracker_categories(snapshot: dict) -> dict[str, int]:
    """One device's ``MemTracker`` snapshot under ``FSDPMemTracker``'s category names."""
    names = {getattr(k, "value", str(k)): int(v) for k, v in snapshot.items()}
    return {_MEMTRACKER_NAMES.get(k, k): v for k, v in names.items()}


def gradient_bucket_bytes(model: nn.Module) -> int:
    """Bytes of DDP's gradient buckets in a model ``fsdp()`` put on DDP's engine (0 before its
    first forward, where DDP is built). Every ``.grad`` is a view into them.
    """
    from torch.distributed._composable.replicate import replicate

    total = 0
    for module in replicated_modules(model):
        ddp = getattr(replicate.state(module), "_ddp", None)
        if ddp is not None:  # DDP's own record of the buckets it allocated (a comma-separated string)
            sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
            total += sum(int(n) for n in sizes.split(",") if n.strip())
    return total


def _replicated_peak(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer], step: Callable[[], Any], inputs: tuple
) -> dict[str, int]:
    """``peak_memory_by_category`` for NO_SHARD on DDP's engine (``MemTracker``: no FSDP units).

    DDP allocates its gradient buckets once, at its first forward, and every ``.grad`` is a view
    into them (``gradient_as_bucket_view``). When the step starts with gradients set, the tracker
    counts the buckets through them; when it starts with none (``zero_grad(set_to_none=True)`` at
    the end of the step before), a step allocates no gradient and the tracker sees none, so the
    resident buckets (DDP's own record of their sizes) are added to ``"Sharded Grad"`` and ``"Total"``.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    grads_set = any(p.grad is not None for p in model.parameters())
    tracker = MemTracker()
    tracker.track_external(*(t for t in (model, optimizer) if t is not None), *inputs)
    with tracker:
        step()
    result = memtracker_categories(next(iter(tracker.get_tracker_snapshot("peak").values()), {}))
    if not grads_set:
        buckets = gradient_bucket_bytes(model)
        result["Sharded Grad"] = result.get("Sharded Grad", 0) + buckets
        result["Total"] = result.get("Total", 0) + buckets
    return result


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
    times.sort()
    return times[len(times) // 2]
