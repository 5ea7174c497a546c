"""A parameter no rank used in a step ends with ``.grad is None``, as in one process (``engines.fully_shard``).

``fsdp()`` turns on FSDP2's ``set_reduce_scatter_unused_params`` so that ranks which used different
parameters (MoE routing) reduce-scatter the same layout. A parameter NO rank used is then reduced as
zeros: a zero ``.grad`` where one process (and DDP) leaves ``None``, so Adam would move it on its
momentum. For the parameters of the modules the plan says a forward may skip (``WrapPlan.skippable``):

- each rank flags the parameters its autograd accumulated a gradient into (a post-accumulate-grad
  hook on FSDP2's unsharded parameter) since FSDP2 last wrote the sharded ``.grad``: every micro-batch
  of a ``no_sync`` accumulation counts, one ``zero_grad()`` dropped does not;
- at the start of each backward it notes which sharded ``.grad`` are ``None``;
- after FSDP2's root post-backward callback, in a backward that wrote ``.grad``: one all-reduce (MAX)
  of the flags over the mesh, then ``.grad = None`` where no rank used the parameter and this backward
  created the ``.grad``. Every other gradient is FSDP2's, untouched.

A model without such parameters gets no hook and no collective (``track`` returns ``None``).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..distributed import comm_device, mesh_groups
from .fsdp2_state import final_callback_pending, holds_pending_grads, unsharded_param, writes_sharded_grads

__all__ = ["UnusedGrads", "track"]


def _under(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def track(root: nn.Module, groups: Sequence[Any], prefixes: Sequence[str], mesh: DeviceMesh) -> Optional[UnusedGrads]:
    """An ``UnusedGrads`` for the parameters of FSDP2 parameter ``groups`` under module names ``prefixes``
    (the containers a forward may skip), or ``None`` when there are none: nothing to watch."""
    if not prefixes:
        return None
    names = {id(p): n for n, p in root.named_parameters()}
    watched = [
        (fsdp_param, group)
        for group in groups
        for fsdp_param in group.fsdp_params
        if _under(names.get(id(fsdp_param.sharded_param), ""), prefixes)
    ]
    return UnusedGrads(root, watched, mesh_groups(mesh)) if watched else None


class UnusedGrads:
    """The module docstring, for ``watched`` (``(FSDPParam, its parameter group)`` pairs) of ``root``;
    ``flag_groups``: the process groups the used flags are combined over (``None``: the default group)."""

    def __init__(self, root: nn.Module, watched: list[tuple[Any, Any]], flag_groups: list) -> None:
        self._root = root
        self._params = [fsdp_param for fsdp_param, _ in watched]
        self._members: dict[int, list[int]] = {}
        self._groups: list[Any] = []
        for i, (_, group) in enumerate(watched):
            if id(group) not in self._members:
                self._members[id(group)] = []
                self._groups.append(group)
            self._members[id(group)].append(i)
        self._flag_groups = flag_groups
        self._device = comm_device(flag_groups[0]) if flag_groups else torch.device("cpu")
        self._used = [False] * len(watched)
        self._was_none = [False] * len(watched)
        self._hooked: list[Optional[weakref.ref]] = [None] * len(watched)
        self._queued = False

    def after_forward(self, outputs: Iterable[torch.Tensor]) -> None:
        """The root's forward hook: hook the unsharded parameters, arm the start of the backward."""
        if not torch.is_grad_enabled():
            return
        self._queued = False  # a backward that raised never ran its callback
        self._hook_unsharded()
        for tensor in outputs:
            if not tensor.requires_grad:
                continue
            # A node pre-hook runs after every tensor hook on that output, so after training.pending
            # has taken back the .grad it showed after a no_sync block (or dropped the block's sums).
            if tensor.grad_fn is not None:
                tensor.grad_fn.register_prehook(self._on_backward_start)
            else:
                tensor.register_hook(self._on_backward_start)

    def _hook_unsharded(self) -> None:
        """A post-accumulate-grad hook on each unsharded parameter, once (FSDP2 makes it at a unit's
        first all-gather and keeps it)."""
        for i, fsdp_param in enumerate(self._params):
            param = unsharded_param(fsdp_param)
            hooked = self._hooked[i]
            # a frozen one takes no hook (nor a gradient); it is hooked once unfrozen
            if param is not None and param.requires_grad and (hooked is None or hooked() is not param):
                param.register_post_accumulate_grad_hook(functools.partial(self._mark_used, i))
                self._hooked[i] = weakref.ref(param)

    def _mark_used(self, index: int, _param: torch.Tensor) -> None:
        self._used[index] = True  # this rank's autograd produced a gradient, whatever its values

    def _on_backward_start(self, _grads: Any) -> None:
        if self._queued:
            return
        self._queued = True
        for group in self._groups:
            # Flags outlive a backward only while FSDP2 holds that accumulation (no_sync); a group
            # holding nothing was written to .grad or had its sums dropped (zero_grad after no_sync).
            if not holds_pending_grads(group):
                for i in self._members[id(group)]:
                    self._used[i] = False
        self._was_none = [fsdp_param.sharded_param.grad is None for fsdp_param in self._params]
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self, requeued: bool = False) -> None:
        """Runs after FSDP2's root post-backward callback (queued again if it has not run yet: it
        reduces the units whose forward inputs needed no gradient, the root's)."""
        if final_callback_pending(self._root) and not requeued:
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._after_backward, True))
            return
        self._queued = False
        written = [group for group in self._groups if writes_sharded_grads(group)]
        if not written:  # inside no_sync: nothing reduced into .grad yet, the flags accumulate
            return
        used = self._used_by_any_rank()
        for group in written:
            for i in self._members[id(group)]:
                param = self._params[i].sharded_param
                if not used[i] and self._was_none[i] and param.grad is not None:
                    param.grad = None  # FSDP2's zero for a parameter no rank used: one process has None
                self._used[i] = False

    def _used_by_any_rank(self) -> list[bool]:
        """The flags combined over the mesh: one all-reduce (MAX) of one int per watched parameter."""
        if not self._flag_groups:
            return list(self._used)
        flags = torch.tensor(self._used, dtype=torch.int32, device=self._device)
        for group in self._flag_groups:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        return [bool(f) for f in flags.tolist()]
