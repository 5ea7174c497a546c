"""Step torch's elementwise optimizers on the local shards of an ``fsdp()`` model's DTensors.

Why it is correct: in SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam and RAdam each element
of a parameter is updated from the same element of its gradient and state only. A DTensor
parameter, its gradient and its state share one layout (FSDP2 shards them alike; a replicated
dimension holds identical copies), so stepping each rank's local tensors is the DTensor step
without the dispatch: the same torch implementation (the group's foreach / fused / single-tensor
choice is resolved the same way for local tensors of the same device) runs the same kernels on
the same elements, bit for bit. The state stays DTensors (new state is wrapped with the
parameter's layout), so ``get_optimizer_state_dict``, DCP checkpoints and resharding see what
they saw before.

How: ``install()`` (called by ``fsdp()``) wraps the ``step`` of exactly those classes, below
torch's hook wrapper (step hooks still see the DTensors). An optimizer of one of the classes
(not a subclass: its ``step`` may look across elements) whose parameters are all ``fsdp()``
DTensors, with no ``closure`` and ``differentiable=False``, steps with its param groups and state
swapped to the local tensors for the call. Anything else takes torch's path untouched.
Off: ``ZETA_FSDP_LOCAL_STEP=0`` (the whole process) or ``use_local_step(optimizer, False)``.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections import defaultdict
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor
from torch.optim import SGD, Adagrad, Adam, Adamax, AdamW, NAdam, Optimizer, RAdam, RMSprop

from .registry import fsdp_owner, register_fsdp_model, snapshot_params

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ENV_VAR", "install", "is_elementwise", "snapshot_params", "steps_locally"]
__all__ += ["track_fsdp_model", "use_local_step"]

ELEMENTWISE_OPTIMIZERS = (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam)
ENV_VAR = "ZETA_FSDP_LOCAL_STEP"
_OFF: weakref.WeakKeyDictionary[Optimizer, bool] = weakref.WeakKeyDictionary()
_ELIGIBLE: weakref.WeakKeyDictionary[Optimizer, tuple] = weakref.WeakKeyDictionary()
_MARK = "_zeta_fsdp_local_step"


def use_local_step(optimizer: Optimizer, enabled: bool = True) -> Optimizer:
    """Turn the local-shard step on (default) or off for one optimizer; returns it.

    Example:
        >>> opt = use_local_step(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]), False)
        >>> steps_locally(opt)
        False
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"use_local_step: enabled={enabled!r} is not accepted. Accepted: True or False.")
    _OFF[optimizer] = not enabled
    return optimizer


def is_elementwise(optimizer: Optimizer) -> bool:
    """``True`` for an instance of exactly one of ``ELEMENTWISE_OPTIMIZERS`` with ``differentiable=False``.

    Example:
        >>> is_elementwise(torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))]))
        False
    """
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        return False
    return not any(group.get("differentiable", False) for group in optimizer.param_groups)


def _signature(optimizer: Optimizer) -> tuple:
    return tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)


def steps_locally(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step()`` runs on the local shards: an elementwise optimizer over ``fsdp()``
    DTensor parameters only, not turned off. (A step also falls back to torch's path when a gradient's
    layout differs from its parameter's, or a ``closure`` is given.)

    Example:
        >>> steps_locally(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))]))  # plain tensors
        False
    """
    if _OFF.get(optimizer, False) or os.environ.get(ENV_VAR, "1").strip() == "0":
        return False
    signature = _signature(optimizer)
    cached = _ELIGIBLE.get(optimizer)
    if cached is None or cached[0] != signature:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        ok = bool(params) and is_elementwise(optimizer)
        ok = ok and all(isinstance(p, DTensor) and fsdp_owner(p) is not None for p in params)
        cached = (signature, ok and not any(pl.is_partial() for p in params for pl in p.placements))
        _ELIGIBLE[optimizer] = cached
    return cached[1]


def _grads_match(optimizer: Optimizer) -> bool:
    """Every gradient has its parameter's mesh and placements (what FSDP2 produces), so its local tensor
    is the parameter's local elements' gradient."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is not None and (
                not isinstance(grad, DTensor) or grad.placements != p.placements or grad.device_mesh != p.device_mesh
            ):
                return False
    return True


def _to_local_views(optimizer: Optimizer) -> tuple[list, list, defaultdict]:
    """Swap the param groups to the local tensors (gradients attached) and build the local state."""
    saved = [group["params"] for group in optimizer.param_groups]
    pairs, state = [], defaultdict(dict)
    for group in optimizer.param_groups:
        local = []
        for p in group["params"]:
            t = p.to_local()  # under no_grad: the DTensor's own local tensor, sharing its storage
            grad = p.grad
            t.grad = None if grad is None else grad.to_local()
            entry = optimizer.state.get(p)
            if entry:
                state[t] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in entry.items()}
            local.append(t)
            pairs.append((p, t))
        group["params"] = local
    return saved, pairs, state


def _write_back(optimizer: Optimizer, saved_state: Any, pairs: list, local_state: defaultdict) -> None:
    """Drop the local gradients and fold the local state back: DTensor entries were updated in place;
    an entry torch created (first step, ``add_param_group``) gets the parameter's DTensor layout."""
    for p, t in pairs:
        t.grad = None  # the DTensor keeps the gradient; no second reference outlives the step
        new = local_state.get(t)
        if not new:
            continue
        entry = saved_state[p]
        for key, value in new.items():
            old = entry.get(key)
            if isinstance(old, DTensor):
                if value is not old.to_local():
                    old.to_local().copy_(value)
            elif isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape == t.shape:
                entry[key] = DTensor.from_local(
                    value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            else:
                entry[key] = value


def _step_on_local_shards(optimizer: Optimizer, step: Callable, args: tuple, kwargs: dict) -> Any:
    saved_state = optimizer.state
    with torch.no_grad():
        saved_params, pairs, local_state = _to_local_views(optimizer)
    optimizer.state = local_state
    try:
        return step(optimizer, *args, **kwargs)
    finally:
        for group, params in zip(optimizer.param_groups, saved_params):
            group["params"] = params
        optimizer.state = saved_state
        with torch.no_grad():
            _write_back(optimizer, saved_state, pairs, local_state)


def _local_step(step: Callable) -> Callable:
    """``step`` of an elementwise class, run on the local shards when the optimizer qualifies."""

    @functools.wraps(step)
    def wrapper(self: Optimizer, *args: Any, **kwargs: Any) -> Any:
        closure = kwargs.get("closure", args[0] if args else None)
        if closure is not None or torch.compiler.is_compiling() or not steps_locally(self) or not _grads_match(self):
            return step(self, *args, **kwargs)
        return _step_on_local_shards(self, step, args, kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper


def install() -> None:
    """Wrap ``step`` of each elementwise class once (idempotent). A class torch already wrapped with its
    hook runner (an instance exists) is re-wrapped inside it, so step hooks keep running outside.

    Example:
        >>> install(); install()
        >>> getattr(torch.optim.AdamW.step, "hooked", False) or hasattr(torch.optim.AdamW.step, _MARK)
        True
    """
    for cls in ELEMENTWISE_OPTIMIZERS:  # Adam before AdamW: AdamW inherits Adam's step until torch hooks it
        current = cls.__dict__.get("step")
        if (
            current is None
            or getattr(current, _MARK, False)
            or getattr(getattr(current, "__wrapped__", None), _MARK, False)
        ):
            continue
        if getattr(current, "hooked", False):
            hooked = Optimizer.profile_hook_step(_local_step(current.__wrapped__))
            hooked.hooked = True
            cls.step = hooked
        else:
            cls.step = _local_step(current)


def track_fsdp_model(model: torch.nn.Module, before: Any) -> None:
    """What ``fsdp()`` calls after wrapping: register ``model`` (``before`` = ``snapshot_params(model)``
    taken before wrapping) for the optimizer checks and the local-shard step, and install the step."""
    register_fsdp_model(model, before)
    install()
