"""Materializing a model built on the ``meta`` device, after sharding: allocate each rank's shards
(``to_empty``), initialise every tensor, re-tie, and prove nothing was left uninitialised.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from .engines import unwrapped_class
from .ties import retie
from .torch_compat import dtensor_random_from_local_generator

__all__ = ["materialize_meta_model", "move_buffers"]

# Written into every floating-point tensor (and the most negative value into integer ones) after
# ``to_empty``: whatever still holds it after initialisation was not initialised.
_SENTINEL = float("nan")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _still_sentinel(t: torch.Tensor) -> bool:
    local = _local(t)
    if local.numel() == 0 or local.dtype == torch.bool:
        return False
    if local.is_floating_point() or local.is_complex():
        return bool(torch.isnan(local).any())
    return bool((local == torch.iinfo(local.dtype).min).any())


def _children_first(module: nn.Module) -> Iterable[nn.Module]:
    for child in module.children():
        yield from _children_first(child)
    yield module


class _RealConstants(TorchFunctionMode):
    """Inside ``torch.device("meta")``: tensors made from data (``torch.tensor(2.6592)``) are real."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (torch.tensor, torch.as_tensor):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _fill_constructor_constants(model: nn.Module, unset: list[str], tensors: dict[str, torch.Tensor]) -> None:
    """The parameters a Hugging Face model sets from its config in its constructor and its weight init skips
    (CLIP's ``logit_scale``), as eager construction sets them: copied from a ``meta`` twin built with
    tensors made from data kept real. Models without a ``config`` are left alone (the caller raises)."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "_init_weights", None)):
        return
    try:
        with torch.device("meta"), _RealConstants():
            twin = unwrapped_class(model)(config)
    except Exception:  # noqa: BLE001 - a constructor that needs more than its config: nothing to copy
        return
    built = {**dict(twin.named_parameters()), **dict(twin.named_buffers())}
    for name in unset:
        source = built.get(name)
        if source is None or source.is_meta or source.shape != tensors[name].shape:
            continue
        target = tensors[name]
        if isinstance(target, DTensor):
            source = distribute_tensor(
                source.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None
            )
            target.to_local().copy_(source.to_local())
        else:
            target.copy_(source.to(dtype=target.dtype, device=target.device))


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Every buffer of ``model`` onto ``device``, parameters left where they are: under FSDP2's CPU offload
    the sharded parameters live on CPU while buffers stay on the compute device, where the forward uses them."""
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is None or buffer.is_meta or buffer.device == device:
                continue
            persistent = name not in module._non_persistent_buffers_set
            module.register_buffer(name, buffer.to(device), persistent=persistent)


def materialize_meta_model(
    model: nn.Module,
    device: torch.device,
    tied_params: list[list[str]],
    *,
    shard_index: int = 0,
    offload_to_cpu: bool = False,
) -> bool:
    """Allocate a sharded ``meta`` model on ``device`` (each rank its shards) and initialise it; ``True`` if it did.

    In order: every module's own initialiser, children first as their constructors ran them; the root's
    ``init_weights()`` (a model-wide scheme, a causal mask, a Hugging Face model's init); the config-valued
    parameters that init skips (``_fill_constructor_constants``); the ties. Every tensor first holds
    ``_SENTINEL``: one still holding it was initialised by nobody and raises ``RuntimeError`` naming it.

    ``shard_index``: this rank's coordinate on the mesh's shard dimension. On CPU (also CPU-offloaded
    shards of a CUDA model, drawn from the CPU generator, not DTensor's CUDA RNG tracker), DTensor random ops
    draw from each rank's own generator, so every shard would get the same numbers (a weight of one
    repeated block): there the init is seeded with ``shard_index`` (distinct across shards, equal across
    replicas). The caller's RNG state is left as it was.
    """
    meta_names = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if not meta_names:
        return False
    on_cpu = _allocate(model, device, offload_to_cpu)
    mesh = next((t.device_mesh for t in model.parameters() if isinstance(t, DTensor)), None)
    local_rng = dtensor_random_from_local_generator(mesh) if on_cpu and mesh is not None else contextlib.nullcontext()
    with torch.no_grad(), torch.random.fork_rng(devices=[]), local_rng:
        fresh = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        _fill_sentinel([_local(fresh[n]) for n in meta_names])
        if on_cpu:
            _seed_for_shard(shard_index)
        _run_initialisers(model)
        unset = [n for n in meta_names if _still_sentinel(fresh[n])]
        if unset:
            _fill_constructor_constants(model, unset, fresh)
    retie(model, tied_params)
    _check_initialised(model, meta_names)
    return True


def _allocate(model: nn.Module, device: torch.device, offload_to_cpu: bool) -> bool:
    """``to_empty`` where the tensors will live; ``True`` if the shards are on CPU (their init draws
    from each rank's CPU generator). FSDP2's CPU offload keeps the sharded parameters on CPU (it pins
    them as they move); buffers stay on the compute device, where the forward uses them."""
    model.to_empty(device="cpu" if offload_to_cpu else device)
    if offload_to_cpu and device.type != "cpu":
        move_buffers(model, device)
    return device.type == "cpu" or offload_to_cpu


def _fill_sentinel(tensors: list[torch.Tensor]) -> None:
    """Mark fresh memory: ``_SENTINEL`` (floating/complex), the dtype's minimum (ints); bools are left."""
    for local in tensors:
        if local.is_floating_point() or local.is_complex():
            local.fill_(_SENTINEL)
        elif local.dtype != torch.bool:
            local.fill_(torch.iinfo(local.dtype).min)


def _seed_for_shard(shard_index: int) -> None:
    """Seed this rank's generator with rank 0's draw plus ``shard_index``: ranks' generators differ unless
    the user seeded them alike (torchrun seeds each rank at random), and replicas must be initialised
    identically, shards differently."""
    seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    torch.manual_seed(int(seed.item()) + 7919 * shard_index)


def _run_initialisers(model: nn.Module) -> None:
    """Every module's initialiser, children first, then the root's ``init_weights()``.

    ``reset_parameters()``, else torch.nn's private ``_reset_parameters()``: nn.MultiheadAttention's
    in_proj_weight, nn.Transformer's xavier re-draw over its children's init."""
    for module in _children_first(model):
        init = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        if callable(init):
            init()
    if callable(getattr(model, "init_weights", None)):
        # Hugging Face skips what is flagged ``_is_hf_initialized`` (set when weights were loaded);
        # after to_empty nothing is, so the flags would only leave memory unset.
        for obj in [*model.modules(), *model.parameters(), *model.buffers()]:
            if getattr(obj, "_is_hf_initialized", False):
                obj._is_hf_initialized = False
        model.init_weights()  # a Hugging Face model's own scheme too (its init_weights)


def _check_initialised(model: nn.Module, meta_names: list[str]) -> None:
    """``RuntimeError`` for a tensor still on ``meta``, or one no initialiser filled (still the sentinel)."""
    now = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    left = [n for n, t in now.items() if t.is_meta]
    if left:
        raise RuntimeError(f"fsdp(): these tensors are still on the meta device after materialization: {left[:10]}")
    # Rank-local: init code runs alike on every rank, so a tensor nothing fills is caught on
    # every rank holding a non-empty shard of it, with no extra collective.
    unset = [n for n in meta_names if _still_sentinel(now[n])]
    if unset:
        raise RuntimeError(
            f"fsdp(): {len(unset)} meta-built parameter(s)/buffer(s) were initialised by nothing: "
            f"{unset[:10]}{' ...' if len(unset) > 10 else ''}. fsdp() runs every module's reset_parameters() "
            "(or torch.nn's _reset_parameters()), then the model's init_weights(); make one of them fill these "
            "(or load weights into the model built on meta with materialize=False)."
        )
