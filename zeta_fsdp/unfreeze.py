"""Staged fine-tuning: a parameter frozen when ``fsdp()`` wrapped the model and unfrozen later.

Frozen parameters keep their dtype at wrap time (fp32 masters are for what an optimizer steps). On
FSDP2 a later unfreeze works where the parameter's dtype is what it would have had as a trainable
one (its master dtype, e.g. an fp32 model): FSDP2 reduce-scatters whatever got a gradient. Where it
is not (a bf16 base under ``master_dtype="fp32"``), its master weight, gradient and optimizer state
would stay bf16: refused. DDP's engine (NO_SHARD) builds its all-reduce at the first forward from
the parameters that require a gradient then: one unfrozen later would never be averaged across
ranks (replicas drift apart silently): refused. Both refusals come at the next forward, naming the
parameter and the fix (docs/finetuning.md, "Staged unfreezing").
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from .wrapped import refresh_reduce_dtypes

__all__ = ["UnfrozenAfterWrapError", "guard_unfreezing"]


class UnfrozenAfterWrapError(RuntimeError):
    """A parameter frozen at ``fsdp()`` time requires a gradient now, and its engine cannot train it right."""


def _fully_shard_check(model: nn.Module, master: Optional[torch.dtype]) -> Callable[[], Optional[str]]:
    params = dict(model.named_parameters())
    watched = {}
    for name, param in params.items():
        if param.requires_grad or not param.is_floating_point():
            continue
        would_be = master if master is not None else param.dtype
        if param.dtype != would_be:
            watched[name] = (param, would_be)

    # Frozen at wrap time in the dtype they would have had trainable: FSDP2 trains them once a unit that
    # had no trainable parameter at its first forward re-derives its gradient dtypes.
    allowed = [p for n, p in params.items() if not p.requires_grad and p.is_floating_point() and n not in watched]
    seen_trainable: set[int] = set()

    def check() -> Optional[str]:
        unfrozen = {id(p) for p in allowed if p.requires_grad} - seen_trainable
        if unfrozen:
            refresh_reduce_dtypes(model)
            seen_trainable.update(unfrozen)
        for name, (param, would_be) in watched.items():
            if param.requires_grad:
                return (
                    f"{name} was frozen when fsdp() wrapped the model, so it was kept in "
                    f"{str(param.dtype).replace('torch.', '')} (frozen parameters keep their dtype); trainable, it "
                    f"would be stored in {str(would_be).replace('torch.', '')}, and its master weight, gradient "
                    "reduction and optimizer state would not be. Wrap with it trainable (requires_grad=True "
                    "during fsdp(), then freeze it: parameters frozen after fsdp() can be unfrozen later), or "
                    f"cast it to {str(would_be).replace('torch.', '')} before fsdp()."
                )
        return None

    return check


def _replicate_check(model: nn.Module) -> Callable[[], Optional[str]]:
    frozen: list[tuple[str, nn.Parameter]] = []
    built = [False]

    def check() -> Optional[str]:
        if not built[0]:  # DDP's reducer was built by this forward's own pre-hook, which ran before ours
            frozen.extend((n, p) for n, p in model.named_parameters() if not p.requires_grad)
            built[0] = True
            return None
        for name, param in frozen:
            if param.requires_grad:
                return (
                    f"{name} was frozen at the first forward, when DDP's engine (NO_SHARD) built its gradient "
                    "all-reduce, and requires a gradient now: its gradient would never be averaged across ranks. "
                    'Pass a (world, 1) DeviceMesh (fsdp(..., mesh=init_device_mesh(device, (world, 1), mesh_dim_names=("replicate", "shard"))): FSDP2\'s '
                    "engine, where unfreezing works), or keep it trainable through the first step and freeze "
                    "it after."
                )
        return None

    return check


def guard_unfreezing(model: nn.Module, engine: str, master: Optional[torch.dtype]) -> None:
    """Check, before each forward of ``model``, that no parameter the engine cannot train was unfrozen.

    Example:
        model = fsdp(model, ...)  # then, at a forward after an unsupported unfreeze:
        # UnfrozenAfterWrapError: blocks.0.norm1.weight was frozen when fsdp() wrapped the model ...
    """
    check = _replicate_check(model) if engine == "replicate" else _fully_shard_check(model, master)

    def before(module: nn.Module, args: Any) -> None:
        problem = check()
        if problem is not None:
            raise UnfrozenAfterWrapError(problem)

    model.register_forward_pre_hook(before)
