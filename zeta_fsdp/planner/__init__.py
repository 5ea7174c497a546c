"""Sharding planner: what ``fsdp()`` will do to a model, and what it will cost per rank, before any run.

``estimate`` computes the per-rank bytes from the same wrap plan ``fsdp()`` uses (``plan()``);
``dry_run`` checks them against the real ``fsdp()`` under PyTorch's fake process group (and holds
what both read: the job's size and mesh, dtype names).

Example:
    >>> import torch
    >>> from zeta_fsdp.models.gpt import small
    >>> with torch.device("meta"):
    ...     model = small()
    >>> plan(model, world_size=2, shard_strat="FULL_SHARD").param_bytes
    69960
"""

from .dry_run import DryRunResult, dry_run
from .estimate import OPTIMIZERS, MemoryPlan, UnitEstimate, plan

__all__ = ["OPTIMIZERS", "DryRunResult", "MemoryPlan", "UnitEstimate", "dry_run", "plan"]
