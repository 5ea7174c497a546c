"""Skipping a step whose loss or gradients are non-finite on any rank, on every rank alike: ``NonFiniteGuard``.

A NaN/inf on one rank only (one bad batch, one overflow) must not make that rank step while the
others skip, nor the others step with a gradient the reduction already poisoned. The check is
one all-reduce of one number over the world, so every rank gets the same answer.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..distributed import comm_device, get_world_size

__all__ = ["NonFiniteGuard", "first_nonfinite"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def first_nonfinite(tensors: list[Optional[torch.Tensor]], group: Optional[dist.ProcessGroup] = None) -> int:
    """The index of the first tensor holding a NaN/inf on any rank (this rank's shard of a DTensor),
    ``len(tensors)`` when all are finite; ``None`` entries are skipped. The same on every rank of
    ``group`` (default: the world): one all-reduce (MIN) of one integer.

    Example:
        >>> first_nonfinite([torch.ones(2), torch.tensor([1.0, float("nan")])])
        1
    """
    found = len(tensors)
    for index, tensor in enumerate(tensors):
        if tensor is not None and tensor.is_floating_point() and not torch.isfinite(_local(tensor)).all():
            found = index
            break
    if get_world_size(group) > 1:
        flag = torch.tensor([found], dtype=torch.int64, device=comm_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        found = int(flag.item())
    return found


class NonFiniteGuard:
    """Skip the optimizer step on every rank when the loss or a gradient is NaN/inf on any rank.

    ``step(optimizer, loss)`` checks this rank's loss and gradient shards, agrees with every rank
    (one all-reduce of one number), then either steps and zeroes the gradients (``True``) or only
    zeroes them (``False``, and ``skipped`` counts it). Zeroing also drops what a ``no_sync`` block
    had accumulated. ``check(loss)`` is the agreement alone. Call it at the same point on every rank.

    Args:
        model_or_params: the model (or its parameters) whose gradients are checked.
        group: the ranks that must agree (default: the world, which covers tensor parallel too).

    Example:
        guard = NonFiniteGuard(model)
        loss = loss_fn(model(batch)); loss.backward()
        clip_grad_norm_(model, 1.0)
        if guard.step(optimizer, loss):  # False on every rank when any rank saw NaN/inf
            scheduler.step()
        print(f"skipped steps: {guard.skipped}")
    """

    def __init__(
        self,
        model_or_params: Union[nn.Module, Iterable[torch.Tensor]],
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        if isinstance(model_or_params, nn.Module):
            model_or_params = model_or_params.parameters()
        self.params = list(model_or_params)
        self.group = group
        self.skipped = 0  # steps skipped so far: log it

    def check(self, loss: Optional[torch.Tensor] = None) -> bool:
        """``True`` when the loss (if given) and every gradient are finite on every rank; a ``False``
        adds one to ``skipped``. Every rank calls it.

        Example:
            >>> NonFiniteGuard(torch.nn.Linear(2, 2)).check(torch.tensor(float("inf")))
            False
        """
        loss = loss.detach() if isinstance(loss, torch.Tensor) else None
        finite = first_nonfinite([loss, *(p.grad for p in self.params)], self.group) > len(self.params)
        self.skipped += not finite
        return finite

    def step(
        self, optimizer: torch.optim.Optimizer, loss: Optional[torch.Tensor] = None, *, zero_grad: bool = True
    ) -> bool:
        """``optimizer.step()`` when ``check(loss)`` passes; then (``zero_grad=True``) zero the gradients
        either way. Returns whether it stepped: the same on every rank.

        Example:
            stepped = guard.step(optimizer, loss)
        """
        finite = self.check(loss)
        if finite:
            optimizer.step()
        if zero_grad:
            optimizer.zero_grad(set_to_none=True)
            for param in self.params:
                param.grad = None  # parameters the optimizer does not hold, too
        return finite
