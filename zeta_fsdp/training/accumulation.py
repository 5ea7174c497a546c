"""Gradient accumulation: ``no_sync`` and what each way of accumulating costs.

``no_sync(model, defer="all")`` defers every gradient collective to the first backward after the
block; ``defer="all_reduce"`` keeps each micro-batch's reduce-scatter and defers only HYBRID_SHARD's
cross-replica all-reduce. ``accumulation_costs`` / ``accumulation_table`` give the gradient bytes
held and the collectives per K micro-batches (``memory_report`` and the planner fill them in).

Example:
    with no_sync(model, defer="all_reduce"):
        (loss_fn(model(batch0)) / 2).backward()
    (loss_fn(model(batch1)) / 2).backward()
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from .. import torch_compat
from ..report import format_bytes, render_table
from ..wrapped import fsdp_param_groups, replicated_modules

__all__ = [
    "AccumulationCost",
    "accumulation_costs",
    "accumulation_table",
    "ddp_all_reduces",
    "gradient_wait_dtype",
    "no_sync",
    "resolve_defer",
]


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _sync_setting(module: FSDPModule) -> tuple[bool, bool]:
    """``(requires_gradient_sync, requires_all_reduce)`` of one unit; ``(True, True)`` (FSDP's
    default) when its state cannot be read."""
    groups = fsdp_param_groups(module)
    if not groups:
        return True, True
    return (
        all(getattr(g, "reduce_grads", True) for g in groups),
        all(getattr(g, "all_reduce_grads", True) for g in groups),
    )


def _set_sync(module: FSDPModule, reduce: bool, all_reduce: bool) -> None:
    """Public FSDP2 API only: gradient sync (reduce-scatter, and HSDP's all-reduce) then the
    all-reduce on its own, where this torch has ``set_requires_all_reduce``."""
    module.set_requires_gradient_sync(reduce, recurse=False)
    set_all_reduce = getattr(module, "set_requires_all_reduce", None)
    if callable(set_all_reduce):
        set_all_reduce(all_reduce, recurse=False)


# no_sync(defer=...) values: what the block defers until the first backward after it.
_DEFER_CHOICES = ("all", "all_reduce")


def resolve_defer(defer: object) -> str:
    """``no_sync``'s ``defer`` value, normalized (``"all"`` or ``"all_reduce"``); else ``ValueError``
    naming the value and the accepted ones.

    Example:
        >>> resolve_defer("ALL_REDUCE")
        'all_reduce'
    """
    if isinstance(defer, str) and defer.strip().lower() in _DEFER_CHOICES:
        return defer.strip().lower()
    raise ValueError(
        f"no_sync: defer={defer!r} is not accepted. Accepted: 'all' (no gradient collective inside the "
        "block; unsharded gradients are kept) or 'all_reduce' (reduce-scatter every micro-batch, defer only "
        "HYBRID_SHARD's cross-replica all-reduce; gradients stay sharded)."
    )


@contextlib.contextmanager
def no_sync(model: nn.Module, *, defer: str = "all") -> Iterator[nn.Module]:
    """Defer gradient collectives for backwards run inside: gradient accumulation.

    ``defer="all"`` (default): no gradient collective at all. Each rank keeps every unit's
    *unsharded* gradient until the first backward outside the block, which reduces the sum of all
    accumulated micro-batches in one go: K micro-batches cost one reduce-scatter (and, under
    HYBRID_SHARD, one all-reduce) per unit, but hold the full model's gradients on every rank.

    ``defer="all_reduce"``: each micro-batch still reduce-scatters within its shard group, so only
    a *sharded* gradient (1/shard size) is kept; only HYBRID_SHARD's cross-replica all-reduce
    waits for the first backward outside the block (FSDP2's ``set_requires_all_reduce(False)``):
    K reduce-scatters and one all-reduce per unit. On a 1-D mesh (FULL_SHARD, SHARD_GRAD) there
    is no all-reduce to defer: it is accepted and is the same as syncing every micro-batch, so one
    training loop serves every strategy. Any other value raises ``ValueError`` before a unit changes.

    Divide each micro-batch loss by K to get the mean over the K micro-batches. The previous
    per-unit settings are restored on exit, also when the body raises (a unit whose setting
    cannot be read, on a torch without the private state this reads, is restored to sync). A
    model without FSDP units is left alone (a DDP model uses its own ``no_sync``).

    NO_SHARD in fp32 runs on DDP's engine (``fsdp_engine(model) == "replicate"``): there, as with
    DDP, the forward decides, so run each micro-batch's forward and backward inside the block.

    Example:
        with no_sync(model):
            (loss_fn(model(batch0)) / 2).backward()  # no collective for gradients
        (loss_fn(model(batch1)) / 2).backward()  # reduces both micro-batches
        with no_sync(model, defer="all_reduce"):  # HYBRID_SHARD: sharded gradients while accumulating
            (loss_fn(model(batch0)) / 2).backward()  # reduce-scatter only
        (loss_fn(model(batch1)) / 2).backward()  # reduce-scatter + the one all-reduce
    """
    reduce = resolve_defer(defer) == "all_reduce"  # validated before any unit changes
    replicated = replicated_modules(model)
    if replicated:
        # DDP's engine has one collective, the all-reduce: deferring it is deferring everything
        with contextlib.ExitStack() as stack:
            for module in replicated:
                stack.enter_context(_replicated_no_sync(module))
            yield model
        return
    modules = _fsdp_modules(model)
    if not modules:
        ddp_no_sync = getattr(model, "no_sync", None)
        with ddp_no_sync() if callable(ddp_no_sync) else contextlib.nullcontext():
            yield model
        return
    # Save each unit's exact setting so nesting, or a user who already disabled sync on some
    # units, is restored as it was rather than forced back to True.
    saved = [(module, _sync_setting(module)) for module in modules]
    try:
        for module in modules:
            # set_requires_gradient_sync(False) also turns off HSDP's replica all-reduce (torch >= 2.4);
            # set_requires_all_reduce makes sure of it on any version that has it. With
            # reduce=True, FSDP2 adds each micro-batch's reduce-scattered gradient into a sharded
            # buffer and all-reduces that sum at the next backward that has all-reduce on.
            _set_sync(module, reduce, False)
        yield model
    finally:
        for module, (reduce_grads, all_reduce) in saved:
            _set_sync(module, reduce_grads, all_reduce)


@dataclass(frozen=True)
class AccumulationCost:
    """What one way of accumulating K micro-batches costs one rank (``accumulation_costs``).

    Attributes:
        choice: ``"sync"`` (reduce every micro-batch, no ``no_sync``), ``"all"`` or ``"all_reduce"``
            (``no_sync(defer=...)`` for the first K-1 micro-batches).
        grad_bytes: gradient bytes the rank holds between micro-batches (FSDP2's storage: padded
            shards, the reduce dtype where gradients wait in it).
        reduce_scatters, all_reduces: gradient collectives per K micro-batches, all units together.

    Example:
        >>> accumulation_costs(4, sharded=10, unsharded=40, partial=10, reduce_scatter_units=3, all_reduce_units=3)["all_reduce"]
        AccumulationCost(choice='all_reduce', grad_bytes=10, reduce_scatters=12, all_reduces=3)
    """

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
    """Gradient bytes held and collectives per ``micro_batches`` micro-batches, for each choice.

    ``sharded``: bytes of the sharded ``.grad`` (what syncing every micro-batch keeps);
    ``unsharded``: the unsharded gradients ``defer="all"`` keeps; ``partial``: the reduce-scattered
    sum ``defer="all_reduce"`` keeps on a mesh with replicas (on a 1-D mesh nothing is deferred:
    it keeps ``sharded``). ``reduce_scatter_units`` / ``all_reduce_units``: units that reduce-scatter
    (shard group > 1) / all-reduce (replicas > 1) in one synced backward. ``memory_report`` and the
    planner fill these in; a ``ValueError`` for ``micro_batches`` < 1.

    Example:
        >>> costs = accumulation_costs(4, sharded=10, unsharded=40, partial=10, reduce_scatter_units=3, all_reduce_units=3)
        >>> [(c.choice, c.grad_bytes, c.reduce_scatters, c.all_reduces) for c in costs.values()]
        [('sync', 10, 12, 12), ('all', 40, 3, 3), ('all_reduce', 10, 12, 3)]
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} is not accepted. Accepted: an int >= 1.")
    k, rs, ar = micro_batches, reduce_scatter_units, all_reduce_units
    return {
        "sync": AccumulationCost("sync", sharded, k * rs, k * ar),
        "all": AccumulationCost("all", unsharded, rs, ar),
        "all_reduce": AccumulationCost("all_reduce", partial if ar else sharded, k * rs, ar),
    }


def gradient_wait_dtype(policy: MixedPrecisionPolicy, dtype: torch.dtype) -> torch.dtype:
    """The dtype FSDP2 keeps a parameter's gradient in between its backward and its reduction
    (unsharded gradients under ``no_sync``, the reduce-scatter output, the sum ``defer="all_reduce"``
    keeps). ``dtype``: the parameter's own (sharded) dtype. The policy's ``reduce_dtype`` when set;
    with ``reduce_dtype=None`` it depends on the torch release (``torch_compat``): torch >= 2.15
    keeps the parameter's own dtype, older releases the compute dtype (``FSDPParam.init_dtype_attrs``).
    ``resolve_mixed_precision``'s presets set ``reduce_dtype`` wherever the two would differ.

    Example:
        >>> gradient_wait_dtype(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), torch.float32)
        torch.float32
        >>> gradient_wait_dtype(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16), torch.float32)
        torch.bfloat16
    """
    if policy.reduce_dtype is None and torch_compat.REDUCE_DTYPE_NONE_KEEPS_PARAM_DTYPE:
        return dtype
    reduce = policy.reduce_dtype if policy.reduce_dtype != policy.param_dtype else None
    compute = policy.param_dtype if policy.param_dtype != dtype and dtype.is_floating_point else None
    return reduce or compute or dtype


def accumulation_table(costs: dict[str, AccumulationCost], micro_batches: int) -> str:
    """``accumulation_costs`` as a fixed-width table (used by ``MemoryReport`` and the planner).

    Example:
        >>> costs = accumulation_costs(4, sharded=10, unsharded=40, partial=10, reduce_scatter_units=3, all_reduce_units=3)
        >>> print(accumulation_table(costs, 4).splitlines()[0])
        gradient accumulation, 4 micro-batches  grads held between  reduce-scatters  all-reduces
    """
    header = (f"gradient accumulation, {micro_batches} micro-batches", "grads held between", "reduce-scatters")
    rows = [header + ("all-reduces",)]
    for cost in costs.values():
        rows.append(
            (
                _CHOICE_LABELS[cost.choice],
                format_bytes(cost.grad_bytes),
                str(cost.reduce_scatters),
                str(cost.all_reduces),
            )
        )
    return render_table(rows, align="lrrr")


@contextlib.contextmanager
def _replicated_no_sync(model: nn.Module) -> Iterator[None]:
    """``no_sync`` for NO_SHARD on DDP's engine (composable ``replicate``).

    DDP decides at each forward whether the backward that follows all-reduces, so the forward
    must run inside the block (as with ``DistributedDataParallel.no_sync``). The previous setting
    is restored on exit, so nested blocks stay off until the outermost exits.
    """
    was_off = bool(getattr(replicate.state(model), "_no_sync", False))
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(not was_off)


# DDP's defaults (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, ``bucket_cap_mb=25``).
_DDP_FIRST_BUCKET_BYTES = 1024 * 1024
_DDP_BUCKET_BYTES = 25 * 1024 * 1024


def ddp_all_reduces(grads: list[tuple[torch.dtype, int]]) -> int:
    """All-reduces per synced backward of NO_SHARD on DDP's engine, for gradients of these
    ``(dtype, bytes)`` in parameter order: one per gradient bucket, as DDP's constructor assigns
    them (``_compute_bucket_assignment_by_size``: parameters in order, one open bucket per dtype,
    a bucket closed once it holds 1 MiB (the first) or 25 MiB (the rest)), plus one for the map of
    used parameters (``find_unused_parameters=True``, which ``fsdp()`` sets).

    Example:
        >>> ddp_all_reduces([(torch.float32, 4 * 2**20)] * 3)  # a 4 MiB bucket, an 8 MiB one, the map
        3
        >>> ddp_all_reduces([(torch.float32, 100)] * 3)
        2
    """
    limits: dict[torch.dtype, int] = {}
    open_bytes: dict[torch.dtype, int] = {}
    closed = 0
    for dtype, nbytes in grads:
        open_bytes[dtype] = open_bytes.get(dtype, 0) + nbytes
        if open_bytes[dtype] >= limits.get(dtype, _DDP_FIRST_BUCKET_BYTES):
            closed += 1
            open_bytes[dtype] = 0
            limits[dtype] = _DDP_BUCKET_BYTES
    return closed + sum(1 for b in open_bytes.values() if b) + 1
