"""What ``fsdp()`` did to a model, read back: the engine's name, the plan, the devices.

``fsdp()`` records them on the model (``record_wrap``); everything else reads them here.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.distributed._composable.replicate import DDP as ReplicatedModule  # noqa: N811 - torch names the class DDP
from torch.distributed.fsdp import FSDPModule

from ..wrapping import WrapPlan

__all__ = [
    "compute_device",
    "fsdp_engine",
    "get_wrap_plan",
    "is_fsdp_wrapped",
    "record_wrap",
    "shard_device",
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


def get_wrap_plan(model: nn.Module) -> Optional[WrapPlan]:
    """The ``WrapPlan`` ``fsdp()`` applied to ``model`` (``None`` if ``fsdp()`` did not wrap it).

    Example:
        model = fsdp(small(), auto_wrap=True)
        print(get_wrap_plan(model).table())
    """
    return model.__dict__.get(_PLAN_ATTR)
