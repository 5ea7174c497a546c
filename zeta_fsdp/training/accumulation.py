"""Gradient accumulation: ``no_sync``.

``no_sync(model, defer="all")`` defers every gradient collective to the first backward after the
block; ``defer="all_reduce"`` keeps each micro-batch's reduce-scatter and defers only HYBRID_SHARD's
cross-replica all-reduce. What each choice costs: ``zeta_fsdp.costs``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from ..engines import engine_of
from .pending import show_pending

__all__ = ["no_sync", "resolve_defer"]


# no_sync(defer=...) values: what the block defers until the first backward after it.
_DEFER_CHOICES = ("all", "all_reduce")


def resolve_defer(defer: object) -> str:
    """``no_sync``'s ``defer``, normalized (``"all"`` or ``"all_reduce"``); else ``ValueError``."""
    if isinstance(defer, str) and defer.strip().lower() in _DEFER_CHOICES:
        return defer.strip().lower()
    raise ValueError(
        f"no_sync: defer={defer!r} is not accepted. Accepted: 'all' (no gradient collective inside the "
        "block; unsharded gradients are kept) or 'all_reduce' (reduce-scatter every micro-batch, defer only "
        "HYBRID_SHARD's cross-replica all-reduce; gradients stay sharded)."
    )


@contextlib.contextmanager
def no_sync(model: nn.Module, *, defer: str = "all") -> Iterator[nn.Module]:
    """Defer gradient collectives for backwards run inside: gradient accumulation.

    ``defer="all"`` (default): no gradient collective; each rank keeps every unit's *unsharded*
    gradient until the first backward outside the block reduces the sum (least communication, the
    whole model's gradients held). ``defer="all_reduce"``: each micro-batch still reduce-scatters
    (sharded gradients) and only HYBRID_SHARD's cross-replica all-reduce waits; on a 1-D mesh it is
    syncing every micro-batch, so one loop serves every strategy. Another value is a ``ValueError``
    before a unit changes. Settings are restored on exit, also on an exception; a model without FSDP
    units is left alone. On DDP's engine, as with DDP, run each micro-batch's forward inside too.
    Divide each micro-batch loss by K for the mean. The table of costs: docs/strategy.md.
    ``zero_grad()`` after a block drops what it accumulated on every engine, as under DDP
    (``training.pending``; ``drop_accumulation(model)`` does it explicitly): docs/long_jobs.md.

    Example:
        with no_sync(model):
            (loss_fn(model(batch0)) / 2).backward()  # no collective for gradients
        (loss_fn(model(batch1)) / 2).backward()  # reduces both micro-batches
        with no_sync(model, defer="all_reduce"):  # HYBRID_SHARD: sharded gradients while accumulating
            (loss_fn(model(batch0)) / 2).backward()  # reduce-scatter only
        (loss_fn(model(batch1)) / 2).backward()  # reduce-scatter + the one all-reduce
    """
    reduce = resolve_defer(defer) == "all_reduce"  # validated before any unit changes
    try:
        with engine_of(model).no_sync(model, reduce):
            yield model
    finally:
        show_pending(model)  # FSDP2's held sums, where zero_grad() reaches them (training.pending)
