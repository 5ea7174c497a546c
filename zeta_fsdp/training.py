"""Helpers a training loop needs around ``fsdp()``: gradient accumulation, clipping, memory.

* ``no_sync(model)``: accumulate gradients over micro-batches without any gradient collective;
  the first backward after the block reduces everything accumulated.
* ``clip_grad_norm_(model, max_norm)``: the global gradient norm of a sharded model (DTensor
  gradients, on one or several meshes), returned as a plain float, and clipping in place.
* ``memory_report(model, optimizer)``: bytes this rank holds for parameters, gradients and
  optimizer state, next to what the unsharded tensors would take.

Example:
    for i, batch in enumerate(micro_batches):
        with no_sync(model) if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss_fn(model(batch)) / len(micro_batches)).backward()
    norm = clip_grad_norm_(model, 1.0)
    print(memory_report(model, optimizer).table())
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Iterable, Iterator, Optional, Union

import torch
import torch.nn as nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .distributed import get_rank, get_world_size
from .fsdp import fsdp_param_groups, is_replicated
from .report import format_bytes, render_table

__all__ = ["MemoryReport", "clip_grad_norm_", "memory_report", "no_sync"]


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _sync_setting(module: FSDPModule) -> tuple[bool, bool]:
    """``(requires_gradient_sync, requires_all_reduce)`` of one unit; ``(True, True)`` (FSDP's
    default) when its state cannot be read."""
    groups = fsdp_param_groups(module)
    if not groups:
        return True, True
    return (
        all(getattr(g, "reduce_grads", True) for g in groups),
        all(getattr(g, "all_reduce_grads", True) for g in groups),
    )


def _set_sync(module: FSDPModule, reduce: bool, all_reduce: bool) -> None:
    """Public FSDP2 API only: gradient sync (reduce-scatter, and HSDP's all-reduce) then the
    all-reduce on its own, where this torch has ``set_requires_all_reduce``."""
    module.set_requires_gradient_sync(reduce, recurse=False)
    set_all_reduce = getattr(module, "set_requires_all_reduce", None)
    if callable(set_all_reduce):
        set_all_reduce(all_reduce, recurse=False)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[nn.Module]:
    """Skip gradient reduce-scatter (and HYBRID's replica all-reduce) for backwards run inside.

    Gradients accumulate unreduced on each rank; the first backward outside the block reduces
    the sum of all accumulated micro-batches in one go, so K micro-batches cost one reduction.
    Divide each micro-batch loss by K to get the mean over the K micro-batches. The previous
    per-unit settings are restored on exit, also when the body raises (a unit whose setting
    cannot be read, on a torch without the private state this reads, is restored to sync). A
    model without FSDP units is left alone (a DDP model uses its own ``no_sync``).

    NO_SHARD in fp32 runs on DDP's engine (``fsdp_engine(model) == "replicate"``): there, as with
    DDP, the forward decides, so run each micro-batch's forward and backward inside the block.

    Example:
        with no_sync(model):
            (loss_fn(model(batch0)) / 2).backward()  # no collective for gradients
        (loss_fn(model(batch1)) / 2).backward()  # reduces both micro-batches
    """
    if is_replicated(model):
        with _replicated_no_sync(model):
            yield model
        return
    modules = _fsdp_modules(model)
    if not modules:
        ddp_no_sync = getattr(model, "no_sync", None)
        with ddp_no_sync() if callable(ddp_no_sync) else contextlib.nullcontext():
            yield model
        return
    # Save each unit's exact setting so nesting, or a user who already disabled sync on some
    # units, is restored as it was rather than forced back to True.
    saved = [(module, _sync_setting(module)) for module in modules]
    try:
        for module in modules:
            # torch >= 2.4: also turns off HSDP's replica all-reduce; set_requires_all_reduce makes
            # sure of it on any version that has it.
            _set_sync(module, False, False)
        yield model
    finally:
        for module, (reduce, all_reduce) in saved:
            _set_sync(module, reduce, all_reduce)


@contextlib.contextmanager
def _replicated_no_sync(model: nn.Module) -> Iterator[None]:
    """``no_sync`` for NO_SHARD on DDP's engine (composable ``replicate``).

    DDP decides at each forward whether the backward that follows all-reduces, so the forward
    must run inside the block (as with ``DistributedDataParallel.no_sync``). The previous setting
    is restored on exit, so nested blocks stay off until the outermost exits.
    """
    was_off = bool(getattr(replicate.state(model), "_no_sync", False))
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(not was_off)


def _parameters(model_or_params: Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]]) -> list[torch.Tensor]:
    if isinstance(model_or_params, nn.Module):
        return list(model_or_params.parameters())
    if isinstance(model_or_params, torch.Tensor):
        return [model_or_params]
    return list(model_or_params)


def _plain(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _by_layout(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group gradients by (mesh, placements): DTensor ops may not mix meshes or layouts."""
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else ("local", grad.device)
        groups.setdefault(key, []).append(grad)
    return list(groups.values())


def _total_norm(groups: list[list[torch.Tensor]], norm_type: float) -> torch.Tensor:
    """Norm of all gradients together, as a plain tensor, whatever meshes they live on.

    ``torch.nn.utils.get_total_norm`` stacks per-gradient norms, which DTensor only allows on
    one mesh with one layout. So each (mesh, placements) group's norm is one collective
    (``full_tensor()`` of a partial norm), and the group norms combine locally. Plain tensors
    (e.g. ignored parameters) are taken as they are on this rank: no collective.
    """
    norms = [_plain(torch.nn.utils.get_total_norm(group, norm_type)) for group in groups]
    device = norms[0].device
    stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    return torch.linalg.vector_norm(stacked, norm_type)


def _norm_order(norm_type: Union[float, str]) -> float:
    """``norm_type`` as a float: a positive number, ``float("inf")`` or ``"inf"``; else ``ValueError``."""
    if isinstance(norm_type, str) and norm_type.strip().lower() == "inf":
        return float("inf")
    if isinstance(norm_type, numbers.Real) and not isinstance(norm_type, bool) and norm_type > 0:
        return float(norm_type)  # nan fails "> 0"
    raise ValueError(
        f"clip_grad_norm_: norm_type={norm_type!r} is not accepted. Accepted: a positive float "
        "(e.g. 2.0 for the Euclidean norm, 1.0), float('inf') or 'inf' (largest magnitude)."
    )


def clip_grad_norm_(
    model_or_params: Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: Union[float, str] = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> float:
    """Clip gradients in place so their global norm is at most ``max_norm``; return that norm.

    Works on sharded models: DTensor gradients on one or several meshes (FSDP, FSDP+TP, HSDP),
    plain gradients, and parameters without a gradient (skipped). The returned norm is a plain
    ``float``, identical on every rank and equal to ``torch.nn.utils.clip_grad_norm_`` on the
    unsharded model. ``norm_type`` is a positive float, or ``float("inf")`` / ``"inf"`` (largest
    magnitude); anything else is a ``ValueError`` naming it.

    Example:
        loss.backward()
        norm = clip_grad_norm_(model, max_norm=1.0)
        optimizer.step()
    """
    norm_type = _norm_order(norm_type)
    params = _parameters(model_or_params)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    groups = _by_layout(grads)
    total = _total_norm(groups, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite ({total.item()})."
        )
    # Same coefficient as torch.nn.utils.clip_grads_with_norm_ (1e-6 guard, clamped at 1, and
    # applied even when it is 1 so the result matches torch bit for bit), one foreach per layout.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for group in groups:
            torch._foreach_mul_(group, coef.to(group[0].device))
    return float(total.item())


def _bytes(tensor: torch.Tensor) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the full tensor)."""
    size = tensor.element_size()
    if isinstance(tensor, DTensor):
        return tensor.to_local().numel() * size, tensor.numel() * size
    return tensor.numel() * size, tensor.numel() * size


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
        dtypes = {key: ", ".join(self[key].get("dtypes", [])) or "-" for key in ("params", "optimizer_state")}
        rows = [(head, "this rank", "unsharded", "local/full")]
        for key, label in self.ROWS:
            entry = self[key]
            local, full = entry["local_bytes"], entry["full_bytes"]
            ratio = f"{local / full:.3f}" if full else "-"
            rows.append((label, format_bytes(local), format_bytes(full), ratio))
        table = render_table(rows, rules=(0, -2))
        return f"{table}\nmaster weights {dtypes['params']}; optimizer state {dtypes['optimizer_state']}"

    def __str__(self) -> str:
        return self.table()


def _entry(tensors: Iterable[torch.Tensor], skip_scalar_dtypes: bool = False) -> dict:
    local = full = count = 0
    dtypes: set[str] = set()
    for tensor in tensors:
        a, b = _bytes(tensor)
        local, full, count = local + a, full + b, count + 1
        if tensor.dim() > 0 or not skip_scalar_dtypes:
            dtypes.add(str(tensor.dtype).replace("torch.", ""))
    # skip_scalar_dtypes: Adam's 0-dim ``step`` counters (always fp32) say nothing about the state's dtype
    return {"local_bytes": local, "full_bytes": full, "tensors": count, "dtypes": sorted(dtypes)}


def _optimizer_tensors(optimizer: Optional[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def memory_report(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> MemoryReport:
    """Bytes this rank holds for parameters, gradients and optimizer state, vs the unsharded sizes.

    Returns a ``MemoryReport`` (a dict) with ``rank``, ``world_size`` and, for each of
    ``params``, ``grads``, ``optimizer_state`` and ``total``: ``local_bytes`` (this rank's
    shards), ``full_bytes`` (the same tensors unsharded), ``tensors`` (how many) and ``dtypes``
    (sorted names: ``params``' are the master-weight dtypes, ``optimizer_state``'s what AdamW keeps
    its moments in; 0-dim step counters left out). These are
    logical sizes of the tensors (FSDP's padding and temporary all-gather buffers are not
    counted: measure peaks with ``FSDPMemTracker``). Tied parameters count once; gradients that
    are ``None`` count zero. ``report.table()`` (or ``print(report)``) gives a readable view.

    Example:
        report = memory_report(model, optimizer)
        report["params"]["local_bytes"] / report["params"]["full_bytes"]  # ~1/world with FULL_SHARD
        # -> 0.5
    """
    params = list(model.parameters())
    report = MemoryReport(
        rank=get_rank(),
        world_size=get_world_size(),
        params=_entry(params),
        grads=_entry(p.grad for p in params if p.grad is not None),
        optimizer_state=_entry(_optimizer_tensors(optimizer), skip_scalar_dtypes=True),
    )
    report["total"] = {
        key: sum(report[k][key] for k in ("params", "grads", "optimizer_state"))
        for key in ("local_bytes", "full_bytes", "tensors")
    }
    return report
