"""State dicts and checkpoints of sharded models, on PyTorch's own machinery.

Everything here is built on ``torch.distributed.checkpoint`` (DCP) and
``torch.distributed.checkpoint.state_dict``; there is no file format of our own. A checkpoint is a
plain DCP directory (one ``.metadata`` file plus one ``.distcp`` file per rank) holding:

* ``model.<fqn>``: the model's tensors, sharded as they live on the ranks (each rank writes its
  own); a tied tensor once, under its first name,
* ``optim.state.<fqn>.<name>``: optimizer state keyed by parameter name (never by index), so it
  loads at any world size and sharding strategy; ``optim.param_groups``: one record of
  ``{"param_groups.<fqn>.<option>": value}`` (torch's flattened optimizer format),
* ``model_layout``: the model's keys in order and its tied names (for consolidation),
* ``extra``: one object of the user's (step, epoch, scheduler, RNG), saved from rank 0.

Safety rules: nothing in a checkpoint is unpickled with ``weights_only=False`` (DCP's ``.metadata``
goes through an allow-list unpickler, ``extra`` and optimizer options through
``torch.load(weights_only=True)``, and every record's zip CRC-32 is checked while reading); a save
is written to a hidden temporary directory and renamed into place; a load validates the checkpoint
(keys, shapes, files) and reads it completely into scratch tensors before the live model or
optimizer changes.

Example:
    >>> save_checkpoint("ckpt/step_100", model, optimizer, extra={"step": 100})
    >>> extra = load_checkpoint("ckpt/step_100", model, optimizer)  # any world size, any strategy
    >>> consolidate_checkpoint("ckpt/step_100", "model.safetensors")  # offline, one process
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict as _dcp_get_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = [
    "CheckpointError",
    "consolidate_checkpoint",
    "get_full_state_dict",
    "get_optimizer_state_dict",
    "get_sharded_state_dict",
    "is_checkpoint",
    "load_checkpoint",
    "load_full_state_dict",
    "load_optimizer_state_dict",
    "load_sharded_state_dict",
    "save_checkpoint",
]

PathLike = Union[str, os.PathLike]
# DCP's CheckpointException derives from BaseException, not Exception: catch it explicitly.
_FAILURES = (Exception, CheckpointException)

_MODEL = "model."
_OPTIM = "optim."
_EXTRA = "extra"
# {"keys": the model's keys in order, "tied": {alias: first name}}: a tied tensor is written once,
# under its first name; consolidation restores every name, in the unwrapped model's order.
_LAYOUT = "model_layout"
# All param-group options in one record (rank 0's): hundreds of tiny records otherwise, each one
# read back by every rank.
_PACKED_GROUPS = "optim.param_groups"
_STATE = "state."
_GROUPS = "param_groups."
_METADATA_FILE = ".metadata"
# Wrapper modules that insert a name into parameter paths (activation checkpointing, torch.compile,
# FSDP1). The façade adds none of them, but a user's own wrapping may.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


class CheckpointError(ValueError):
    """A checkpoint or state dict that cannot be used: not a checkpoint, corrupted, or of another model.

    Raised before the live model or optimizer is changed.

    Example:
        >>> try:
        ...     load_checkpoint("ckpt/other_model", model)
        ... except CheckpointError as e:
        ...     print(e)  # names the path and the mismatching keys/shapes
    """


# --------------------------------------------------------------------------- ranks


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world() -> int:
    return dist.get_world_size() if _dist_on() else 1


_ERROR_TYPES = {cls.__name__: cls for cls in (FileNotFoundError, FileExistsError, TypeError, ImportError)}


def _agree(error: Optional[BaseException]) -> None:
    """Raise on every rank when any rank failed.

    A rank that raised alone would leave its peers waiting in the next collective until the group's
    timeout, so each check ends with one all-gather of "ok or what went wrong".
    """
    if _world() > 1:
        text = None if error is None else (_reason(error) if isinstance(error, CheckpointException) else str(error))
        report = None if error is None else (type(error).__name__, text)
        reports: list = [None] * _world()
        dist.all_gather_object(reports, report)
        if error is None:
            for rank, item in enumerate(reports):
                if item is not None:
                    raise _ERROR_TYPES.get(item[0], CheckpointError)(f"{item[1]} (reported by rank {rank})")
    if error is not None:
        raise error


def _reason(error: BaseException) -> str:
    """One readable line per failing rank (DCP's exception text holds every rank's traceback)."""
    if isinstance(error, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(error.failures.items())
        )
    return f"{type(error).__name__}: {error}" if not isinstance(error, CheckpointError) else str(error)


def _on_all_ranks(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank; if it raises anywhere, raise everywhere (see ``_agree``)."""
    try:
        result, error = fn(), None
    except _FAILURES as e:  # re-raised below, on every rank
        result, error = None, e
    _agree(error)
    return result


# --------------------------------------------------------------------------- names and shapes


def _clean_fqn(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _param_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of every parameter (tied parameters have several), keyed by ``id(param)``."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(_clean_fqn(name))
    return names


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: first name}`` for every parameter reachable under more than one name."""
    return {alias: names[0] for names in _param_names(model).values() for alias in names[1:]}


def _shape(value: Any) -> Optional[tuple[int, ...]]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _short(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... and {len(names) - limit} more' if len(names) > limit else ''}]"


def _mismatch(
    got: Mapping[str, Optional[tuple]], want: Mapping[str, Optional[tuple]], source: str, strict: bool
) -> str:
    """What differs between two ``{key: shape}`` maps, in words; empty when they match."""
    missing = [k for k in want if k not in got]
    unexpected = [k for k in got if k not in want]
    shapes = [
        f"{k}: {source} {list(got[k])} vs model {list(want[k])}"
        for k in want
        if k in got and got[k] is not None and want[k] is not None and got[k] != want[k]
    ]
    parts = []
    if strict and missing:
        parts.append(f"missing keys (in the model, not in the {source}): {_short(missing)}")
    if strict and unexpected:
        parts.append(f"unexpected keys (in the {source}, not in the model): {_short(unexpected)}")
    if shapes:
        parts.append(f"shape mismatches: {_short(shapes)}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- state dicts


def get_sharded_state_dict(model: nn.Module) -> dict[str, Any]:
    """The model's state dict as it lives on this rank: ``DTensor`` shards, clean FQNs, no communication.

    For users who save with ``torch.distributed.checkpoint`` themselves. Keys are exactly those of
    the unwrapped model.

    Example:
        >>> sd = get_sharded_state_dict(model)
        >>> sd["blocks.0.attn.qkv.weight"].placements
        (Shard(dim=0),)
    """
    return {_clean_fqn(k): v for k, v in get_model_state_dict(model).items()}


def load_sharded_state_dict(model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load a sharded state dict (as returned by ``get_sharded_state_dict``) into ``model`` in place.

    Keys and shapes are checked first; on a mismatch nothing is loaded.

    Example:
        >>> sd = get_sharded_state_dict(model)
        >>> load_sharded_state_dict(model, sd)
    """
    live = get_sharded_state_dict(model)
    state_dict = {_clean_fqn(k): v for k, v in state_dict.items()}

    def check() -> None:
        got = {k: _shape(v) for k, v in state_dict.items()}
        problem = _mismatch(got, {k: _shape(v) for k, v in live.items()}, "state dict", strict)
        if problem:
            raise CheckpointError(f"load_sharded_state_dict(): the state dict does not match the model: {problem}")

    _on_all_ranks(check)
    if not strict:
        state_dict = {k: v for k, v in state_dict.items() if k in live}
    set_model_state_dict(model, state_dict, options=StateDictOptions(strict=strict))


@torch.no_grad()
def _gather_full(
    sharded: Mapping[str, Any], aliases: Mapping[str, str], *, cpu_offload: bool, rank0_only: bool
) -> dict[str, Any]:
    """All-gather each ``DTensor`` in turn (every rank, same order); keep the result where asked.

    One tensor at a time: the peak is the kept copy plus one full tensor in flight, never a second
    copy of the model. The result never shares memory with the live model or optimizer. Tied
    aliases reuse the tensor gathered for their first name, as in ``state_dict()`` of the
    unwrapped model.
    """
    keep = not rank0_only or _rank() == 0
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
    ranks get ``{}``; with ``cpu_offload`` the tensors are moved to CPU as they arrive, so GPU
    memory holds at most one full tensor. ``unwrapped_model.load_state_dict(sd)`` works, and so
    does ``torch.save(sd, "model.pt")`` on rank 0.

    Example:
        >>> sd = get_full_state_dict(model)
        >>> if dist.get_rank() == 0:
        ...     torch.save(sd, "model.pt")
    """
    return _gather_full(
        get_sharded_state_dict(model), _tied_aliases(model), cpu_offload=cpu_offload, rank0_only=rank0_only
    )


def load_full_state_dict(
    model: nn.Module,
    full_sd: Optional[Mapping[str, Any]],
    *,
    broadcast_from_rank0: bool = True,
    strict: bool = True,
) -> None:
    """Load a full state dict (e.g. a ``torch.save`` or Hugging Face one) into a sharded model, in place.

    With ``broadcast_from_rank0`` only rank 0 needs to hold ``full_sd`` (pass ``None`` or ``{}``
    elsewhere): tensors are broadcast one at a time and each rank keeps its shard. Works for a
    model built on ``meta`` and wrapped with ``fsdp()``; tied weights stay tied, and a state dict
    holding only one name of a tied pair (as many exported checkpoints do) fills the other.
    Keys and shapes are checked before anything is loaded.

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT(cfg)
        >>> fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD")
        >>> sd = torch.load("model.pt", weights_only=True) if dist.get_rank() == 0 else None
        >>> load_full_state_dict(model, sd)
    """
    live = {k: _shape(v) for k, v in get_sharded_state_dict(model).items()}
    holds = not (broadcast_from_rank0 and _dist_on()) or _rank() == 0

    def prepare() -> dict[str, Any]:
        if not holds:
            return {}
        if not isinstance(full_sd, Mapping):
            raise TypeError(f"load_full_state_dict(): full_sd must be a dict of tensors, got {type(full_sd).__name__}.")
        sd = {_clean_fqn(k): v for k, v in full_sd.items()}
        for alias, source in _tied_aliases(model).items():
            if alias not in sd and source in sd:
                sd[alias] = sd[source]
            elif source not in sd and alias in sd:
                sd[source] = sd[alias]
        problem = _mismatch({k: _shape(v) for k, v in sd.items()}, live, "state dict", strict)
        if problem:
            raise CheckpointError(f"load_full_state_dict(): the state dict does not match the model: {problem}")
        return {k: v for k, v in sd.items() if k in live}

    sd = _on_all_ranks(prepare)
    if not _dist_on():
        model.load_state_dict(sd, strict=strict)
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0, strict=strict)
    set_model_state_dict(model, sd, options=options)


# --------------------------------------------------------------------------- optimizer state


def _optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[nn.Parameter, list[str], dict]]:
    """``(param, its names, its param group)`` for every parameter the optimizer updates."""
    names = _param_names(model)
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


def _param_group_entries(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    out = {}
    for _, names, group in _optimizer_params(model, optimizer):
        for option, value in group.items():
            if option != "params":
                out[f"param_groups.{names[0]}.{option}"] = value
    return out


def _flat_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Sharded optimizer state, flattened and keyed by parameter FQN."""
    if not optimizer.state:
        # Never stepped. torch's get_optimizer_state_dict would first run a zero-lr step to create
        # state, which changes Adam's step count (and so every later update): record the options only.
        return _param_group_entries(model, optimizer)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    return {_clean_fqn(k): v for k, v in _dcp_get_optimizer_state_dict(model, optimizer, options=options).items()}


def _materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (its names and shapes) with one step at lr 0 on zero gradients.

    What torch's ``set_optimizer_state_dict`` does itself, except that the user's gradients are
    kept aside (torch skips the step when any gradient exists, and then loads no state at all).
    """
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


def _check_group_consistency(model: nn.Module, optimizer: torch.optim.Optimizer, flat: Mapping[str, Any]) -> None:
    """Every parameter of one live param group must come back with the same options."""
    saved_fqns = {k[len(_GROUPS) :].rsplit(".", 1)[0] for k in flat if k.startswith(_GROUPS)}
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


def _set_flat_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, flat: Mapping[str, Any]) -> None:
    """Load a validated, flattened sharded optimizer state into ``optimizer``."""
    if not any(k.startswith(_STATE) for k in flat):
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


def _validate_optimizer(
    saved_keys: list[str], model: nn.Module, optimizer: torch.optim.Optimizer, source: str
) -> dict[int, str]:
    """Check saved flat optimizer keys against the live optimizer; return ``{id(param): saved FQN}``.

    Parameter names must match both ways, and every state name the optimizer keeps (``exp_avg``,
    ``step`` ...) must be saved. A fresh optimizer has no state yet, so this creates it first
    (``_materialize_optimizer_state``); callers clear it again if anything fails.
    """
    params = _optimizer_params(model, optimizer)
    group_keys = [k[len(_GROUPS) :] for k in saved_keys if k.startswith(_GROUPS)]
    if not group_keys:
        raise CheckpointError(f"{source} holds no optimizer state (it was saved without an optimizer).")
    saved_fqns = {k.rsplit(".", 1)[0] for k in group_keys}
    known = {name for _, names, _ in params for name in names}
    unexpected = sorted(f for f in saved_fqns if f not in known)
    missing = [names[0] for _, names, _ in params if not any(n in saved_fqns for n in names)]
    if missing or unexpected:
        raise CheckpointError(
            f"the optimizer state in {source} does not match the optimizer: parameters without saved "
            f"state: {_short(missing)}; saved parameters the optimizer does not have: {_short(unexpected)}"
        )
    chosen = {id(p): next(n for n in names if n in saved_fqns) for p, names, _ in params}
    state_keys = [k for k in saved_keys if k.startswith(_STATE)]
    if not state_keys:
        return chosen  # saved before the first step: options only
    if not optimizer.state:
        _materialize_optimizer_state(optimizer)
    saved_set = set(state_keys)
    lacking = []
    for param, _, _ in params:
        for name in optimizer.state.get(param, {}):
            key = f"state.{chosen[id(param)]}.{name}"
            if key not in saved_set and not any(k.startswith(key + ".") for k in state_keys):
                lacking.append(f"{chosen[id(param)]}.{name}")
    if lacking:
        raise CheckpointError(
            f"{source} lacks optimizer state the optimizer needs: {_short(lacking)} (saved by a different optimizer class?)"
        )
    return chosen


def _optimizer_scratch(
    saved: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, chosen: Mapping[int, str]
) -> dict[str, Any]:
    """Scratch tensors/placeholders to read the saved optimizer entries into (``{flat key: metadata}``)."""
    params = _optimizer_params(model, optimizer)
    by_name = {name: param for param, names, _ in params for name in names}
    scratch: dict[str, Any] = {}
    for key, entry in saved.items():
        if key.startswith(_STATE):
            fqn = _state_key_fqn(key[len(_STATE) :], by_name)
            scratch[key] = _scratch_like(entry, by_name.get(fqn) if fqn else None)
        elif key.startswith(_GROUPS):
            scratch[key] = entry  # options travel as values (one record in a checkpoint)
    for param, _, group in params:
        for option, value in group.items():
            key = f"param_groups.{chosen[id(param)]}.{option}"
            if option != "params" and key not in scratch:
                scratch[key] = value  # an option newer than the checkpoint: keep the live value
    return scratch


def _scratch_like(entry: Any, param: Optional[torch.Tensor]) -> Any:
    """Something to read a saved entry into: sharded like ``param`` when it has the parameter's shape.

    ``entry`` is DCP metadata (from a checkpoint) or a tensor/value (from a state dict).
    """
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
    ``get_full_state_dict``). An optimizer that never stepped yields its options only.

    Example:
        >>> osd = get_optimizer_state_dict(model, optimizer, full=True)
        >>> osd["state.head.weight.exp_avg"].shape  # on rank 0
        torch.Size([37, 30])
    """
    flat = _flat_optimizer_state(model, optimizer)
    if not full:
        return flat
    return _gather_full(flat, {}, cpu_offload=cpu_offload, rank0_only=rank0_only)


def load_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    osd: Optional[Mapping[str, Any]],
    *,
    full: bool = False,
    broadcast_from_rank0: bool = True,
) -> None:
    """Load an optimizer state from ``get_optimizer_state_dict`` into ``optimizer``, in place.

    ``full=False``: ``osd`` holds this rank's shards. ``full=True``: ``osd`` holds plain full
    tensors, on rank 0 only when ``broadcast_from_rank0`` (pass ``None`` elsewhere). Parameter names
    and state names are checked first; on a mismatch nothing changes.

    Example:
        >>> osd = get_optimizer_state_dict(model, optimizer, full=True)
        >>> load_optimizer_state_dict(model, optimizer, osd, full=True)
    """
    holds = not (full and broadcast_from_rank0 and _dist_on()) or _rank() == 0
    if holds and not isinstance(osd, Mapping):
        raise TypeError(f"load_optimizer_state_dict(): osd must be a dict, got {type(osd).__name__}.")
    flat = {_clean_fqn(k): v for k, v in osd.items()} if holds else {}
    if full:
        # What each entry is (a shape-only meta tensor, or the option's value): every rank needs it
        # to validate and to allocate what the broadcast fills.
        described = [
            {
                k: torch.empty_like(v, device="meta") if k.startswith(_STATE) and isinstance(v, torch.Tensor) else v
                for k, v in flat.items()
            }
        ]
        if broadcast_from_rank0 and _world() > 1:
            dist.broadcast_object_list(described, src=0)
        entries = described[0]
    else:
        entries = flat
    was_fresh = not optimizer.state
    try:
        source = "the optimizer state dict"
        chosen = _on_all_ranks(lambda: _validate_optimizer(list(entries), model, optimizer, source))
        if full:
            scratch = _optimizer_scratch(entries, model, optimizer, chosen)
            flat = _distribute_full(flat, entries, scratch, broadcast=broadcast_from_rank0 and _world() > 1)
        _on_all_ranks(lambda: _check_group_consistency(model, optimizer, flat))
    except _FAILURES:
        if was_fresh:
            optimizer.state.clear()
        raise
    _set_flat_optimizer_state(model, optimizer, flat)


@torch.no_grad()
def _distribute_full(
    full: Mapping[str, Any], entries: Mapping[str, Any], scratch: Mapping[str, Any], *, broadcast: bool
) -> dict[str, Any]:
    """Full tensors (on rank 0 when ``broadcast``) -> this rank's shards, one tensor at a time."""
    out: dict[str, Any] = {}
    for key, entry in entries.items():
        like = scratch.get(key)
        if not key.startswith(_STATE) or not isinstance(entry, torch.Tensor) or not isinstance(like, torch.Tensor):
            out[key] = entry
            continue
        device = like.device if isinstance(like, DTensor) else _comm_device()
        if key in full:
            value = full[key].detach().to(device=device, dtype=like.dtype)
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


def _comm_device() -> torch.device:
    """Where a plain (unsharded) tensor must be to take part in a collective of the default group."""
    backend = str(dist.get_backend()) if _dist_on() else "gloo"
    if "nccl" in backend and "cpu:" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------- reading checkpoints safely

_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}
_METADATA_CLASSES = {
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "_MEM_FORMAT_ENCODING",
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its ``.metadata`` with plain pickle; load it allowing only DCP's own metadata types.

    Plain ``pickle.load`` (what DCP's reader does) runs whatever a crafted file names.
    """

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module, name) in _METADATA_GLOBALS
            or (module == "torch.distributed.checkpoint.metadata" and name in _METADATA_CLASSES)
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


def is_checkpoint(path: PathLike) -> bool:
    """``True`` if ``path`` is a complete checkpoint (an interrupted save never leaves one).

    An overwrite that stopped between its two renames (see ``save_checkpoint``) is finished first,
    so the checkpoint is found again at ``path``.

    Example:
        >>> if is_checkpoint("ckpt/last"):
        ...     extra = load_checkpoint("ckpt/last", model, optimizer)
    """
    _recover(Path(path))
    return (Path(path) / _METADATA_FILE).is_file()


def _incomplete_dir(path: Path) -> Path:
    """Where ``save_checkpoint`` writes before renaming into place."""
    return path.parent / f".{path.name}.incomplete"


def _replaced_dir(path: Path) -> Path:
    """Where ``save_checkpoint(overwrite=True)`` moves the previous checkpoint until the new one is in place."""
    return path.parent / f".{path.name}.replaced"


def _discard(path: Path) -> None:
    """Delete a checkpoint directory, its ``.metadata`` first: an interrupted delete never looks complete."""
    try:
        (path / _METADATA_FILE).unlink()
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def _recover(path: Path) -> None:
    """Finish an overwrite that stopped between its two renames (``save_checkpoint``'s last step).

    Then ``path`` is missing and ``.<name>.replaced`` holds what was there: the new checkpoint is
    renamed into place if ``.<name>.incomplete`` holds it complete, else the previous one is put back.
    Ranks and processes may race here: a rename that loses fails and changes nothing.
    """
    old, tmp = _replaced_dir(path), _incomplete_dir(path)
    if path.exists() or not old.is_dir():
        return
    if (tmp / _METADATA_FILE).is_file():
        source = tmp
    elif (old / _METADATA_FILE).is_file():
        source = old
    else:
        return
    try:
        source.rename(path)
    except OSError:
        return  # another process was first, or no permission: the errors then say where the data is
    if source == tmp:
        _discard(old)
    which = "new" if source == tmp else "previous"
    warnings.warn(
        f"an overwrite of {path} was interrupted; restored the {which} checkpoint from {source}.", stacklevel=3
    )


def _leftovers(path: Path) -> str:
    """What an interrupted save or overwrite of ``path`` left next to it, for error messages."""
    old, tmp = _replaced_dir(path), _incomplete_dir(path)
    hint = ""
    if old.exists():
        hint += f" An overwrite of it was interrupted: the previous checkpoint is in {old}."
    if tmp.exists():
        state = "complete" if (tmp / _METADATA_FILE).is_file() else "partial"
        hint += f" A save to it was interrupted ({state} data is in {tmp})."
    return hint


def _read_metadata(path: Path, caller: str) -> Metadata:
    _recover(path)
    if not path.exists():
        raise FileNotFoundError(f"{caller}: {path} does not exist.{_leftovers(path)}")
    if not path.is_dir():
        raise CheckpointError(f"{caller}: {path} is a file, not a checkpoint directory.")
    if not is_checkpoint(path):
        hint = _leftovers(path)
        raise CheckpointError(f"{caller}: {path} is not a checkpoint (it has no {_METADATA_FILE} file).{hint}")
    try:
        with open(path / _METADATA_FILE, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - any failure here means a damaged or foreign file
        raise CheckpointError(f"{caller}: {path / _METADATA_FILE} is corrupted or not DCP metadata: {e}") from e
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise CheckpointError(f"{caller}: {path / _METADATA_FILE} is not DCP checkpoint metadata.")
    return metadata


def _check_files(path: Path, metadata: Metadata, caller: str) -> None:
    """Every shard file the metadata points to exists and is long enough (catches truncation early)."""
    needed: dict[str, int] = {}
    keys: dict[str, list[str]] = {}
    for index, info in metadata.storage_data.items():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
        keys.setdefault(info.relative_path, []).append(index.fqn)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{caller}: shard file {file} is missing (it holds {_short(keys[name], 4)}).")
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(
                f"{caller}: shard file {file} is truncated: {size} bytes, the metadata needs {end} "
                f"(it holds {_short(keys[name], 4)})."
            )


def _open_checkpoint(path: Path, caller: str) -> Metadata:
    metadata = _read_metadata(path, caller)
    _check_files(path, metadata, caller)
    return metadata


class _VerifyingReader(FileSystemReader):
    """DCP's file reader with safe metadata loading and a CRC-32 check of every record it reads.

    Each record in a ``.distcp`` file is a ``torch.save`` zip archive whose entries carry CRC-32s;
    ``torch.load`` does not check them, so a flipped bit would load silently as a wrong value.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _read_metadata(Path(self.path), "load")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file: Any, sinfo: Any) -> io.BytesIO:
        where = f"{Path(self.path) / sinfo.relative_path} (bytes {sinfo.offset}..{sinfo.offset + sinfo.length})"
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        if len(data) != sinfo.length:
            raise CheckpointError(f"shard record {where} is truncated.")
        try:
            bad = zipfile.ZipFile(io.BytesIO(data)).testzip()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            raise CheckpointError(f"shard record {where} is corrupted: {e}") from e
        if bad is not None:
            raise CheckpointError(f"shard record {where} is corrupted: {bad} fails its CRC-32 check.")
        return io.BytesIO(data)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but non-tensor entries load with ``torch.load(weights_only=True)``.

    Keys are matched as given (no nested flattening: ``extra`` is one object), and keys absent
    from the checkpoint are skipped (they were validated before loading).
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, allow_partial_load=True)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        # ``self.state_dict`` may be a copy (sharded-tensor flattening): fill the caller's dict.
        loaded = torch.load(value, weights_only=True)
        self.state_dict[read_item.dest_index.fqn] = loaded
        self.original_state_dict[read_item.dest_index.fqn] = loaded


def _dcp_load(state: dict[str, Any], path: Path, *, alone: bool = False) -> None:
    """DCP load through the safe reader and planner; ``alone``: this rank only, no collectives."""
    no_dist = alone or not _dist_on()
    with warnings.catch_warnings():
        # DCP warns that it "assumes" single-process loading; here that is the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=_VerifyingReader(path), planner=_SafeLoadPlanner(), no_dist=no_dist)


# --------------------------------------------------------------------------- save / load


def _check_loadable(obj: Any, what: str) -> None:
    """``obj`` must come back through ``torch.load(weights_only=True)``: refuse it now, not at resume."""
    if isinstance(obj, list):  # param groups: the parameters themselves are stored by name, not here
        obj = [{k: v for k, v in group.items() if k != "params"} for group in obj]
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 - reported with the reason torch gives
        raise TypeError(
            f"save_checkpoint(): {what} must be loadable with torch.load(weights_only=True): tensors, "
            "numbers, strings, None, and lists/tuples/dicts of them (convert numpy arrays to "
            f"tensors or lists). {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from e


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    extra: Any = None,
    overwrite: bool = False,
) -> Path:
    """Save a sharded checkpoint with DCP: every rank writes its own shards, in parallel.

    Call on every rank. The checkpoint holds the model, the optimizer state keyed by parameter
    FQN, and ``extra`` (step, epoch, scheduler/RNG state: anything ``torch.load(weights_only=True)``
    accepts; saved once, from rank 0). It is written to a hidden ``.<name>.incomplete`` directory
    next to ``path`` and renamed into place, so a crash never leaves a complete-looking checkpoint.
    An existing checkpoint at ``path`` is refused unless ``overwrite=True``; it is replaced only
    after the new one is complete (it waits in ``.<name>.replaced`` until the new one is in place;
    after a crash between those two renames, the next ``is_checkpoint``, load or save of ``path``
    puts the new checkpoint, or if it is incomplete the previous one, back at ``path``). A failed
    save removes what it wrote. Returns ``path``.

    Example:
        >>> save_checkpoint(f"ckpt/step_{step}", model, optimizer,
        ...                 extra={"step": step, "rng": torch.get_rng_state()})
    """
    path = Path(path)
    tmp, old = _incomplete_dir(path), _replaced_dir(path)
    made_tmp = False  # rank 0, once prepare() made tmp: then it is ours to remove if the save fails

    def prepare() -> None:
        nonlocal made_tmp
        _check_loadable(extra, "extra")
        if optimizer is not None:
            _check_loadable([g for g in optimizer.param_groups], "the optimizer's param_groups")
        if _rank() != 0:
            return
        _recover(path)
        if path.exists():
            empty_dir = path.is_dir() and not any(path.iterdir())
            if not empty_dir and not is_checkpoint(path):
                raise CheckpointError(
                    f"save_checkpoint(): {path} exists and is not a checkpoint; refusing to replace it."
                )
            if is_checkpoint(path) and not overwrite:
                raise FileExistsError(
                    f"save_checkpoint(): a checkpoint already exists at {path}; pass overwrite=True to replace it."
                )
        path.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by an interrupted save
            shutil.rmtree(tmp)
        tmp.mkdir()
        made_tmp = True

    def write(state: dict[str, Any]) -> None:
        planner = DefaultSavePlanner(flatten_state_dict=False)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, storage_writer=FileSystemWriter(tmp), planner=planner, no_dist=not _dist_on())

    def publish() -> None:
        if _rank() != 0:
            return
        replacing = path.exists()
        if replacing:
            _discard(old)  # left by an interrupted clean-up: the checkpoint at path is the complete one
            path.rename(old)
        # A crash right here leaves the previous checkpoint in old and the new one, complete, in tmp:
        # the next is_checkpoint(), load or save of path finishes the job (_recover).
        try:
            tmp.rename(path)
        except BaseException:
            if replacing and not path.exists():
                old.rename(path)  # put the previous checkpoint back
            raise
        _fsync_dir(path.parent)
        _discard(old)  # only now: the new checkpoint is in place

    def failure(what: str, e: BaseException) -> CheckpointError:
        kept = " The checkpoint already there is untouched." if is_checkpoint(path) else ""
        return CheckpointError(f"save_checkpoint(): {what} failed; nothing was saved.{kept} {_reason(e)}")

    published = False
    try:
        _on_all_ranks(prepare)
        model_sd = get_sharded_state_dict(model)
        tied = {alias: source for alias, source in _tied_aliases(model).items() if alias in model_sd}
        state: dict[str, Any] = {_MODEL + k: v for k, v in model_sd.items() if k not in tied}
        if _rank() == 0:
            state[_LAYOUT] = {"keys": list(model_sd), "tied": tied}
        if optimizer is not None:
            flat = _flat_optimizer_state(model, optimizer)
            state.update({_OPTIM + k: v for k, v in flat.items() if not k.startswith(_GROUPS)})
            if _rank() == 0:
                state[_PACKED_GROUPS] = {k: v for k, v in flat.items() if k.startswith(_GROUPS)}
        if extra is not None and _rank() == 0:
            state[_EXTRA] = extra
        try:
            _on_all_ranks(lambda: write(state))
        except _FAILURES as e:
            raise failure(f"writing {path}", e) from e
        try:
            _on_all_ranks(publish)  # no rank returns before the checkpoint is in place
        except _FAILURES as e:
            raise failure(f"renaming {tmp} to {path}", e) from e
        published = True
    finally:
        if made_tmp and not published:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    strict: bool = True,
    model_weights: bool = True,
) -> Any:
    """Restore ``model`` (and ``optimizer``) in place from ``save_checkpoint``; return the saved ``extra``.

    Call on every rank. Works at any world size and sharding strategy (DCP reshards: save at 2
    ranks FULL_SHARD, load at 1 or 4, NO_SHARD or HYBRID). Before anything changes, the checkpoint
    is checked against the model (keys, shapes), the optimizer (parameter and state names) and
    its files (present, long enough), then read completely into scratch tensors, with every
    record's CRC-32 checked; only then are model and optimizer updated. That costs one extra
    sharded copy while loading. Returns ``None`` when no ``extra`` was saved.

    ``model_weights=False`` restores the optimizer only: the model's weights are neither read nor
    changed (the model is still checked against the checkpoint: its parameter names key the optimizer state).
    Use it when the weights were loaded already and may have changed since.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: not a checkpoint, corrupted or truncated, or of another model/optimizer.

    Example:
        >>> extra = load_checkpoint("ckpt/step_100", model, optimizer)
        >>> start_step = extra["step"]
        >>> load_checkpoint("ckpt/step_100", model, optimizer, model_weights=False)  # optimizer only
    """
    path = Path(path)
    caller = "load_checkpoint()"
    metadata = _on_all_ranks(lambda: _open_checkpoint(path, caller))
    saved = metadata.state_dict_metadata
    live = get_sharded_state_dict(model)
    small = [k for k in (_PACKED_GROUPS, _EXTRA, _LAYOUT) if k in saved]
    objects = _on_all_ranks(lambda: _read_objects(path, small)) if small else {}
    # Where each model key is stored: under its own name, or under the name it is tied to.
    stored = {k[len(_MODEL) :]: k for k in saved if k.startswith(_MODEL)}
    for alias, source in (objects.get(_LAYOUT) or {}).get("tied", {}).items():
        if source in stored and alias not in stored:
            stored[alias] = stored[source]

    def check_model() -> None:
        got = {k: _saved_shape(saved[key]) for k, key in stored.items()}
        problem = _mismatch(got, {k: _shape(v) for k, v in live.items()}, "checkpoint", strict)
        if problem:
            raise CheckpointError(f"{caller}: {path} does not match the model: {problem}")

    _on_all_ranks(check_model)
    scratch: dict[str, Any] = {}
    for key, value in live.items() if model_weights else ():
        if key in stored and stored[key] not in scratch:
            scratch[stored[key]] = torch.empty_like(value)
    was_fresh = optimizer is not None and not optimizer.state
    try:
        if optimizer is not None:
            saved_optim: dict[str, Any] = {
                k[len(_OPTIM) :]: md for k, md in saved.items() if k.startswith(_OPTIM + _STATE)
            }
            saved_optim.update(objects.get(_PACKED_GROUPS) or {})
            source = f"{caller}: {path}"
            chosen = _on_all_ranks(lambda: _validate_optimizer(list(saved_optim), model, optimizer, source))
            optim_scratch = _optimizer_scratch(saved_optim, model, optimizer, chosen)
            scratch.update({_OPTIM + k: v for k, v in optim_scratch.items() if k.startswith(_STATE)})
        try:
            _on_all_ranks(lambda: _dcp_load(scratch, path))
        except _FAILURES as e:
            raise CheckpointError(
                f"{caller}: reading {path} failed; the model and optimizer were not changed. {_reason(e)}"
            ) from e
        if optimizer is not None:
            flat_optim = {k: v for k, v in optim_scratch.items() if not k.startswith(_STATE)}
            flat_optim.update({k[len(_OPTIM) :]: v for k, v in scratch.items() if k.startswith(_OPTIM)})
            _on_all_ranks(lambda: _check_group_consistency(model, optimizer, flat_optim))
    except _FAILURES:
        if was_fresh:
            optimizer.state.clear()  # validation created its state: back to the fresh optimizer we were given
        raise
    # Commit: everything is read and checked.
    if model_weights:
        model_sd = {k: scratch[stored[k]] for k in live if k in stored}
        set_model_state_dict(model, model_sd, options=StateDictOptions(strict=strict))
    if optimizer is not None:
        _set_flat_optimizer_state(model, optimizer, flat_optim)
    return objects.get(_EXTRA)


def _read_objects(path: Path, keys: list[str]) -> dict[str, Any]:
    """Read small non-tensor records (options, ``extra``) on this rank alone, before the real load."""
    state: dict[str, Any] = dict.fromkeys(keys)
    try:
        _dcp_load(state, path, alone=True)
    except _FAILURES as e:
        raise CheckpointError(
            f"load_checkpoint(): reading {path} failed; the model and optimizer were not changed. {_reason(e)}"
        ) from e
    return state


def _saved_shape(md: Any) -> Optional[tuple[int, ...]]:
    return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None


# --------------------------------------------------------------------------- consolidation


def consolidate_checkpoint(dcp_dir: PathLike, out_file: PathLike, *, overwrite: bool = False) -> Path:
    """Turn a checkpoint into one file of the model's weights: offline, one process, no process group.

    ``out_file`` ending in ``.safetensors`` is written with ``safetensors`` (the ``safetensors``
    extra: ``pip install 'zeta-fsdp[safetensors]'``); anything else with ``torch.save``, loadable with
    ``torch.load(out_file, weights_only=True)``. Keys are the unwrapped model's, so
    ``model.load_state_dict(...)`` works. Optimizer state and ``extra`` are left out. The file is
    written next to ``out_file`` and renamed into place. Returns ``out_file``.

    Also available as ``python -m zeta_fsdp consolidate DIR OUT``.

    Example:
        >>> consolidate_checkpoint("ckpt/step_100", "model.pt")
        >>> GPT(cfg).load_state_dict(torch.load("model.pt", weights_only=True))
    """
    caller = "consolidate_checkpoint()"
    src, out = Path(dcp_dir), Path(out_file)
    metadata = _open_checkpoint(src, caller)
    use_safetensors = out.suffix == ".safetensors"
    if use_safetensors:
        try:
            from safetensors.torch import save_file
        except ImportError as e:
            raise ImportError(
                f"{caller}: writing {out.name} needs the safetensors package: pip install 'zeta-fsdp[safetensors]'"
            ) from e
    if out.exists() and not overwrite:
        raise FileExistsError(f"{caller}: {out} already exists; pass overwrite=True to replace it.")
    state: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(_MODEL):
            state[key] = (
                torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
            )
    if not state:
        raise CheckpointError(f"{caller}: {src} holds no model weights (no '{_MODEL}*' entries).")
    if _LAYOUT in metadata.state_dict_metadata:
        state[_LAYOUT] = None
    try:
        _dcp_load(state, src, alone=True)
    except _FAILURES as e:  # DCP's CheckpointException is a BaseException: one readable line instead
        failures = getattr(e, "failures", None) or {}
        reason = _reason(next(iter(failures.values()))[0] if len(failures) == 1 else e)
        raise CheckpointError(f"{caller}: reading {src} failed: {reason}") from e
    layout = state.pop(_LAYOUT, None) or {}
    weights = {k[len(_MODEL) :]: v for k, v in state.items()}
    for alias, source in layout.get("tied", {}).items():
        if source in weights and alias not in weights:
            # torch.save keeps one copy of a shared tensor; safetensors refuses sharing: a copy.
            weights[alias] = weights[source].clone() if use_safetensors else weights[source]
    order = [k for k in layout.get("keys", []) if k in weights]
    listed = set(order)
    weights = {k: weights[k] for k in order + [k for k in weights if k not in listed]}
    tmp = out.parent / f".{out.name}.incomplete"
    if use_safetensors:
        odd = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
        if odd:
            raise CheckpointError(f"{caller}: safetensors holds tensors only; these entries are not: {_short(odd)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if use_safetensors:
            save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp))
        else:
            torch.save(weights, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)  # after a failure: no half-written file left next to out
    return out
