"""A ``no_sync`` accumulation that ``zero_grad()`` reaches on FSDP2 as on DDP's engine.

DDP accumulates in ``.grad``, so ``zero_grad()`` drops an accumulation. FSDP2 keeps it out of
reach: unsharded gradients (``defer="all"``) or a reduce-scattered sum awaiting HSDP's all-reduce
(``defer="all_reduce"``), added at the next synced backward whatever ``zero_grad()`` did. So at a
block's exit each trainable parameter of a unit holding such a sum, whose ``.grad`` is ``None``,
is given a ``.grad`` *showing* it: a view of this rank's rows of the held sum (no new memory; this
rank's own, not yet reduced, as DDP's ``.grad`` inside ``no_sync``), or a zero standing in where
no view fits. The next backward of the model starts by comparing, per unit: a ``.grad`` set to
``None``, replaced or changed in place means ``zero_grad()`` ran and the unit's held sum is
dropped; either way the shown ``.grad``s are taken back out before FSDP2 reduces. The comparison
runs from a hook on the model's outputs: the first thing a backward computes.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from ..engines import (
    clear_pending_grads,
    fsdp_param_groups,
    output_tensors,
    partial_reduce_output,
    pending_unsharded_grad,
)

__all__ = ["drop_accumulation", "show_pending"]

# parameter group -> [(sharded parameter, the .grad seen at exit, its version, whether we set it)]
_RECORDS: weakref.WeakKeyDictionary[Any, list] = weakref.WeakKeyDictionary()
_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # top units whose outputs carry our hook


def _groups(model: nn.Module) -> list:
    found: dict[int, Any] = {}
    for module in model.modules():
        for group in fsdp_param_groups(module) or ():
            found.setdefault(id(group), group)
    return list(found.values())


def _top_units(model: nn.Module) -> list[nn.Module]:
    """The sharded modules with no sharded ancestor inside ``model`` (the roots a forward enters)."""
    tops: list[nn.Module] = []
    covered: set[int] = set()
    for module in model.modules():
        if id(module) in covered or not isinstance(module, FSDPModule):
            continue
        tops.append(module)
        covered.update(id(m) for m in module.modules())
    return tops


def _is_pending(group: Any) -> bool:
    return partial_reduce_output(group) is not None or any(
        pending_unsharded_grad(fp) is not None for fp in group.fsdp_params
    )


def _rows(fsdp_param: Any, full: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's rows of an unsharded tensor, shaped like its shard (dim-0 sharding only)."""
    if getattr(getattr(fsdp_param, "fsdp_placement", None), "dim", 0) != 0:
        return None
    rows, size = fsdp_param.padded_sharded_param_size[0], fsdp_param.sharded_size
    start = min(getattr(fsdp_param.mesh_info, "shard_mesh_rank", 0) * rows, full.shape[0])
    return full.narrow(0, start, size[0]).view(size)


def _flat_views(group: Any, trainable: list) -> dict[int, torch.Tensor]:
    """Each trainable parameter's slot in the held reduce-scattered sum, when it has one per parameter."""
    flat = partial_reduce_output(group)
    if flat is None or sum(fp.padded_sharded_param_size.numel() for fp in trainable) != flat.numel():
        return {}
    views, offset = {}, 0
    for fp in trainable:
        views[id(fp)] = flat[offset : offset + fp.sharded_size.numel()].view(fp.sharded_size)
        offset += fp.padded_sharded_param_size.numel()
    return views


def _shown(fsdp_param: Any, flat_views: dict[int, torch.Tensor]) -> torch.Tensor:
    """What ``.grad`` shows for one parameter: a view of its held sum, else a zero (an expanded scalar:
    no memory; ``zero_()`` works on it)."""
    local = fsdp_param.sharded_param.to_local()
    full = pending_unsharded_grad(fsdp_param)
    view = _rows(fsdp_param, full) if full is not None else flat_views.get(id(fsdp_param))
    if view is None or view.dtype != local.dtype or view.device != local.device:
        view = torch.zeros((), dtype=local.dtype, device=local.device).expand(fsdp_param.sharded_size)
    return view.detach()


def show_pending(model: nn.Module) -> None:
    """At a ``no_sync`` block's exit: record each unit's gradients and show a held sum in each empty
    ``.grad`` (the module docstring). A model without FSDP2 units: nothing to do."""
    for group in _groups(model):
        if not _is_pending(group):
            continue
        trainable = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]
        flat_views = _flat_views(group, trainable)
        records = []
        for fsdp_param in trainable:
            param, ours = fsdp_param.sharded_param, False
            if param.grad is None:
                param.grad, ours = fsdp_param.to_sharded_dtensor(_shown(fsdp_param, flat_views)), True
            grad = param.grad
            records.append((param, grad, _versions(grad), ours))
        _RECORDS[group] = records
    for unit in _top_units(model):
        if unit not in _HOOKED:
            unit.register_forward_hook(_after_forward)
            _HOOKED.add(unit)


def _after_forward(module: nn.Module, _inputs: Any, output: Any) -> None:
    if not torch.is_grad_enabled():
        return
    unit = weakref.ref(module)
    fired = [False]

    def settle_first(grad: torch.Tensor) -> None:
        found = unit()
        if not fired[0] and found is not None:
            fired[0] = True
            for group in _groups(found):
                _settle(group)

    for tensor in output_tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(settle_first)


def _versions(grad: torch.Tensor) -> tuple[int, int]:
    """In-place changes to a DTensor ``.grad``: its own counter (``zero_()`` on it), its local tensor's."""
    return grad._version, grad._local_tensor._version


def _settle(group: Any) -> None:
    """A backward after a ``no_sync`` block, before FSDP2 touches ``group``: drop its held sum if
    ``zero_grad()`` touched a recorded ``.grad``; take the shown ``.grad``s back out."""
    records = _RECORDS.pop(group, None)
    if not records:
        return
    zeroed = any(param.grad is not grad or _versions(grad) != version for param, grad, version, _ in records)
    _unshow(records)
    if zeroed:
        clear_pending_grads(group)


def _unshow(records: list) -> None:
    for param, grad, _, ours in records:
        if ours and param.grad is grad:
            param.grad = None  # FSDP2 would add the reduced sum onto the view


def drop_accumulation(model: nn.Module) -> None:
    """Forget every gradient accumulated so far, on either engine: ``.grad`` set to ``None`` and what
    FSDP2 holds for the next synced backward (``no_sync``'s deferred sums) dropped. ``zero_grad()``
    does the same after a ``no_sync`` block; call this where no ``zero_grad()`` would run, e.g. after
    an exception inside a block.

    Example:
        with no_sync(model):
            (loss_fn(model(batch0)) / 2).backward()
        drop_accumulation(model)  # e.g. the loss was NaN: start the step again
        loss_fn(model(batch1)).backward()  # this batch's gradients alone
    """
    for group in _groups(model):
        _unshow(_RECORDS.pop(group, None) or [])
        clear_pending_grads(group)
    model.zero_grad(set_to_none=True)
