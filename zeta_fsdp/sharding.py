"""The side effects of ``fsdp()`` on a planned model: per-block transforms (activation
checkpointing, ``torch.compile``), the master-dtype cast, ``fully_shard`` bottom-up, explicit
prefetching, whole-on-every-rank 0-dim parameters, and autocast around a forward (the engines
apply them: ``engines``).

Each step is a plain function of a ``WrapPlan`` (``wrapping``) and what ``distributed`` built; the
façade (``fsdp.py``) validates first and calls them in order.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from .options import stored_dtype
from .wrapping import WrapPlan, WrapUnit

__all__ = [
    "apply_activation_checkpointing",
    "apply_compile",
    "autocast_forward",
    "average_replicated_grads",
    "cast_to_master",
    "set_prefetch_chains",
    "shard_units",
    "tail_units",
]


def cast_to_master(model: nn.Module, master: Optional[torch.dtype]) -> list[str]:
    """Store every trainable floating-point parameter in ``master`` (in place; ties stay one
    object). Frozen ones keep their dtype (``options.stored_dtype``)."""
    cast = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            dtype = stored_dtype(param, master)
            if param.dtype != dtype:
                param.data = param.data.to(dtype)
                cast.append(name)
    return cast


def _checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(plan: WrapPlan) -> None:
    """Recompute each block's activations in backward instead of storing them.

    The block's ``forward`` is wrapped in place (no wrapper module), so parameter names and
    state-dict keys stay exactly those of the unwrapped model, and FSDP's hooks still run around
    the whole checkpointed call.
    """
    for unit in plan.blocks:
        for module in unit.modules:
            if "forward" not in vars(module):
                module.forward = functools.partial(_checkpointed_forward, module.forward)


def apply_compile(plan: WrapPlan, options: Union[bool, dict]) -> None:
    """``torch.compile`` each block in place (``nn.Module.compile``: names unchanged)."""
    kwargs = options if isinstance(options, dict) else {}
    for unit in plan.blocks:
        for module in unit.modules:
            module.compile(**kwargs)


def shard_units(
    plan: WrapPlan,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: Union[bool, int],
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter],
    keep_unsharded: Iterable[WrapUnit] = (),
) -> None:
    """Call ``fully_shard`` on every unit, bottom-up, with one policy for all.

    Mixed precision is not inherited by child units in FSDP2: a unit sharded without the policy
    would all-gather and compute in fp32 while its neighbours run in bf16. So every call gets it.
    The root keeps its parameters after forward (``reshard_after_forward=None``): backward starts
    with it, so freeing and re-gathering would be pure waste. The units in ``keep_unsharded``
    (see ``tail_units``) keep theirs too (``reshard_after_forward=False``).
    """
    kept = {id(u) for u in keep_unsharded}
    for unit in plan.units:
        is_root = unit.kind == "root"
        fully_shard(
            unit.target,
            mesh=mesh,
            reshard_after_forward=None if is_root else False if id(unit) in kept else reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored_params=ignored_params or None,
        )


def autocast_forward(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run every forward of ``model`` under ``torch.autocast(device_type, dtype)``, as if the
    caller had written ``with torch.autocast(...): model(x)``.

    Entered by a forward pre-hook and left by a forward hook that runs even when the forward
    raises (``always_call``); a stack keeps nested or re-entrant forwards paired. Activation
    checkpointing recomputes under the same autocast state (``torch.utils.checkpoint`` records it).
    """
    entered: list = []

    def enter(module: nn.Module, args: Any) -> None:
        context = torch.autocast(device_type, dtype=dtype)
        context.__enter__()
        entered.append(context)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if entered:
            entered.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


def tail_units(plan: WrapPlan, count: int) -> list[WrapUnit]:
    """The ``count`` units forward runs last, last first: the output head, then blocks backwards.

    Backward starts with exactly these, so resharding them after forward only to all-gather them
    again at once costs one all-gather each (torchtitan keeps ``[norm, output]`` unsharded for
    this reason). Embedding units (first in forward, last in backward) are never counted.
    """
    return [u for u in plan.backward_order if u.kind != "embedding"][:count]


def set_prefetch_chains(plan: WrapPlan, depth: int) -> None:
    """Explicit FSDP2 prefetching: each unit all-gathers the next ``depth`` units of forward (and
    of backward) as soon as it starts, instead of FSDP2's implicit one-ahead in backward.

    Uses ``FSDPModule.set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``
    on each unit's first module (a unit's modules share one FSDP state), in the orders of
    ``WrapPlan.forward_order`` / ``backward_order``. Collective counts are unchanged: a
    prefetched all-gather replaces the one the unit would issue itself.
    """
    for order, setter in (
        (plan.forward_order, "set_modules_to_forward_prefetch"),
        (plan.backward_order, "set_modules_to_backward_prefetch"),
    ):
        for i, unit in enumerate(order):
            targets = [u.modules[0] for u in order[i + 1 : i + 1 + depth]]
            if targets:
                getattr(unit.modules[0], setter)(targets)


def average_replicated_grads(params: Iterable[nn.Parameter], mesh: DeviceMesh) -> list[Any]:
    """Average the gradients of parameters kept whole on every rank over ``mesh``, as FSDP does.

    ``fully_shard`` cannot shard a 0-dim parameter (CLIP's ``logit_scale``), so ``fsdp()`` keeps
    those whole on every rank and trains them with this hook: after each backward accumulates
    into ``.grad``, the gradient is summed over every mesh dimension and divided by the mesh size
    (the mean FSDP's reduce-scatter takes). Under ``no_sync`` the mean is taken each micro-batch:
    the already-averaged part is equal on every rank, so the result is the same mean. Returns the
    hook handles.
    """
    groups = [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]
    size = mesh.size()

    def hook(param: torch.Tensor) -> None:
        if param.grad is None or not groups:
            return
        for group in groups:
            dist.all_reduce(param.grad, group=group)
        param.grad.div_(size)

    return [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]
