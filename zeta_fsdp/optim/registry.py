"""Which parameters ``fsdp()`` made, which it replaced, and the checks of an optimizer over them.

``fsdp()`` registers each model it wraps: its DTensor parameters (the only ones the local step
touches) and the parameters ``fully_shard`` replaced (an optimizer built over those before
wrapping would step tensors that no longer get gradients: training silently does nothing). A
global optimizer step pre-hook (torch's public ``register_optimizer_step_pre_hook``) turns both
mistakes, and one optimizer over models on different meshes, into a clear error before the step.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["check_optimizer", "forget_snapshot", "fsdp_owner", "layout_matches", "param_layout", "register_fsdp_model"]
__all__ += ["snapshot_params"]

# No weak reference to a parameter anywhere: torch.utils.swap_tensors (to_empty, load_pretrained into a
# meta model) refuses a tensor that has one. DTensor parameters fsdp() made are known by id (the module
# keeps the same Python object across a swap); the parameters fully_shard replaced carry a marker.
_OWNER: dict[int, weakref.ref[nn.Module]] = {}  # id(DTensor parameter fsdp() made) -> its model
_MARK = "_zeta_fsdp_replaced_in"  # on a parameter fsdp() replaced: the model's class name
_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple] = weakref.WeakKeyDictionary()
_HOOK: list = []


def snapshot_params(model: nn.Module) -> str:
    """Mark ``model``'s parameters before wrapping (an attribute on each, no reference kept: wrapping
    still frees each original as its unit is sharded); ``register_fsdp_model`` unmarks those the model
    still holds afterwards, so only the replaced ones an optimizer may hold stay marked."""
    for param in model.parameters():
        setattr(param, _MARK, type(model).__name__)
    return type(model).__name__


def forget_snapshot(model: nn.Module) -> None:
    """Unmark ``model``'s parameters (``fsdp()`` failed part way: nothing was replaced for good)."""
    for param in model.parameters():
        if hasattr(param, _MARK):
            delattr(param, _MARK)


def register_fsdp_model(model: nn.Module, before: str) -> None:
    """Record what ``fsdp()`` did to ``model``'s parameters; ``before`` = ``snapshot_params`` taken before wrapping.

    Example:
        >>> m = nn.Linear(2, 2)
        >>> register_fsdp_model(m, snapshot_params(m))  # nothing replaced, nothing sharded
        >>> fsdp_owner(m.weight) is None
        True
    """
    owner = weakref.ref(model)
    for param in model.parameters():
        if hasattr(param, _MARK):
            delattr(param, _MARK)  # still the model's: not replaced
        if isinstance(param, DTensor):
            _OWNER[id(param)] = owner
    for key in [k for k, ref in _OWNER.items() if ref() is None]:
        del _OWNER[key]  # models gone
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_pre_step_check))


def fsdp_owner(param: torch.Tensor) -> Optional[nn.Module]:
    """The ``fsdp()`` model that made DTensor ``param``, or ``None`` (not made by ``fsdp()``, or gone)."""
    ref = _OWNER.get(id(param))
    model = ref() if ref is not None else None
    return model if isinstance(param, DTensor) and model is not None else None


def param_layout(optimizer: torch.optim.Optimizer) -> tuple:
    """The optimizer's parameters, group by group, for :func:`layout_matches`. It holds the parameters
    themselves, not ids: an id of a freed parameter can be reused by a new one, and a list edited in
    place (a swap between groups, ``group["params"][0] = p``) keeps its own id.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> param_layout(torch.optim.SGD([w]))[0][0] is w
        True
    """
    return tuple(tuple(group["params"]) for group in optimizer.param_groups)


def layout_matches(optimizer: torch.optim.Optimizer, layout: Optional[tuple]) -> bool:
    """Whether ``optimizer`` holds the very parameters of ``layout`` (a :func:`param_layout`), in the same groups
    and order: the per-step check, an identity pass at C speed without building a new layout (a tensor's ``==``
    is elementwise).

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))])
        >>> layout = param_layout(opt)
        >>> layout_matches(opt, layout), layout_matches(opt, None)
        (True, False)
    """
    groups = optimizer.param_groups
    if layout is None or len(groups) != len(layout):
        return False
    for group, params in zip(groups, layout):
        current = group["params"]
        if len(current) != len(params) or not all(map(operator.is_, current, params)):
            return False
    return True


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` if ``optimizer`` holds parameters ``fsdp()`` replaced, or DTensor parameters of
    several ``fsdp()`` models on different device meshes (one model on several meshes, FSDP + tensor
    parallel, is fine)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stale = [p for p in params if hasattr(p, _MARK)]
    if stale:
        raise ValueError(
            f"{type(optimizer).__name__} holds {len(stale)} parameter(s) of {getattr(stale[0], _MARK)} from before "
            "fsdp() wrapped it: fsdp() replaces them with sharded DTensor parameters, so these would never get "
            "a gradient. Build the optimizer after wrapping: model = fsdp(model, ...); "
            "optimizer = torch.optim.AdamW(model.parameters())."
        )
    meshes: dict[int, tuple[str, set]] = {}  # per fsdp() model: its name and the meshes of its parameters here
    for p in params:
        owner = fsdp_owner(p)
        if owner is not None:
            meshes.setdefault(id(owner), (type(owner).__name__, set()))[1].add(p.device_mesh)
    if len(meshes) > 1 and len({frozenset(m) for _, m in meshes.values()}) > 1:
        raise ValueError(
            f"{type(optimizer).__name__} holds parameters of {len(meshes)} fsdp() models on different device "
            f"meshes ({'; '.join(f'{name}: {sorted(map(str, m))}' for name, m in meshes.values())}): DTensors of "
            "different meshes cannot meet in one foreach/fused step, and a checkpoint of this optimizer would mix "
            "the models. Build one optimizer per model, or wrap the models on one mesh (fsdp(..., mesh=mesh))."
        )


def _pre_step_check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: :func:`check_optimizer` once per optimizer and param-group layout."""
    if not layout_matches(optimizer, _CHECKED.get(optimizer)):
        check_optimizer(optimizer)
        _CHECKED[optimizer] = param_layout(optimizer)
