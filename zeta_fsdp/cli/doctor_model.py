"""``doctor --model SPEC``: a model's first training step, sharded by ``fsdp()`` with the divergence check on.

Each rank draws its own batch (token ids when the model starts with an embedding, else floats), as
training does, so a block some rank skips for its data (a branch on the batch, LayerDrop) is named.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..divergence import UnitDivergenceError
from ..engines import get_wrap_plan
from ..fsdp import fsdp
from .model_spec import importable_cwd, meta_model_from_spec

__all__ = ["first_step"]

_BATCH, _SEQ = 2, 8


def _batch(model: nn.Module, device: torch.device) -> torch.Tensor:
    """This rank's batch: ids below the first embedding's size, else ``(batch, in_features)`` floats."""
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is not None:
        return torch.randint(0, embedding.num_embeddings, (_BATCH, _SEQ), generator=g).to(device)
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        raise ValueError("doctor --model: the model has no nn.Embedding or nn.Linear to size a batch for")
    return torch.randn(_BATCH, first.in_features, generator=g).to(device)


def _scalar(output: Any) -> torch.Tensor:
    """A loss from whatever the forward returned: the mean of its floating-point tensors."""
    if isinstance(output, torch.Tensor):
        return output.float().mean()
    values = output.values() if isinstance(output, dict) else output
    tensors = [t for t in values if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError(f"doctor --model: the forward returned no floating-point tensor ({type(output).__name__})")
    return sum(t.float().mean() for t in tensors)


def first_step(spec: str, shard_strat: str, device: torch.device) -> tuple[list[str], list[str]]:
    """Build ``spec`` (on meta, materialized by ``fsdp()``), shard it with every forward checked, run two
    forward/backward steps on this rank's batch. Returns (info lines, problems)."""
    with importable_cwd():
        model = meta_model_from_spec(spec)
    fsdp(model, auto_wrap=True, shard_strat=shard_strat, device=device, divergence_check=True)
    units = len(get_wrap_plan(model).units)
    batch = _batch(model, device)
    try:
        for _ in range(2):
            _scalar(model(batch)).backward()
    except UnitDivergenceError as err:
        return [], [str(err).split(". A rank")[0]]
    return [f"model {spec}: {units} FSDP units ({shard_strat}); every rank ran the same units in 2 steps"], []
