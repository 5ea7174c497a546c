"""The engine a wrapped model runs on, behind one seam.

``fsdp()`` shards with FSDP2 (``fully_shard``) or, for NO_SHARD in fp32 or bf16, replicates with
DDP's engine (composable ``replicate``); ``options.choose_engine`` picks. Whatever depends on which
one runs is a function of the same name in ``engines.fully_shard`` and ``engines.replicate``
(``SEAM``); consumers ask ``engine_of(model)`` (a live model) or ``engine_named(name)`` (``fsdp()``,
the planner) and never branch on the engine.
"""

from __future__ import annotations

from types import ModuleType

import torch.nn as nn
from torch.distributed._composable.replicate import DDP as ReplicatedModule  # noqa: N811 - torch names the class DDP
from torch.distributed.fsdp import FSDPModule

from . import fully_shard, replicate

__all__ = ["SEAM", "engine_named", "engine_of", "hooks_on"]

# What each engine module defines: the façade's steps, what training and measuring ask of a live
# model, the planner's engine terms (pure: sizes only), and whether replicas hold equal parameters.
SEAM = ("check", "mesh_for", "wrap", "managed", "no_sync", "accumulation_bytes", "peak_memory")
SEAM += ("plan_costs", "plan_accumulation", "REPLICAS_EQUAL")


def engine_of(model: nn.Module) -> ModuleType:
    """The engine module for ``model`` (searched inside: a container, ``torch.compile``'s wrapper);
    ``fully_shard``'s for a model neither manages (its functions leave such a model alone)."""
    return replicate if replicate.managed(model) else fully_shard


def engine_named(name: str) -> ModuleType:
    """The engine module for an ``options.choose_engine`` name."""
    return {"fully_shard": fully_shard, "replicate": replicate}[name]


def hooks_on(module: nn.Module) -> bool:
    """``True`` if an engine's forward hooks sit on ``module`` itself (an FSDP unit, the replicated model)."""
    return isinstance(module, (FSDPModule, ReplicatedModule))
