"""What ``fsdp()`` did to a model, read back: the engine's name, the plan, FSDP2's private state.

The one place the package reads FSDP2's private per-module state; what differs between the
engines is asked of ``engines``. Modules that only need to know import this, not the façade.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed._composable.replicate import DDP as ReplicatedModule  # noqa: N811 - torch names the class DDP
from torch.distributed.fsdp import FSDPModule

from .wrapping import WrapPlan

__all__ = [
    "compute_device",
    "shard_device",
    "fsdp_engine",
    "fsdp_param_groups",
    "fsdp_state",
    "get_wrap_plan",
    "is_fsdp_wrapped",
    "record_wrap",
    "refresh_reduce_dtypes",
    "unwrapped_class",
]

_PLAN_ATTR = "_zeta_fsdp_plan"
_ENGINE_ATTR = "_zeta_fsdp_engine"
_DEVICE_ATTR = "_zeta_fsdp_devices"


def record_wrap(
    model: nn.Module, engine: str, plan: WrapPlan, device: Optional[torch.device] = None, cpu_offload: bool = False
) -> None:
    """Remember on ``model`` the engine ``fsdp()`` chose, its plan, the compute device and whether the shards
    live on CPU (``fsdp_engine``, ``get_wrap_plan``, ``compute_device``, ``shard_device``)."""
    model.__dict__[_ENGINE_ATTR] = engine
    model.__dict__[_PLAN_ATTR] = plan
    # accelerate's "already prepared" mark: a plain Accelerator().prepare() then returns the model as is,
    # instead of wrapping the shards in DistributedDataParallel (which cannot broadcast DTensors).
    model.__dict__["_is_accelerate_prepared"] = True
    if device is not None:
        model.__dict__[_DEVICE_ATTR] = (device, torch.device("cpu") if cpu_offload else device)


def compute_device(model: nn.Module) -> torch.device:
    """The device ``model`` computes on: where ``fsdp()`` put it (``cuda:LOCAL_RANK`` on GPUs), else the device
    of its first parameter (CPU for none). Move batches there: ``x, y = x.to(device), y.to(device)``.

    Example:
        >>> compute_device(nn.Linear(2, 2))
        device(type='cpu')
    """
    devices = model.__dict__.get(_DEVICE_ATTR)
    if devices is not None:
        return devices[0]
    first = next(iter(model.parameters()), None)
    return torch.device("cpu") if first is None or first.is_meta else first.device


def shard_device(model: nn.Module) -> torch.device:
    """Where the model's parameter shards live: the compute device, or CPU under ``cpu_offload``."""
    devices = model.__dict__.get(_DEVICE_ATTR)
    return devices[1] if devices is not None else compute_device(model)


def is_fsdp_wrapped(model: nn.Module) -> bool:
    """``True`` if ``model`` or any submodule has already been passed to ``fully_shard`` or to
    ``replicate`` (what ``fsdp()`` uses for NO_SHARD).

    Example:
        >>> is_fsdp_wrapped(nn.Linear(2, 2))
        False
    """
    return any(isinstance(m, (FSDPModule, ReplicatedModule)) for m in model.modules())


def fsdp_engine(model: nn.Module) -> Optional[str]:
    """The engine ``fsdp()`` put ``model`` on: ``"fully_shard"`` (FSDP2, DTensor parameters) or
    ``"replicate"`` (NO_SHARD on DDP's engine, plain tensor parameters); ``None`` if ``fsdp()``
    did not wrap it. ``options.choose_engine`` says which and why.

    Example:
        >>> fsdp_engine(nn.Linear(2, 2)) is None
        True
    """
    return model.__dict__.get(_ENGINE_ATTR)


def unwrapped_class(model: nn.Module) -> type:
    """The model's own class, under the subclass ``fully_shard`` / ``replicate`` swap in (``FSDP<Name>``)."""
    return next(c for c in type(model).__mro__ if not issubclass(c, (FSDPModule, ReplicatedModule)))


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


def get_wrap_plan(model: nn.Module) -> Optional[WrapPlan]:
    """The ``WrapPlan`` ``fsdp()`` applied to ``model`` (``None`` if ``fsdp()`` did not wrap it).

    Example:
        model = fsdp(small(), auto_wrap=True)
        print(get_wrap_plan(model).table())
    """
    return model.__dict__.get(_PLAN_ATTR)


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
