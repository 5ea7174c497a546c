"""Helpers a training loop needs around ``fsdp()``: gradient accumulation, clipping, memory.

* ``no_sync(model)``: accumulate gradients over micro-batches without any gradient collective;
  the first backward after the block reduces everything accumulated. ``defer="all_reduce"``
  keeps the reduce-scatter (sharded gradients) and defers only HYBRID_SHARD's replica all-reduce;
  ``accumulation_costs`` / ``memory_report(micro_batches=K)`` say what each choice costs.
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
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Union

import torch
import torch.nn as nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from .distributed import get_rank, get_world_size
from .fsdp import fsdp_param_groups, is_replicated
from .report import format_bytes, render_table

__all__ = [
    "AccumulationCost",
    "MemoryReport",
    "accumulation_costs",
    "accumulation_table",
    "clip_grad_norm_",
    "gradient_wait_dtype",
    "memory_report",
    "no_sync",
    "resolve_defer",
]


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


# no_sync(defer=...) values: what the block defers until the first backward after it.
_DEFER_CHOICES = ("all", "all_reduce")


def resolve_defer(defer: object) -> str:
    """``no_sync``'s ``defer`` value, normalized (``"all"`` or ``"all_reduce"``); else ``ValueError``
    naming the value and the accepted ones.

    Example:
        >>> resolve_defer("ALL_REDUCE")
        'all_reduce'
    """
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

    ``defer="all"`` (default): no gradient collective at all. Each rank keeps every unit's
    *unsharded* gradient until the first backward outside the block, which reduces the sum of all
    accumulated micro-batches in one go: K micro-batches cost one reduce-scatter (and, under
    HYBRID_SHARD, one all-reduce) per unit, but hold the full model's gradients on every rank.

    ``defer="all_reduce"``: each micro-batch still reduce-scatters within its shard group, so only
    a *sharded* gradient (1/shard size) is kept; only HYBRID_SHARD's cross-replica all-reduce
    waits for the first backward outside the block (FSDP2's ``set_requires_all_reduce(False)``):
    K reduce-scatters and one all-reduce per unit. On a 1-D mesh (FULL_SHARD, SHARD_GRAD) there
    is no all-reduce to defer: it is accepted and is the same as syncing every micro-batch, so one
    training loop serves every strategy. Any other value raises ``ValueError`` before a unit changes.

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
        with no_sync(model, defer="all_reduce"):  # HYBRID_SHARD: sharded gradients while accumulating
            (loss_fn(model(batch0)) / 2).backward()  # reduce-scatter only
        (loss_fn(model(batch1)) / 2).backward()  # reduce-scatter + the one all-reduce
    """
    reduce = resolve_defer(defer) == "all_reduce"  # validated before any unit changes
    if is_replicated(model):
        # DDP's engine has one collective, the all-reduce: deferring it is deferring everything
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
            # set_requires_gradient_sync(False) also turns off HSDP's replica all-reduce (torch >= 2.4);
            # set_requires_all_reduce makes sure of it on any version that has it. With
            # reduce=True, FSDP2 adds each micro-batch's reduce-scattered gradient into a sharded
            # buffer and all-reduces that sum at the next backward that has all-reduce on.
            _set_sync(module, reduce, False)
        yield model
    finally:
        for module, (reduce_grads, all_reduce) in saved:
            _set_sync(module, reduce_grads, all_reduce)


@dataclass(frozen=True)
class AccumulationCost:
    """What one way of accumulating K micro-batches costs one rank (``accumulation_costs``).

    Attributes:
        choice: ``"sync"`` (reduce every micro-batch, no ``no_sync``), ``"all"`` or ``"all_reduce"``
            (``no_sync(defer=...)`` for the first K-1 micro-batches).
        grad_bytes: gradient bytes the rank holds between micro-batches (FSDP2's storage: padded
            shards, the reduce dtype where gradients wait in it).
        reduce_scatters, all_reduces: gradient collectives per K micro-batches, all units together.

    Example:
        >>> accumulation_costs(4, sharded=10, unsharded=40, partial=10, reduce_scatter_units=3, all_reduce_units=3)["all_reduce"]
        AccumulationCost(choice='all_reduce', grad_bytes=10, reduce_scatters=12, all_reduces=3)
    """

    choice: str
    grad_bytes: int
    reduce_scatters: int
    all_reduces: int


_CHOICE_LABELS = {
    "sync": "sync every micro-batch",
    "all": 'no_sync(defer="all")',
    "all_reduce": 'no_sync(defer="all_reduce")',
}


def accumulation_costs(
    micro_batches: int,
    *,
    sharded: int,
    unsharded: int,
    partial: int,
    reduce_scatter_units: int,
    all_reduce_units: int,
) -> dict[str, AccumulationCost]:
    """Gradient bytes held and collectives per ``micro_batches`` micro-batches, for each choice.

    ``sharded``: bytes of the sharded ``.grad`` (what syncing every micro-batch keeps);
    ``unsharded``: the unsharded gradients ``defer="all"`` keeps; ``partial``: the reduce-scattered
    sum ``defer="all_reduce"`` keeps on a mesh with replicas (on a 1-D mesh nothing is deferred:
    it keeps ``sharded``). ``reduce_scatter_units`` / ``all_reduce_units``: units that reduce-scatter
    (shard group > 1) / all-reduce (replicas > 1) in one synced backward. ``memory_report`` and the
    planner fill these in; a ``ValueError`` for ``micro_batches`` < 1.

    Example:
        >>> costs = accumulation_costs(4, sharded=10, unsharded=40, partial=10, reduce_scatter_units=3, all_reduce_units=3)
        >>> [(c.choice, c.grad_bytes, c.reduce_scatters, c.all_reduces) for c in costs.values()]
        [('sync', 10, 12, 12), ('all', 40, 3, 3), ('all_reduce', 10, 12, 3)]
    """
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} is not accepted. Accepted: an int >= 1.")
    k, rs, ar = micro_batches, reduce_scatter_units, all_reduce_units
    return {
        "sync": AccumulationCost("sync", sharded, k * rs, k * ar),
        "all": AccumulationCost("all", unsharded, rs, ar),
        "all_reduce": AccumulationCost("all_reduce", partial if ar else sharded, k * rs, ar),
    }


def gradient_wait_dtype(policy: MixedPrecisionPolicy, dtype: torch.dtype) -> torch.dtype:
    """The dtype FSDP2 keeps a parameter's gradient in between its backward and its reduction
    (unsharded gradients under ``no_sync``, the reduce-scatter output, the sum ``defer="all_reduce"``
    keeps): the policy's reduce dtype when it differs from the compute dtype, else the compute dtype
    (torch's ``FSDPParam.init_dtype_attrs``). ``dtype``: the parameter's own (sharded) dtype.

    Example:
        >>> gradient_wait_dtype(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), torch.float32)
        torch.float32
        >>> gradient_wait_dtype(MixedPrecisionPolicy(param_dtype=torch.bfloat16), torch.float32)
        torch.bfloat16
    """
    reduce = policy.reduce_dtype if policy.reduce_dtype != policy.param_dtype else None
    compute = policy.param_dtype if policy.param_dtype != dtype and dtype.is_floating_point else None
    return reduce or compute or dtype


def accumulation_table(costs: dict[str, AccumulationCost], micro_batches: int) -> str:
    """``accumulation_costs`` as a fixed-width table (used by ``MemoryReport`` and the planner).

    Example:
        >>> costs = accumulation_costs(4, sharded=10, unsharded=40, partial=10, reduce_scatter_units=3, all_reduce_units=3)
        >>> print(accumulation_table(costs, 4).splitlines()[0])
        gradient accumulation, 4 micro-batches  grads held between  reduce-scatters  all-reduces
    """
    header = (f"gradient accumulation, {micro_batches} micro-batches", "grads held between", "reduce-scatters")
    rows = [header + ("all-reduces",)]
    for cost in costs.values():
        rows.append(
            (
                _CHOICE_LABELS[cost.choice],
                format_bytes(cost.grad_bytes),
                str(cost.reduce_scatters),
                str(cost.all_reduces),
            )
        )
    return render_table(rows, align="lrrr")


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
        text = f"{table}\nmaster weights {dtypes['params']}; optimizer state {dtypes['optimizer_state']}"
        if "accumulation" in self:
            text += "\n\n" + accumulation_table(self["accumulation"], self["micro_batches"])
        return text

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


# DDP's defaults (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, ``bucket_cap_mb=25``).
_DDP_FIRST_BUCKET_BYTES = 1024 * 1024
_DDP_BUCKET_BYTES = 25 * 1024 * 1024


def ddp_all_reduces(grads: list[tuple[torch.dtype, int]]) -> int:
    """All-reduces per synced backward of NO_SHARD on DDP's engine, for gradients of these
    ``(dtype, bytes)`` in parameter order: one per gradient bucket, as DDP's constructor assigns
    them (parameters in reverse order, one open bucket per dtype, a bucket closed once it holds
    1 MiB (the first) or 25 MiB (the rest)), plus one for the map of used parameters
    (``find_unused_parameters=True``, which ``fsdp()`` sets).

    Example:
        >>> ddp_all_reduces([(torch.float32, 4 * 2**20)] * 3)  # a 4 MiB bucket, an 8 MiB one, the map
        3
        >>> ddp_all_reduces([(torch.float32, 100)] * 3)
        2
    """
    limits: dict[torch.dtype, int] = {}
    open_bytes: dict[torch.dtype, int] = {}
    closed = 0
    for dtype, nbytes in reversed(grads):
        open_bytes[dtype] = open_bytes.get(dtype, 0) + nbytes
        if open_bytes[dtype] >= limits.get(dtype, _DDP_FIRST_BUCKET_BYTES):
            closed += 1
            open_bytes[dtype] = 0
            limits[dtype] = _DDP_BUCKET_BYTES
    return closed + sum(1 for b in open_bytes.values() if b) + 1


def _accumulation_bytes(model: nn.Module, micro_batches: int) -> dict[str, AccumulationCost]:
    """``accumulation_costs`` from the wrapped model's FSDP2 parameter groups (their mesh, padded
    shard sizes and dtypes, as FSDP2 allocates them); parameters no unit manages (ignored ones,
    0-dim ones ``fsdp()`` keeps whole) keep whole gradients in every choice."""
    if is_replicated(model):
        # DDP's engine: gradients are whole and accumulate in place in its buckets whatever the
        # choice; its collectives are all-reduces (ddp_all_reduces).
        grads = [p for p in model.parameters() if p.requires_grad]
        whole = sum(p.numel() * p.element_size() for p in grads)
        all_reduces = ddp_all_reduces([(p.dtype, p.numel() * p.element_size()) for p in grads])
        return accumulation_costs(
            micro_batches,
            sharded=whole,
            unsharded=whole,
            partial=whole,
            reduce_scatter_units=0,
            all_reduce_units=all_reduces,
        )
    sharded = unsharded = partial = rs_units = ar_units = 0
    managed: set[int] = set()
    groups: dict[int, object] = {}
    for module in _fsdp_modules(model):
        groups.update((id(g), g) for g in fsdp_param_groups(module) or ())
    for group in groups.values():
        shard_size = getattr(group.mesh_info, "shard_mesh_size", 1)
        trainable = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]
        rs_units += bool(trainable) and shard_size > 1
        ar_units += bool(trainable) and getattr(group.mesh_info, "replicate_mesh_size", 1) > 1
        for fp in group.fsdp_params:
            managed.add(id(fp.sharded_param))
            if not fp.sharded_param.requires_grad:
                continue
            # The sharded .grad is cast back to the parameter's dtype; the rest waits in
            # gradient_wait_dtype. (Read from the policy: FSDP2 sets its own dtype fields lazily.)
            dtype = fp.sharded_param.dtype
            wait_dtype = gradient_wait_dtype(group.mp_policy, dtype)
            padded = fp.padded_sharded_param_size.numel()
            unsharded += fp.sharded_param.numel() * wait_dtype.itemsize  # a DTensor: the global numel
            partial += padded * wait_dtype.itemsize
            sharded += padded * dtype.itemsize
    whole = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and id(p) not in managed)
    return accumulation_costs(
        micro_batches,
        sharded=sharded + whole,
        unsharded=unsharded + whole,
        partial=partial + whole,
        reduce_scatter_units=rs_units,
        all_reduce_units=ar_units,
    )


def memory_report(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *, micro_batches: Optional[int] = None
) -> MemoryReport:
    """Bytes this rank holds for parameters, gradients and optimizer state, vs the unsharded sizes.

    Returns a ``MemoryReport`` (a dict) with ``rank``, ``world_size`` and, for each of
    ``params``, ``grads``, ``optimizer_state`` and ``total``: ``local_bytes`` (this rank's
    shards), ``full_bytes`` (the same tensors unsharded), ``tensors`` (how many) and ``dtypes``
    (sorted names: ``params``' are the master-weight dtypes, ``optimizer_state``'s what AdamW keeps
    its moments in; 0-dim step counters left out). These are
    logical sizes of the tensors (FSDP's padding and temporary all-gather buffers are not
    counted: measure peaks with ``FSDPMemTracker``). Tied parameters count once; gradients that
    are ``None`` count zero. ``report.table()`` (or ``print(report)``) gives a readable view.

    ``micro_batches=K`` adds ``micro_batches`` and ``accumulation``: for each way of accumulating K
    micro-batches (``"sync"`` every micro-batch, ``no_sync(defer="all")``,
    ``no_sync(defer="all_reduce")``) an ``AccumulationCost``: the gradient bytes this rank holds
    between micro-batches (FSDP2's padded storage) and the gradient collectives per K
    micro-batches. The table shows them too.

    Example:
        report = memory_report(model, optimizer)
        report["params"]["local_bytes"] / report["params"]["full_bytes"]  # ~1/world with FULL_SHARD
        # -> 0.5
        memory_report(model, micro_batches=4)["accumulation"]["all_reduce"].grad_bytes
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
    if micro_batches is not None:
        report["micro_batches"] = micro_batches
        report["accumulation"] = _accumulation_bytes(model, micro_batches)
    return report
