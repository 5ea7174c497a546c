"""Optimizer state keyed by parameter FQN (never by index): flattening, validation, scratch space, loading."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as _dcp_get_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from ..distributed import comm_device, get_rank, get_world_size, is_distributed
from .checks import (
    FAILURES,
    GROUPS_PREFIX,
    STATE_PREFIX,
    CheckpointError,
    checkpoint_on_all_ranks,
    clean_fqn,
    short_list,
)
from .model import gather_full


def _optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[nn.Parameter, list[str], dict]]:
    """``(param, its names, its param group)`` for every parameter the optimizer updates (a tied one has several)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(clean_fqn(name))
    out = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise CheckpointError(
                    "the optimizer holds a parameter that is not in the model. Create the optimizer "
                    "after fsdp(), from model.parameters() (sharding replaces the parameters)."
                )
            out.append((param, names[id(param)], group))
    return out


def flat_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Sharded optimizer state, flattened and keyed by parameter FQN."""
    if not optimizer.state:
        # Never stepped. torch's get_optimizer_state_dict would first run a zero-lr step to create
        # state, which changes Adam's step count (and so every later update): record the options only.
        params = _optimizer_params(model, optimizer)
        return {f"{GROUPS_PREFIX}{names[0]}.{k}": v for _, names, g in params for k, v in g.items() if k != "params"}
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    return {clean_fqn(k): v for k, v in _dcp_get_optimizer_state_dict(model, optimizer, options=options).items()}


def _materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (names, shapes) with one step at lr 0 on zero gradients, as torch's
    ``set_optimizer_state_dict`` does, but the user's gradients kept aside (torch skips the step if any exists)."""
    grads = [(p, p.grad) for g in optimizer.param_groups for p in g["params"]]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        for param, _ in grads:
            param.grad = torch.zeros_like(param) if param.requires_grad else None
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for param, grad in grads:
            param.grad = grad


def _state_key_fqn(rest: str, known: Mapping[str, Any]) -> Optional[str]:
    """The parameter FQN at the start of ``rest`` (``"<fqn>.<state name>"``): the longest known prefix."""
    parts = rest.split(".")
    for end in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def check_group_consistency(model: nn.Module, optimizer: torch.optim.Optimizer, flat: Mapping[str, Any]) -> None:
    """Every parameter of one live param group must come back with the same options."""
    saved_fqns = {k[len(GROUPS_PREFIX) :].rsplit(".", 1)[0] for k in flat if k.startswith(GROUPS_PREFIX)}
    seen: dict[tuple[int, str], tuple[str, Any]] = {}
    for _, names, group in _optimizer_params(model, optimizer):
        fqn = next((n for n in names if n in saved_fqns), names[0])
        for option in group:
            key = f"param_groups.{fqn}.{option}"
            if option == "params" or key not in flat:
                continue
            first = seen.setdefault((id(group), option), (fqn, flat[key]))
            if not _same(first[1], flat[key]):
                raise CheckpointError(
                    f"optimizer option {option!r} differs inside one live param group: {first[0]} has "
                    f"{first[1]!r}, {fqn} has {flat[key]!r}. Build the optimizer's param groups as when saving."
                )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def set_flat_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, flat: Mapping[str, Any]) -> None:
    """Load a validated, flattened sharded optimizer state into ``optimizer``."""
    if not any(k.startswith(STATE_PREFIX) for k in flat):
        # Saved before the first step: restore the options and leave the optimizer fresh.
        for _, names, group in _optimizer_params(model, optimizer):
            for name in names:
                for option in group:
                    key = f"param_groups.{name}.{option}"
                    if option != "params" and key in flat:
                        group[option] = flat[key]
        optimizer.state.clear()
        return
    grads = [(p, p.grad) for g in optimizer.param_groups for p in g["params"]]
    try:
        for param, _ in grads:
            param.grad = None
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        set_optimizer_state_dict(model, optimizer, dict(flat), options=options)
    finally:
        for param, grad in grads:
            param.grad = grad


# Options torch's LR schedulers add to param groups: a checkpoint may hold them before the scheduler exists.
_SCHEDULER_OPTIONS = {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"}


def validate_optimizer(
    saved_keys: list[str], model: nn.Module, optimizer: torch.optim.Optimizer, source: str
) -> dict[int, str]:
    """Check saved flat optimizer keys against the live optimizer (names both ways, every state name it keeps), and
    return ``{id(param): saved FQN}``. A fresh optimizer gets its state to know those (callers clear it on failure)."""
    params = _optimizer_params(model, optimizer)
    group_keys = [k[len(GROUPS_PREFIX) :] for k in saved_keys if k.startswith(GROUPS_PREFIX)]
    if not group_keys:
        raise CheckpointError(f"{source} holds no optimizer state (it was saved without an optimizer).")
    saved_fqns = {k.rsplit(".", 1)[0] for k in group_keys}
    _check_param_names(params, saved_fqns, source)
    _check_options(group_keys, optimizer, source)
    chosen = {id(p): next(n for n in names if n in saved_fqns) for p, names, _ in params}
    state_keys = [k for k in saved_keys if k.startswith(STATE_PREFIX)]
    if not state_keys:
        return chosen  # saved before the first step: options only
    if not optimizer.state:
        _materialize_optimizer_state(optimizer)
    _check_state_names(state_keys, params, optimizer, chosen, source)
    return chosen


def _check_param_names(params: list, saved_fqns: set[str], source: str) -> None:
    """Every optimized parameter has saved state (under one of its names), every saved one is optimized."""
    known = {name for _, names, _ in params for name in names}
    unexpected = sorted(f for f in saved_fqns if f not in known)
    missing = [names[0] for _, names, _ in params if not any(n in saved_fqns for n in names)]
    if missing or unexpected:
        raise CheckpointError(
            f"the optimizer state in {source} does not match the optimizer: parameters without saved "
            f"state: {short_list(missing)}; saved parameters the optimizer does not have: {short_list(unexpected)}"
        )


def _check_options(group_keys: list[str], optimizer: torch.optim.Optimizer, source: str) -> None:
    """Options the checkpoint's optimizer had and this one lacks mean another optimizer class (options
    only this one has are tolerated: a newer torch adds some)."""
    saved_options = {k.rsplit(".", 1)[1] for k in group_keys}
    live_options = {option for group in optimizer.param_groups for option in group if option != "params"}
    foreign = sorted(saved_options - live_options - _SCHEDULER_OPTIONS)
    if foreign:
        raise CheckpointError(
            f"{source} was saved by an optimizer with options {foreign} that this {type(optimizer).__name__} does "
            f"not have (its options: {sorted(live_options)}): a different optimizer class. Create the optimizer "
            "the checkpoint was saved with (nothing was changed)."
        )


def _check_state_names(
    state_keys: list[str], params: list, optimizer: torch.optim.Optimizer, chosen: dict[int, str], source: str
) -> None:
    """Every state name the live optimizer keeps for a parameter (``exp_avg``, ``step``...) was saved."""
    saved_set = set(state_keys)
    lacking = []
    for param, _, _ in params:
        for name in optimizer.state.get(param, {}):
            key = f"state.{chosen[id(param)]}.{name}"
            if key not in saved_set and not any(k.startswith(key + ".") for k in state_keys):
                lacking.append(f"{chosen[id(param)]}.{name}")
    if lacking:
        raise CheckpointError(
            f"{source} lacks optimizer state the optimizer needs: {short_list(lacking)} (saved by a different optimizer class?)"
        )


def optimizer_scratch(
    saved: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, chosen: Mapping[int, str]
) -> dict[str, Any]:
    """Scratch tensors/placeholders to read the saved optimizer entries into (``{flat key: metadata}``)."""
    params = _optimizer_params(model, optimizer)
    by_name = {name: param for param, names, _ in params for name in names}
    scratch: dict[str, Any] = {}
    for key, entry in saved.items():
        if key.startswith(STATE_PREFIX):
            fqn = _state_key_fqn(key[len(STATE_PREFIX) :], by_name)
            scratch[key] = _scratch_like(entry, by_name.get(fqn) if fqn else None)
        elif key.startswith(GROUPS_PREFIX):
            scratch[key] = entry  # options travel as values (one record in a checkpoint)
    for param, _, group in params:
        for option, value in group.items():
            key = f"param_groups.{chosen[id(param)]}.{option}"
            if option != "params" and key not in scratch:
                scratch[key] = value  # an option newer than the checkpoint: keep the live value
    return scratch


def _scratch_like(entry: Any, param: Optional[torch.Tensor]) -> Any:
    """Something to read a saved entry (DCP metadata, a tensor or a value) into: sharded like ``param``
    when it has the parameter's shape."""
    if isinstance(entry, TensorStorageMetadata):
        shape, dtype = tuple(entry.size), entry.properties.dtype
    elif isinstance(entry, torch.Tensor):
        shape, dtype = tuple(entry.shape), entry.dtype
    elif isinstance(entry, BytesStorageMetadata):
        return None  # replaced by the loaded object
    else:
        return entry
    if param is not None and shape == tuple(param.shape):
        return torch.empty_like(param.detach(), dtype=dtype)
    return torch.empty(shape, dtype=dtype)


def get_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    full: bool = False,
    cpu_offload: bool = True,
    rank0_only: bool = True,
) -> dict[str, Any]:
    """The optimizer state keyed by parameter FQN (never by index), flattened.

    Keys are ``"state.<fqn>.<name>"`` (e.g. ``state.blocks.0.attn.qkv.weight.exp_avg``) and
    ``"param_groups.<fqn>.<option>"``. ``full=False``: ``DTensor`` shards as they live on this rank.
    ``full=True``: plain tensors gathered one at a time (``cpu_offload`` / ``rank0_only`` as in
    ``get_full_state_dict``).

    Example:
        osd = get_optimizer_state_dict(model, optimizer, full=True)
        osd["state.head.weight.exp_avg"].shape  # on rank 0
        # -> torch.Size([37, 30])
    """
    flat = flat_optimizer_state(model, optimizer)
    return gather_full(flat, {}, cpu_offload=cpu_offload, rank0_only=rank0_only) if full else flat


def load_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    osd: Optional[Mapping[str, Any]],
    *,
    full: bool = False,
    broadcast_from_rank0: bool = True,
) -> None:
    """Load an optimizer state from ``get_optimizer_state_dict`` into ``optimizer``, in place.

    ``full=True``: ``osd`` holds plain full tensors, on rank 0 only when ``broadcast_from_rank0``
    (pass ``None`` elsewhere). Names are checked first; on a mismatch nothing changes.

    Example:
        osd = get_optimizer_state_dict(model, optimizer, full=True)
        load_optimizer_state_dict(model, optimizer, osd, full=True)
    """
    holds = not (full and broadcast_from_rank0 and is_distributed()) or get_rank() == 0
    if holds and not isinstance(osd, Mapping):
        raise TypeError(f"load_optimizer_state_dict(): osd must be a dict, got {type(osd).__name__}.")
    flat = entries = {clean_fqn(k): v for k, v in osd.items()} if holds else {}
    if full:
        # What each entry is (a shape-only meta tensor, or the option's value): every rank needs it
        # to validate and to allocate what the broadcast fills.
        tensors = [k for k, v in flat.items() if k.startswith(STATE_PREFIX) and isinstance(v, torch.Tensor)]
        described = [{**flat, **{k: torch.empty_like(flat[k], device="meta") for k in tensors}}]
        if broadcast_from_rank0 and get_world_size() > 1:
            dist.broadcast_object_list(described, src=0)
        entries = described[0]
    was_fresh = not optimizer.state
    try:
        source = "the optimizer state dict"
        chosen = checkpoint_on_all_ranks(lambda: validate_optimizer(list(entries), model, optimizer, source))
        if full:
            scratch = optimizer_scratch(entries, model, optimizer, chosen)
            flat = _distribute_full(flat, entries, scratch, broadcast=broadcast_from_rank0 and get_world_size() > 1)
        checkpoint_on_all_ranks(lambda: check_group_consistency(model, optimizer, flat))
    except FAILURES:
        if was_fresh:
            optimizer.state.clear()
        raise
    set_flat_optimizer_state(model, optimizer, flat)


@torch.no_grad()
def _distribute_full(
    full: Mapping[str, Any], entries: Mapping[str, Any], scratch: Mapping[str, Any], *, broadcast: bool
) -> dict[str, Any]:
    """Full tensors (on rank 0 when ``broadcast``) -> this rank's shards, one tensor at a time."""
    out: dict[str, Any] = {}
    for key, entry in entries.items():
        like = scratch.get(key)
        if not (key.startswith(STATE_PREFIX) and isinstance(entry, torch.Tensor) and isinstance(like, torch.Tensor)):
            out[key] = entry
            continue
        device = like.device if isinstance(like, DTensor) else comm_device()
        if key in full:
            # a copy: the optimizer updates its state in place (AdamW's step += 1), the caller's dict stays as given
            value = full[key].detach().to(device=device, dtype=like.dtype, copy=True)
        else:
            value = torch.empty(like.shape, dtype=like.dtype, device=device)
        if broadcast:
            value = value.contiguous()
            dist.broadcast(value, src=0)
        if isinstance(like, DTensor):
            # every rank holds the full tensor now: each keeps its own slice, no more communication
            value = distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
        out[key] = value
    return out
