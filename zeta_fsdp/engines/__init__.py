"""The engine a wrapped model runs on, behind one seam, and what ``fsdp()`` did, read back.

``fsdp()`` shards with FSDP2 (``fully_shard``) or, for NO_SHARD in fp32 or bf16, replicates with
DDP's engine (composable ``replicate``); ``options.choose_engine`` picks. Whatever depends on which
one runs is a function of the same name and signature in ``engines.fully_shard`` and
``engines.replicate`` (the ``Engine`` protocol, ``engines.base``); consumers ask
``engine_of(model)`` (a live model) or ``engine_named(name)`` (``fsdp()``, the planner) and never
branch on the engine. ``engines.record`` answers what ``fsdp()`` did (engine, plan, devices);
``engines.fsdp2_state`` is the one reader of FSDP2's private state. Import from here.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed._composable.replicate import DDP as ReplicatedModule  # noqa: N811 - torch names the class DDP
from torch.distributed.fsdp import FSDPModule

from . import fully_shard, replicate
from .base import Engine, PlanTerms, WrapOptions
from .fsdp2_state import (
    clear_pending_grads,
    fsdp_param_groups,
    fsdp_state,
    partial_reduce_output,
    pending_unsharded_grad,
    refresh_reduce_dtypes,
)
from .fully_shard import output_tensors, restore_fsdp_hooks
from .record import (
    compute_device,
    fsdp_engine,
    get_wrap_plan,
    is_fsdp_wrapped,
    record_wrap,
    shard_device,
    unwrapped_class,
)
from .replicate import gradient_bucket_bytes, memtracker_categories

__all__ = ["DEFAULT_ENGINE", "SEAM", "Engine", "PlanTerms", "WrapOptions", "engine_named", "engine_of", "hooks_on"]
__all__ += ["compute_device", "fsdp_engine", "get_wrap_plan", "is_fsdp_wrapped", "record_wrap", "shard_device"]
__all__ += ["unwrapped_class", "clear_pending_grads", "fsdp_param_groups", "fsdp_state", "partial_reduce_output"]
__all__ += ["pending_unsharded_grad", "refresh_reduce_dtypes", "output_tensors", "restore_fsdp_hooks"]
__all__ += ["gradient_bucket_bytes", "memtracker_categories"]

# What each engine module defines: the names of the Engine protocol (functions and constants).
SEAM = tuple(n for n in (*Engine.__annotations__, *vars(Engine)) if not n.startswith("_"))
# The engines by name, and the one a model gets unless ``options.choose_engine`` picks another.
_BY_NAME = {engine.NAME: engine for engine in (fully_shard, replicate)}
DEFAULT_ENGINE = fully_shard.NAME


def engine_of(model: nn.Module) -> Engine:
    """The engine module for ``model`` (searched inside: a container, ``torch.compile``'s wrapper);
    ``fully_shard``'s for a model neither manages (its functions leave such a model alone)."""
    return replicate if replicate.managed(model) else fully_shard


def engine_named(name: str) -> Engine:
    """The engine module for an ``options.choose_engine`` name."""
    return _BY_NAME[name]


def hooks_on(module: nn.Module) -> bool:
    """``True`` if an engine's forward hooks sit on ``module`` itself (an FSDP unit, the replicated model)."""
    return isinstance(module, (FSDPModule, ReplicatedModule))
