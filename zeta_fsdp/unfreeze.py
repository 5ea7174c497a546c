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

import torch.nn as nn

__all__ = ["UnfrozenAfterWrapError", "guard_unfreezing"]


class UnfrozenAfterWrapError(RuntimeError):
    """A parameter frozen at ``fsdp()`` time requires a gradient now, and its engine cannot train it right."""


def guard_unfreezing(model: nn.Module, check: Callable[[], Optional[str]]) -> None:
    """Run ``check`` (the engine's ``unfreeze_check``) before each forward of ``model``: it names a parameter
    the engine cannot train that was unfrozen after ``fsdp()``, or returns ``None``.

    Example:
        model = fsdp(model, ...)  # then, at a forward after an unsupported unfreeze:
        # UnfrozenAfterWrapError: blocks.0.norm1.weight was frozen when fsdp() wrapped the model ...
    """

    def before(module: nn.Module, args: Any) -> None:
        problem = check()
        if problem is not None:
            raise UnfrozenAfterWrapError(problem)

    model.register_forward_pre_hook(before)
