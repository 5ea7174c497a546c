"""Materializing a model built on the ``meta`` device, after sharding: allocate each rank's shards
(``to_empty``), initialise every tensor, re-tie, and prove nothing was left uninitialised.

Example:
    materialize_meta_model(meta_built_and_sharded, torch.device("cpu"), tied_params=[])
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .ties import retie

__all__ = ["materialize_meta_model"]

# Written into every floating-point tensor (and the most negative value into integer ones) after
# ``to_empty``: whatever still holds it after initialisation was not initialised.
_SENTINEL = float("nan")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _fill_sentinel(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        local = _local(t)
        if local.is_floating_point() or local.is_complex():
            local.fill_(_SENTINEL)
        elif local.dtype != torch.bool:
            local.fill_(torch.iinfo(local.dtype).min)


def _still_sentinel(t: torch.Tensor) -> bool:
    local = _local(t)
    if local.numel() == 0 or local.dtype == torch.bool:
        return False
    if local.is_floating_point() or local.is_complex():
        return bool(torch.isnan(local).any())
    return bool((local == torch.iinfo(local.dtype).min).any())


def _agreed_seed() -> int:
    """A seed drawn from this rank's generator and made the same on every rank (rank 0's).

    Ranks' generators differ unless the user seeded them alike (torchrun starts each rank with a
    random seed), and replicas must be initialised identically whatever the user did.
    """
    seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed.item())


def materialize_meta_model(
    model: nn.Module,
    device: torch.device,
    tied_params: list[list[str]],
    *,
    shard_index: int = 0,
    offload_to_cpu: bool = False,
) -> bool:
    """Allocate a sharded ``meta`` model on ``device`` and initialise it. Returns ``True`` if it did.

    Each rank allocates only its shards (``to_empty``), then initialises, in this order:

    1. every module's ``reset_parameters()`` (``nn.Linear``, ``nn.LayerNorm``, ... and yours),
    2. then the root's ``init_weights()``, if it defines one, on top (a model-wide scheme such
       as ``normal(0, 0.02)``, buffers such as a causal mask or RoPE tables),
    3. then ties are restored.

    Every floating-point tensor is filled with NaN (integer ones with their dtype's minimum)
    right after ``to_empty``; any parameter or buffer that still holds that marker after steps
    1-2 was initialised by nobody, and the call raises ``RuntimeError`` naming it (on each rank
    holding a non-empty shard of it). Boolean buffers cannot be checked this way. Nothing may
    stay on ``meta``.

    ``shard_index`` is this rank's coordinate on the shard dimension of the mesh. On CUDA, DTensor
    random ops keep shards of one parameter distinct by themselves; on CPU they draw from each
    rank's own generator, so every shard would get the same numbers (a weight made of one block
    repeated). We therefore seed the init with ``shard_index`` on CPU: distinct across shards,
    equal across replicas (HYBRID/NO_SHARD replicas must hold identical copies). The caller's RNG
    state is left as it was.

    Example:
        materialize_meta_model(meta_built_and_sharded, torch.device("cpu"), [])
        # -> True
    """
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    if not any(t.is_meta for t in tensors.values()):
        return False
    meta_names = [n for n, t in tensors.items() if t.is_meta]
    # FSDP2's CPU offload expects the sharded parameters on CPU; buffers stay on the compute device.
    model.to_empty(device="cpu" if offload_to_cpu else device)
    if offload_to_cpu and device.type != "cpu":
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                module.register_buffer(
                    name, buffer.to(device), persistent=name not in module._non_persistent_buffers_set
                )
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        fresh = dict(model.named_parameters())
        fresh.update(model.named_buffers())
        _fill_sentinel({n: fresh[n] for n in meta_names})
        if device.type == "cpu":
            torch.manual_seed(_agreed_seed() + 7919 * shard_index)
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
        if callable(getattr(model, "init_weights", None)):
            model.init_weights()
    retie(model, tied_params)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"fsdp(): these tensors are still on the meta device after materialization: {left[:10]}")
    now = dict(model.named_parameters())
    now.update(model.named_buffers())
    # Rank-local: init code runs alike on every rank, so a tensor nothing fills is caught on
    # every rank holding a non-empty shard of it, with no extra collective.
    unset = [n for n in meta_names if _still_sentinel(now[n])]
    if unset:
        raise RuntimeError(
            f"fsdp(): {len(unset)} meta-built parameter(s)/buffer(s) were initialised by nothing: "
            f"{unset[:10]}{' ...' if len(unset) > 10 else ''}. fsdp() runs every module's "
            "reset_parameters(), then the model's init_weights(); make one of them fill these "
            "(or load weights into the model built on meta with materialize=False)."
        )
    return True
