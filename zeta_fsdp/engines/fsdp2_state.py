"""FSDP2's private per-module state, read (and, for pending gradients, cleared) here and nowhere else.

Every reader falls back to ``None`` where a torch release renamed or hid what it reads, so callers
can fall back to FSDP2's public defaults.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

__all__ = [
    "clear_pending_grads",
    "fsdp_param_groups",
    "fsdp_state",
    "partial_reduce_output",
    "pending_unsharded_grad",
    "refresh_reduce_dtypes",
]


def fsdp_state(module: nn.Module) -> Optional[Any]:
    """FSDP2's private per-module state, or ``None`` (not sharded, or this torch hides it)."""
    if not isinstance(module, FSDPModule):
        return None
    try:
        return module._get_fsdp_state()
    except Exception:  # noqa: BLE001 - an unreadable state: callers fall back to FSDP's defaults
        return None


def fsdp_param_groups(module: nn.Module) -> Optional[list]:
    """The FSDP parameter groups of one sharded module (``[]`` if none), or ``None`` when unreadable.
    Newer torch: ``_fsdp_param_groups``; older ``_fsdp_param_group`` (newer: raises for several groups)."""
    state = fsdp_state(module)
    if state is None:
        return None
    for name in ("_fsdp_param_groups", "_fsdp_param_group"):
        try:
            groups = getattr(state, name)
        except Exception:  # noqa: BLE001 - absent, or the property refused: try the other name
            continue
        if groups is None:
            return []
        return list(groups) if isinstance(groups, (list, tuple)) else [groups]
    return None


def refresh_reduce_dtypes(model: nn.Module) -> bool:
    """Make FSDP2 re-derive each unit's gradient dtypes from which parameters require a gradient *now*.

    FSDP2 fixes a unit's original and reduce dtypes at its first forward, from its trainable parameters;
    a unit with none then reduces a later gradient in the compute dtype (bf16) and cannot assign it to
    the fp32 shard. ``False`` when this torch's FSDP2 state is unreadable."""
    refreshed = False
    for module in model.modules():
        for group in fsdp_param_groups(module) or []:
            init = getattr(group, "_init_mp_dtypes", None)
            if callable(init):
                init()
                refreshed = True
    return refreshed


def pending_unsharded_grad(fsdp_param: Any) -> Optional[torch.Tensor]:
    """The unsharded gradient FSDP2 holds for one parameter between backwards with gradient sync off
    (``no_sync(defer="all")``): its reduce-dtype accumulator, else the unsharded parameter's ``.grad``."""
    accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
    if accumulated is not None:
        return accumulated
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return None if unsharded is None else unsharded.grad


def partial_reduce_output(group: Any) -> Optional[torch.Tensor]:
    """A parameter group's reduce-scattered sum awaiting HSDP's all-reduce (``no_sync(defer="all_reduce")``)."""
    return getattr(group, "_partial_reduce_output", None)


def clear_pending_grads(group: Any) -> None:
    """Drop every gradient FSDP2 holds for ``group`` outside ``.grad`` (the two readers above)."""
    for fsdp_param in group.fsdp_params:
        if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
            fsdp_param.unsharded_accumulated_grad = None
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None
    if hasattr(group, "_partial_reduce_output"):
        group._partial_reduce_output = None
