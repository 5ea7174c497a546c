"""What ``fsdp()`` does to a planned model on either engine before wrapping it (``engines``):
per-block transforms (activation checkpointing, ``torch.compile``) and the master-dtype cast.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .options import stored_dtype
from .wrapping import WrapPlan

__all__ = ["apply_activation_checkpointing", "apply_compile", "cast_to_fp32", "cast_to_master"]


def cast_to_master(model: nn.Module, master: Optional[torch.dtype]) -> list[str]:
    """Store every trainable floating-point parameter in ``master`` (in place; ties stay one
    object). Frozen ones keep their dtype (``options.stored_dtype``)."""
    cast = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            dtype = stored_dtype(param, master)
            if param.dtype != dtype:
                param.data = param.data.to(dtype)
                cast.append(name)
    return cast


def cast_to_fp32(model: nn.Module, names: Sequence[str]) -> list[str]:
    """Store the parameters ``names`` (``fp32_modules``) in fp32, frozen ones too: they compute in
    the dtype they are stored in, as ``from_pretrained`` loads them."""
    cast = []
    with torch.no_grad():
        for name in names:
            param = model.get_parameter(name)
            if param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()
                cast.append(name)
    return cast


def apply_activation_checkpointing(plan: WrapPlan) -> None:
    """Recompute each block's activations in backward instead of storing them. ``forward`` is wrapped in
    place (no wrapper module): names and state-dict keys stay the model's; FSDP's hooks run around it."""
    for unit in plan.blocks:
        for module in unit.modules:
            if "forward" not in vars(module):
                module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)


def apply_compile(plan: WrapPlan, options: Union[bool, dict]) -> None:
    """``torch.compile`` each block in place (``nn.Module.compile``: names unchanged)."""
    kwargs = options if isinstance(options, dict) else {}
    for unit in plan.blocks:
        for module in unit.modules:
            module.compile(**kwargs)
