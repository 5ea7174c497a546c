"""What a ``no_sync`` block leaves for the next backward, made visible to ``zero_grad()``.

DDP accumulates in ``.grad`` itself, so ``zero_grad()`` drops an accumulation. FSDP2 keeps it
out of reach: unsharded gradients on its unsharded parameters (``defer="all"``) or a flat sharded
sum in its parameter group (HSDP, ``defer="all_reduce"``), added at the next synced backward
whatever ``zero_grad()`` did in between. So at a block's exit each trainable FSDP parameter
without a ``.grad`` gets one *showing* that pending sum: a copy of this rank's rows of it (this
rank's own, not yet reduced, as DDP's ``.grad`` inside ``no_sync``; it costs one sharded gradient
between micro-batches, freed at the next backward). Before the next
backward accumulates into a unit, a gradient hook compares: a ``.grad`` set to ``None``, zeroed in
place or replaced means ``zero_grad()`` ran, and the unit's pending sum is dropped; otherwise the
views go and FSDP2 reduces the sum as before. Read from torch's FSDP state (``wrapped.fsdp_param_groups``).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn as nn

from ..wrapped import fsdp_param_groups

__all__ = ["show_pending"]

# parameter group -> [(fsdp_param, the .grad we recorded, its version, whether we set it)]
_RECORDS: weakref.WeakKeyDictionary[Any, list] = weakref.WeakKeyDictionary()
# Marks an unsharded parameter that carries our hook (an attribute: a WeakSet would compare tensors with ==).
_HOOKED = "_zeta_fsdp_settle_hook"


def _groups(model: nn.Module) -> list:
    found: dict[int, Any] = {}
    for module in model.modules():
        for group in fsdp_param_groups(module) or ():
            found.setdefault(id(group), group)
    return list(found.values())


def _pending_full(fsdp_param: Any) -> Optional[torch.Tensor]:
    """The unsharded pending gradient of one parameter (``defer="all"``), if any."""
    accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
    if accumulated is not None:
        return accumulated
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return None if unsharded is None else unsharded.grad


def _rows(fsdp_param: Any, full: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's rows of an unsharded tensor, shaped like its shard (dim-0 sharding only)."""
    placement = getattr(fsdp_param, "fsdp_placement", None)
    if getattr(placement, "dim", 0) != 0:
        return None
    rows, size = fsdp_param.padded_sharded_param_size[0], fsdp_param.sharded_size
    start = getattr(fsdp_param.mesh_info, "shard_mesh_rank", 0) * rows
    # a copy: a .grad aliasing FSDP2's own pending buffer gave wrong sums (torch 2.13)
    return full.narrow(0, min(start, full.shape[0]), size[0]).reshape(size).clone()


def _shown(group: Any) -> list[Optional[torch.Tensor]]:
    """For each of the group's parameters, a tensor shaped like its shard showing its pending sum
    (``None``: nothing pending). Where no view fits (another dtype, device or shard dimension) a zero
    tensor stands in: it still shows whether ``zero_grad()`` ran."""
    flat = getattr(group, "_partial_reduce_output", None)
    trainable = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]
    if flat is not None and sum(fp.padded_sharded_param_size.numel() for fp in trainable) != flat.numel():
        flat_views = [None] * len(trainable)  # not one slot per trainable parameter: no view
    else:
        flat_views, offset = [], 0  # HSDP defer="all_reduce": the shard group's sum, padded per parameter
        for fp in trainable:
            size = fp.sharded_size
            flat_views.append(None if flat is None else flat[offset : offset + size.numel()].view(size).clone())
            offset += fp.padded_sharded_param_size.numel()
    by_param = dict(zip(map(id, trainable), flat_views))
    shown = []
    for fsdp_param in group.fsdp_params:
        full = _pending_full(fsdp_param)
        view = _rows(fsdp_param, full) if full is not None else by_param.get(id(fsdp_param))
        pending = full is not None or (flat is not None and fsdp_param.sharded_param.requires_grad)
        shown.append(view if view is not None or not pending else _zeros(fsdp_param))
    return shown


def _zeros(fsdp_param: Any) -> torch.Tensor:
    local = fsdp_param.sharded_param.to_local()
    return torch.zeros(fsdp_param.sharded_size, dtype=local.dtype, device=local.device)


def show_pending(model: nn.Module) -> None:
    """After a ``no_sync`` block: record every FSDP unit's gradients and show a pending sum in each empty
    ``.grad`` (see the module docstring). A model without FSDP units: nothing to do."""
    for group in _groups(model):
        records = []
        for fsdp_param, view in zip(group.fsdp_params, _shown(group)):
            param = fsdp_param.sharded_param
            if not param.requires_grad:
                continue
            ours = False
            if param.grad is None and view is not None:
                if view.dtype != param.dtype or view.device != param.to_local().device:
                    view = _zeros(fsdp_param)
                param.grad, ours = fsdp_param.to_sharded_dtensor(view.detach()), True
            grad = param.grad
            version = None if grad is None else _version(grad)
            records.append((fsdp_param, grad, version, ours))
            _hook(fsdp_param, group)
        _RECORDS[group] = records


def _version(grad: Any) -> tuple[int, int]:
    """In-place writes to a DTensor ``.grad`` bump the wrapper's version (DTensor runs the op on its
    local tensor below autograd's version bump); writes to the local tensor bump the local one."""
    return grad._version, grad._local_tensor._version


def _hook(fsdp_param: Any, group: Any) -> None:
    """Once per unsharded parameter: before its gradient accumulates, settle its unit's record."""
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    if unsharded is None or getattr(unsharded, _HOOKED, False) or not unsharded.requires_grad:
        return
    group_ref = weakref.ref(group)

    def settle_first(grad: torch.Tensor) -> torch.Tensor:
        found = group_ref()
        if found is not None:
            _settle(found)
        return grad

    unsharded.register_hook(settle_first)
    setattr(unsharded, _HOOKED, True)


def _settle(group: Any) -> None:
    """The unit's first gradient of a backward after a ``no_sync`` block: drop its pending sum if
    ``zero_grad()`` touched a recorded ``.grad``, then take our views back out of ``.grad``."""
    records = _RECORDS.pop(group, None)
    if not records:
        return
    zeroed = any(
        fp.sharded_param.grad is not grad or (grad is not None and grad._local_tensor._version != version)
        for fp, grad, version, ours in records
    )
    for fp, grad, _, ours in records:
        if ours and fp.sharded_param.grad is grad:
            fp.sharded_param.grad = None  # FSDP2 would add the reduced sum onto the view
    if zeroed:
        for fp in group.fsdp_params:
            if getattr(fp, "unsharded_accumulated_grad", None) is not None:
                fp.unsharded_accumulated_grad = None
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
        if hasattr(group, "_partial_reduce_output"):
            group._partial_reduce_output = None
