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
    "final_callback_pending",
    "fsdp_param_groups",
    "fsdp_state",
    "holds_pending_grads",
    "partial_reduce_output",
    "pending_unsharded_grad",
    "refresh_reduce_dtypes",
    "unsharded_param",
    "writes_sharded_grads",
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
        # torch >= 2.15: a read-only view of the unsharded parameter's .grad (cleared below)
        settable = not isinstance(getattr(type(fsdp_param), "unsharded_accumulated_grad", None), property)
        if settable and getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
            fsdp_param.unsharded_accumulated_grad = None
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None
    if hasattr(group, "_partial_reduce_output"):
        group._partial_reduce_output = None


def holds_pending_grads(group: Any) -> bool:
    """``group`` holds a gradient outside ``.grad`` for the next synced backward (either reader above)."""
    return partial_reduce_output(group) is not None or any(
        pending_unsharded_grad(fsdp_param) is not None for fsdp_param in group.fsdp_params
    )


def unsharded_param(fsdp_param: Any) -> Optional[nn.Parameter]:
    """The unsharded parameter autograd accumulates into: one object from the unit's first all-gather on
    (later all-gathers refill its storage), ``None`` before it."""
    return getattr(fsdp_param, "_unsharded_param", None)


def writes_sharded_grads(group: Any) -> bool:
    """Whether ``group``'s reduction in a backward now writes the sharded ``.grad``: gradient sync on and,
    on a mesh with replicas (HSDP), the all-reduce too (else the sum waits in ``partial_reduce_output``)."""
    if not getattr(group, "reduce_grads", True):
        return False
    replicated = getattr(getattr(group, "mesh_info", None), "replicate_mesh_dim", None) is not None
    return bool(getattr(group, "all_reduce_grads", True)) or not replicated


def final_callback_pending(root: nn.Module) -> bool:
    """FSDP2's root post-backward callback (where it reduces the units it has not reduced yet) is queued
    and has not run; ``False`` where unreadable."""
    context = getattr(fsdp_state(root), "_state_ctx", None)
    return bool(getattr(context, "post_backward_final_callback_queued", False))
