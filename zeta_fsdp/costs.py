"""The cost model: what a sharding and accumulation choice costs one rank, computed from sizes alone.

Pure (no process group, no model): ``memory_report`` fills it in from a live model, the planner
(``plan``) from a meta one, and the benchmarks compare both against what ``FSDPMemTracker`` and
``CommDebugMode`` measure. One home, so the three never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from . import torch_compat
from .report import format_bytes, render_table

__all__ = ["AccumulationCost", "accumulation_costs", "accumulation_table", "gradient_wait_dtype", "peak_by_device"]


def peak_by_device(snapshot: dict, primary: torch.device, categories=lambda per_device: per_device) -> dict[str, int]:
    """A memory tracker's ``{device: {category: bytes}}`` peak as one flat dict: the ``primary`` device's
    categories under their own names (``"Total"``, ...), every other device's prefixed with it
    (``"cpu Sharded Param"``): under CPU offload both sides count, and the optimizer's ``step`` counters
    live on CPU. ``categories`` turns one device's snapshot into ``{name: bytes}``.

    Example:
        >>> peak_by_device({"cpu": {"Total": 3}, "cuda:0": {"Total": 5}}, torch.device("cuda", 0))
        {'Total': 5, 'cpu Total': 3}
    """
    named = {str(device): categories(per_device) for device, per_device in snapshot.items()}
    main = named.pop(str(primary), None)
    if main is None and named:  # not on the compute device at all: the first device seen stands in
        main = named.pop(next(iter(named)))
    flat = {getattr(k, "value", str(k)): int(v) for k, v in (main or {}).items()}
    for device, per_device in named.items():
        flat.update({f"{device} {getattr(k, 'value', str(k))}": int(v) for k, v in per_device.items()})
    return flat


@dataclass(frozen=True)
class AccumulationCost:
    """What one way of accumulating K micro-batches costs one rank: ``choice`` (``"sync"``, or ``no_sync``'s
    ``"all"`` / ``"all_reduce"``), the gradient bytes held between micro-batches (FSDP2's padded storage,
    in the dtype gradients wait in) and the gradient collectives per K micro-batches, all units."""

    choice: str
    grad_bytes: int
    reduce_scatters: int
    all_reduces: int


_CHOICE_LABELS = {
    "sync": "sync every micro-batch",
    "all": 'no_sync(defer="all")',
    "all_reduce": 'no_sync(defer="all_reduce")',
}


def accumulation_costs(
    micro_batches: int,
    *,
    sharded: int,
    unsharded: int,
    partial: int,
    reduce_scatter_units: int,
    all_reduce_units: int,
) -> dict[str, AccumulationCost]:
    """Each choice's ``AccumulationCost`` from the bytes each keeps (``partial``: the reduce-scattered sum
    ``defer="all_reduce"`` keeps with replicas; without, it keeps ``sharded``) and the units that
    reduce-scatter / all-reduce in one synced backward. ``micro_batches`` < 1 is a ``ValueError``."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} is not accepted. Accepted: an int >= 1.")
    k, rs, ar = micro_batches, reduce_scatter_units, all_reduce_units
    return {
        "sync": AccumulationCost("sync", sharded, k * rs, k * ar),
        "all": AccumulationCost("all", unsharded, rs, ar),
        "all_reduce": AccumulationCost("all_reduce", partial if ar else sharded, k * rs, ar),
    }


def gradient_wait_dtype(policy: MixedPrecisionPolicy, dtype: torch.dtype) -> torch.dtype:
    """The dtype FSDP2 keeps a gradient in between backward and reduction (under ``no_sync``, the
    reduce-scatter output). ``dtype``: the parameter's (sharded) dtype. The policy's ``reduce_dtype``
    when set; else torch >= 2.15 keeps ``dtype``, older releases the compute dtype (``torch_compat``).
    """
    if policy.reduce_dtype is None and torch_compat.REDUCE_DTYPE_NONE_KEEPS_PARAM_DTYPE:
        return dtype
    reduce = policy.reduce_dtype if policy.reduce_dtype != policy.param_dtype else None
    compute = policy.param_dtype if policy.param_dtype != dtype and dtype.is_floating_point else None
    return reduce or compute or dtype


def accumulation_table(costs: dict[str, AccumulationCost], micro_batches: int) -> str:
    """``accumulation_costs`` as a fixed-width table (used by ``MemoryReport`` and the planner)."""
    header = (f"gradient accumulation, {micro_batches} micro-batches", "grads held between", "reduce-scatters")
    rows = [header + ("all-reduces",)]
    for c in costs.values():
        rows.append((_CHOICE_LABELS[c.choice], format_bytes(c.grad_bytes), str(c.reduce_scatters), str(c.all_reduces)))
    return render_table(rows, align="lrrr")
