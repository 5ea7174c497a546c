"""``doctor --model SPEC``: a model's first training step, sharded by ``fsdp()`` with the divergence check on.

Each rank draws its own batch (token ids when the model starts with an embedding, else floats), as
training does, so a block some rank skips for its data (a branch on the batch, LayerDrop) is named.
"""

from __future__ import annotations

import os
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
    forward/backward steps on this rank's batch. Returns (info lines, problems): a model that cannot be
    built, sharded or run is a problem line, not a traceback."""
    try:
        with importable_cwd():
            model = meta_model_from_spec(spec)
        too_big = _too_big(model)
        if too_big:
            return [], [f"model {spec}: {too_big}"]
        fsdp(model, auto_wrap=True, shard_strat=shard_strat, device=device, divergence_check=True)
        units = len(get_wrap_plan(model).units)
        batch = _batch(model, device)
        for _ in range(2):
            _scalar(model(batch)).backward()
    except UnitDivergenceError as err:
        return [], [str(err).split(". A rank")[0]]
    except (ValueError, TypeError, RuntimeError, ImportError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return [], [f"model {spec}: its first step failed: {type(err).__name__}: {first}"]
    return [f"model {spec}: {units} FSDP units ({shard_strat}); every rank ran the same units in 2 steps"], []


def _too_big(model: nn.Module) -> str:
    """Why ``model`` (on meta) will not fit one rank's share of this host's memory (its weights, gradients
    and slack: 4x its parameter bytes, the rank's share of RAM), or ``""``."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 4 * nbytes <= ram / per_node:
        return ""
    return (
        f"{nbytes / 2**30:.1f} GiB of parameters is too large for a first step on this host ({ram / 2**30:.0f} "
        f"GiB for {per_node} rank(s)); name a smaller config of it (a config.json, or a factory of smaller sizes)"
    )
