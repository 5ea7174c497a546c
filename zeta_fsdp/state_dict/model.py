"""The model's state dicts: sharded (``DTensor`` shards, no communication) and full (gathered one tensor at a time)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from ..distributed import get_rank, is_distributed
from ..engines import compute_device, fsdp_engine
from ..materialize import move_buffers
from ..ties import retie, tied_aliases, tied_parameter_groups
from .checks import CheckpointError, checkpoint_on_all_ranks, clean_fqn, describe_mismatch, named_parameters, shape_of


def get_sharded_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's state dict as it lives on this rank: ``DTensor`` shards, clean FQNs, no communication.

    For users who save with DCP themselves. Keys are exactly those of the unwrapped model.

    Example:
        sd = get_sharded_state_dict(model)
        sd["blocks.0.attn.qkv.weight"].placements
        # -> (Shard(dim=0),)
    """
    return {clean_fqn(k): v for k, v in get_model_state_dict(model).items()}


def load_sharded_state_dict(model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load a sharded state dict (as returned by ``get_sharded_state_dict``) into ``model`` in place.

    Keys and shapes are checked first; on a mismatch nothing is loaded.

    Example:
        sd = get_sharded_state_dict(model)
        load_sharded_state_dict(model, sd)
    """
    live = get_sharded_state_dict(model)
    state_dict = {clean_fqn(k): v for k, v in state_dict.items()}

    def check() -> None:
        got = {k: shape_of(v) for k, v in state_dict.items()}
        problem = describe_mismatch(got, {k: shape_of(v) for k, v in live.items()}, "state dict", strict)
        if problem:
            raise CheckpointError(f"load_sharded_state_dict(): the state dict does not match the model: {problem}")

    checkpoint_on_all_ranks(check)
    if not strict:
        state_dict = {k: v for k, v in state_dict.items() if k in live}
    set_model_state_dict(model, state_dict, options=StateDictOptions(strict=strict))


@torch.no_grad()
def gather_full(
    sharded: Mapping[str, Any], aliases: Mapping[str, str], *, cpu_offload: bool, rank0_only: bool
) -> dict[str, Any]:
    """All-gather each ``DTensor`` in turn (every rank, same order; the peak is the kept copy plus one full tensor),
    kept where asked, never sharing memory with the live model or optimizer; tied aliases reuse their first name's."""
    keep = not rank0_only or get_rank() == 0
    out: dict[str, Any] = {}
    gathered: set[str] = set()
    for key, value in sharded.items():
        source = aliases.get(key)
        if source is not None and source in gathered:
            if keep:
                out[key] = out[source]
            continue
        gathered.add(key)
        if not isinstance(value, torch.Tensor):
            if keep:
                out[key] = value
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            full = full.detach().cpu() if cpu_offload else full.detach()
            if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                # A replicated or unsharded tensor comes back as the live one: copy it, so the
                # result is a snapshot (Adam's step counter would otherwise keep counting in it).
                full = full.clone()
            out[key] = full
    return out


def get_full_state_dict(model: nn.Module, *, cpu_offload: bool = True, rank0_only: bool = True) -> dict[str, Any]:
    """The model's full (unsharded) state dict: plain tensors, keys exactly the unwrapped model's.

    Every rank must call it (it all-gathers one tensor at a time). With ``rank0_only`` the other
    ranks get ``{}``; with ``cpu_offload`` GPU memory holds at most one full tensor.

    Example:
        sd = get_full_state_dict(model)
        if dist.get_rank() == 0:
            torch.save(sd, "model.pt")
    """
    aliases = tied_aliases(named_parameters(model))
    return gather_full(get_sharded_state_dict(model), aliases, cpu_offload=cpu_offload, rank0_only=rank0_only)


def load_full_state_dict(
    model: nn.Module,
    full_sd: Optional[Mapping[str, Any]],
    *,
    broadcast_from_rank0: bool = True,
    strict: bool = True,
) -> None:
    """Load a full state dict (e.g. a ``torch.save`` or Hugging Face one) into a sharded model, in place.

    With ``broadcast_from_rank0`` only rank 0 needs ``full_sd`` (pass ``None`` elsewhere): tensors
    are broadcast one at a time. Works for a model built on ``meta``; one name of a tied pair fills
    the other. Keys and shapes are checked before anything is loaded.

    Example:
        with torch.device("meta"):
            model = GPT(cfg)
        fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD")
        sd = torch.load("model.pt", weights_only=True) if dist.get_rank() == 0 else None
        load_full_state_dict(model, sd)
    """
    live = {k: shape_of(v) for k, v in get_sharded_state_dict(model).items()}
    holds = not (broadcast_from_rank0 and is_distributed()) or get_rank() == 0

    def prepare() -> dict[str, Any]:
        if not holds:
            return {}
        if not isinstance(full_sd, Mapping):
            raise TypeError(f"load_full_state_dict(): full_sd must be a dict of tensors, got {type(full_sd).__name__}.")
        sd = {clean_fqn(k): v for k, v in full_sd.items()}
        for alias, source in tied_aliases(named_parameters(model)).items():
            if alias not in sd and source in sd:
                sd[alias] = sd[source]
            elif source not in sd and alias in sd:
                sd[source] = sd[alias]
        problem = describe_mismatch({k: shape_of(v) for k, v in sd.items()}, live, "state dict", strict)
        if problem:
            raise CheckpointError(f"load_full_state_dict(): the state dict does not match the model: {problem}")
        return {k: v for k, v in sd.items() if k in live}

    sd = checkpoint_on_all_ranks(prepare)
    if not is_distributed():
        model.load_state_dict(sd, strict=strict)
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0, strict=strict)
    ties = tied_parameter_groups(model)
    set_model_state_dict(model, sd, options=options)
    # A meta model is filled by assignment, one name at a time: tied names get separate tensors again,
    # and buffers land on the group's default device (CPU when it has a CPU backend), not where the
    # forward runs.
    retie(model, ties)
    if fsdp_engine(model) is not None:
        move_buffers(model, compute_device(model))
