"""Gradient accumulation: ``no_sync``.

``no_sync(model, defer="all")`` defers every gradient collective to the first backward after the
block; ``defer="all_reduce"`` keeps each micro-batch's reduce-scatter and defers only HYBRID_SHARD's
cross-replica all-reduce. What each choice costs: ``zeta_fsdp.costs``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import FSDPModule

from ..wrapped import fsdp_param_groups, replicated_modules

__all__ = ["no_sync", "resolve_defer"]


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
