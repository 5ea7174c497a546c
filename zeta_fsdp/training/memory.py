"""``memory_report``: the bytes this rank holds for parameters, gradients and optimizer state."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..costs import accumulation_table
from ..distributed import get_rank, get_world_size
from ..engines import engine_of
from ..report import format_bytes, render_table

__all__ = ["MemoryReport", "memory_report"]


class MemoryReport(dict):
    """``memory_report``'s result: a dict (see there) with ``table()`` for a readable view.

    Example:
        report = memory_report(model, optimizer)
        report["params"]["local_bytes"], report["params"]["full_bytes"]
        print(report.table())
    """

    ROWS = (
        ("params", "parameters"),
        ("grads", "gradients"),
        ("optimizer_state", "optimizer state"),
        ("total", "total"),
    )

    def table(self) -> str:
        """A fixed-width table: one row per category, local vs full bytes and their ratio.

        Example:
            >>> memory_report(torch.nn.Linear(10, 10)).table().splitlines()[2].split()
            ['parameters', '440', 'B', '440', 'B', '1.000']
        """
        head = f"rank {self['rank']}/{self['world_size']}"
        masters = ", ".join(self["trainable_dtypes"]) or "-"  # masters are what an optimizer steps
        state = ", ".join(self["optimizer_state"]["dtypes"]) or "-"
        rows = [(head, "this rank", "unsharded", "local/full")]
        for key, label in self.ROWS:
            entry = self[key]
            local, full = entry["local_bytes"], entry["full_bytes"]
            ratio = f"{local / full:.3f}" if full else "-"
            rows.append((label, format_bytes(local), format_bytes(full), ratio))
        table = render_table(rows, rules=(0, -2))
        text = f"{table}\nmaster weights {masters}; optimizer state {state}"
        frozen = self["frozen"]
        if frozen["tensors"]:
            text += (
                f"\nfrozen: {frozen['tensors']} parameter(s), {format_bytes(frozen['local_bytes'])} on this rank "
                f"({', '.join(frozen['dtypes'])}), no gradients or optimizer state"
            )
        if "accumulation" in self:
            text += "\n\n" + accumulation_table(self["accumulation"], self["micro_batches"])
        return text

    def __str__(self) -> str:
        return self.table()


def _entry(tensors: Iterable[torch.Tensor], skip_scalar_dtypes: bool = False) -> dict:
    local = full = count = 0
    dtypes: set[str] = set()
    for tensor in tensors:  # a DTensor's numel is the full tensor's
        size = tensor.element_size()
        local += (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel() * size
        full, count = full + tensor.numel() * size, count + 1
        if tensor.dim() > 0 or not skip_scalar_dtypes:
            dtypes.add(str(tensor.dtype).replace("torch.", ""))
    # skip_scalar_dtypes: Adam's 0-dim ``step`` counters (always fp32) say nothing about the state's dtype
    return {"local_bytes": local, "full_bytes": full, "tensors": count, "dtypes": sorted(dtypes)}


def memory_report(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, micro_batches: Optional[int] = None
) -> MemoryReport:
    """Bytes this rank holds for parameters, gradients and optimizer state, vs the unsharded sizes.

    A ``MemoryReport`` (a dict): ``rank``, ``world_size`` and, for each of ``params``, ``grads``,
    ``optimizer_state``, ``total`` and ``frozen`` (parameters with ``requires_grad=False``: no
    gradient, no optimizer state), ``local_bytes`` (this rank's shards), ``full_bytes`` (unsharded),
    ``tensors`` and ``dtypes`` (sorted; 0-dim step counters left out); ``trainable_dtypes``: the
    master-weight dtypes. Logical sizes: FSDP's padding and all-gather buffers are not counted
    (peaks: ``measure.peak_memory_by_category``); tied parameters count once.

    ``micro_batches=K`` adds ``micro_batches`` and ``accumulation``: an ``AccumulationCost`` for
    each way of accumulating K micro-batches (``"sync"``, ``no_sync(defer="all")``,
    ``no_sync(defer="all_reduce")``): gradient bytes held between micro-batches and gradient
    collectives per K. ``report.table()`` (or ``print(report)``) shows it all.

    Example:
        report = memory_report(model, optimizer)
        report["params"]["local_bytes"] / report["params"]["full_bytes"]  # ~1/world with FULL_SHARD
        # -> 0.5
        memory_report(model, micro_batches=4)["accumulation"]["all_reduce"].grad_bytes
    """
    params = list(model.parameters())
    states = optimizer.state.values() if optimizer is not None else ()
    state_tensors = [v for state in states for v in state.values() if isinstance(v, torch.Tensor)]
    report = MemoryReport(
        rank=get_rank(),
        world_size=get_world_size(),
        params=_entry(params),
        # frozen (requires_grad=False: a LoRA base): stored in their own dtype, no grad, no optimizer state
        frozen=_entry(p for p in params if not p.requires_grad),
        grads=_entry(p.grad for p in params if p.grad is not None),
        optimizer_state=_entry(state_tensors, skip_scalar_dtypes=True),
    )
    report["trainable_dtypes"] = _entry(p for p in params if p.requires_grad)["dtypes"]
    report["total"] = {
        key: sum(report[k][key] for k in ("params", "grads", "optimizer_state"))
        for key in ("local_bytes", "full_bytes", "tensors")
    }
    if micro_batches is not None:
        report["micro_batches"] = micro_batches
        report["accumulation"] = engine_of(model).accumulation_bytes(model, micro_batches)
    return report
