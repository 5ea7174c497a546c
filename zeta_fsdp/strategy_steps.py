"""How the strategy calls a module: its own hooks, through the FSDP root, and what they return.

Plain functions shared by ``zeta_fsdp.strategy`` and ``zeta_fsdp.lightning``.

Example:
    >>> defines(model, "training_step")  # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["call_through_root", "defines", "parse_optimizers"]


def defines(module: nn.Module, name: str) -> bool:
    """``True`` when the module's class defines ``name`` itself (not a plain ``nn.Module``).

    Example:
        >>> defines(nn.Linear(2, 2), "training_step")
        False
    """
    attr = getattr(type(module), name, None)
    return callable(attr) and getattr(nn.Module, name, None) is not attr


def call_through_root(module: nn.Module, method: str, *args: Any) -> Any:
    """Call ``module.<method>(*args)`` from inside ``module(...)``, so FSDP's root hooks wrap it.

    FSDP2 treats the first unit whose ``forward`` runs as the root. A LightningModule step that
    calls ``self.model(x)`` (not ``self(x)``) would make a child unit the root and leave the real
    root's parameters sharded. So, like Lightning's forward redirection, ``forward`` is swapped
    for the step for exactly one call; the step's own ``self(...)`` calls reach the real forward.

    Example:
        >>> loss = call_through_root(model, "training_step", batch, 0)  # doctest: +SKIP
    """
    if not isinstance(module, FSDPModule):
        return getattr(module, method)(*args)
    had_own = "forward" in vars(module)
    original = module.forward

    def restore() -> None:
        if had_own:
            module.forward = original
        else:
            vars(module).pop("forward", None)

    def redirected(*inner_args: Any, **inner_kwargs: Any) -> Any:
        restore()
        return getattr(module, method)(*inner_args, **inner_kwargs)

    module.forward = redirected
    try:
        return module(*args)
    finally:
        restore()


def parse_optimizers(result: Any) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """Lightning's ``configure_optimizers`` return forms -> (optimizers, schedulers).

    Example:
        >>> opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        >>> parse_optimizers({"optimizer": opt}) == ([opt], [])
        True
    """
    if result is None:
        return [], []
    if isinstance(result, torch.optim.Optimizer):
        return [result], []
    if isinstance(result, Mapping):
        scheduler = result.get("lr_scheduler")
        if isinstance(scheduler, Mapping):
            scheduler = scheduler.get("scheduler")
        return [result["optimizer"]], [scheduler] if scheduler is not None else []
    if isinstance(result, tuple) and len(result) == 2 and all(isinstance(r, (list, tuple)) for r in result):
        optimizers, schedulers = result
        return list(optimizers), [s.get("scheduler") if isinstance(s, Mapping) else s for s in schedulers]
    if isinstance(result, (list, tuple)):
        optimizers, schedulers = [], []
        for item in result:
            opts, scheds = parse_optimizers(item)
            optimizers += opts
            schedulers += scheds
        return optimizers, schedulers
    raise ValueError(f"FSDP2Strategy: configure_optimizers returned {type(result).__name__}, not an optimizer.")
